//! Regional budget allocations (feature `redis`): see [`RegionalBudget`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use redis::{Script, Value};

use crate::redis::{CallError, Connector, Request, Target, Timing};
use crate::ConfigError;

const DEBIT: &str = include_str!("scripts/regions_debit.lua");
const CREDIT: &str = include_str!("scripts/regions_credit.lua");
const SEED: &str = include_str!("scripts/regions_seed.lua");
const REFUND: &str = include_str!("scripts/regions_refund.lua");
const PIN: &str = include_str!("scripts/regions_pin.lua");

/// Allocations are integers in Lua doubles: exact below 2^53.
const MAX_TOTAL: u64 = (1 << 53) - 1;
/// How many times [`RegionalBudget::snapshot`] reads before giving up.
const SNAPSHOT_ATTEMPTS: u32 = 64;
const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_millis(500);
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
/// A [`TransferId`] names one transfer out of one donor. Both scripts check
/// it: calling [`transfer`](Self::transfer) again with the same id never
/// debits or credits twice; it finishes whatever is missing and reports
/// what it did ([`TransferOutcome`]). Reusing an id for a different receiver
/// or amount is refused with [`TransferError::Conflict`].
///
/// A transfer interrupted after its debit (the receiver's Redis down, a
/// deadline passed, the process died between the two steps, or the caller
/// dropped the `transfer` future there, which returns no error) leaves the
/// amount in flight: the sum stays below the total until
/// [`repair`](Self::repair) or [`repair_all`](Self::repair_all) sends the
/// credit, which the receiver applies at most once. Any error for which
/// [`TransferError::needs_repair`] is true may have left a debit behind.
/// A refused transfer records nothing, so its id may be used again later.
///
/// A donor that lost its data has forgotten its debits. A retry of a
/// transfer it had debited debits it again, but the receiver keeps, with
/// each credit, the donor epoch it came from: it refuses the new debit
/// because it already holds the id from the donor's earlier state, and the
/// donor is given the amount back (`regions_refund.lua`, recorded on the
/// debit, step [`Step::Refund`]). The retry answers
/// [`TransferOutcome::AlreadyApplied`], or [`TransferError::Conflict`] if
/// the earlier credit was of another amount; nothing has moved twice. A
/// retry naming another receiver than the first time cannot be recognised
/// this way and is a new transfer.
///
/// # Deadlines and errors
///
/// Every Redis call (connecting included) has a deadline,
/// [`RegionalBudgetBuilder::call_timeout`], 500 ms by default. No error
/// panics; each names the region and, for transfers, the [`Step`]. A call
/// that timed out or lost its connection after it was sent has an unknown
/// outcome (`outcome_unknown: true`): the step may have been applied. Retry
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
/// [`TransferError::StateLost`]), because re-creating a region at its
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
/// [`TransferError::ReceiverRecreated`] and is dropped from the pending
/// list; its amount is lost from the sum, which stays at most the total. So
/// is a new transfer debited against the lost state by a process that had
/// not seen the recovery yet.
///
/// A donor re-seeded at its initial share by
/// [`initialize`](Self::initialize) never has a credit of its lost state
/// land after it: that share holds the amount again
/// ([`TransferError::DonorReseeded`]).
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
/// The two ledgers grow by one field per transfer and are never trimmed
/// here: forgetting an id would make a late retry of it apply twice.
///
/// # Example
///
/// ```no_run
/// use tower_admission::outbound::{RegionalBudget, TransferError, TransferId};
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
/// let id = TransferId::random();
/// match budget.transfer(&id, "ap", "eu", 20).await {
///     Ok(outcome) => println!("moved: {outcome:?}"),
///     Err(TransferError::Insufficient { available, .. }) => println!("ap holds only {available}"),
///     Err(e) if e.needs_repair() => {
///         // Safe at any time, as often as needed.
///         budget.repair(&id).await?;
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
    regions: Vec<Region>,
    debit: Script,
    credit: Script,
    seed: Script,
    refund: Script,
    pin: Script,
}

/// One region: its Redis, its keys and its connection slot.
struct Region {
    name: Box<str>,
    initial: u64,
    connector: Connector,
    state_key: String,
    debits_key: String,
    pending_key: String,
    credits_key: String,
    /// The epoch of the region's state as last seen; a new debit to this
    /// region is bound to it.
    epoch: std::sync::Mutex<Option<String>>,
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

/// Settings for a [`RegionalBudget`]; [`build`](Self::build) checks them.
///
/// ```
/// use tower_admission::outbound::RegionalBudget;
///
/// let err = RegionalBudget::builder(240)
///     .region("eu", "redis://127.0.0.1:6380/", 100)
///     .region("us", "redis://127.0.0.1:6381/", 100)
///     .build()
///     .unwrap_err();
/// assert_eq!(err.field(), "regions"); // 100 + 100 is not 240
/// ```
#[derive(Debug, Clone)]
pub struct RegionalBudgetBuilder {
    name: String,
    total: u64,
    regions: Vec<(String, String, u64)>,
    call_timeout: Duration,
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

    /// Seeds every region with its initial allocation, if needed; safe to
    /// call from every process at start.
    ///
    /// Regions that already hold state are never changed. Missing regions
    /// are seeded only while every existing region is untouched since it
    /// was seeded (no debit, no credit), which is the case during a first
    /// start, even with several processes initializing at once. If a region
    /// is missing after transfers have run, its data was lost: re-seeding it
    /// at its initial share could raise the sum above the total, so this
    /// returns [`RegionError::StateLost`] and changes nothing; see
    /// [`recover_lost`](Self::recover_lost).
    ///
    /// Seeding never raises the sum above the total: when the surviving
    /// allocations plus the missing regions' initial shares exceed it (a
    /// region added to a budget whose surviving regions still hold the old
    /// split), this returns [`RegionError::AboveTotal`] and changes nothing.
    /// Create such a region at 0 with [`recover_lost`](Self::recover_lost)
    /// and [`transfer`](Self::transfer) allocation to it. The check reads the
    /// surviving regions in the same reads that find the missing ones, so
    /// processes initializing at once must share one split.
    ///
    /// A missing region next to surviving ones may have lost a debit whose
    /// credit is still on the way. Before seeding it, each surviving region
    /// is pinned, atomically with its untouched check, to take credits from
    /// the new state only (a late credit fails with
    /// [`TransferError::DonorReseeded`]). When another process seeded the
    /// region first, the pins move to its state; a transfer from it that
    /// runs before they have moved is refused the same way.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::{Initialized, RegionalBudget};
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// match budget.initialize().await? {
    ///     Initialized::Seeded => println!("first start"),
    ///     Initialized::AlreadyInitialized => {}
    ///     _ => {} // the enum may grow
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn initialize(&self) -> Result<Initialized, RegionError> {
        let states = self.read_states().await?;
        let missing: Vec<&Region> = self
            .inner
            .regions
            .iter()
            .zip(&states)
            .filter(|(_, s)| s.is_none())
            .map(|(r, _)| r)
            .collect();
        if missing.is_empty() {
            return Ok(Initialized::AlreadyInitialized);
        }
        let touched = states
            .iter()
            .flatten()
            .any(|s| s.debited > 0 || s.credited > 0);
        if touched {
            return Err(RegionError::StateLost {
                regions: missing.iter().map(|r| r.name.to_string()).collect(),
            });
        }
        let surviving = states.iter().flatten().map(|s| s.allocation);
        self.check_at_most_total(surviving.chain(missing.iter().map(|r| r.initial)))?;
        let survivors: Vec<&Region> = self
            .inner
            .regions
            .iter()
            .zip(&states)
            .filter(|(_, s)| s.is_some())
            .map(|(r, _)| r)
            .collect();
        for region in missing {
            // A lost state of `region` may have debited a credit still on
            // the way: before its share is back, the survivors take credits
            // from the new state only, while still untouched.
            let epoch = fresh_epoch();
            for survivor in &survivors {
                let lost = match self.pin(survivor, region, &epoch, Pin::Untouched).await? {
                    1 => continue,
                    -1 => survivor,
                    _ => region,
                };
                return Err(RegionError::StateLost {
                    regions: vec![lost.name.to_string()],
                });
            }
            if !self.seed(region, region.initial, &epoch).await? {
                // Seeded at once by another process, after this one found it
                // missing: its state is a new one too.
                let live = self.live_epoch(region).await?;
                for survivor in &survivors {
                    self.pin(survivor, region, &live, Pin::Always).await?;
                }
            }
        }
        Ok(Initialized::Seeded)
    }

