use crate::quota::algorithm::{micros, never, Hold};
use crate::quota::Decision;
use crate::ConfigError;

/// Token bucket with capacity `B` and continuous refill of one token every
/// `interval` microseconds, as GCRA: the state is one theoretical arrival time.
///
/// A request of cost `n` at `now` is admitted iff
/// `max(tat, now) + n * interval <= now + B * interval`, and then
/// `tat = max(tat, now) + n * interval`. This is governor's rule, so the two
/// agree decision for decision. Starting full, at most `floor(B + T / interval)`
/// are admitted over any interval `T`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    capacity: u64,
    interval: u64,
}

/// The theoretical arrival time: the bucket is full at and after `tat`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenBucketState {
    tat: u64,
}

impl TokenBucketState {
    /// The first whole µs at which the bucket is full.
    pub(crate) fn full_at(&self) -> u64 {
        self.tat
    }
}

impl TokenBucket {
    /// PLACEHOLDER (replaced by the any-rate bucket).
    pub(crate) fn new(capacity: u64, refill: u64, period: u64) -> Result<Self, ConfigError> {
        let capacity = super::positive("capacity", capacity)?;
        let refill = super::positive("refill", refill)?;
        let period = super::positive("period", period)?;
        if period % refill != 0 {
            return Err(ConfigError::new(
                "refill",
                "period must divide evenly by refill",
            ));
        }
        Ok(TokenBucket {
            capacity,
            interval: period / refill,
        })
    }

    /// Bucket size, the most admitted at once.
    pub fn limit(&self) -> u64 {
        self.capacity
    }

    /// Time to refill from empty, in µs.
    pub fn window_micros(&self) -> u64 {
        self.capacity.saturating_mul(self.interval)
    }

    pub(crate) fn share(&self, divisor: u64) -> Self {
        TokenBucket {
            capacity: super::part(self.capacity, divisor),
            interval: self.interval.saturating_mul(divisor.max(1)),
        }
    }

    #[cfg(feature = "redis")]
    pub(crate) fn script_args(&self) -> [u64; 3] {
        [self.capacity, self.interval, 1]
    }

    #[cfg(feature = "redis")]
    pub(crate) fn lua_exact(&self) -> Result<(), ConfigError> {
        super::lua_small("capacity", self.capacity)?;
        super::lua_small("refill", self.interval)
    }

    pub(crate) fn fresh_at(&self, s: &TokenBucketState) -> u64 {
        s.tat
    }

    fn horizon(&self, now: u64) -> u64 {
        now.saturating_add(self.capacity.saturating_mul(self.interval))
    }

    pub(crate) fn check(&self, state: &mut TokenBucketState, now: u64, cost: u64) -> Decision {
        self.decide(state.tat, now, cost).0
    }

    /// Check and, if admitted, record, in one pass: the memory store's path
    /// for a quota of one bucket. Same result as `check` then `record`.
    #[inline]
    pub(crate) fn step_in_place(
        &self,
        state: &mut TokenBucketState,
        now: u64,
        cost: u64,
    ) -> (Decision, Option<Hold>) {
        let (decision, next) = self.decide(state.tat, now, cost);
        if decision.admitted {
            // Admitted means `next <= horizon`, so `record` would clamp nothing.
            state.tat = next;
            return (
                decision,
                Some(Hold {
                    mark: next,
                    frac: 0,
                    amount: cost,
                }),
            );
        }
        (decision, None)
    }

    /// The decision at `tat`, and the TAT after it if admitted.
    #[inline]
    fn decide(&self, tat: u64, now: u64, cost: u64) -> (Decision, u64) {
        let start = tat.max(now);
        let horizon = self.horizon(now);
        // One division per decision: `remaining` is computed in each branch.
        let remaining = || horizon.saturating_sub(start) / self.interval;
        if cost > self.capacity {
            return (never(self.capacity, remaining(), start - now), start);
        }
        let next = start.saturating_add(cost.saturating_mul(self.interval));
        let decision = if next <= horizon {
            Decision {
                admitted: true,
                limit: self.capacity,
                remaining: (horizon - next) / self.interval,
                retry_after: None,
                reset: micros(next - now),
            }
        } else {
            Decision {
                admitted: false,
                limit: self.capacity,
                remaining: remaining(),
                retry_after: Some(micros(next - horizon)),
                reset: micros(start - now),
            }
        };
        (decision, next)
    }

    pub(crate) fn record(&self, state: &mut TokenBucketState, now: u64, cost: u64) -> Hold {
        let next = state
            .tat
            .max(now)
            .saturating_add(cost.saturating_mul(self.interval));
        state.tat = next.min(self.horizon(now).max(state.tat));
        Hold {
            mark: state.tat,
            frac: 0,
            amount: cost,
        }
    }

    pub(crate) fn settle(
        &self,
        state: &mut TokenBucketState,
        now: u64,
        hold: Hold,
        delta: i64,
    ) -> Hold {
        self.adjust(state, now, delta);
        hold
    }

    fn adjust(&self, state: &mut TokenBucketState, now: u64, delta: i64) {
        let amount = delta.unsigned_abs().saturating_mul(self.interval);
        if delta >= 0 {
            let start = state.tat.max(now);
            state.tat = start
                .saturating_add(amount)
                .min(self.horizon(now).max(start));
        } else if state.tat > now {
            state.tat = state.tat.saturating_sub(amount).max(now);
        }
    }
}
