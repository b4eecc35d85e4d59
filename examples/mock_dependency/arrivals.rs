//! The arrivals: the log of the last second that the limit applies to, the
//! per-second series, and the counts `GET /stats` reports.

use std::collections::VecDeque;
use std::num::{NonZeroU32, NonZeroU64};

use tokio::time::Instant;

use super::stats::{Series, Stats};
use super::{SERIES_SECONDS, WINDOW};

/// How an arrival is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// 200.
    Ok,
    /// 429: over the limit.
    Rejected,
    /// 503: the K-th accepted arrival.
    Failed,
}

/// The arrivals since start or the last reset.
#[derive(Debug)]
pub(crate) struct Arrivals {
    /// `Stats` without the percentiles.
    counts: Stats,
    /// When the counts started: the start or the last reset.
    origin: Instant,
    /// Arrivals per whole second since `origin`, the oldest counting the
    /// second `series_first`; at most [`SERIES_SECONDS`] entries.
    series: VecDeque<u64>,
    series_first: u64,
    /// Arrivals of the last second, oldest first, equal instants merged into one count.
    window: VecDeque<(Instant, u64)>,
    /// The sum of the counts in `window`.
    in_window: u64,
    /// Accepted arrivals, for `fail_every`.
    accepted: u64,
    in_flight: u64,
}

impl Arrivals {
    pub(crate) fn new(origin: Instant) -> Self {
        Arrivals {
            counts: Stats::default(),
            origin,
            series: VecDeque::new(),
            series_first: 0,
            window: VecDeque::new(),
            in_window: 0,
            accepted: 0,
            in_flight: 0,
        }
    }

    /// Starts again at `now`. Requests still in flight stay counted as in
    /// flight, so they are released correctly, but `max_concurrent` starts
    /// again from 0.
    pub(crate) fn reset(&mut self, now: Instant) {
        let in_flight = self.in_flight;
        *self = Self {
            in_flight,
            ..Self::new(now)
        };
    }

    /// The counts; the percentiles are left `None`.
    pub(crate) fn counts(&self) -> Stats {
        self.counts
    }

    /// Records one arrival at `now` and decides its answer.
    ///
    /// `now` never goes back (the caller reads the clock under its lock), so
    /// the log is in time order. Each call pops what left the window and
    /// pushes at most one entry: O(1) amortized, with at most one entry per
    /// distinct instant of the last second. `limit` is compared with the
    /// arrivals already in the window, whatever limit they arrived under.
    pub(crate) fn arrive(
        &mut self,
        now: Instant,
        limit: NonZeroU32,
        fail_every: Option<NonZeroU64>,
    ) -> Outcome {
        while let Some(&(at, count)) = self.window.front() {
            if now.duration_since(at) < WINDOW {
                break;
            }
            self.window.pop_front();
            self.in_window -= count;
        }
        match self.window.back_mut() {
            Some((at, count)) if *at == now => *count += 1,
            _ => self.window.push_back((now, 1)),
        }
        self.in_window += 1;
        let second = self.series_to(now);
        self.series[second] += 1;
        let c = &mut self.counts;
        c.total += 1;
        c.max_in_any_1s = c.max_in_any_1s.max(self.in_window);
        self.in_flight += 1;
        c.max_concurrent = c.max_concurrent.max(self.in_flight);

        if self.in_window > u64::from(limit.get()) {
            c.rejected += 1;
            return Outcome::Rejected;
        }
        self.accepted += 1;
        match fail_every {
            Some(k) if self.accepted.is_multiple_of(k.get()) => {
                c.failed += 1;
                Outcome::Failed
            }
            _ => Outcome::Ok,
        }
    }

    /// An arrival was answered or dropped.
    pub(crate) fn leave(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Extends the series with zeros up to the second that holds `now`,
    /// dropping the oldest beyond [`SERIES_SECONDS`]; returns that second's
    /// index in `series`.
    fn series_to(&mut self, now: Instant) -> usize {
        let second = now.duration_since(self.origin).as_secs();
        let end = self.series_first + self.series.len() as u64;
        if second >= end {
            let mut missing = second + 1 - end;
            if missing > SERIES_SECONDS {
                self.series.clear();
                self.series_first = second + 1 - SERIES_SECONDS;
                missing = SERIES_SECONDS;
            }
            self.series.extend(std::iter::repeat_n(0, missing as usize));
            while self.series.len() as u64 > SERIES_SECONDS {
                self.series.pop_front();
                self.series_first += 1;
            }
        }
        // The clock is read under the lock, so `second` never goes back.
        (second.max(self.series_first) - self.series_first) as usize
    }

    /// The arrivals per second up to `now`.
    pub(crate) fn series(&mut self, now: Instant) -> Series {
        self.series_to(now);
        Series {
            first_second: self.series_first,
            arrivals: self.series.iter().copied().collect(),
        }
    }
}