    /// Re-creates a region whose state is missing (lost, or added to a
    /// running budget) with allocation **0**; returns false (and changes
    /// nothing) if the region has state.
    ///
    /// This is the safe recovery after a region's Redis lost its data: the
    /// other regions plus the amounts in flight hold at most the total, so a
    /// region at 0 keeps the sum at most the total. The share the region
    /// held is not restored. Transfers to and from it work again at once.
    /// The new state has a new epoch: transfers to it debited before the
    /// recovery are never credited to it, and [`repair`](Self::repair),
    /// [`repair_all`](Self::repair_all) and retries report them as
    /// [`TransferError::ReceiverRecreated`], their amounts lost from the sum.
    /// Debits it had made are forgotten with its data (a retry of one is
    /// given back, see [`RegionalBudget`]). After a recovery the
    /// identity `sum + in_flight == total` of a [`Snapshot`] no longer holds
    /// (the lost share is missing from both), while `sum <= total` does.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::{RegionError, RegionalBudget};
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// if let Err(RegionError::StateLost { regions }) = budget.initialize().await {
    ///     for region in &regions {
    ///         budget.recover_lost(region).await?;
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn recover_lost(&self, region: &str) -> Result<bool, RegionError> {
        let region = self
            .region(region)
            .ok_or_else(|| RegionError::UnknownRegion {
                region: region.to_owned(),
            })?;
        let created = self.seed(region, 0, &fresh_epoch()).await?;
        // Regions pinned to an earlier state of it (see `initialize`) take
        // credits from this one now; a share of 0 cannot count them twice.
        let live = self.live_epoch(region).await?;
        for other in self.inner.regions.iter().filter(|r| r.name != region.name) {
            self.pin(other, region, &live, Pin::Existing).await?;
        }
        Ok(created)
    }

    /// Reads one region's allocation.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::RegionalBudget;
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let eu = budget.allocation("eu").await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn allocation(&self, region: &str) -> Result<u64, RegionError> {
        let r = self
            .region(region)
            .ok_or_else(|| RegionError::UnknownRegion {
                region: region.to_owned(),
            })?;
        self.read_allocation(r).await
    }

    /// Reads every region's allocation, each region separately, in the
    /// order the regions were added.
    ///
    /// The reads are not one moment: while transfers run, their sum can be
    /// below the total (an amount in flight, or a transfer seen at neither
    /// end) **or above it** (a transfer completed between the read of its
    /// donor and the read of its receiver counts at both ends). The
    /// invariant, sum ≤ total, is about moments; check it with
    /// [`snapshot`](Self::snapshot).
    ///
    /// ```no_run
    /// # use tower_admission::outbound::RegionalBudget;
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// for (region, allocation) in budget.allocations().await? {
    ///     println!("{region}: {allocation}");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn allocations(&self) -> Result<Vec<(String, u64)>, RegionError> {
        let reads = join_all(self.inner.regions.iter().map(|r| self.read_allocation(r))).await;
        self.inner
            .regions
            .iter()
            .zip(reads)
            .map(|(r, read)| read.map(|a| (r.name.to_string(), a)))
            .collect()
    }

