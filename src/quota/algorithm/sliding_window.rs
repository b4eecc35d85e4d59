use crate::quota::algorithm::{micros, never, next_epoch, Hold};
use crate::quota::Decision;
use crate::ConfigError;

/// Weighted window counter: estimates the count over the last `W` as
/// `previous * (1 - elapsed / W) + current` and admits while the estimate plus
/// the cost stays at or below `limit`.
///
/// **An approximation.** It assumes the previous window's admissions were
/// spread evenly, so it can admit more than `limit` in some interval of length
/// `W` (at most `2 * limit` in the worst case). Use [`SlidingLog`] when the cap
/// must be exact. A refusal waits at most `2W`.
///
/// **Changed numbers.** The state records its current window's start and end
/// in µs. Under another window length, both counts carry into the new
/// policy's aligned window that holds `now` (if the old window has ended, its
/// count becomes the previous one when it ended less than a new window ago,
/// and is dropped otherwise).
///
/// [`SlidingLog`]: crate::quota::algorithm::SlidingLog
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlidingWindow {
    limit: u64,
    window: u64,
}

/// Counts of the current window `[start, end)` (µs) and of the one before it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SlidingWindowState {
    start: u64,
    end: u64,
    current: u64,
    previous: u64,
    /// Names, with `end`, the window a charge was counted in: see
    /// [`next_epoch`](super::next_epoch).
    epoch: u64,
}

impl SlidingWindow {
    /// About `limit` per `window` µs; both at least 1.
    pub(crate) fn new(limit: u64, window: u64) -> Result<Self, ConfigError> {
        Ok(SlidingWindow {
            limit: super::positive("limit", limit)?,
            window: super::positive("window", window)?,
        })
    }

    /// Most estimated cost in any window.
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    /// Window length in µs.
    pub(crate) fn window_micros(&self) -> u64 {
        self.window
    }

    pub(crate) fn share(&self, divisor: u64) -> Self {
        SlidingWindow {
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

    /// Rolls the windows forward, never backwards; returns the acting time.
    #[inline]
    fn roll(&self, s: &mut SlidingWindowState, now: u64) -> u64 {
        let now = now.max(s.start);
        if now < s.end && s.end - s.start == self.window {
            return now;
        }
        let start = now - now % self.window;
        s.epoch = next_epoch(s.epoch, s.start, s.end, self.window, now);
        if now >= s.end {
            // The counted window has ended: it is the previous one while it
            // ended less than a window ago (as `fresh_at` says).
            s.previous = if now < s.end.saturating_add(self.window) {
                s.current
            } else {
                0
            };
            s.current = 0;
        }
        s.start = start;
        s.end = start.saturating_add(self.window);
        now
    }

    /// `estimate * W`, exact in integers.
    fn weighted(&self, s: &SlidingWindowState, elapsed: u64) -> u128 {
        u128::from(s.previous) * u128::from(self.window - elapsed)
            + u128::from(s.current) * u128::from(self.window)
    }

    #[inline]
    pub(crate) fn check(&self, s: &mut SlidingWindowState, now: u64, cost: u64) -> Decision {
        let now = self.roll(s, now);
        let elapsed = now - s.start;
        let w = u128::from(self.window);
        let budget = u128::from(self.limit) * w;
        let used = self.weighted(s, elapsed);
        let remaining = (budget.saturating_sub(used) / w) as u64;
        let reset = self.fresh_at(s).saturating_sub(now);
        if cost > self.limit {
            return never(self.limit, remaining, reset);
        }
        let needed = used + u128::from(cost) * w;
        if needed <= budget {
            return Decision {
                admitted: true,
                limit: self.limit,
                remaining: ((budget - needed) / w) as u64,
                retry_after: None,
                reset: micros(s.end.saturating_add(self.window) - now),
            };
        }
        let wait = match s.current.checked_add(cost).filter(|&c| c <= self.limit) {
            // Wait for the previous window's weight to decay enough:
            // previous * (W - e) <= (limit - current - cost) * W.
            Some(used_now) => {
                let room = u128::from(self.limit - used_now) * w;
                let keep = room / u128::from(s.previous.max(1));
                let e = self.window - keep.min(w) as u64;
                e.saturating_sub(elapsed).max(1)
            }
            // Next window: current becomes previous; need
            // current * (W - e) <= (limit - cost) * W.
            None => {
                let room = u128::from(self.limit - cost) * w;
                let keep = room / u128::from(s.current.max(1));
                let e = self.window - keep.min(w) as u64;
                (s.end - now) + e
            }
        };
        Decision {
            admitted: false,
            limit: self.limit,
            remaining,
            retry_after: Some(micros(wait)),
            reset: micros(reset),
        }
    }

    #[inline]
    pub(crate) fn record(&self, s: &mut SlidingWindowState, now: u64, cost: u64) -> Hold {
        self.roll(s, now);
        let take = cost.min(self.limit.saturating_sub(s.current));
        s.current += take;
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
        s: &mut SlidingWindowState,
        now: u64,
        hold: Hold,
        delta: i64,
    ) -> Hold {
        let fresh = self.fresh_at(s) <= now;
        if super::settle_may_roll(fresh, s.start, s.end, self.window, now) {
            self.roll(s, now);
        }
        super::settle_window(&mut s.current, self.limit, (s.end, s.epoch), hold, delta)
    }

    pub(crate) fn fresh_at(&self, s: &SlidingWindowState) -> u64 {
        if s.current > 0 {
            s.end.saturating_add(self.window)
        } else if s.previous > 0 {
            s.end
        } else {
            0
        }
    }
}
