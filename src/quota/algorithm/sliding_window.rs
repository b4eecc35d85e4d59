use crate::quota::algorithm::{micros, never};
use crate::quota::Decision;

/// Weighted window counter: estimates the count over the last `W` as
/// `previous * (1 - elapsed / W) + current` and admits while the estimate plus
/// the cost stays at or below `limit`.
///
/// **An approximation.** It assumes the previous window's admissions were
/// spread evenly, so it can admit more than `limit` in some interval of length
/// `W` (at most `2 * limit` in the worst case). Use [`SlidingLog`] when the cap
/// must be exact. State is three integers per key.
///
/// [`SlidingLog`]: crate::quota::algorithm::SlidingLog
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlidingWindow {
    /// Most estimated cost in any window.
    pub limit: u64,
    /// Window length in microseconds.
    pub window: u64,
}

/// Counts of the current and the previous clock-aligned window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingWindowState {
    /// Index `k` of the current window `[kW, (k+1)W)`.
    pub window_index: u64,
    /// Cost admitted in the current window.
    pub current: u64,
    /// Cost admitted in the previous window.
    pub previous: u64,
}

impl SlidingWindow {
    /// Rolls the windows forward; returns microseconds elapsed in the current one.
    fn roll(&self, state: &mut SlidingWindowState, now: u64) -> u64 {
        let k = (now / self.window).max(state.window_index);
        match k - state.window_index {
            0 => {}
            1 => {
                state.previous = state.current;
                state.current = 0;
            }
            _ => {
                state.previous = 0;
                state.current = 0;
            }
        }
        state.window_index = k;
        now.saturating_sub(k * self.window)
    }

    /// `estimate * W`, exact in integers.
    fn weighted(&self, state: &SlidingWindowState, elapsed: u64) -> u128 {
        u128::from(state.previous) * u128::from(self.window - elapsed)
            + u128::from(state.current) * u128::from(self.window)
    }

    #[inline]
    pub(crate) fn check(&self, state: &mut SlidingWindowState, now: u64, cost: u64) -> Decision {
        let elapsed = self.roll(state, now);
        let w = u128::from(self.window);
        let budget = u128::from(self.limit) * w;
        let used = self.weighted(state, elapsed);
        let remaining = (budget.saturating_sub(used) / w) as u64;
        let reset = self.fresh_at(state).saturating_sub(now);
        if cost > self.limit {
            return never(self.limit, remaining, reset);
        }
        let needed = used + u128::from(cost) * w;
        if needed <= budget {
            let left = ((budget - needed) / w) as u64;
            return Decision {
                admitted: true,
                limit: self.limit,
                remaining: left,
                retry_after: None,
                reset: micros((state.window_index + 2) * self.window - now),
            };
        }
        let window_end = (state.window_index + 1) * self.window;
        let wait = if state.current + cost <= self.limit {
            // Wait for the previous window's weight to decay enough:
            // previous * (W - e) <= (limit - current - cost) * W.
            let room = u128::from(self.limit - state.current - cost) * w;
            let keep = room / u128::from(state.previous.max(1));
            let e = self.window - keep.min(w) as u64;
            e.saturating_sub(elapsed).max(1)
        } else {
            // Next window: current becomes previous; need current * (W - e) <= (limit - cost) * W.
            let room = u128::from(self.limit - cost) * w;
            let keep = room / u128::from(state.current.max(1));
            let e = self.window - keep.min(w) as u64;
            (window_end - now.max(state.window_index * self.window)) + e
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
    pub(crate) fn record(&self, state: &mut SlidingWindowState, now: u64, cost: u64) {
        self.roll(state, now);
        state.current = state.current.saturating_add(cost).min(self.limit);
    }

    pub(crate) fn adjust(&self, state: &mut SlidingWindowState, now: u64, delta: i64) {
        self.roll(state, now);
        state.current = state.current.saturating_add_signed(delta).min(self.limit);
    }

    pub(crate) fn fresh_at(&self, state: &SlidingWindowState) -> u64 {
        if state.current > 0 {
            (state.window_index + 2) * self.window
        } else if state.previous > 0 {
            (state.window_index + 1) * self.window
        } else {
            0
        }
    }
}