    /// A consistent cut of all regions: allocations and the amount in
    /// flight, in a state the regions could have been in together.
    ///
    /// Every region's state is read at once, each with one atomic
    /// `HGETALL`. The reads form a consistent cut when every credit they
    /// contain has its debit in them too; the scripts number each debit
    /// (`seq`) and each receiver keeps the highest number it credited from
    /// each donor, so that is checked exactly. A cut that is not consistent
    /// (a whole transfer ran between two of the reads) is read again, up to
    /// 64 times, then [`RegionError::NotConsistent`]. A consistent cut
    /// above the total (regions seeded under different splits) is
    /// [`RegionError::AboveTotal`], so in the result `sum() <= total()`
    /// and, unless a region was recovered after a state loss,
    /// `sum() + in_flight() == total()`.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::RegionalBudget;
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let snapshot = budget.snapshot().await?;
    /// assert!(snapshot.sum() <= budget.total());
    /// println!("{} in flight", snapshot.in_flight());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn snapshot(&self) -> Result<Snapshot, RegionError> {
        for _ in 0..SNAPSHOT_ATTEMPTS {
            let states = self.read_states().await?;
            let missing: Vec<String> = self
                .inner
                .regions
                .iter()
                .zip(&states)
                .filter(|(_, s)| s.is_none())
                .map(|(r, _)| r.name.to_string())
                .collect();
            if !missing.is_empty() {
                return Err(RegionError::StateLost { regions: missing });
            }
            let states: Vec<RegionState> = states.into_iter().flatten().collect();
            if self.is_consistent(&states) {
                self.check_at_most_total(states.iter().map(|s| s.allocation))?;
                return Ok(Snapshot {
                    total: self.inner.total,
                    regions: self
                        .inner
                        .regions
                        .iter()
                        .zip(states)
                        .map(|(r, s)| (r.name.to_string(), s.allocation, s.debited, s.credited))
                        .collect(),
                });
            }
        }
        Err(RegionError::NotConsistent {
            attempts: SNAPSHOT_ATTEMPTS,
        })
    }

    /// Every debit whose credit is not yet confirmed, from all regions: the
    /// transfers in flight, or interrupted and waiting for
    /// [`repair_all`](Self::repair_all).
    ///
    /// A transfer whose credit has been applied but not yet settled on the
    /// donor is listed too; repairing it changes nothing but the list.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::RegionalBudget;
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// for p in budget.pending().await? {
    ///     println!("{}: {} from {} to {}", p.id(), p.amount(), p.from(), p.to());
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn pending(&self) -> Result<Vec<PendingTransfer>, RegionError> {
        let mut all = Vec::new();
        for region in &self.inner.regions {
            let records = self
                .pending_of(region)
                .await
                .map_err(|e| e.into_region(region))?;
            all.extend(records.into_iter().map(|(p, _)| p));
        }
        Ok(all)
    }

    /// Moves `amount` of allocation from region `from` to region `to`.
    ///
    /// The donor is debited first (atomically, refused if it holds less than
    /// `amount`), and the receiver is credited only after the debit is
    /// confirmed, so the sum of the allocations never exceeds the total.
    /// Calling it again with the same `id` is safe and never moves the
    /// amount twice: it completes a half-done transfer, or does nothing.
    /// If the receiver was re-created after the debit
    /// ([`recover_lost`](Self::recover_lost)), it cannot be completed: the
    /// call fails with [`TransferError::ReceiverRecreated`], and the amount
    /// is lost from the sum.
    ///
    /// Errors: [`TransferError::ZeroAmount`], [`UnknownRegion`](TransferError::UnknownRegion)
    /// and [`SameRegion`](TransferError::SameRegion) before any Redis call;
    /// [`Insufficient`](TransferError::Insufficient) and
    /// [`Conflict`](TransferError::Conflict) from the donor, with nothing
    /// changed; [`Unreachable`](TransferError::Unreachable) and
    /// [`StateLost`](TransferError::StateLost) naming the [`Step`] (at
    /// [`Step::Lookup`], the receiver could not be read before a new debit,
    /// and nothing changed); [`ReceiverRecreated`](TransferError::ReceiverRecreated).
    /// After a
    /// failed credit the amount is in flight until [`repair`](Self::repair).
    /// So it is when the future is dropped between the two steps (under an
    /// outer timeout, say): call it again with the same `id`, or let
    /// [`repair_all`](Self::repair_all) finish it.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::{RegionalBudget, TransferId, TransferOutcome};
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let id = TransferId::new("rebalance-2024-06-01T10:00Z-ap-eu")?;
    /// assert_eq!(budget.transfer(&id, "ap", "eu", 20).await?, TransferOutcome::Applied);
    /// // A retry (say, after a timeout) moves nothing more.
    /// assert_eq!(budget.transfer(&id, "ap", "eu", 20).await?, TransferOutcome::AlreadyApplied);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn transfer(
        &self,
        id: &TransferId,
        from: &str,
        to: &str,
        amount: u64,
    ) -> Result<TransferOutcome, TransferError> {
        if amount == 0 {
            return Err(TransferError::ZeroAmount);
        }
        let unknown = |region: &str| TransferError::UnknownRegion {
            region: region.to_owned(),
        };
        let donor = self.region(from).ok_or_else(|| unknown(from))?;
        let receiver = self.region(to).ok_or_else(|| unknown(to))?;
        if from == to {
            return Err(TransferError::SameRegion {
                region: from.to_owned(),
            });
        }

        // Step 1: the debit, on the donor, bound to the receiver's state as
        // last seen (read first if never seen). Nothing else happens unless
        // it is confirmed.
        let mut to_epoch = receiver.known_epoch().unwrap_or_default();
        let mut reply = self.debit(donor, id, amount, to, &to_epoch).await?;
        if matches!(reply, Some(DebitReply::EpochNeeded)) {
            to_epoch = self.read_epoch(receiver).await?;
            reply = self.debit(donor, id, amount, to, &to_epoch).await?;
        }
        let (record, debited_now) = match reply {
            Some(DebitReply::Now { seq, epoch }) => {
                donor.remember_epoch(Some(&epoch));
                let record = Record {
                    amount,
                    to: to.to_owned(),
                    seq,
                    epoch,
                    to_epoch,
                    refunded: false,
                };
                (record, true)
            }
            Some(DebitReply::Before(record)) => {
                if record.amount != amount || record.to != to {
                    return Err(TransferError::Conflict {
                        id: id.clone(),
                        from: from.to_owned(),
                        recorded_to: record.to,
                        recorded_amount: record.amount,
                    });
                }
                (record, false)
            }
            Some(DebitReply::Refused { available }) => {
                return Err(TransferError::Insufficient {
                    region: from.to_owned(),
                    available,
                    requested: amount,
                })
            }
            Some(DebitReply::Missing) => {
                return Err(TransferError::StateLost {
                    region: from.to_owned(),
                    step: Step::Debit,
                })
            }
            Some(DebitReply::EpochNeeded) | None => {
                return Err(malformed(donor, "unexpected reply to the debit script"))
            }
        };

        // Steps 2 and 3.
        Ok(match self.finish(donor, receiver, id, &record).await? {
            Credit::Now | Credit::Before if debited_now => TransferOutcome::Applied,
            Credit::Now => TransferOutcome::Completed,
            Credit::Before => TransferOutcome::AlreadyApplied,
            Credit::Refunded { credited_earlier } if credited_earlier == amount => {
                TransferOutcome::AlreadyApplied
            }
            Credit::Refunded { credited_earlier } => {
                return Err(TransferError::Conflict {
                    id: id.clone(),
                    from: from.to_owned(),
                    recorded_to: to.to_owned(),
                    recorded_amount: credited_earlier,
                })
            }
        })
    }

    /// Finishes transfer `id` if it was debited but not credited; never
    /// credits twice, so it is safe to call at any time, concurrently with
    /// the transfer itself, and as often as needed.
    ///
    /// The debit record is looked up in every region (an id names one
    /// transfer per donor; if several donors recorded the same id, each is
    /// finished). Every region must answer the lookup. A transfer whose
    /// receiver was re-created after its debit is never credited: this
    /// returns [`TransferError::ReceiverRecreated`] and drops it from the
    /// pending list.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::{RegionalBudget, RepairOutcome, TransferId};
    /// # async fn run(budget: RegionalBudget, id: TransferId) -> Result<(), Box<dyn std::error::Error>> {
    /// match budget.repair(&id).await? {
    ///     RepairOutcome::Completed => println!("credited now"),
    ///     RepairOutcome::AlreadyComplete => println!("nothing was missing"),
    ///     RepairOutcome::NothingDebited => println!("no region debited {id}"),
    ///     _ => {}
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn repair(&self, id: &TransferId) -> Result<RepairOutcome, TransferError> {
        let lookups = join_all(self.inner.regions.iter().map(|donor| async move {
            let mut cmd = redis::cmd("HGET");
            cmd.arg(&donor.debits_key).arg(id.as_str());
            self.call(donor, Request::Cmd(&cmd)).await
        }))
        .await;
        let mut found = Vec::new();
        for (donor, lookup) in self.inner.regions.iter().zip(lookups) {
            match lookup.map_err(|e| e.into_transfer(donor, Step::Lookup))? {
                Value::Nil => {}
                value => {
                    let record = text(&value)
                        .and_then(|s| Record::parse(&s))
                        .ok_or_else(|| malformed(donor, "unreadable debit record"))?;
                    found.push((donor, record));
                }
            }
        }
        if found.is_empty() {
            return Ok(RepairOutcome::NothingDebited);
        }
        let mut completed = false;
        for (donor, record) in found {
            let receiver = self
                .region(&record.to)
                .ok_or_else(|| TransferError::UnknownRegion {
                    region: record.to.clone(),
                })?;
            completed |= matches!(
                self.finish(donor, receiver, id, &record).await?,
                Credit::Now
            );
        }
        Ok(if completed {
            RepairOutcome::Completed
        } else {
            RepairOutcome::AlreadyComplete
        })
    }

    /// Repairs every pending transfer of every region (see
    /// [`pending`](Self::pending) and [`repair`](Self::repair)); never
    /// credits twice. It goes on past failures and reports them, a transfer
    /// whose receiver was re-created after its debit as
    /// [`TransferError::ReceiverRecreated`] (once: it is dropped from the
    /// pending list).
    ///
    /// ```no_run
    /// # use tower_admission::outbound::RegionalBudget;
    /// # async fn run(budget: RegionalBudget) {
    /// let report = budget.repair_all().await;
    /// println!("{} completed, {} errors", report.completed().len(), report.errors().len());
    /// # }
    /// ```
    pub async fn repair_all(&self) -> RepairReport {
        let mut report = RepairReport::default();
        for donor in &self.inner.regions {
            let records = match self.pending_of(donor).await {
                Ok(records) => records,
                Err(e) => {
                    report.errors.push(e.into_transfer(donor, Step::Lookup));
                    continue;
                }
            };
            for (pending, record) in records {
                let Some(receiver) = self.region(&record.to) else {
                    report.errors.push(TransferError::UnknownRegion {
                        region: record.to.clone(),
                    });
                    continue;
                };
                match self.finish(donor, receiver, &pending.id, &record).await {
                    Ok(Credit::Now) => report.completed.push(pending),
                    Ok(Credit::Before | Credit::Refunded { .. }) => report.already_complete += 1,
                    Err(e) => report.errors.push(e),
                }
            }
        }
        report
    }

    fn region(&self, name: &str) -> Option<&Region> {
        self.inner.regions.iter().find(|r| &*r.name == name)
    }

    /// Step 1: runs the debit script; `to_epoch` empty only looks the id up.
    async fn debit(
        &self,
        donor: &Region,
        id: &TransferId,
        amount: u64,
        to: &str,
        to_epoch: &str,
    ) -> Result<Option<DebitReply>, TransferError> {
        let mut invocation = self.inner.debit.prepare_invoke();
        invocation
            .key(&donor.state_key)
            .key(&donor.debits_key)
            .key(&donor.pending_key)
            .arg(id.as_str())
            .arg(amount)
            .arg(to)
            .arg(to_epoch);
        let reply = self
            .call(donor, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_transfer(donor, Step::Debit))?;
        Ok(parse_debit(reply))
    }

    /// Reads the epoch of `region`'s state. A new debit to a receiver whose
    /// state cannot be read is not made.
    async fn read_epoch(&self, region: &Region) -> Result<String, TransferError> {
        let mut cmd = redis::cmd("HGET");
        cmd.arg(&region.state_key).arg("epoch");
        let reply = self
            .call(region, Request::Cmd(&cmd))
            .await
            .map_err(|e| e.into_transfer(region, Step::Lookup))?;
        match reply {
            Value::Nil => {
                region.remember_epoch(None);
                Err(TransferError::StateLost {
                    region: region.name.to_string(),
                    step: Step::Lookup,
                })
            }
            value => {
                let epoch = text(&value).ok_or_else(|| malformed(region, "unreadable epoch"))?;
                region.remember_epoch(Some(&epoch));
                Ok(epoch)
            }
        }
    }

    /// Steps 2 and 3 for a confirmed debit: credits it (or gives it back,
    /// see [`Credit::Refunded`]), then clears its pending mark. A debit the
    /// receiver refuses for good is dropped from the pending list.
    async fn finish(
        &self,
        donor: &Region,
        receiver: &Region,
        id: &TransferId,
        record: &Record,
    ) -> Result<Credit, TransferError> {
        if record.refunded {
            return Ok(Credit::Refunded {
                credited_earlier: record.amount,
            });
        }
        let credit = match self.credit(donor, receiver, id, record).await {
            Ok(Credit::Refunded { credited_earlier }) => {
                self.refund(donor, id, record).await?;
                return Ok(Credit::Refunded { credited_earlier });
            }
            Err(e @ TransferError::DonorReseeded { .. }) => {
                tracing::warn!(
                    from = &*donor.name,
                    to = &*receiver.name,
                    id = id.as_str(),
                    amount = record.amount,
                    "the donor was re-seeded after losing the state that made this debit: never credited"
                );
                Err(e)
            }
            Err(e @ TransferError::ReceiverRecreated { .. }) => {
                tracing::warn!(
                    from = &*donor.name,
                    to = &*receiver.name,
                    id = id.as_str(),
                    amount = record.amount,
                    "the receiver was re-created after this debit: never credited, the amount is lost"
                );
                Err(e)
            }
            Err(e) => return Err(e),
            credited => credited,
        };
        // Step 3: clear the pending mark; a failure leaves a stale mark that
        // repair_all clears.
        self.settle(donor, id).await;
        credit
    }

    /// Step 2: credits `record` to `receiver`, in the receiver state the
    /// debit was bound to and at most once per donor state and id.
    async fn credit(
        &self,
        donor: &Region,
        receiver: &Region,
        id: &TransferId,
        record: &Record,
    ) -> Result<Credit, TransferError> {
        let mut invocation = self.inner.credit.prepare_invoke();
        invocation
            .key(&receiver.state_key)
            .key(&receiver.credits_key)
            .arg(&*donor.name)
            .arg(id.as_str())
            .arg(record.amount)
            .arg(record.seq)
            .arg(&record.epoch)
            .arg(&record.to_epoch);
        let reply = self
            .call(receiver, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_transfer(receiver, Step::Credit))?;
        let unexpected = || malformed(receiver, "unexpected credit reply");
        let Value::Array(items) = reply else {
            return Err(unexpected());
        };
        let code = items.first().and_then(int).ok_or_else(unexpected)?;
        let amount = || {
            items
                .get(1)
                .and_then(int)
                .and_then(|a| u64::try_from(a).ok())
                .ok_or_else(unexpected)
        };
        match code {
            1 => Ok(Credit::Now),
            2 if amount()? == record.amount => Ok(Credit::Before),
            2 => Err(TransferError::Conflict {
                id: id.clone(),
                from: donor.name.to_string(),
                recorded_to: receiver.name.to_string(),
                recorded_amount: amount()?,
            }),
            3 => Ok(Credit::Refunded {
                credited_earlier: amount()?,
            }),
            -1 => {
                receiver.remember_epoch(None);
                Err(TransferError::StateLost {
                    region: receiver.name.to_string(),
                    step: Step::Credit,
                })
            }
            -3 => Err(TransferError::DonorReseeded {
                id: id.clone(),
                from: donor.name.to_string(),
                to: receiver.name.to_string(),
                amount: record.amount,
            }),
            -2 => {
                let epoch = items.get(1).and_then(text).ok_or_else(unexpected)?;
                receiver.remember_epoch(Some(&epoch));
                Err(TransferError::ReceiverRecreated {
                    id: id.clone(),
                    from: donor.name.to_string(),
                    to: receiver.name.to_string(),
                    amount: record.amount,
                })
            }
            _ => Err(unexpected()),
        }
    }

    /// Gives back a debit that the receiver refuses for good because it
    /// holds a credit under the same id from an earlier state of the donor.
    async fn refund(
        &self,
        donor: &Region,
        id: &TransferId,
        record: &Record,
    ) -> Result<(), TransferError> {
        let mut invocation = self.inner.refund.prepare_invoke();
        invocation
            .key(&donor.state_key)
            .key(&donor.debits_key)
            .key(&donor.pending_key)
            .arg(id.as_str())
            .arg(record.as_written());
        let reply = self
            .call(donor, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_transfer(donor, Step::Refund))?;
        match int(&reply) {
            // 0: given back already, or the record left with a state loss.
            Some(0 | 1) => Ok(()),
            _ => Err(malformed(donor, "unexpected reply to the refund script")),
        }
    }

    /// Step 3, best effort: drops `id` from the donor's pending debits.
    async fn settle(&self, donor: &Region, id: &TransferId) {
        let mut cmd = redis::cmd("HDEL");
        cmd.arg(&donor.pending_key).arg(id.as_str());
        if let Err(e) = self.call(donor, Request::Cmd(&cmd)).await {
            tracing::warn!(
                region = &*donor.name,
                id = id.as_str(),
                error = %e,
                "could not clear a completed transfer from the pending list; repair_all clears it"
            );
        }
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

    async fn seed(
        &self,
        region: &Region,
        allocation: u64,
        epoch: &str,
    ) -> Result<bool, RegionError> {
        let mut invocation = self.inner.seed.prepare_invoke();
        invocation.key(&region.state_key).arg(allocation).arg(epoch);
        let reply = self
            .call(region, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_region(region))?;
        match int(&reply) {
            Some(1) => {
                region.remember_epoch(Some(epoch));
                Ok(true)
            }
            Some(0) => Ok(false),
            _ => Err(RegionError::Malformed {
                region: region.name.to_string(),
                message: "unexpected reply to the seed script".to_owned(),
            }),
        }
    }

    /// Makes `on` take credits from `from` only from its state `epoch`
    /// (`regions_pin.lua`); replies 1 if pinned, 0 if not, -1 if `on` has
    /// no state.
    async fn pin(
        &self,
        on: &Region,
        from: &Region,
        epoch: &str,
        when: Pin,
    ) -> Result<i64, RegionError> {
        let mut invocation = self.inner.pin.prepare_invoke();
        invocation
            .key(&on.state_key)
            .arg(&*from.name)
            .arg(epoch)
            .arg(match when {
                Pin::Untouched => "untouched",
                Pin::Existing => "existing",
                Pin::Always => "always",
            });
        let reply = self
            .call(on, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_region(on))?;
        int(&reply).ok_or_else(|| RegionError::Malformed {
            region: on.name.to_string(),
            message: "unexpected reply to the pin script".to_owned(),
        })
    }

    /// `field` of `region`'s state, which must exist.
    async fn state_field(&self, region: &Region, field: &str) -> Result<Value, RegionError> {
        let mut cmd = redis::cmd("HGET");
        cmd.arg(&region.state_key).arg(field);
        let reply = self
            .call(region, Request::Cmd(&cmd))
            .await
            .map_err(|e| e.into_region(region))?;
        match reply {
            Value::Nil => Err(RegionError::StateLost {
                regions: vec![region.name.to_string()],
            }),
            value => Ok(value),
        }
    }

    /// The epoch of `region`'s state, which must exist.
    async fn live_epoch(&self, region: &Region) -> Result<String, RegionError> {
        let value = self.state_field(region, "epoch").await?;
        let epoch = text(&value).ok_or_else(|| RegionError::Malformed {
            region: region.name.to_string(),
            message: "unreadable epoch".to_owned(),
        })?;
        region.remember_epoch(Some(&epoch));
        Ok(epoch)
    }

    async fn read_allocation(&self, region: &Region) -> Result<u64, RegionError> {
        let value = self.state_field(region, "alloc").await?;
        int(&value)
            .and_then(|a| u64::try_from(a).ok())
            .ok_or_else(|| RegionError::Malformed {
                region: region.name.to_string(),
                message: "the allocation is not a non-negative integer".to_owned(),
            })
    }

    /// Every region's state hash at once; `None` for a missing one.
    async fn read_states(&self) -> Result<Vec<Option<RegionState>>, RegionError> {
        let reads = join_all(self.inner.regions.iter().map(|region| async move {
            let mut cmd = redis::cmd("HGETALL");
            cmd.arg(&region.state_key);
            let reply = self
                .call(region, Request::Cmd(&cmd))
                .await
                .map_err(|e| e.into_region(region))?;
            let map: HashMap<String, String> =
                redis::from_redis_value(reply).map_err(|e| RegionError::Malformed {
                    region: region.name.to_string(),
                    message: e.to_string(),
                })?;
            let state = RegionState::parse(&map).map_err(|message| RegionError::Malformed {
                region: region.name.to_string(),
                message,
            })?;
            region.remember_epoch(state.as_ref().map(|s| s.epoch.as_str()));
            Ok(state)
        }))
        .await;
        reads.into_iter().collect()
    }

    /// True if every credit in `states` has its debit in `states` too.
    fn is_consistent(&self, states: &[RegionState]) -> bool {
        states.iter().all(|receiver| {
            receiver.seen.iter().all(|(donor, epoch, seq)| {
                match self.inner.regions.iter().position(|r| &*r.name == donor) {
                    // A credit from the donor's current life must not be
                    // ahead of the donor's own count of debits. Credits from
                    // an earlier life (before a recovery) or from a region no
                    // longer configured cannot be checked.
                    Some(i) => states[i].epoch != *epoch || *seq <= states[i].seq,
                    None => true,
                }
            })
        })
    }

    async fn pending_of(
        &self,
        donor: &Region,
    ) -> Result<Vec<(PendingTransfer, Record)>, CallError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(&donor.pending_key);
        let reply = self.call(donor, Request::Cmd(&cmd)).await?;
        let map: HashMap<String, String> = redis::from_redis_value(reply).map_err(|e| {
            // Read only: known not applied.
            CallError::Rejected(format!("unreadable pending list: {e}"))
        })?;
        let mut out: Vec<(PendingTransfer, Record)> = map
            .into_iter()
            .filter_map(|(id, rec)| {
                let parsed = Record::parse(&rec).zip(TransferId::new(id.as_str()).ok());
                if parsed.is_none() {
                    tracing::warn!(
                        region = &*donor.name,
                        id,
                        record = rec,
                        "skipping an unreadable pending record"
                    );
                }
                let (record, id) = parsed?;
                let pending = PendingTransfer {
                    id,
                    from: donor.name.to_string(),
                    to: record.to.clone(),
                    amount: record.amount,
                };
                Some((pending, record))
            })
            .collect();
        out.sort_by_key(|a| a.1.seq);
        Ok(out)
    }

    /// One Redis call on `region` under the call deadline, connecting first
    /// if needed.
    async fn call(&self, region: &Region, request: Request<'_>) -> Result<Value, CallError> {
        region.connector.call(request).await
    }
}

