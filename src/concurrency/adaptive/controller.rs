//! The adaptive limit's state machine: samples in, limit out. Pure: time is
//! passed in, so it is tested without a runtime.

use std::time::Duration;

use tokio::time::Instant;

use super::config::AdaptiveLimit;

/// How a request that answered went, as the limit reads it.
///
/// ```
/// use tower_admission::concurrency::Outcome;
///
/// let outcome = |status: u16| match status {
///     429 | 503 | 504 => Outcome::Overload,
///     400..=499 => Outcome::Ignore,
///     _ => Outcome::Success,
/// };
/// assert_eq!(outcome(503), Outcome::Overload);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// It answered: its latency is a sample.
    Success,
    /// An error or a timeout that says the dependency is overloaded: the
    /// limit backs off (multiplicative decrease) at the end of the window.
    Overload,
    /// Neither: no sample (a client error, say).
    Ignore,
}

/// What the controller is told when a request leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sample {
    /// It answered with this outcome.
    Answered(Outcome),
    /// It was dropped (cancelled) before it answered: its latency is only a
    /// lower bound of the real one.
    Dropped,
}

/// Most samples a window keeps: past that, the newest overwrite the oldest.
const MAX_SAMPLES: usize = 2048;

/// Latencies of one window (or probe), bounded.
#[derive(Debug, Default)]
struct Samples {
    values: Vec<Duration>,
    seen: usize,
}

impl Samples {
    fn push(&mut self, latency: Duration) {
        if self.values.len() < MAX_SAMPLES {
            self.values.push(latency);
        } else {
            self.values[self.seen % MAX_SAMPLES] = latency;
        }
        self.seen += 1;
    }

    fn len(&self) -> usize {
        self.values.len()
    }

    /// The `p` percentile (nearest rank); `None` when empty.
    fn percentile(&mut self, p: f64) -> Option<Duration> {
        let n = self.values.len();
        if n == 0 {
            return None;
        }
        let rank = ((p * n as f64).ceil() as usize).clamp(1, n) - 1;
        Some(*self.values.select_nth_unstable(rank).1)
    }

    fn clear(&mut self) {
        self.values.clear();
        self.seen = 0;
    }
}

/// A baseline probe under way.
#[derive(Debug)]
struct Probe {
    /// The limit to go back to.
    saved: f64,
    samples: Samples,
}

/// The limit, its baseline and its current window.
#[derive(Debug)]
pub(crate) struct Controller {
    cfg: AdaptiveLimit,
    limit: f64,
    baseline: Option<Duration>,
    latency: Option<Duration>,
    window_start: Instant,
    samples: Samples,
    overloads: u32,
    /// Most requests in flight since the window began.
    max_in_flight: usize,
    /// A request found no slot it could take since the window began.
    pressed: bool,
    probe: Option<Probe>,
    next_probe: Instant,
    /// Counts probes: a request admitted during the current probe carries
    /// it, and only those give the baseline.
    epoch: u64,
    /// The window follows a probe: the requests the probe held back crowd
    /// in, which is no evidence of demand, so it may not grow the limit.
    after_probe: bool,
}

impl Controller {
    /// Starts with a probe: there is no baseline yet.
    pub(crate) fn new(cfg: AdaptiveLimit, now: Instant) -> Self {
        Controller {
            cfg,
            limit: cfg.initial as f64,
            baseline: None,
            latency: None,
            window_start: now,
            samples: Samples::default(),
            overloads: 0,
            max_in_flight: 0,
            pressed: false,
            probe: Some(Probe {
                saved: cfg.initial as f64,
                samples: Samples::default(),
            }),
            next_probe: now,
            epoch: 1,
            after_probe: false,
        }
    }

    /// The limit in force now: the probe's level while probing.
    /// New floor and ceiling (a reload): the limit is clamped into them,
    /// the measurements kept.
    pub(crate) fn set_bounds(&mut self, floor: usize, ceiling: usize) {
        self.cfg.floor = floor;
        self.cfg.ceiling = ceiling;
        self.limit = self.limit.clamp(floor as f64, ceiling as f64);
    }

    pub(crate) fn limit(&self) -> usize {
        match self.probe {
            Some(_) => self.cfg.probe_limit,
            None => self.limit as usize,
        }
    }

    pub(crate) fn baseline(&self) -> Option<Duration> {
        self.baseline
    }

    /// The latency of the last window that moved the limit.
    pub(crate) fn latency(&self) -> Option<Duration> {
        self.latency
    }

    pub(crate) fn probing(&self) -> bool {
        self.probe.is_some()
    }

    /// The tag of a request admitted now.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// A request was admitted; `in_flight` counts it.
    pub(crate) fn admitted(&mut self, in_flight: usize) {
        self.max_in_flight = self.max_in_flight.max(in_flight);
    }

