//! Time sources for limiter decisions.
//!
//! Every decision reads time from exactly one trusted source per store. In
//! memory that is a [`Clock`]; in Redis it is the server's `TIME`. A clock
//! tells the time since the Unix epoch, as a [`Duration`], so that fixed
//! windows align with wall-clock minutes. The crate keeps whole microseconds,
//! which Lua scripts use as integers without losing precision (2^53 µs is
//! about 285 years).
//!
//! [`SystemClock`] anchors the wall clock once and then advances with the
//! monotonic clock, so it never moves backwards even if NTP steps the system
//! time. [`ManualClock`] is for tests: its clones share one time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Whole microseconds since the Unix epoch: a [`Clock`]'s time as the
/// crate keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub(crate) struct Timestamp(pub(crate) u64);

impl Timestamp {
    /// The time `clock` reads now.
    #[inline]
    pub(crate) fn now(clock: &impl Clock) -> Self {
        Timestamp(clock.now_micros())
    }

    /// The time `d` after the Unix epoch, in whole microseconds (saturating).
    #[inline]
    pub(crate) fn from_duration(d: Duration) -> Self {
        Timestamp(duration_to_micros(d))
    }

    /// The time since the Unix epoch.
    #[cfg(any(test, feature = "redis"))]
    pub(crate) const fn as_duration(self) -> Duration {
        Duration::from_micros(self.0)
    }

    /// Builds a timestamp from whole seconds since the Unix epoch.
    #[cfg(test)]
    pub(crate) const fn from_secs(s: u64) -> Self {
        Timestamp(s * 1_000_000)
    }

    /// Microseconds since the Unix epoch.
    pub(crate) const fn as_micros(self) -> u64 {
        self.0
    }

    /// The time from `earlier` to `self`, zero if `earlier` is later.
    #[cfg(feature = "redis")]
    pub(crate) fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }
}

/// Converts a duration to whole microseconds, saturating at `u64::MAX`.
#[inline]
pub(crate) fn duration_to_micros(d: Duration) -> u64 {
    d.as_secs()
        .saturating_mul(1_000_000)
        .saturating_add(u64::from(d.subsec_micros()))
}

/// A source of time: the time since the Unix epoch. The crate reads it in
/// whole microseconds.
///
/// Implementations must be cheap to clone; clones share one time source.
///
/// ```
/// use std::time::Duration;
/// use tower_admission::clock::Clock;
///
/// /// A clock stopped at noon, 2024-01-01 UTC.
/// #[derive(Clone)]
/// struct Noon;
///
/// impl Clock for Noon {
///     fn now(&self) -> Duration {
///         Duration::from_secs(1_704_110_400)
///     }
/// }
/// assert_eq!(Noon.now().as_secs(), 1_704_110_400);
/// assert_eq!(Noon.now_micros(), 1_704_110_400_000_000);
/// ```
pub trait Clock: Clone + Send + Sync + 'static {
    /// The current time, since the Unix epoch.
    fn now(&self) -> Duration;

    /// The current time in whole microseconds since the Unix epoch
    /// (saturating), what the crate reads. Provided from [`now`](Self::now);
    /// a clock that counts microseconds answers it without building a
    /// `Duration`, as the crate's two do.
    #[inline]
    fn now_micros(&self) -> u64 {
        duration_to_micros(self.now())
    }
}

/// Wall-clock aligned, monotonic time: the wall clock read once at creation,
/// advanced by a monotonic clock afterwards.
///
/// The monotonic clock is [`quanta`]'s (the CPU's invariant TSC where it has
/// one, else the OS monotonic clock), the same source governor uses: reading
/// it costs a few nanoseconds instead of a system call.
#[derive(Debug, Clone)]
pub struct SystemClock {
    anchor_wall: u64,
    anchor: u64,
    clock: quanta::Clock,
}

impl SystemClock {
    /// Anchors a new clock at the current wall-clock time.
    pub fn new() -> Self {
        let anchor_wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(duration_to_micros)
            .unwrap_or(0);
        let clock = quanta::Clock::new();
        SystemClock {
            anchor_wall,
            anchor: clock.raw(),
            clock,
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Duration {
        Duration::from_micros(self.now_micros())
    }

    #[inline]
    fn now_micros(&self) -> u64 {
        let nanos = self.clock.delta_as_nanos(self.anchor, self.clock.raw());
        self.anchor_wall.saturating_add(nanos / 1_000)
    }
}

/// A clock that moves only when told to. Clones share one time.
///
/// ```
/// use tower_admission::clock::{Clock, ManualClock};
/// use std::time::Duration;
///
/// let clock = ManualClock::new(Duration::from_secs(60));
/// let shared = clock.clone();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(shared.now(), Duration::from_millis(61_500));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock that reads `start` (since the Unix epoch) until moved, in
    /// whole microseconds.
    pub fn new(start: Duration) -> Self {
        ManualClock {
            now: Arc::new(AtomicU64::new(duration_to_micros(start))),
        }
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.now.fetch_add(duration_to_micros(d), Ordering::SeqCst);
    }

    /// Sets the clock to `t` since the Unix epoch, which may be earlier than
    /// now (to test rollback).
    pub fn set(&self, t: Duration) {
        self.now.store(duration_to_micros(t), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_micros(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }

    fn now(&self) -> Duration {
        Duration::from_micros(self.now_micros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_clock_is_monotonic_and_near_wall_time() {
        let clock = SystemClock::new();
        let a = clock.now();
        let b = clock.now();
        assert!(b >= a);
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let diff = wall.as_micros().abs_diff(b.as_micros());
        assert!(
            diff < 5_000_000,
            "system clock drifted {diff}µs from wall time"
        );
    }

    #[test]
    fn manual_clock_clones_share_time() {
        let clock = ManualClock::new(Duration::from_micros(10));
        let other = clock.clone();
        other.set(Duration::from_micros(5));
        assert_eq!(clock.now(), Duration::from_micros(5));
    }

    #[test]
    fn timestamps_are_whole_microseconds() {
        let d = Duration::new(1_704_110_400, 123_456_789);
        let t = Timestamp::from_duration(d);
        assert_eq!(t.as_micros(), 1_704_110_400_123_456);
        assert_eq!(t.as_duration(), Duration::new(1_704_110_400, 123_456_000));
        assert_eq!(Timestamp::from_duration(Duration::MAX), Timestamp(u64::MAX));
    }
}
