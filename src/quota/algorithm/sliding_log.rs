use std::collections::VecDeque;

use crate::quota::algorithm::{micros, never, Hold};
use crate::quota::Decision;
use crate::ConfigError;

/// Exact sliding log: a request at `t` is admitted only if the cost admitted
/// in `(t - W, t]` plus its own stays at or below `limit`.
///
/// Every admission is its own entry, so admissions with identical timestamps
/// are distinct. Memory per key is at most `limit` entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlidingLog {
    limit: u64,
    window: u64,
}

/// Admissions still inside the window, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingLogState {
    entries: VecDeque<(u64, u64)>,
    total: u64,
    newest: u64,
    oldest: u64,
}

impl SlidingLog {
    /// PLACEHOLDER (replaced by the bounded-work log).
    pub(crate) fn new(limit: u64, window: u64) -> Result<Self, ConfigError> {
        Ok(SlidingLog {
            limit: super::positive("limit", limit)?,
            window: super::positive("window", window)?,
        })
    }

    /// Most cost admitted in any window.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Window length in µs.
    pub fn window_micros(&self) -> u64 {
        self.window
    }

    pub(crate) fn share(&self, divisor: u64) -> Self {
        SlidingLog {
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

    /// Drops entries at or before `now - W`; returns the time the log acts at.
    #[inline]
    fn trim(&self, state: &mut SlidingLogState, now: u64) -> u64 {
        let now = now.max(state.newest);
        if state.total == 0 || state.oldest.saturating_add(self.window) > now {
            return now;
        }
        while let Some(&(t, cost)) = state.entries.front() {
            if t.saturating_add(self.window) > now {
                break;
            }
            state.entries.pop_front();
            state.total -= cost;
        }
        state.oldest = state.entries.front().map_or(0, |&(t, _)| t);
        now
    }

    fn reset(&self, state: &SlidingLogState, now: u64) -> u64 {
        if state.entries.is_empty() {
            0
        } else {
            (state.newest + self.window).saturating_sub(now)
        }
    }

    #[inline]
    pub(crate) fn check(&self, state: &mut SlidingLogState, now: u64, cost: u64) -> Decision {
        self.trim(state, now);
        let remaining = self.limit.saturating_sub(state.total);
        let reset = self.reset(state, now);
        if cost > self.limit {
            return never(self.limit, remaining, reset);
        }
        if cost <= remaining {
            let reset = if cost > 0 { self.window } else { reset };
            return Decision {
                admitted: true,
                limit: self.limit,
                remaining: remaining - cost,
                retry_after: None,
                reset: micros(reset),
            };
        }
        // Wait until enough of the oldest entries have left the window.
        let mut to_free = cost - remaining;
        // Every entry costs at least 1, so the oldest alone frees one.
        let mut wait = state.oldest.saturating_add(self.window).saturating_sub(now);
        if to_free > 1 {
            for &(t, c) in &state.entries {
                wait = (t + self.window).saturating_sub(now);
                if c >= to_free {
                    break;
                }
                to_free -= c;
            }
        }
        Decision {
            admitted: false,
            limit: self.limit,
            remaining,
            retry_after: Some(micros(wait)),
            reset: micros(reset),
        }
    }

    #[inline]
    pub(crate) fn record(&self, state: &mut SlidingLogState, now: u64, cost: u64) -> Hold {
        self.push(state, now, cost);
        Hold {
            mark: 0,
            frac: 0,
            amount: cost,
        }
    }

    pub(crate) fn settle(
        &self,
        state: &mut SlidingLogState,
        now: u64,
        hold: Hold,
        delta: i64,
    ) -> Hold {
        self.adjust(state, now, delta);
        hold
    }

    fn push(&self, state: &mut SlidingLogState, now: u64, cost: u64) {
        let now = self.trim(state, now);
        let cost = cost.min(self.limit.saturating_sub(state.total));
        if cost > 0 {
            if state.entries.is_empty() {
                state.oldest = now;
            }
            state.entries.push_back((now, cost));
            state.total += cost;
            state.newest = now;
        }
    }

    fn adjust(&self, state: &mut SlidingLogState, now: u64, delta: i64) {
        if delta >= 0 {
            self.push(state, now, delta.unsigned_abs());
            return;
        }
        self.trim(state, now);
        // Refunds come off the newest admissions, the ones being settled.
        let mut refund = delta.unsigned_abs();
        while refund > 0 {
            let Some(last) = state.entries.back_mut() else {
                break;
            };
            let take = refund.min(last.1);
            last.1 -= take;
            state.total -= take;
            refund -= take;
            if last.1 == 0 {
                state.entries.pop_back();
                state.newest = state.entries.back().map_or(0, |&(t, _)| t);
                state.oldest = state.entries.front().map_or(0, |&(t, _)| t);
            }
        }
    }

    #[inline]
    pub(crate) fn fresh_at(&self, state: &SlidingLogState) -> u64 {
        if state.entries.is_empty() {
            0
        } else {
            state.newest.saturating_add(self.window)
        }
    }
}
