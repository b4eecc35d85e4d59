//! Rate leases: a fleet shares one budget with no Redis call per send
//! (feature `redis`).
//!
//! The user-facing description is on [`RateLease`]; the grant rule is in
//! `scripts/lease.lua` and the proof of the bound in `docs/leases.md`.
//!
//! Layout, one idea per file:
//! - `store.rs`: [`LeaseStore`], the grant script's client (one call per
//!   refresh, through the crate's one Redis call module, `src/redis/`);
//!   `table.rs` reads the grants back ([`GrantTable`]); `error.rs` is
//!   [`LeaseError`].
//! - `rate_lease.rs`: [`RateLease`] and its send path, `try_acquire`;
//!   `builder.rs` its settings.
//! - `state.rs`: the local state and its bucket (the outbound side's one
//!   bucket, `src/outbound/bucket.rs`, in integer nano-tokens), filled at
//!   the grant until its local expiry; `fallback.rs`: what it spends after.
//! - `ceiling.rs`: a run-time ceiling on the budget a refresh reports, read
//!   beside the refresher (a region's lease follows its spendable
//!   allocation through it).
//! - `demand.rs`: the demand reported at each refresh; `pushback.rs`: the
//!   dependency's pushback, reported with it.
//! - `refresh.rs`: a refresh, its reply taken in, the refresher, the
//!   release.
//! - `schedule.rs`: the rate schedule a leased budget's shares replay;
//!   `shares.rs`: what a [`LeasedBudget`](crate::outbound::LeasedBudget)
//!   reads from and tells its lease.

mod builder;
mod ceiling;
mod demand;
mod error;
mod fallback;
mod pushback;
mod rate;
mod rate_lease;
mod refresh;
mod schedule;
mod shares;
mod state;
mod status;
mod store;
mod table;

pub use builder::RateLeaseBuilder;
pub(crate) use ceiling::{Ceiling, Source};
pub(crate) use demand::Asked;
pub use error::LeaseError;
pub use rate::Rate;
pub use rate_lease::RateLease;
pub(crate) use schedule::Schedule;
pub use status::LeaseStatus;
use status::Mode;
pub use store::LeaseStore;
pub(crate) use table::GrantTable;

/// The lease tests read the grant table back, which is crate-private: they
/// run as unit tests.
#[cfg(test)]
#[path = "../../../tests/internal/outbound_leases.rs"]
mod outbound_leases;

use rate_lease::Shared;