impl Region {
    fn known_epoch(&self) -> Option<String> {
        self.epoch.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records the epoch just read from this region; `None` if its state is
    /// missing.
    fn remember_epoch(&self, epoch: Option<&str>) {
        *self.epoch.lock().unwrap_or_else(|e| e.into_inner()) = epoch.map(str::to_owned);
    }
}

/// A failed call as the error of a transfer step or of a region.
trait Unreachable {
    fn into_transfer(self, region: &Region, step: Step) -> TransferError;
    fn into_region(self, region: &Region) -> RegionError;
}

impl Unreachable for CallError {
    fn into_transfer(self, region: &Region, step: Step) -> TransferError {
        TransferError::Unreachable {
            region: region.name.to_string(),
            step,
            outcome_unknown: self.outcome_unknown(),
            message: self.to_string(),
        }
    }

    fn into_region(self, region: &Region) -> RegionError {
        RegionError::Unreachable {
            region: region.name.to_string(),
            message: self.to_string(),
        }
    }
}

fn malformed(region: &Region, message: &str) -> TransferError {
    TransferError::Malformed {
        region: region.name.to_string(),
        message: message.to_owned(),
    }
}

/// A debit as recorded by the donor.
#[derive(Debug, Clone)]
struct Record {
    amount: u64,
    to: String,
    seq: u64,
    /// The donor's epoch when it debited.
    epoch: String,
    /// The receiver's epoch the transfer was started against.
    to_epoch: String,
    /// Given back by `regions_refund.lua`.
    refunded: bool,
}

impl Record {
    /// `amount:to:seq:epoch:to_epoch`, with `:refunded` once given back.
    fn parse(s: &str) -> Option<Record> {
        let mut parts = s.split(':');
        let record = Record {
            amount: parts.next()?.parse().ok()?,
            to: parts.next()?.to_owned(),
            seq: parts.next()?.parse().ok()?,
            epoch: parts.next()?.to_owned(),
            to_epoch: parts.next()?.to_owned(),
            refunded: match parts.next() {
                None => false,
                Some("refunded") => true,
                Some(_) => return None,
            },
        };
        parts.next().is_none().then_some(record)
    }

