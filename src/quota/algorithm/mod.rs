//! The four quota algorithms as pure state machines.
//!
//! Each algorithm is a value holding its numbers, and a state type. A decision
//! is two steps on one state, always made together under one lock (memory) or
//! inside one script (Redis):
//!
//! 1. [`Algorithm::check`]: remove expired state, then decide. Cleanup only
//!    drops state that no longer matters, so it never changes a later answer.
//! 2. record the admission, only when every enforcing policy facing the
//!    request admitted it, so a refusal consumes nothing. Recording returns
//!    what the charge holds, so that a settlement gives back only that.
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

#[cfg(test)]
mod sample_tests;

use std::time::Duration;

pub(crate) use fixed_window::{FixedWindow, FixedWindowState};
pub(crate) use sliding_log::{SlidingLog, SlidingLogState};
pub(crate) use sliding_window::{SlidingWindow, SlidingWindowState};
pub(crate) use token_bucket::{TokenBucket, TokenBucketState};

use crate::clock::Timestamp;
use crate::quota::Decision;
use crate::ConfigError;

/// One of the four algorithms, with its numbers. Built only through the
/// [`Policy`](crate::quota::Policy) constructors, which check the numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum Algorithm {
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
#[non_exhaustive]
pub(crate) enum State {
    /// State of a [`FixedWindow`].
    FixedWindow(FixedWindowState),
    /// State of a [`SlidingLog`].
    SlidingLog(SlidingLogState),
    /// State of a [`TokenBucket`].
    TokenBucket(TokenBucketState),
    /// State of a [`SlidingWindow`].
    SlidingWindow(SlidingWindowState),
}

/// What one admission holds in one policy's state, so that a later
/// settlement gives back only what that charge still holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Hold {
    /// Where the charge sits: the window end (µs) for the windows, the
    /// entry's sequence number for the sliding log, the end of the charge's
    /// segment of the TAT timeline (whole µs) for the token bucket.
    pub(crate) mark: u64,
    /// The token bucket: the fractional part of `mark`. The windows: the
    /// state's epoch, which counts its changes of window length, so that a
    /// window of another length that happens to end at `mark` is not the
    /// charge's. 0 for the sliding log.
    pub(crate) frac: u64,
    /// Cost the charge still holds: the most a refund can give back.
    pub(crate) amount: u64,
    /// The token bucket: the life of the state that recorded the charge
    /// (the time it began), so that a state its store lost and began again
    /// is not the charge's. 0 for the others.
    pub(crate) life: u64,
}

/// Applies `$body` to the algorithm and its state of the same kind.
macro_rules! each {
    ($alg:expr, $state:expr, |$a:ident, $s:ident| $body:expr) => {
        match ($alg, $state) {
            (Algorithm::FixedWindow($a), State::FixedWindow($s)) => $body,
            (Algorithm::SlidingLog($a), State::SlidingLog($s)) => $body,
            (Algorithm::TokenBucket($a), State::TokenBucket($s)) => $body,
            (Algorithm::SlidingWindow($a), State::SlidingWindow($s)) => $body,
            _ => panic!("state does not belong to this algorithm"),
        }
    };
}

/// Applies `$body` to the algorithm, whatever its kind.
macro_rules! any {
    ($alg:expr, |$a:ident| $body:expr) => {
        match $alg {
            Algorithm::FixedWindow($a) => $body,
            Algorithm::SlidingLog($a) => $body,
            Algorithm::TokenBucket($a) => $body,
            Algorithm::SlidingWindow($a) => $body,
        }
    };
}

impl Algorithm {
    /// The state of a key that has never been seen.
    pub(crate) fn fresh_state(&self) -> State {
        match self {
            Algorithm::FixedWindow(_) => State::FixedWindow(FixedWindowState::default()),
            Algorithm::SlidingLog(_) => State::SlidingLog(SlidingLogState::default()),
            Algorithm::TokenBucket(_) => State::TokenBucket(TokenBucketState::default()),
            Algorithm::SlidingWindow(_) => State::SlidingWindow(SlidingWindowState::default()),
        }
    }

    /// True when `state` is a state of this algorithm.
    pub(crate) fn owns(&self, state: &State) -> bool {
        matches!(
            (self, state),
            (Algorithm::FixedWindow(_), State::FixedWindow(_))
                | (Algorithm::SlidingLog(_), State::SlidingLog(_))
                | (Algorithm::TokenBucket(_), State::TokenBucket(_))
                | (Algorithm::SlidingWindow(_), State::SlidingWindow(_))
        )
    }