    /// A request found no slot it could take (it queued or was refused):
    /// the limit, or its class's share of it, was used up.
    pub(crate) fn pressed(&mut self) {
        self.pressed = true;
    }

    /// A request admitted under `epoch` left after `elapsed`, as `sample`
    /// says; `in_flight` no longer counts it. True when the limit moved.
    pub(crate) fn sample(
        &mut self,
        now: Instant,
        epoch: u64,
        elapsed: Duration,
        sample: Sample,
        in_flight: usize,
    ) -> bool {
        if let Some(probe) = &mut self.probe {
            // Only requests admitted during the probe, at its level, measure
            // the no-load latency; a dropped one measures nothing.
            if epoch == self.epoch && sample == Sample::Answered(Outcome::Success) {
                probe.samples.push(elapsed);
            }
            if probe.samples.len() < self.cfg.probe_samples {
                return false;
            }
            self.baseline = probe.samples.percentile(self.cfg.percentile);
            self.limit = probe.saved;
            self.probe = None;
            self.next_probe = now + self.cfg.probe_interval;
            self.restart_window(now, in_flight);
            self.after_probe = true;
            return true;
        }
        match sample {
            Sample::Answered(Outcome::Success) => self.samples.push(elapsed),
            Sample::Answered(Outcome::Overload) => self.overloads += 1,
            Sample::Answered(Outcome::Ignore) => {}
            // A request dropped before it answered is no fast success: it
            // counts only once it has waited longer than the latency aimed
            // at, as a sample of at least that long.
            Sample::Dropped => {
                if elapsed > self.goal() {
                    self.samples.push(elapsed);
                }
            }
        }
        if now.saturating_duration_since(self.window_start) < self.cfg.window {
            return false;
        }
        if self.overloads > 0 {
            self.limit = (self.limit * self.cfg.backoff).max(self.cfg.floor as f64);
        } else if self.samples.len() < self.cfg.min_samples {
            // Too few samples: the window goes on, the limit stays.
            return false;
        } else {
            self.follow_latency();
        }
        if now >= self.next_probe {
            self.epoch += 1;
            self.probe = Some(Probe {
                saved: self.limit,
                samples: Samples::default(),
            });
        }
        self.restart_window(now, in_flight);
        true
    }

    /// The latency aimed at: the baseline plus the tolerance.
    fn goal(&self) -> Duration {
        self.above_baseline(self.cfg.tolerance)
    }

    /// The latency under which the limit may grow past its gradient: the
    /// lower half of the band between the baseline and the goal. Nearer
    /// the goal the gradient alone moves it, so a limit whose latency is
    /// within the goal stays there rather than stepping past it (at a
    /// capacity of 2, one more request in flight costs half the baseline).
    fn headroom_below(&self) -> Duration {
        self.above_baseline(self.cfg.tolerance / 2.0)
    }

    /// The baseline and `share` more; unbounded without a baseline.
    fn above_baseline(&self, share: f64) -> Duration {
        self.baseline
            .map_or(Duration::MAX, |b| b.mul_f64(1.0 + share))
    }

    /// The gradient step: the limit in force times goal / latency (within
    /// 0.5 and 2), plus √limit of headroom while the latency is in the
    /// lower half of the band up to the goal, smoothed; it grows only if it
    /// was used. The step is measured from the whole limit that admitted
    /// the window's requests, not from the fraction above it: a fraction
    /// admitted no one, so a latency measured under 2 says nothing about
    /// 2.9, and growing from 2.9 would reach 4 in two windows of evidence
    /// about 2.
    fn follow_latency(&mut self) {
        let Some(latency) = self.samples.percentile(self.cfg.percentile) else {
            return;
        };
        self.latency = Some(latency);
        let goal = self.goal().as_secs_f64();
        let gradient = (goal / latency.as_secs_f64().max(1e-9)).clamp(0.5, 2.0);
        let in_force = self.limit.floor();
        let headroom = if latency <= self.headroom_below() {
            in_force.sqrt()
        } else {
            0.0
        };
        let mut target = in_force * gradient + headroom;
        let used = (self.pressed || self.max_in_flight as f64 >= self.cfg.utilisation * self.limit)
            && !self.after_probe;
        if target > self.limit && !used {
            target = self.limit;
        }
        let limit = self.limit + self.cfg.smoothing * (target - self.limit);
        self.limit = limit.clamp(self.cfg.floor as f64, self.cfg.ceiling as f64);
    }

    fn restart_window(&mut self, now: Instant, in_flight: usize) {
        self.after_probe = false;
        self.window_start = now;
        self.samples.clear();
        self.overloads = 0;
        self.max_in_flight = in_flight;
        self.pressed = false;
    }
}

#[cfg(test)]
mod tests;