    /// The record as `regions_debit.lua` wrote it (before any refund).
    fn as_written(&self) -> String {
        let Record {
            amount,
            to,
            seq,
            epoch,
            to_epoch,
            ..
        } = self;
        format!("{amount}:{to}:{seq}:{epoch}:{to_epoch}")
    }
}

/// What the credit step found on the receiver.
enum Credit {
    /// Credited by this call.
    Now,
    /// Credited before; nothing changed.
    Before,
    /// The receiver holds a credit under this id from an earlier state of
    /// the donor, of this amount; the debit was given back.
    Refunded { credited_earlier: u64 },
}

enum DebitReply {
    Now {
        seq: u64,
        epoch: String,
    },
    Before(Record),
    Refused {
        available: u64,
    },
    Missing,
    /// Not debited before, and no receiver epoch was given.
    EpochNeeded,
}

fn parse_debit(reply: Value) -> Option<DebitReply> {
    let Value::Array(items) = reply else {
        return None;
    };
    let unsigned = |v: &Value| int(v).and_then(|i| u64::try_from(i).ok());
    match int(items.first()?)? {
        1 => Some(DebitReply::Now {
            seq: unsigned(items.get(1)?)?,
            epoch: text(items.get(2)?)?,
        }),
        2 => Some(DebitReply::Before(Record {
            amount: unsigned(items.get(1)?)?,
            seq: unsigned(items.get(2)?)?,
            epoch: text(items.get(3)?)?,
            to: text(items.get(4)?)?,
            to_epoch: text(items.get(5)?)?,
            refunded: unsigned(items.get(6)?)? == 1,
        })),
        0 => Some(DebitReply::Refused {
            available: unsigned(items.get(1)?)?,
        }),
        -1 => Some(DebitReply::Missing),
        -2 => Some(DebitReply::EpochNeeded),
        _ => None,
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

/// A region's state hash, parsed.
struct RegionState {
    allocation: u64,
    debited: u64,
    credited: u64,
    seq: u64,
    epoch: String,
    /// (donor, donor epoch, highest seq credited from it)
    seen: Vec<(String, String, u64)>,
}

impl RegionState {
    fn parse(map: &HashMap<String, String>) -> Result<Option<RegionState>, String> {
        let Some(alloc) = map.get("alloc") else {
            return Ok(None);
        };
        let number = |field: &str, v: Option<&String>| -> Result<u64, String> {
            v.map_or(Ok(0), |v| v.parse())
                .map_err(|_| format!("field `{field}` is not a non-negative integer"))
        };
        let mut seen = Vec::new();
        for (field, value) in map {
            if let Some(donor) = field.strip_prefix("from:") {
                let (epoch, seq) = value
                    .split_once(':')
                    .ok_or_else(|| format!("field `{field}` is unreadable"))?;
                let seq = seq
                    .parse()
                    .map_err(|_| format!("field `{field}` is unreadable"))?;
                seen.push((donor.to_owned(), epoch.to_owned(), seq));
            }
        }
        Ok(Some(RegionState {
            allocation: number("alloc", Some(alloc))?,
            debited: number("debited", map.get("debited"))?,
            credited: number("credited", map.get("credited"))?,
            seq: number("seq", map.get("seq"))?,
            epoch: map.get("epoch").cloned().unwrap_or_default(),
            seen,
        }))
    }
}

impl RegionalBudgetBuilder {
    /// The budget's name, default `default`: 1 to 64 characters of
    /// `[A-Za-z0-9_-]`. Budgets with different names keep separate keys in
    /// the same Redis.
    ///
    /// ```
    /// # use tower_admission::outbound::RegionalBudget;
    /// let budget = RegionalBudget::builder(10)
    ///     .name("search-api")
    ///     .region("eu", "redis://127.0.0.1/", 10)
    ///     .build()?;
    /// assert_eq!(budget.name(), "search-api");
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn name(mut self, name: &str) -> Self {
        name.clone_into(&mut self.name);
        self
    }

    /// Adds a region: its name (1 to 64 characters of `[A-Za-z0-9_-]`),
    /// the URL of its own Redis, and its initial allocation. The initial
    /// allocations of all regions must sum to the total.
    ///
    /// ```
    /// # use tower_admission::outbound::RegionalBudget;
    /// let budget = RegionalBudget::builder(240)
    ///     .region("eu", "redis://127.0.0.1:6380/", 240)
    ///     .region("us", "redis://127.0.0.1:6381/", 0)
    ///     .build()?;
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn region(mut self, name: &str, url: &str, initial: u64) -> Self {
        self.regions
            .push((name.to_owned(), url.to_owned(), initial));
        self
    }

    /// The deadline of every Redis call (connecting included), default
    /// 500 ms: above zero, at most 60 s.
    ///
    /// ```
    /// # use tower_admission::outbound::RegionalBudget;
    /// # use std::time::Duration;
    /// let budget = RegionalBudget::builder(10)
    ///     .region("eu", "redis://127.0.0.1/", 10)
    ///     .call_timeout(Duration::from_millis(100))
    ///     .build()?;
    /// assert_eq!(budget.call_timeout(), Duration::from_millis(100));
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// Checks the settings and builds the budget. Nothing connects yet.
    ///
    /// The error names the field: `name`, `total` (zero, or not below
    /// 2^53), `regions` (none, or the split does not sum to the total),
    /// `region` (a bad or repeated name), `url`, or `call_timeout`.
    ///
    /// ```
    /// # use tower_admission::outbound::RegionalBudget;
    /// let err = RegionalBudget::builder(240).build().unwrap_err();
    /// assert_eq!(err.field(), "regions");
    /// ```
    pub fn build(self) -> Result<RegionalBudget, ConfigError> {
        check_name("name", &self.name)?;
        if self.total == 0 {
            return Err(ConfigError::new("total", "the total must be at least 1"));
        }
        if self.total > MAX_TOTAL {
            return Err(ConfigError::new(
                "total",
                format!("the total must be below 2^53 (at most {MAX_TOTAL})"),
            ));
        }
        if self.regions.is_empty() {
            return Err(ConfigError::new("regions", "at least one region is needed"));
        }
        crate::error::redis_deadline("call_timeout", self.call_timeout)?;
        let mut sum: u128 = 0;
        let mut regions: Vec<Region> = Vec::with_capacity(self.regions.len());
        for (name, url, initial) in &self.regions {
            check_name("region", name)?;
            if regions.iter().any(|r| &*r.name == name) {
                return Err(ConfigError::new(
                    "region",
                    format!("region `{name}` is added twice"),
                ));
            }
            let target = Target::single(url)
                .map_err(|e| ConfigError::new("url", format!("region `{name}`: {e}")))?;
            sum += u128::from(*initial);
            let tag = format!("tower-admission:regions:{{{}:{name}}}", self.name);
            regions.push(Region {
                name: name.as_str().into(),
                initial: *initial,
                connector: Connector::new(target, Timing::per_call(self.call_timeout)),
                state_key: format!("{tag}:state"),
                debits_key: format!("{tag}:debits"),
                pending_key: format!("{tag}:pending"),
                credits_key: format!("{tag}:credits"),
                epoch: std::sync::Mutex::new(None),
            });
        }
        if sum != u128::from(self.total) {
            return Err(ConfigError::new(
                "regions",
                format!(
                    "the initial allocations sum to {sum}, not to the total {}",
                    self.total
                ),
            ));
        }
        Ok(RegionalBudget {
            inner: Arc::new(Inner {
                name: self.name.into(),
                total: self.total,
                call_timeout: self.call_timeout,
                regions,
                debit: Script::new(DEBIT),
                credit: Script::new(CREDIT),
                seed: Script::new(SEED),
                refund: Script::new(REFUND),
                pin: Script::new(PIN),
            }),
        })
    }
}

fn check_name(field: &'static str, name: &str) -> Result<(), ConfigError> {
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if valid {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            format!("`{name}` must be 1 to {MAX_NAME} characters of [A-Za-z0-9_-]"),
        ))
    }
}

/// The name of one transfer out of one donor region, which makes the
/// transfer idempotent: both steps record it, and a repeated call with the
/// same id never moves the amount twice.
///
/// Choose ids that mean something (a rebalancing round and its pair of
/// regions), or [`random`](Self::random) ones kept until the transfer is
/// known complete.
///
/// ```
/// use tower_admission::outbound::TransferId;
///
/// let id = TransferId::new("rebalance-42-ap-eu")?;
/// assert_eq!(id.as_str(), "rebalance-42-ap-eu");
/// assert!(TransferId::new("has space").is_err());
/// assert_ne!(TransferId::random(), TransferId::random());
/// # Ok::<(), tower_admission::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(Box<str>);

impl TransferId {
    /// An id of 1 to 128 printable ASCII characters (no spaces).
    ///
    /// ```
    /// # use tower_admission::outbound::TransferId;
    /// assert_eq!(TransferId::new("").unwrap_err().field(), "transfer_id");
    /// ```
    pub fn new(id: impl Into<String>) -> Result<Self, ConfigError> {
        let id = id.into();
        if id.is_empty() || id.len() > MAX_ID || !id.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::new(
                "transfer_id",
                format!("must be 1 to {MAX_ID} printable ASCII characters without spaces"),
            ));
        }
        Ok(TransferId(id.into()))
    }

    /// A random 128-bit id, as 32 hex digits.
    ///
    /// ```
    /// # use tower_admission::outbound::TransferId;
    /// assert_eq!(TransferId::random().as_str().len(), 32);
    /// ```
    pub fn random() -> Self {
        TransferId(format!("{:032x}", rand::random::<u128>()).into())
    }

    /// The id as a string.
    ///
    /// ```
    /// # use tower_admission::outbound::TransferId;
    /// assert_eq!(TransferId::new("t-1")?.as_str(), "t-1");
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a successful [`RegionalBudget::transfer`] did. In every case the
/// amount has moved exactly once.
///
/// ```
/// use tower_admission::outbound::TransferOutcome;
/// assert_ne!(TransferOutcome::Applied, TransferOutcome::AlreadyApplied);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransferOutcome {
    /// This call debited the donor; the receiver is credited (by this call,
    /// or by a concurrent call or repair with the same id).
    Applied,
    /// An earlier call had debited the donor; this call made the missing
    /// credit.
    Completed,
    /// The transfer had been fully applied before; nothing changed (a debit
    /// made again after the donor's state loss was given back).
    AlreadyApplied,
}