    /// The most cost that can ever be admitted at once.
    pub(crate) fn limit(&self) -> u64 {
        any!(self, |a| a.limit())
    }

    /// The window, or for a token bucket the time to refill from empty.
    pub(crate) fn window(&self) -> Duration {
        Duration::from_micros(any!(self, |a| a.window_micros()))
    }

    /// Removes expired state and decides, without recording anything.
    ///
    /// # Panics
    /// If `state` belongs to another algorithm. Stores never mix them.
    #[inline]
    pub(crate) fn check(&self, state: &mut State, now: Timestamp, cost: u64) -> Decision {
        let now = now.as_micros();
        each!(self, state, |a, s| a.check(s, now, cost))
    }

    /// Records an admission of `cost` that [`check`](Self::check) just
    /// admitted at `now`; returns what the charge holds.
    #[inline]
    pub(crate) fn record(&self, state: &mut State, now: Timestamp, cost: u64) -> Hold {
        let now = now.as_micros();
        each!(self, state, |a, s| a.record(s, now, cost))
    }

    #[cfg(test)]
    /// Check and, if admitted, record: `(state, now, cost) -> (state', Decision)`.
    ///
    /// # Panics
    /// If `state` belongs to another algorithm.
    pub(crate) fn step(&self, state: &State, now: Timestamp, cost: u64) -> (State, Decision) {
        let mut next = state.clone();
        let decision = self.check(&mut next, now, cost);
        if decision.admitted {
            self.record(&mut next, now, cost);
        }
        (next, decision)
    }

    /// Settles a charge: `delta > 0` charges more, capped at what is left;
    /// `delta < 0` refunds at most what the charge `hold` still holds.
    /// Returns the charge's hold after the settlement.
    pub(crate) fn settle(&self, state: &mut State, now: Timestamp, hold: Hold, delta: i64) -> Hold {
        let now = now.as_micros();
        each!(self, state, |a, s| a.settle(s, now, hold, delta))
    }

    /// The time from which `state` is equivalent to a fresh state, so that
    /// dropping it admits nothing extra.
    ///
    /// # Panics
    /// If `state` belongs to another algorithm.
    #[inline]
    pub(crate) fn fresh_at(&self, state: &State) -> Timestamp {
        Timestamp(each!(self, state, |a, s| a.fresh_at(s)))
    }

    /// The same algorithm with its limit (and refill rate) divided by `divisor`,
    /// at least 1: the share of one instance when the shared store is down.
    pub(crate) fn share(&self, divisor: u64) -> Algorithm {
        match self {
            Algorithm::FixedWindow(a) => Algorithm::FixedWindow(a.share(divisor)),
            Algorithm::SlidingLog(a) => Algorithm::SlidingLog(a.share(divisor)),
            Algorithm::TokenBucket(a) => Algorithm::TokenBucket(a.share(divisor)),
            Algorithm::SlidingWindow(a) => Algorithm::SlidingWindow(a.share(divisor)),
        }
    }

    #[cfg(feature = "redis")]
    /// The algorithm's code in scripts and key names.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            Algorithm::FixedWindow(_) => "fw",
            Algorithm::SlidingLog(_) => "sl",
            Algorithm::TokenBucket(_) => "tb",
            Algorithm::SlidingWindow(_) => "sw",
        }
    }

    #[cfg(feature = "redis")]
    /// The three numbers the algorithm's Lua script loads with.
    pub(crate) fn script_args(&self) -> [u64; 3] {
        any!(self, |a| a.script_args())
    }

    #[cfg(feature = "redis")]
    /// Ok when the Lua script decides this algorithm exactly in doubles.
    pub(crate) fn lua_exact(&self) -> Result<(), ConfigError> {
        any!(self, |a| a.lua_exact())
    }
}

/// An algorithm with its own state type, for a store that keeps a quota of
/// that one algorithm in that type rather than in a [`State`].
pub(crate) trait Machine {
    type State: Default + Clone;
    /// The algorithm, when `algorithm` is of this kind.
    fn of(algorithm: &Algorithm) -> Option<&Self>;
    fn check(&self, state: &mut Self::State, now: u64, cost: u64) -> Decision;
    fn record(&self, state: &mut Self::State, now: u64, cost: u64) -> Hold;
    fn settle(&self, state: &mut Self::State, now: u64, hold: Hold, delta: i64) -> Hold;
    fn fresh_at(&self, state: &Self::State) -> u64;
}

