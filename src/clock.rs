//! Time sources for limiter decisions.
//!
//! Every decision reads time from exactly one trusted source per store. In
//! memory that is a [`Clock`]; in Redis it is the server's `TIME`. Times are
//! [`Timestamp`]s: whole microseconds since the Unix epoch, so that fixed windows
//! align with wall-clock minutes and Lua scripts can use the same integers
//! without losing precision (2^53 µs is about 285 years).
//!
//! [`SystemClock`] anchors the wall clock once and then advances with the
//! monotonic clock, so it never moves backwards even if NTP steps the system
//! time. [`ManualClock`] is for tests: its clones share one time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Whole microseconds since the Unix epoch.
///
/// ```
/// use tower_admission::clock::Timestamp;
///
/// let noon = Timestamp::from_secs(1_704_110_400);
/// assert_eq!(noon.as_micros(), 1_704_110_400_000_000);
/// assert_eq!(Timestamp::from_micros(noon.as_micros()), noon);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(pub(crate) u64);

impl Timestamp {
    /// Builds a timestamp from microseconds since the Unix epoch.
    pub const fn from_micros(us: u64) -> Self {
        Timestamp(us)
    }

    /// Builds a timestamp from milliseconds since the Unix epoch.
    pub const fn from_millis(ms: u64) -> Self {
        Timestamp(ms * 1_000)
    }

    /// Builds a timestamp from whole seconds since the Unix epoch.
    pub const fn from_secs(s: u64) -> Self {
        Timestamp(s * 1_000_000)
    }

    /// Microseconds since the Unix epoch.
    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// This time moved forward by `d` (saturating).
    pub fn plus(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_add(duration_to_micros(d)))
    }

    /// The time from `earlier` to `self`, zero if `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }
}

/// Converts a duration to whole microseconds, saturating at `u64::MAX`.
pub(crate) fn duration_to_micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A source of [`Timestamp`]s.
///
/// Implementations must be cheap to clone; clones share one time source.
pub trait Clock: Clone + Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
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
    fn now(&self) -> Timestamp {
        let nanos = self.clock.delta_as_nanos(self.anchor, self.clock.raw());
        Timestamp(self.anchor_wall.saturating_add(nanos / 1_000))
    }
}

/// A clock that moves only when told to. Clones share one time.
///
/// ```
/// use tower_admission::clock::{Clock, ManualClock, Timestamp};
/// use std::time::Duration;
///
/// let clock = ManualClock::new(Timestamp::from_secs(60));
/// let shared = clock.clone();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(shared.now(), Timestamp::from_millis(61_500));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock that reads `start` until moved.
    pub fn new(start: Timestamp) -> Self {
        ManualClock {
            now: Arc::new(AtomicU64::new(start.0)),
        }
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.now.fetch_add(duration_to_micros(d), Ordering::SeqCst);
    }

    /// Sets the clock to `t`, which may be earlier than now (to test rollback).
    pub fn set(&self, t: Timestamp) {
        self.now.store(t.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.now.load(Ordering::SeqCst))
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
        let diff = wall.as_micros().abs_diff(u128::from(b.0));
        assert!(
            diff < 5_000_000,
            "system clock drifted {diff}µs from wall time"
        );
    }

    #[test]
    fn manual_clock_clones_share_time() {
        let clock = ManualClock::new(Timestamp(10));
        let other = clock.clone();
        other.set(Timestamp(5));
        assert_eq!(clock.now(), Timestamp(5));
    }
}