/// What [`RegionalBudget::repair`] found.
///
/// ```
/// use tower_admission::outbound::RepairOutcome;
/// assert_ne!(RepairOutcome::Completed, RepairOutcome::NothingDebited);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RepairOutcome {
    /// The transfer was debited but not credited; this call credited it.
    Completed,
    /// The transfer was debited and credited already; nothing changed.
    AlreadyComplete,
    /// No region has debited this id: nothing is in flight under it (a
    /// refused transfer, a debit that never reached the donor, or an id
    /// never used).
    NothingDebited,
}

/// What [`RegionalBudget::initialize`] did.
///
/// ```
/// use tower_admission::outbound::Initialized;
/// assert_ne!(Initialized::Seeded, Initialized::AlreadyInitialized);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Initialized {
    /// At least one region was seeded with its initial allocation now.
    Seeded,
    /// Every region already had its state; nothing changed.
    AlreadyInitialized,
}

/// A debit whose credit is not yet confirmed, from
/// [`RegionalBudget::pending`].
///
/// ```no_run
/// # use tower_admission::outbound::RegionalBudget;
/// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
/// let in_flight: u64 = budget.pending().await?.iter().map(|p| p.amount()).sum();
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingTransfer {
    id: TransferId,
    from: String,
    to: String,
    amount: u64,
}

