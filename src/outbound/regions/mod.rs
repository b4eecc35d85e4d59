//! Regional budget allocations (feature `redis`): see [`RegionalBudget`].
//!
//! Layout, one idea per file: `builder.rs` checks the settings;
//! `region.rs` is one region (its Redis, reached through the crate's one
//! Redis call module, `src/redis/`, its keys and its epoch); `ledger.rs` what
//! the scripts (`scripts/`) store and answer; `init.rs` seeds and recovers
//! the regions' states; `snapshot.rs` reads the allocations; `transfer.rs`
//! moves allocation (debit, credit, clear); `repair.rs` finishes half-done
//! transfers; `restore.rs` returns what a state loss took; `ordered.rs` moves allocation by ordered transfers with
//! bounded records and reads what a region may spend; `lease.rs`
//! builds the rate leases a region's allocation is spent through; `rebalancer.rs` moves
//! it toward demand; `error.rs` has the errors.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::Script;

mod builder;
mod error;
mod init;
mod lease;
mod ledger;
mod ordered;
mod rebalancer;
mod region;
mod repair;
mod restore;
mod snapshot;
mod transfer;

pub use builder::RegionalBudgetBuilder;
pub use error::RegionError;
use error::Step;

pub use repair::PendingTransfer;
pub use snapshot::Snapshot;
use transfer::TransferId;
pub use transfer::TransferOutcome;

use region::Region;

const DEBIT: &str = include_str!("scripts/regions_debit.lua");
const CREDIT: &str = include_str!("scripts/regions_credit.lua");
/// Prepended to [`CREDIT`] and [`RECEIVE`]: the rule they share.
const COMMON: &str = include_str!("scripts/regions_common.lua");
const SEED: &str = include_str!("scripts/regions_seed.lua");
const REFUND: &str = include_str!("scripts/regions_refund.lua");
const PIN: &str = include_str!("scripts/regions_pin.lua");
const SEND: &str = include_str!("scripts/regions_send.lua");
const RECEIVE: &str = include_str!("scripts/regions_receive.lua");
const VIEW: &str = include_str!("scripts/regions_view.lua");
const RESTORE: &str = include_str!("scripts/regions_restore.lua");

/// Allocations are integers in Lua doubles: exact below 2^53.
const MAX_TOTAL: u64 = (1 << 53) - 1;
const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_millis(500);
const DEFAULT_CREDIT_HOLD: Duration = Duration::from_secs(8);
const MAX_NAME: usize = 64;
const MAX_ID: usize = 128;

