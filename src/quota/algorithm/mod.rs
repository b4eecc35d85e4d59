//! The four quota algorithms as pure state machines.
//!
//! Each algorithm is a value holding its numbers, and a state type. A decision
//! is two steps on one state, always made together under one lock (memory) or
//! inside one script (Redis):
//!
//! 1. [`Algorithm::check`]: remove expired state, then decide. Cleanup only
//!    drops state that no longer matters, so it never changes a later answer.
//! 2. [`Algorithm::record`]: record an admission. Called only when every
//!    policy facing the request admitted it, so a refusal consumes nothing.
//!
//! [`Algorithm::step`] does both for one policy: the pure form
//! `(state, now, cost) -> (state', Decision)`.
//!
//! Times are [`Timestamp`]s in microseconds. State never moves backwards: an
//! algorithm that sees a `now` older than its state acts at its state's time.
//!
//! | algorithm | guarantee |
//! |---|---|
//! | [`FixedWindow`] | at most `limit` per clock-aligned window `[kW, (k+1)W)`; up to `2 * limit` across a boundary |
//! | [`SlidingLog`] | at most `limit` in every interval `(t - W, t]` (exact) |
//! | [`TokenBucket`] | at most `floor(capacity + rate * T)` in any interval of length `T` (GCRA; decision-for-decision equal to governor) |
//! | [`SlidingWindow`] | `prev * (1 - elapsed/W) + current <= limit`: an approximation, not an exact guarantee |

mod fixed_window;
mod sliding_log;
mod sliding_window;
mod token_bucket;

use std::time::Duration;

pub use fixed_window::{FixedWindow, FixedWindowState};
pub use sliding_log::{SlidingLog, SlidingLogState};
pub use sliding_window::{SlidingWindow, SlidingWindowState};
pub use token_bucket::{TokenBucket, TokenBucketState};

use crate::clock::Timestamp;
use crate::quota::Decision;

/// One of the four algorithms, with its numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Algorithm {
    /// Clock-aligned fixed window.
    FixedWindow(FixedWindow),
    /// Exact sliding log.
    SlidingLog(SlidingLog),
    /// Token bucket with continuous refill (GCRA).
    TokenBucket(TokenBucket),
    /// Weighted window counter (approximate sliding window).
    SlidingWindow(SlidingWindow),
}

/// The state of one key under one algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// State of a [`FixedWindow`].
    FixedWindow(FixedWindowState),
    /// State of a [`SlidingLog`].
    SlidingLog(SlidingLogState),
    /// State of a [`TokenBucket`].
    TokenBucket(TokenBucketState),
    /// State of a [`SlidingWindow`].
    SlidingWindow(SlidingWindowState),
}

impl Algorithm {
    /// The state of a key that has never been seen.
    pub fn fresh_state(&self) -> State {
        match self {
            Algorithm::FixedWindow(_) => State::FixedWindow(FixedWindowState::default()),
            Algorithm::SlidingLog(_) => State::SlidingLog(SlidingLogState::default()),
            Algorithm::TokenBucket(_) => State::TokenBucket(TokenBucketState::default()),
            Algorithm::SlidingWindow(_) => State::SlidingWindow(SlidingWindowState::default()),
        }
    }

    /// True when `state` is a state of this algorithm.
    pub fn owns(&self, state: &State) -> bool {
        matches!(
            (self, state),
            (Algorithm::FixedWindow(_), State::FixedWindow(_))
                | (Algorithm::SlidingLog(_), State::SlidingLog(_))
                | (Algorithm::TokenBucket(_), State::TokenBucket(_))
                | (Algorithm::SlidingWindow(_), State::SlidingWindow(_))
        )
    }

    /// The most cost that can ever be admitted at once.
    pub fn limit(&self) -> u64 {
        match self {
            Algorithm::FixedWindow(a) => a.limit,
            Algorithm::SlidingLog(a) => a.limit,
            Algorithm::TokenBucket(a) => a.capacity,
            Algorithm::SlidingWindow(a) => a.limit,
        }
    }

    /// The window, or for a token bucket the time to refill from empty.
    pub fn window(&self) -> Duration {
        let micros = match self {
            Algorithm::FixedWindow(a) => a.window,
            Algorithm::SlidingLog(a) => a.window,
            Algorithm::TokenBucket(a) => a.capacity.saturating_mul(a.interval),
            Algorithm::SlidingWindow(a) => a.window,
        };
        Duration::from_micros(micros)
    }