macro_rules! machine {
    ($($kind:ident: $alg:ident, $state:ident;)*) => {$(
        impl Machine for $alg {
            type State = $state;
            #[inline]
            fn of(algorithm: &Algorithm) -> Option<&Self> {
                match algorithm {
                    Algorithm::$kind(a) => Some(a),
                    _ => None,
                }
            }
            #[inline]
            fn check(&self, state: &mut $state, now: u64, cost: u64) -> Decision {
                $alg::check(self, state, now, cost)
            }
            #[inline]
            fn record(&self, state: &mut $state, now: u64, cost: u64) -> Hold {
                $alg::record(self, state, now, cost)
            }
            fn settle(&self, state: &mut $state, now: u64, hold: Hold, delta: i64) -> Hold {
                $alg::settle(self, state, now, hold, delta)
            }
            #[inline]
            fn fresh_at(&self, state: &$state) -> u64 {
                $alg::fresh_at(self, state)
            }
        }
    )*};
}

machine! {
    FixedWindow: FixedWindow, FixedWindowState;
    SlidingLog: SlidingLog, SlidingLogState;
    SlidingWindow: SlidingWindow, SlidingWindowState;
}

/// The epoch of a window state moving to a new window of length `window`
/// at `now`, from `[start, end)` in `epoch`: with the window's end it names
/// the window a charge was counted in, so that a refund reaches only that
/// one. A state's first window (`end` 0: fresh, or its store lost it) takes
/// the time it began, which no earlier life of the key had; each change of
/// length adds 1; a roll to the next window of the same length keeps it
/// (the end moves on).
pub(crate) fn next_epoch(epoch: u64, start: u64, end: u64, window: u64, now: u64) -> u64 {
    if end == 0 {
        now
    } else if end - start != window {
        epoch.wrapping_add(1)
    } else {
        epoch
    }
}

/// Whether a settle at `now` under a window of `window` µs may roll the
/// counted window `[start, end)` to its own: not while that window is live,
/// counts something (`fresh` is false) and is of another length. It was
/// then counted under other numbers, those a redeploy brought after the
/// settling charge was made, and realigning it to a shorter window would
/// end its count early.
pub(crate) fn settle_may_roll(fresh: bool, start: u64, end: u64, window: u64, now: u64) -> bool {
    fresh || now.max(start) >= end || end - start == window
}

/// Settles a charge on the count of the window ending at `end` in epoch
/// `epoch`: `delta > 0` charges more, capped at `limit`; `delta < 0` refunds
/// at most what the charge holds, and only while its window is still the
/// current one (`hold.mark` is `end` and `hold.frac` is `epoch`). The one
/// settlement rule of both window algorithms.
pub(crate) fn settle_window(
    count: &mut u64,
    limit: u64,
    (end, epoch): (u64, u64),
    hold: Hold,
    delta: i64,
) -> Hold {
    if delta >= 0 {
        *count += delta.unsigned_abs().min(limit.saturating_sub(*count));
        return hold;
    }
    if hold.mark != end || hold.frac != epoch {
        return hold;
    }
    let refund = delta.unsigned_abs().min(hold.amount).min(*count);
    *count -= refund;
    Hold {
        amount: hold.amount - refund,
        ..hold
    }
}

/// `n`, checked to be at least 1.
pub(crate) fn positive(field: &'static str, n: u64) -> Result<u64, ConfigError> {
    if n == 0 {
        return Err(ConfigError::new(field, "must be at least 1"));
    }
    Ok(n)
}

/// `n / divisor`, at least 1.
pub(crate) fn part(n: u64, divisor: u64) -> u64 {
    (n / divisor.max(1)).max(1)
}

#[cfg(feature = "redis")]
/// Largest number the Lua scripts take as a limit or a time span.
const LUA_MAX: u64 = 1 << 45;

#[cfg(feature = "redis")]
/// Ok when `n` is at most 2^45, so the scripts' arithmetic stays exact.
pub(crate) fn lua_small(field: &'static str, n: u64) -> Result<(), ConfigError> {
    if n > LUA_MAX {
        return Err(ConfigError::new(
            field,
            "must be at most 2^45 for the redis store",
        ));
    }
    Ok(())
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