/// A total budget split into disjoint per-region allocations, each stored in
/// that region's own Redis (feature `redis`).
///
/// A budget of, say, 240 requests per second to a shared dependency is
/// divided among regions (100 + 80 + 60). Each region enforces its share
/// locally, and [`transfer`](Self::transfer) moves allocation from one
/// region to another when demand shifts. Clones share the connections and
/// settings.
///
/// # The invariant
///
/// **At every moment, the allocations of all regions sum to at most the
/// total.** They sum to exactly the total when no transfer is in flight.
///
/// A transfer is two steps on two servers, and each step is one atomic Lua
/// script on one Redis:
///
/// | step | where | what it does | the sum afterwards |
/// |---|---|---|---|
/// | 1. debit (`regions_debit.lua`) | donor's Redis | refuses unless the donor holds at least the amount; else subtracts it and records the transfer id as debited (with amount, receiver and the receiver's epoch) | total − amount: the amount is in flight |
/// | 2. credit (`regions_credit.lua`) | receiver's Redis | sent **only after the debit was confirmed**; adds the amount and records the id as credited, or does nothing if the id was already credited; refuses if the receiver's epoch is not the recorded one | total |
/// | 3. settle (`HDEL`) | donor's Redis | drops the id from the donor's list of pending debits | unchanged |
///
/// Each region's state carries an **epoch**, drawn at random when it is
/// seeded or recovered. The debit is bound to the receiver's epoch as last
/// seen by this process (read first if never seen), and the credit lands
/// only in that state of the receiver, never in one re-created after a
/// state loss (see [State loss](#state-loss)).
///
/// The donor always decreases first and the receiver increases only after,
/// so the amount is never counted in two places; between the steps the sum
/// is below the total ("money in flight"), never above. A region's
/// allocation never goes below zero.
///
/// # Idempotence and repair
///
/// A transfer id names one transfer out of one donor. Both scripts check
/// it: calling [`transfer`](Self::transfer) again with the same id never
/// debits or credits twice; it finishes whatever is missing and reports
/// what it did ([`TransferOutcome`]). Reusing an id for a different receiver
/// or amount is refused with [`RegionError::Conflict`].
///
/// A transfer interrupted after its debit (the receiver's Redis down, a
/// deadline passed, the process died between the two steps, or the caller
/// dropped the `transfer` future there, which returns no error) leaves the
/// amount in flight: the sum stays below the total until
/// [`repair`](Self::repair) or [`repair_all`](Self::repair_all) sends the
/// credit, which the receiver applies at most once. Any error for which
/// [`RegionError::needs_repair`] is true may have left a debit behind.
/// A refused transfer records nothing, so its id may be used again later.
///
/// A donor that lost its data has forgotten its debits. A retry of a
/// transfer it had debited debits it again, but the receiver keeps, with
/// each credit, the donor epoch it came from: it refuses the new debit
/// because it already holds the id from the donor's earlier state, and the
/// donor is given the amount back (`regions_refund.lua`, recorded on the
/// debit, the refund step). The retry answers
/// [`TransferOutcome::AlreadyApplied`], or [`RegionError::Conflict`] if
/// the earlier credit was of another amount; nothing has moved twice. A
/// retry naming another receiver than the first time cannot be recognised
/// this way and is a new transfer.
///
/// # Deadlines and errors
///
/// Every Redis call (connecting included) has a deadline,
/// [`RegionalBudgetBuilder::call_timeout`], 500 ms by default. No error
/// panics; each names the region and, for transfers, the step (debit,
/// credit, lookup or refund) in its message, and says whether the donor is,
/// or may be, debited (`debited: true`). A call that timed out or lost its
/// connection after it was sent has an unknown outcome (`outcome_unknown:
/// true`): the step may have been applied. Retry
/// the transfer with the same id, or repair it; either is safe. After a
/// timeout, or a call dropped by its caller before the answer (an outer
/// timeout, a cancelled request), the next call on that region reconnects.
///
/// # Observing the allocations
///
/// [`allocations`](Self::allocations) reads each region separately. Such a
/// sum is **not** the sum at any one moment: a transfer that completes
/// between the read of its donor and the read of its receiver is counted
/// twice (the observed sum can exceed the total), and one that starts and
/// completes the other way round is missed. Only a consistent cut says
/// something about the invariant; [`snapshot`](Self::snapshot) reads one:
/// it reads every region at once, each atomically, and checks from the
/// sequence numbers the scripts keep that every credit it saw has its debit
/// in the same reads (retrying otherwise). In a [`Snapshot`], `sum() +
/// in_flight() == total` and `sum() <= total`.
///
/// # State loss
///
/// The allocation is only as durable as the region's Redis. A Redis that
/// restarts without its data has lost its allocation and its idempotence
/// records. The scripts never re-create a missing allocation on their own
/// (a credit to a missing state is refused with
/// [`RegionError::StateLost`]), because re-creating a region at its
/// initial share after the others have changed could raise the sum above
/// the total. [`initialize`](Self::initialize) re-seeds missing regions
/// only while every surviving region is untouched since seeding and their
/// shares fit under the total; otherwise
/// an operator calls [`recover_lost`](Self::recover_lost), which re-creates
/// the region with allocation 0: the sum stays at most the total, and the
/// lost share is gone until someone decides where it belongs. Run each
/// region's Redis with persistence (AOF) to make this rare.
///
/// A re-created receiver has a new epoch, and no debit made against its
/// lost state is ever credited to it: the lost state may have received that
/// amount already and passed it on, so crediting it again could raise the
/// sum above the total. Such a transfer, retried or repaired, fails with
/// [`RegionError::ReceiverRecreated`] and is dropped from the pending
/// list; its amount is lost from the sum, which stays at most the total. So
/// is a new transfer debited against the lost state by a process that had
/// not seen the recovery yet.
///
/// A donor re-seeded at its initial share by
/// [`initialize`](Self::initialize) never has a credit of its lost state
/// land after it: that share holds the amount again
/// ([`RegionError::DonorReseeded`]).
///
/// # Keys
///
/// Region `r` of budget `b` keeps, in its own Redis, four keys sharing the
/// hash tag `{b:r}` (so a region may also be a Redis Cluster slot):
///
/// | key | holds |
/// |---|---|
/// | `tower-admission:regions:{b:r}:state` | hash: `alloc`, `debited` and `credited` (running totals), `seq` (debits so far), `epoch`, `from:<donor>` (highest seq credited from each donor), `pin:<donor>` (the only epoch of that donor credited here, once it was re-seeded) |
/// | `tower-admission:regions:{b:r}:debits` | hash: transfer id → `amount:to:seq:epoch:to_epoch` (this region's epoch and the receiver's), with `:refunded` once given back; every debit ever made here |
/// | `tower-admission:regions:{b:r}:pending` | hash: the same records, for debits whose credit is not yet confirmed |
/// | `tower-admission:regions:{b:r}:credits` | hash: `donor:id` → `amount:seq:donor_epoch`, every credit ever applied here |
///
/// The two ledgers grow by one field per id-based transfer and are never
/// trimmed: forgetting an id would make a late retry of it apply twice.
///
/// # Ordered transfers: bounded records
///
/// [`send`](Self::send) moves allocation as the `n`-th transfer of a pair
/// (numbers from [`next_number`](Self::next_number)). Its records are a
/// watermark per pair in the state hash (`out:<to>` and `last:<to>` on the
/// donor, `in:<donor>:<epoch>` on the receiver), a pending mark per pair
/// while unconfirmed, and `hold`, the credits younger than the
/// [credit hold](RegionalBudgetBuilder::credit_hold): 14 fields for three
/// regions however many transfers run. A late retry of a number at or
/// below the watermark is never applied again. Received allocation counts
/// as spendable ([`spendable`](Self::spendable)) and may be given on only
/// after the hold, which is what lets a region's [lease](Self::lease)
/// spend it safely;
/// [`rebalance_once`](Self::rebalance_once) moves allocation toward demand
/// with it. `docs/regions.md` has the proofs.
///
/// # Example
///
/// ```no_run
/// use tower_admission::outbound::{RegionalBudget, RegionError};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let budget = RegionalBudget::builder(240)
///     .name("payments-api")
///     .region("eu", "redis://redis.eu.internal:6379/", 100)
///     .region("us", "redis://redis.us.internal:6379/", 80)
///     .region("ap", "redis://redis.ap.internal:6379/", 60)
///     .build()?;
/// budget.initialize().await?;
///
/// let id = "rebalance-42-ap-eu";
/// match budget.transfer(id, "ap", "eu", 20).await {
///     Ok(outcome) => println!("moved: {outcome:?}"),
///     Err(RegionError::Insufficient { available, .. }) => println!("ap holds only {available}"),
///     Err(e) if e.needs_repair() => {
///         // Safe at any time, as often as needed.
///         budget.repair(id).await?;
///     }
///     Err(e) => return Err(e.into()),
/// }
/// assert_eq!(budget.snapshot().await?.sum(), 240);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RegionalBudget {
    inner: Arc<Inner>,
}