impl PendingTransfer {
    /// The transfer's id.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// for p in budget.pending().await? { budget.repair(p.id()).await?; }
    /// # Ok(())
    /// # }
    /// ```
    pub fn id(&self) -> &TransferId {
        &self.id
    }

    /// The donor region, already debited.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let donors: Vec<String> = budget.pending().await?.iter().map(|p| p.from().to_owned()).collect();
    /// # Ok(())
    /// # }
    /// ```
    pub fn from(&self) -> &str {
        &self.from
    }

    /// The receiver region.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let receivers: Vec<String> = budget.pending().await?.iter().map(|p| p.to().to_owned()).collect();
    /// # Ok(())
    /// # }
    /// ```
    pub fn to(&self) -> &str {
        &self.to
    }

    /// The amount in flight.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let amounts: Vec<u64> = budget.pending().await?.iter().map(|p| p.amount()).collect();
    /// # Ok(())
    /// # }
    /// ```
    pub fn amount(&self) -> u64 {
        self.amount
    }
}

/// What [`RegionalBudget::repair_all`] did.
///
/// ```no_run
/// # async fn run(budget: tower_admission::outbound::RegionalBudget) {
/// let report = budget.repair_all().await;
/// assert!(report.errors().is_empty());
/// # }
/// ```
#[derive(Debug, Default)]
pub struct RepairReport {
    completed: Vec<PendingTransfer>,
    already_complete: usize,
    errors: Vec<TransferError>,
}

impl RepairReport {
    /// The transfers credited by this repair.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) {
    /// for p in budget.repair_all().await.completed() { println!("finished {}", p.id()); }
    /// # }
    /// ```
    pub fn completed(&self) -> &[PendingTransfer] {
        &self.completed
    }

    /// How many pending entries were already complete: credited (only their
    /// pending mark was cleared), or debited again after the donor's state
    /// loss and given back.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) {
    /// println!("{} stale marks cleared", budget.repair_all().await.already_complete());
    /// # }
    /// ```
    pub fn already_complete(&self) -> usize {
        self.already_complete
    }

    /// The failures; those transfers stay pending for a later repair, except
    /// [`TransferError::ReceiverRecreated`], which can never be credited.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) {
    /// for e in budget.repair_all().await.errors() { eprintln!("{e}"); }
    /// # }
    /// ```
    pub fn errors(&self) -> &[TransferError] {
        &self.errors
    }
}

/// A consistent cut of a [`RegionalBudget`], from
/// [`RegionalBudget::snapshot`]: the allocations and the amount in flight,
/// read so that every credit in it has its debit in it too. It is a state
/// the regions could have been in together (money only moves by a debit
/// followed by its credit), which is what the invariant is about.
///
/// ```no_run
/// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
/// let s = budget.snapshot().await?;
/// assert!(s.sum() <= s.total());
/// assert_eq!(s.sum() + s.in_flight(), s.total()); // no region was recovered
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    total: u64,
    /// (region, allocation, debited total, credited total)
    regions: Vec<(String, u64, u64, u64)>,
}

impl Snapshot {
    /// The budget's total.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// assert_eq!(budget.snapshot().await?.total(), budget.total());
    /// # Ok(())
    /// # }
    /// ```
    pub fn total(&self) -> u64 {
        self.total
    }

    /// One region's allocation; `None` for a region not in the budget.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let eu = budget.snapshot().await?.allocation("eu");
    /// # Ok(())
    /// # }
    /// ```
    pub fn allocation(&self, region: &str) -> Option<u64> {
        self.regions.iter().find(|r| r.0 == region).map(|r| r.1)
    }

    /// Every region's allocation, in the order the regions were added.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// for (region, allocation) in budget.snapshot().await?.allocations() {
    ///     println!("{region}: {allocation}");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn allocations(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.regions.iter().map(|r| (r.0.as_str(), r.1))
    }

    /// The sum of the allocations; at most the total.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// assert!(budget.snapshot().await?.sum() <= budget.total());
    /// # Ok(())
    /// # }
    /// ```
    pub fn sum(&self) -> u64 {
        self.regions.iter().map(|r| r.1).sum()
    }

    /// Everything ever debited, over all regions (since each was seeded).
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let s = budget.snapshot().await?;
    /// assert!(s.credited() <= s.debited());
    /// # Ok(())
    /// # }
    /// ```
    pub fn debited(&self) -> u64 {
        self.regions.iter().map(|r| r.2).sum()
    }

    /// Everything ever credited, over all regions; never more than
    /// [`debited`](Self::debited), since every credit follows its debit.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let s = budget.snapshot().await?;
    /// assert!(s.credited() <= s.debited());
    /// # Ok(())
    /// # }
    /// ```
    pub fn credited(&self) -> u64 {
        self.regions.iter().map(|r| r.3).sum()
    }

    /// The amount debited but not yet credited at that moment:
    /// `debited() - credited()`.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// println!("{} in flight", budget.snapshot().await?.in_flight());
    /// # Ok(())
    /// # }
    /// ```
    pub fn in_flight(&self) -> u64 {
        self.debited().saturating_sub(self.credited())
    }
}

/// The step of a transfer at which an error happened.
///
/// ```
/// use tower_admission::outbound::Step;
/// assert_eq!(Step::Credit.to_string(), "credit");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Step {
    /// Step 1, on the donor's Redis. Nothing is in flight unless the error
    /// says the outcome is unknown.
    Debit,
    /// Step 2, on the receiver's Redis. The donor **has been debited**: the
    /// amount is in flight until a repair credits it.
    Credit,
    /// Reading before any change: the receiver's epoch before a transfer's
    /// debit, or the debit records for a repair; nothing was changed.
    Lookup,
    /// Giving back a debit the receiver refuses for good (it was credited
    /// under the same id from an earlier state of the donor). The donor is
    /// debited until a repair gives it back.
    Refund,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::Debit => "debit",
            Step::Credit => "credit",
            Step::Lookup => "lookup",
            Step::Refund => "refund",
        })
    }
}

