//! [`LeaseMode`] and [`LeaseStatus`]: what a lease is spending.

use super::Rate;
use crate::clock::Timestamp;

/// What a [`RateLease`](super::RateLease) is spending.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LeaseMode {
    /// No refresh has finished yet: nothing is spent.
    Starting,
    /// A grant from the script, until its local expiry.
    Granted,
    /// The grant expired without renewal (Redis unreachable): the fallback
    /// capacity `R / expected_instances`, or no limit at all after
    /// [`fail_open`](super::RateLeaseBuilder::fail_open).
    Fallback,
    /// Released: nothing is spent, ever again.
    Released,
}

/// A snapshot of a [`RateLease`](super::RateLease), from
/// [`RateLease::status`](super::RateLease::status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseStatus {
    /// The mode at the time asked.
    pub mode: LeaseMode,
    /// The rate the local bucket fills at now.
    pub rate: Rate,
    /// The latest grant (zero before the first).
    pub grant: Rate,
    /// The local time the latest grant stops being spent (zero if none).
    pub expires_at: Timestamp,
    /// An older grant above `grant` that is still spent, until
    /// `kept_expires_at` (zero if none): a lowered grant's surplus, which
    /// the script counts until the older grant's expiry anyway.
    pub kept: Rate,
    /// The local time `kept` stops being spent (zero if none).
    pub kept_expires_at: Timestamp,
    /// The max-min fair target the script computed at the last refresh.
    pub target: Rate,
    /// The demand reported at the last refresh.
    pub demand: Rate,
    /// The local bucket's capacity now, in cost units.
    pub capacity: u64,
    /// When the next refresh is due, local time.
    pub next_refresh: Timestamp,
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