struct Inner {
    name: Box<str>,
    total: u64,
    call_timeout: Duration,
    /// The credit hold H, in µs.
    hold_us: u64,
    /// The settings of the region leases.
    leases: builder::LeaseSettings,
    /// Each region's lease store, if it has leases.
    lease_stores: Vec<(String, crate::outbound::LeaseStore)>,
    /// The rebalancers' settings.
    rebalance: builder::Rebalance,
    regions: Vec<Region>,
    debit: Script,
    credit: Script,
    seed: Script,
    refund: Script,
    pin: Script,
    send: Script,
    receive: Script,
    view: Script,
    restore: Script,
}

impl fmt::Debug for RegionalBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let regions: Vec<(&str, u64)> = self
            .inner
            .regions
            .iter()
            .map(|r| (&*r.name, r.initial))
            .collect();
        f.debug_struct("RegionalBudget")
            .field("name", &self.inner.name)
            .field("total", &self.inner.total)
            .field("initial_split", &regions)
            .field("call_timeout", &self.inner.call_timeout)
            .finish()
    }
}

impl RegionalBudget {
    /// Settings for a budget of `total`, to be split among the regions added
    /// with [`RegionalBudgetBuilder::region`].
    ///
    /// ```
    /// use tower_admission::outbound::RegionalBudget;
    ///
    /// let budget = RegionalBudget::builder(240)
    ///     .region("eu", "redis://127.0.0.1:6380/", 100)
    ///     .region("us", "redis://127.0.0.1:6381/", 80)
    ///     .region("ap", "redis://127.0.0.1:6382/", 60)
    ///     .build()?; // checks the settings; connects lazily
    /// assert_eq!(budget.total(), 240);
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn builder(total: u64) -> RegionalBudgetBuilder {
        RegionalBudgetBuilder {
            name: "default".to_owned(),
            total,
            regions: Vec::new(),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            credit_hold: DEFAULT_CREDIT_HOLD,
            leases: builder::LeaseSettings::default(),
            lease_stores: Vec::new(),
            rebalance: builder::Rebalance {
                max_step: None,
                dead_band: None,
                floor: 0,
            },
        }
    }