    /// Removes expired state and decides, without recording anything.
    ///
    /// # Panics
    /// If `state` belongs to another algorithm. Stores never mix them.
    #[inline]
    pub fn check(&self, state: &mut State, now: Timestamp, cost: u64) -> Decision {
        let now = now.as_micros();
        match (self, state) {
            (Algorithm::FixedWindow(a), State::FixedWindow(s)) => a.check(s, now, cost),
            (Algorithm::SlidingLog(a), State::SlidingLog(s)) => a.check(s, now, cost),
            (Algorithm::TokenBucket(a), State::TokenBucket(s)) => a.check(s, now, cost),
            (Algorithm::SlidingWindow(a), State::SlidingWindow(s)) => a.check(s, now, cost),
            _ => panic!("state does not belong to this algorithm"),
        }
    }

    /// Records an admission of `cost` checked at `now`.
    ///
    /// # Panics
    /// If `state` belongs to another algorithm.
    #[inline]
    pub fn record(&self, state: &mut State, now: Timestamp, cost: u64) {
        let now = now.as_micros();
        match (self, state) {
            (Algorithm::FixedWindow(a), State::FixedWindow(s)) => a.record(s, now, cost),
            (Algorithm::SlidingLog(a), State::SlidingLog(s)) => a.record(s, now, cost),
            (Algorithm::TokenBucket(a), State::TokenBucket(s)) => a.record(s, now, cost),
            (Algorithm::SlidingWindow(a), State::SlidingWindow(s)) => a.record(s, now, cost),
            _ => panic!("state does not belong to this algorithm"),
        }
    }

    /// Check and, if admitted, record: `(state, now, cost) -> (state', Decision)`.
    pub fn step(&self, state: &State, now: Timestamp, cost: u64) -> (State, Decision) {
        let mut next = state.clone();
        let decision = self.check(&mut next, now, cost);
        if decision.admitted {
            self.record(&mut next, now, cost);
        }
        (next, decision)
    }

    /// Settles the real cost after the work: `delta > 0` charges more, `delta < 0`
    /// refunds. Charges are capped at what is left (a settle never drives state
    /// past empty), refunds at what is held (never past full).
    pub fn adjust(&self, state: &mut State, now: Timestamp, delta: i64) {
        let now = now.as_micros();
        match (self, state) {
            (Algorithm::FixedWindow(a), State::FixedWindow(s)) => a.adjust(s, now, delta),
            (Algorithm::SlidingLog(a), State::SlidingLog(s)) => a.adjust(s, now, delta),
            (Algorithm::TokenBucket(a), State::TokenBucket(s)) => a.adjust(s, now, delta),
            (Algorithm::SlidingWindow(a), State::SlidingWindow(s)) => a.adjust(s, now, delta),
            _ => panic!("state does not belong to this algorithm"),
        }
    }

    /// The time from which `state` is equivalent to a fresh state, so that
    /// dropping it admits nothing extra.
    #[inline]
    pub fn fresh_at(&self, state: &State) -> Timestamp {
        Timestamp(match (self, state) {
            (Algorithm::FixedWindow(a), State::FixedWindow(s)) => a.fresh_at(s),
            (Algorithm::SlidingLog(a), State::SlidingLog(s)) => a.fresh_at(s),
            (Algorithm::TokenBucket(_), State::TokenBucket(s)) => s.tat,
            (Algorithm::SlidingWindow(a), State::SlidingWindow(s)) => a.fresh_at(s),
            _ => 0,
        })
    }

    /// The same algorithm with its limit (and refill rate) divided by `divisor`,
    /// at least 1: the share of one instance when the shared store is down.
    pub fn share(&self, divisor: u64) -> Algorithm {
        let divisor = divisor.max(1);
        let part = |n: u64| (n / divisor).max(1);
        match self {
            Algorithm::FixedWindow(a) => Algorithm::FixedWindow(FixedWindow {
                limit: part(a.limit),
                ..a.clone()
            }),
            Algorithm::SlidingLog(a) => Algorithm::SlidingLog(SlidingLog {
                limit: part(a.limit),
                ..a.clone()
            }),
            Algorithm::TokenBucket(a) => Algorithm::TokenBucket(TokenBucket {
                capacity: part(a.capacity),
                interval: a.interval.saturating_mul(divisor),
            }),
            Algorithm::SlidingWindow(a) => Algorithm::SlidingWindow(SlidingWindow {
                limit: part(a.limit),
                ..a.clone()
            }),
        }
    }
}

/// Microseconds as a duration.
pub(crate) fn micros(us: u64) -> Duration {
    Duration::from_micros(us)
}

/// A refusal for a cost above what the policy can ever admit.
pub(crate) fn never(limit: u64, remaining: u64, reset: u64) -> Decision {
    Decision {
        admitted: false,
        limit,
        remaining,
        retry_after: None,
        reset: micros(reset),
    }
}