/// Why a transfer or repair failed.
///
/// ```no_run
/// # use tower_admission::outbound::{RegionalBudget, Step, TransferError, TransferId};
/// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
/// let id = TransferId::random();
/// match budget.transfer(&id, "eu", "us", 500).await {
///     Err(TransferError::Insufficient { available, .. }) => println!("eu has {available}"),
///     Err(TransferError::Unreachable { step: Step::Credit, .. }) => {
///         budget.repair(&id).await?; // the debit happened; finish it later
///     }
///     other => println!("{other:?}"),
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransferError {
    /// The amount was 0. Nothing was sent.
    ZeroAmount,
    /// The donor and the receiver are the same region. Nothing was sent.
    SameRegion {
        /// The region.
        region: String,
    },
    /// A region is not in the budget. Nothing was sent.
    UnknownRegion {
        /// The name given.
        region: String,
    },
    /// The donor holds less than the amount; nothing changed.
    Insufficient {
        /// The donor.
        region: String,
        /// What the donor holds.
        available: u64,
        /// The amount asked for.
        requested: u64,
    },
    /// A region's Redis did not answer within the call deadline, or the
    /// connection failed.
    Unreachable {
        /// The region whose Redis failed.
        region: String,
        /// The step that failed; at [`Step::Credit`] the donor has been
        /// debited.
        step: Step,
        /// True if the call may have been applied (it was sent, then timed
        /// out or lost its connection); false if it certainly was not.
        outcome_unknown: bool,
        /// What failed.
        message: String,
    },
    /// A region has no allocation stored: it was never initialized, or its
    /// Redis lost its data. Nothing changed in that region; see
    /// [`RegionalBudget::recover_lost`].
    StateLost {
        /// The region.
        region: String,
        /// The step that found it; at [`Step::Credit`] the donor has been
        /// debited.
        step: Step,
    },
    /// The id was already used for a different transfer out of this donor
    /// (another receiver or amount); nothing changed.
    Conflict {
        /// The id.
        id: TransferId,
        /// The donor.
        from: String,
        /// The receiver recorded for the id.
        recorded_to: String,
        /// The amount recorded for the id.
        recorded_amount: u64,
    },
    /// The receiver's state was re-created ([`RegionalBudget::recover_lost`])
    /// after this transfer's debit, so the credit is refused, now and on
    /// every retry or repair: the lost state may have received the amount
    /// already and passed it on, and crediting it again could raise the sum
    /// above the total. The donor stays debited and the amount is lost from
    /// the sum; the transfer is dropped from the pending list.
    ReceiverRecreated {
        /// The id.
        id: TransferId,
        /// The donor, debited.
        from: String,
        /// The receiver, never credited.
        to: String,
        /// The amount lost.
        amount: u64,
    },
    /// The donor lost the state that made this debit and was re-seeded at
    /// its initial share ([`RegionalBudget::initialize`]) before the credit
    /// landed, so the credit is refused, now and on every retry or repair:
    /// the re-seeded share holds the amount again.
    DonorReseeded {
        /// The id.
        id: TransferId,
        /// The donor, re-seeded.
        from: String,
        /// The receiver, never credited.
        to: String,
        /// The amount.
        amount: u64,
    },
    /// A Redis reply that the scripts never send (the keys were changed by
    /// something else).
    Malformed {
        /// The region.
        region: String,
        /// What was wrong.
        message: String,
    },
}

impl TransferError {
    /// True if the amount is, or may be, in flight after this error: the
    /// donor was debited (the credit or a refund failed), or the debit's outcome is
    /// unknown. [`RegionalBudget::repair`] with the same id finishes it.
    ///
    /// ```
    /// use tower_admission::outbound::TransferError;
    /// assert!(!TransferError::ZeroAmount.needs_repair());
    /// ```
    pub fn needs_repair(&self) -> bool {
        match self {
            TransferError::Unreachable {
                step,
                outcome_unknown,
                ..
            } => {
                matches!(step, Step::Credit | Step::Refund)
                    || (*step == Step::Debit && *outcome_unknown)
            }
            TransferError::StateLost { step, .. } => *step == Step::Credit,
            _ => false,
        }
    }
}

impl fmt::Display for TransferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransferError::ZeroAmount => f.write_str("a transfer amount must be at least 1"),
            TransferError::SameRegion { region } => {
                write!(f, "cannot transfer from region `{region}` to itself")
            }
            TransferError::UnknownRegion { region } => write!(f, "unknown region `{region}`"),
            TransferError::Insufficient {
                region,
                available,
                requested,
            } => write!(
                f,
                "region `{region}` holds {available}, less than the {requested} requested"
            ),
            TransferError::Unreachable {
                region,
                step,
                outcome_unknown,
                message,
            } => {
                write!(f, "region `{region}` unreachable at the {step} step")?;
                if *outcome_unknown {
                    f.write_str(" (outcome unknown)")?;
                }
                if matches!(step, Step::Credit | Step::Refund) {
                    f.write_str("; the donor is debited, repair the transfer")?;
                }
                write!(f, ": {message}")
            }
            TransferError::StateLost { region, step } => write!(
                f,
                "region `{region}` has no allocation stored (never initialized, or its data was lost), at the {step} step"
            ),
            TransferError::Conflict {
                id,
                from,
                recorded_to,
                recorded_amount,
            } => write!(
                f,
                "transfer id `{id}` from `{from}` was already used for {recorded_amount} to `{recorded_to}`"
            ),
            TransferError::ReceiverRecreated {
                id,
                from,
                to,
                amount,
            } => write!(
                f,
                "transfer `{id}` of {amount} from `{from}` can never be credited: `{to}` was re-created after the debit; the amount is lost"
            ),
            TransferError::DonorReseeded {
                id,
                from,
                to,
                amount,
            } => write!(
                f,
                "transfer `{id}` of {amount} to `{to}` can never be credited: `{from}` was re-seeded after losing the state that debited it"
            ),
            TransferError::Malformed { region, message } => {
                write!(f, "unexpected data in region `{region}`: {message}")
            }
        }
    }
}

impl std::error::Error for TransferError {}

/// Why reading, initializing or recovering regions failed.
///
/// ```no_run
/// # use tower_admission::outbound::{RegionError, RegionalBudget};
/// # async fn run(budget: RegionalBudget) {
/// match budget.allocation("eu").await {
///     Ok(a) => println!("eu: {a}"),
///     Err(RegionError::Unreachable { message, .. }) => eprintln!("eu is down: {message}"),
///     Err(e) => eprintln!("{e}"),
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegionError {
    /// The region is not in the budget.
    UnknownRegion {
        /// The name given.
        region: String,
    },
    /// The region's Redis did not answer within the call deadline, or the
    /// connection failed.
    Unreachable {
        /// The region.
        region: String,
        /// What failed.
        message: String,
    },
    /// These regions have no allocation stored: never initialized, or their
    /// Redis lost its data.
    StateLost {
        /// The regions.
        regions: Vec<String>,
    },
    /// [`RegionalBudget::snapshot`] found no consistent cut in this many
    /// reads (transfers kept completing between them).
    NotConsistent {
        /// How many times it read.
        attempts: u32,
    },
    /// The allocations sum above the total ([`RegionalBudget::snapshot`]),
    /// or would once the missing regions were seeded at their initial
    /// shares ([`RegionalBudget::initialize`], which then seeds nothing).
    AboveTotal {
        /// The sum, with the missing regions' shares for `initialize`.
        sum: u64,
        /// The budget's total.
        total: u64,
    },
    /// A Redis reply that the scripts never produce.
    Malformed {
        /// The region.
        region: String,
        /// What was wrong.
        message: String,
    },
}

impl fmt::Display for RegionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegionError::UnknownRegion { region } => write!(f, "unknown region `{region}`"),
            RegionError::Unreachable { region, message } => {
                write!(f, "region `{region}` unreachable: {message}")
            }
            RegionError::StateLost { regions } => write!(
                f,
                "no allocation stored in {} (never initialized, or the data was lost)",
                regions.join(", ")
            ),
            RegionError::NotConsistent { attempts } => write!(
                f,
                "no consistent cut of the regions in {attempts} reads; transfers kept completing between them"
            ),
            RegionError::Malformed { region, message } => {
                write!(f, "unexpected data in region `{region}`: {message}")
            }
            RegionError::AboveTotal { sum, total } => write!(
                f,
                "the allocations sum to {sum}, above the total {total}, counting any region still to be seeded at its initial share"
            ),
        }
    }
}

impl std::error::Error for RegionError {}

/// When [`RegionalBudget::pin`] writes its pin.
#[derive(Clone, Copy)]
enum Pin {
    /// Only while the region has no debit and no credit.
    Untouched,
    /// Only in place of a pin already set.
    Existing,
    /// In any case.
    Always,
}

/// A fresh epoch, naming one life of a region's state.
fn fresh_epoch() -> String {
    format!("{:016x}", rand::random::<u64>())
}
