use crate::quota::algorithm::{micros, never, next_epoch, Hold};
use crate::quota::Decision;
use crate::ConfigError;

/// At most `limit` per clock-aligned window `[kW, (k+1)W)`.
///
/// The documented weakness: `limit` admissions just before a boundary and
/// `limit` more just after it pass `2 * limit` in a very short interval.
///
/// **Changed numbers.** The state records its window's start and end in µs,
/// so it is read correctly under any later window length. A state built
/// under another window carries its count into the new policy's aligned
/// window that holds `now`: it never waits longer than the new window and
/// never admits more than the new limit beyond what it has counted. A lower
/// limit applies at once to the count already held. A settle never
/// realigns a live window of another length (see
/// [`Settlement`](crate::quota::Settlement)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FixedWindow {
    limit: u64,
    window: u64,
}

/// The counted window `[start, end)` in µs and the cost admitted in it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FixedWindowState {
    start: u64,
    end: u64,
    count: u64,
    /// Names, with `end`, the window a charge was counted in: see
    /// [`next_epoch`](super::next_epoch).
    epoch: u64,
}

impl FixedWindow {
    /// `limit` per `window` µs; both at least 1.
    pub(crate) fn new(limit: u64, window: u64) -> Result<Self, ConfigError> {
        Ok(FixedWindow {
            limit: super::positive("limit", limit)?,
            window: super::positive("window", window)?,
        })
    }

    /// Most cost admitted per window.
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    /// Window length in µs.
    pub(crate) fn window_micros(&self) -> u64 {
        self.window
    }

    pub(crate) fn share(&self, divisor: u64) -> Self {
        FixedWindow {
            limit: super::part(self.limit, divisor),
            window: self.window,
        }
    }

    #[cfg(feature = "redis")]
    pub(crate) fn script_args(&self) -> [u64; 3] {
        [self.limit, self.window, 0]
    }

    #[cfg(feature = "redis")]
    pub(crate) fn lua_exact(&self) -> Result<(), ConfigError> {
        super::lua_small("limit", self.limit)?;
        super::lua_small("window", self.window)
    }

    /// Moves to the window of `now`, never backwards; returns the acting time.
    #[inline]
    fn roll(&self, s: &mut FixedWindowState, now: u64) -> u64 {
        let now = now.max(s.start);
        if now >= s.end {
            s.count = 0;
        } else if s.end - s.start == self.window {
            return now;
        }
        // A new window, or one built under another length: align to ours.
        s.epoch = next_epoch(s.epoch, s.start, s.end, self.window, now);
        s.start = now - now % self.window;
        s.end = s.start.saturating_add(self.window);
        now
    }

    #[inline]
    pub(crate) fn check(&self, s: &mut FixedWindowState, now: u64, cost: u64) -> Decision {
        let now = self.roll(s, now);
        let reset = s.end - now;
        let remaining = self.limit.saturating_sub(s.count);
        if cost > self.limit {
            return never(self.limit, remaining, reset);
        }
        let admitted = cost <= remaining;
        Decision {
            admitted,
            limit: self.limit,
            remaining: if admitted {
                remaining - cost
            } else {
                remaining
            },
            retry_after: (!admitted).then(|| micros(reset)),
            reset: micros(reset),
        }
    }

    #[inline]
    pub(crate) fn record(&self, s: &mut FixedWindowState, now: u64, cost: u64) -> Hold {
        self.roll(s, now);
        let take = cost.min(self.limit.saturating_sub(s.count));
        s.count += take;
        Hold {
            mark: s.end,
            frac: s.epoch,
            amount: take,
            life: 0,
        }
    }

    /// Charges more (capped at the limit), or refunds while the charge's
    /// window is still the current one.
    pub(crate) fn settle(
        &self,
        s: &mut FixedWindowState,
        now: u64,
        hold: Hold,
        delta: i64,
    ) -> Hold {
        let fresh = self.fresh_at(s) <= now;
        if super::settle_may_roll(fresh, s.start, s.end, self.window, now) {
            self.roll(s, now);
        }
        super::settle_window(&mut s.count, self.limit, (s.end, s.epoch), hold, delta)
    }

    pub(crate) fn fresh_at(&self, s: &FixedWindowState) -> u64 {
        if s.count == 0 {
            0
        } else {
            s.end
        }
    }
}
