use crate::quota::algorithm::{micros, never};
use crate::quota::Decision;

/// At most `limit` per clock-aligned window `[kW, (k+1)W)`.
///
/// The documented weakness: `limit` admissions just before a boundary and
/// `limit` more just after it pass `2 * limit` in a very short interval.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixedWindow {
    /// Most cost admitted per window.
    pub limit: u64,
    /// Window length in microseconds.
    pub window: u64,
}

/// The window index and the cost admitted in it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FixedWindowState {
    /// Index `k` of the window `[kW, (k+1)W)`.
    pub window_index: u64,
    /// Cost admitted in that window.
    pub count: u64,
}

impl FixedWindow {
    fn roll(&self, state: &mut FixedWindowState, now: u64) -> u64 {
        let k = (now / self.window).max(state.window_index);
        if k != state.window_index {
            *state = FixedWindowState {
                window_index: k,
                count: 0,
            };
        }
        (k + 1).saturating_mul(self.window).saturating_sub(now)
    }

    #[inline]
    pub(crate) fn check(&self, state: &mut FixedWindowState, now: u64, cost: u64) -> Decision {
        let reset = self.roll(state, now);
        let remaining = self.limit.saturating_sub(state.count);
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
    pub(crate) fn record(&self, state: &mut FixedWindowState, now: u64, cost: u64) {
        self.roll(state, now);
        state.count = state.count.saturating_add(cost).min(self.limit);
    }

    pub(crate) fn adjust(&self, state: &mut FixedWindowState, now: u64, delta: i64) {
        self.roll(state, now);
        state.count = state.count.saturating_add_signed(delta).min(self.limit);
    }

    pub(crate) fn fresh_at(&self, state: &FixedWindowState) -> u64 {
        if state.count == 0 {
            0
        } else {
            (state.window_index + 1).saturating_mul(self.window)
        }
    }
}
