//! [`LeaseStatus`]: what a lease is spending.

use std::time::Duration;

use super::Rate;

/// What a lease is spending; read through [`LeaseStatus`]'s `is_*` methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Mode {
    Starting,
    Granted,
    Fallback,
    Released,
}

/// A snapshot of a [`RateLease`](super::RateLease), from
/// [`RateLease::status`](super::RateLease::status). It is in exactly one of
/// four modes, read by [`is_starting`](Self::is_starting),
/// [`is_granted`](Self::is_granted), [`is_fallback`](Self::is_fallback) and
/// [`is_released`](Self::is_released).
///
/// ```no_run
/// # fn run(lease: tower_admission::outbound::RateLease) {
/// let status = lease.status();
/// if status.is_fallback() {
///     eprintln!("no grant since {:?}: spending {} from the fallback", status.expires_at, status.rate);
/// }
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseStatus {
    /// The mode at the time asked.
    pub(super) mode: Mode,
    /// The rate the local bucket fills at now.
    pub rate: Rate,
    /// The latest grant (zero before the first).
    pub grant: Rate,
    /// The local time the latest grant stops being spent, since the Unix
    /// epoch (zero if none).
    pub expires_at: Duration,
    /// An older grant above `grant` that is still spent, until
    /// `kept_expires_at` (zero if none): a lowered grant's surplus, which
    /// the script counts until the older grant's expiry anyway.
    pub kept: Rate,
    /// The local time `kept` stops being spent (zero if none).
    pub kept_expires_at: Duration,
    /// The max-min fair target the script computed at the last refresh.
    pub target: Rate,
    /// The demand reported at the last refresh.
    pub demand: Rate,
    /// The local bucket's capacity now, in cost units.
    pub capacity: u64,
    /// When the next refresh is due, local time.
    pub next_refresh: Duration,
    /// Refreshes that failed in a row.
    pub failures: u32,
    /// Refreshes refused since the lease was built because another live lease
    /// held its instance id
    /// ([`LeaseError::InstanceIdInUse`](super::LeaseError::InstanceIdInUse)).
    pub id_in_use: u64,
    /// The effective budget the fleet's targets share: the budget, lowered
    /// while the dependency pushes back (see
    /// [`RateLease::record_pushback`](super::RateLease::record_pushback)).
    pub effective: Rate,
    /// Pushbacks recorded by this lease since it was built.
    pub pushbacks: u64,
}

impl LeaseStatus {
    /// No refresh has finished yet: nothing is spent.
    pub fn is_starting(&self) -> bool {
        self.mode == Mode::Starting
    }

    /// Spending a grant from the script, until its local expiry.
    pub fn is_granted(&self) -> bool {
        self.mode == Mode::Granted
    }

    /// The grant expired without renewal (Redis unreachable): spending the
    /// fallback capacity `R / expected_instances`, or with no limit at all
    /// after [`fail_open`](super::RateLeaseBuilder::fail_open).
    pub fn is_fallback(&self) -> bool {
        self.mode == Mode::Fallback
    }

    /// Released: nothing is spent, ever again.
    pub fn is_released(&self) -> bool {
        self.mode == Mode::Released
    }
}