    /// The budget's name, part of every key.
    ///
    /// ```
    /// # use tower_admission::outbound::RegionalBudget;
    /// let budget = RegionalBudget::builder(10).region("eu", "redis://127.0.0.1/", 10).build()?;
    /// assert_eq!(budget.name(), "default");
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The total that the allocations never exceed together.
    ///
    /// ```
    /// # use tower_admission::outbound::RegionalBudget;
    /// let budget = RegionalBudget::builder(10).region("eu", "redis://127.0.0.1/", 10).build()?;
    /// assert_eq!(budget.total(), 10);
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn total(&self) -> u64 {
        self.inner.total
    }

    /// The deadline of each Redis call.
    ///
    /// ```
    /// # use tower_admission::outbound::RegionalBudget;
    /// # use std::time::Duration;
    /// let budget = RegionalBudget::builder(10).region("eu", "redis://127.0.0.1/", 10).build()?;
    /// assert_eq!(budget.call_timeout(), Duration::from_millis(500));
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn call_timeout(&self) -> Duration {
        self.inner.call_timeout
    }

    /// The credit hold `H` (see [`RegionalBudgetBuilder::credit_hold`]).
    ///
    /// ```
    /// # use tower_admission::outbound::RegionalBudget;
    /// # use std::time::Duration;
    /// let budget = RegionalBudget::builder(10).region("eu", "redis://127.0.0.1/", 10).build()?;
    /// assert_eq!(budget.credit_hold(), Duration::from_secs(8));
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn credit_hold(&self) -> Duration {
        Duration::from_micros(self.inner.hold_us)
    }

    /// The region names with their initial allocations, in the order they
    /// were added.
    ///
    /// ```
    /// # use tower_admission::outbound::RegionalBudget;
    /// let budget = RegionalBudget::builder(10)
    ///     .region("eu", "redis://127.0.0.1:6380/", 7)
    ///     .region("us", "redis://127.0.0.1:6381/", 3)
    ///     .build()?;
    /// assert_eq!(budget.regions().collect::<Vec<_>>(), [("eu", 7), ("us", 3)]);
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn regions(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.inner.regions.iter().map(|r| (&*r.name, r.initial))
    }

    fn region(&self, name: &str) -> Option<&Region> {
        self.inner.regions.iter().find(|r| &*r.name == name)
    }

    /// [`region`](Self::region), or [`RegionError::UnknownRegion`].
    fn known_region(&self, name: &str) -> Result<&Region, RegionError> {
        self.region(name).ok_or_else(|| RegionError::UnknownRegion {
            region: name.to_owned(),
        })
    }

    /// [`RegionError::AboveTotal`] unless `allocations` sum to at most the
    /// total.
    fn check_at_most_total(
        &self,
        allocations: impl Iterator<Item = u64>,
    ) -> Result<(), RegionError> {
        let sum = allocations.fold(0, u64::saturating_add);
        if sum > self.inner.total {
            return Err(RegionError::AboveTotal {
                sum,
                total: self.inner.total,
            });
        }
        Ok(())
    }
}
