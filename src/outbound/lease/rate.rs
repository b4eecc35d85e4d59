//! [`Rate`]: a rate in thousandths of a unit per second.

use std::fmt;

/// The largest budget, in milli-units per second (about 10^9 per second),
/// so that every sum in the script stays exact in Lua's doubles.
pub(super) const MAX_RATE_MILLI: u64 = 1 << 40;

/// A rate in thousandths of a unit per second: exact in the script, fine
/// enough for shares such as 240/s over 41 instances.
///
/// ```
/// use tower_admission::outbound::Rate;
/// assert_eq!(Rate::per_second(240).as_milli(), 240_000);
/// assert_eq!(Rate::from_milli(5_853).to_string(), "5.853/s");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Rate(pub(super) u64);

impl Rate {
    /// Zero per second.
    pub const ZERO: Rate = Rate(0);

    /// `units` per second.
    pub const fn per_second(units: u64) -> Rate {
        Rate(units.saturating_mul(1_000))
    }

    /// `milli` thousandths of a unit per second.
    pub const fn from_milli(milli: u64) -> Rate {
        Rate(milli)
    }

    /// Thousandths of a unit per second.
    pub const fn as_milli(self) -> u64 {
        self.0
    }

    /// Units per second, as a float (for display and metrics).
    pub fn as_f64(self) -> f64 {
        self.0 as f64 / 1_000.0
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:03}/s", self.0 / 1_000, self.0 % 1_000)
    }
}
