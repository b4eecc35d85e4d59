//! Outbound dependency budgets: a shared budget charged before **every
//! send attempt** to a dependency, so that a fleet of instances never
//! overruns a service they all call.
//!
//! One check per incoming request cannot bound what that request sends
//! later: a batch of 100 items that makes 2 calls each sends 200, and
//! retries send more. So the budget sits on the outbound client, inside the
//! retry layer:
//!
//! ```text
//! tower::retry (RetryAttempts marks attempt n) -> DependencyBudgetLayer (normal | retry share) -> client
//! ```
//!
//! - [`DependencyBudget`]: the budget, a normal share for first attempts and
//!   a retry share for retries (for example 200/s + 40/s within 240/s), over
//!   any [`Store`](crate::quota::Store), optionally split into partitions
//!   ([`DependencyBudgetBuilder::partitions_random`]) to spread a hot key,
//!   each holding `1/N` of the budget.
//! - [`DependencyBudgetLayer`]: charges it per attempt, waiting up to a
//!   deadline (the default) or failing at once, with a typed
//!   [`BudgetError`] that carries the wait.
//! - [`RetryAttempts`]: a `tower::retry` policy that marks each attempt's
//!   number ([`Attempt`]) and retries 429 and 5xx with backoff and jitter,
//!   never sooner than the dependency's `Retry-After` or gRPC pushback. A
//!   policy of your own, or a hedge, marks its extra sends with
//!   [`Attempt::next`] to draw on the retry share.
//! - [`PushbackLayer`]: tells the budget when the dependency pushes back
//!   (429, 503 with `Retry-After`, nothing remaining), so
//!   that a leased budget lowers the whole fleet's spend and grows back when
//!   the pushback stops.
//! - `RateLease` (feature `redis`): an instance's lease on a rate of a
//!   fleet-wide budget, granted by a Lua script on Redis time that never lets
//!   unexpired grants sum above the budget, spent locally with no Redis call
//!   per send and refreshed in the background (see `docs/leases.md` for the
//!   bound on send starts).
//! - `LeasedBudget` (feature `redis`): the budget for a fleet, spent from
//!   one `RateLease` on the whole budget with each share held to its part,
//!   charged through the same layer.
//! - `RegionalBudget` (feature `redis`): disjoint per-region allocations of
//!   one total, each in its region's own Redis, moved between regions by
//!   idempotent, repairable transfers that debit the donor before they
//!   credit the receiver, so the allocations never sum above the total.
//!   Ordered transfers (`RegionalBudget::send`) keep bounded records.
//!   A region's instances spend its allocation through
//!   `RegionalBudget::lease`, a `RateLease` whose budget is the region's
//!   spendable allocation, so the grants of all regions never sum above the
//!   total; `RegionalBudget::spawn_rebalancer` moves a region's surplus
//!   toward demand (see `docs/regions.md`).
//!
//! **A bound on send starts is not a bound on arrivals at the receiver.**
//! Attempts admitted within the budget can still arrive together after
//! queueing in the network, a connection pool or the transport's own
//! retries; the dependency counts them when they arrive.

mod attempt;
mod budget;
mod layer;
mod pushback;

pub use attempt::{Attempt, RetryAttempts};
pub use budget::{
    AttemptBudget, BudgetShares, BudgetStats, DependencyBudget, DependencyBudgetBuilder,
};
pub use layer::{BudgetError, DependencyBudgetLayer};
pub use pushback::PushbackLayer;

#[cfg(feature = "redis")]
mod bucket;
#[cfg(feature = "redis")]
mod lease;
#[cfg(feature = "redis")]
mod leased;
#[cfg(feature = "redis")]
mod regions;
#[cfg(feature = "redis")]
pub use lease::{LeaseError, LeaseStatus, LeaseStore, Rate, RateLease, RateLeaseBuilder};
#[cfg(feature = "redis")]
pub use leased::LeasedBudget;
#[cfg(feature = "redis")]
pub use regions::{
    PendingTransfer, RegionError, RegionalBudget, RegionalBudgetBuilder, Snapshot, TransferOutcome,
};
