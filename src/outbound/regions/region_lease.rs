//! [`RegionLease`]: a region's instances spend the region's allocation
//! through rate leases. The proof of the invariant is in `docs/regions.md`.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::task::JoinHandle;

use super::{RegionError, RegionalBudget};
use crate::outbound::lease::Ceiling;
use crate::outbound::{Rate, RateLease};
use crate::ConfigError;

/// The clock rate error the hold allows for, 1 %.
const DRIFT_PERCENT: u32 = 1;

/// One instance's share of its region's allocation (feature `redis`): a
/// [`RateLease`] on the region's
/// [lease store](super::RegionalBudgetBuilder::lease_store) whose budget follows the
/// region's *spendable* allocation ([`RegionalBudget::spendable`]).
///
/// Spend through [`lease`](Self::lease) (its `try_acquire`, or a
/// [`LeasedBudget`](crate::outbound::LeasedBudget) built on it for a
/// [`DependencyBudgetLayer`](crate::outbound::DependencyBudgetLayer)), and
/// run [`spawn`](Self::spawn): it reads the region's view every
/// `view_max_age / 4` and refreshes the lease.
///
/// # What it guarantees
///
/// **At every moment, the grants that any instance of any region may still
/// spend sum to at most the total**, provided allocation moves only by
/// ordered transfers ([`RegionalBudget::send`]) and the credit hold `H`
/// covers `1.01 × (L + S + Q + 2D)`: the lease length `L`, the clock skew
/// `S` between the regions' Redis servers, the view's maximum age `Q` and
/// the Redis deadline `D`. [`new`](Self::new) checks it.
/// In short: a region's grants never sum above the spendable allocation
/// reported by a view at most `Q` old (the lease script keeps its grants
/// under the lowest budget reported); a donor's lowered allocation binds
/// grants issued before it only when they expire, at most `Q + D + L`
/// after the debit; and the receiver counts what it received as spendable
/// only `H` after the credit, which comes after the debit. `docs/regions.md`
/// has the proof.
///
/// # Failing closed
///
/// A view older than `Q` (the region's Redis unreachable, or its state
/// lost) makes the next refreshes report a budget of zero: grants in hand
/// run out at their expiry, and no new ones are issued. The lease's
/// fallback capacity is zero too: an instance whose grant expired without
/// renewal spends nothing.
///
/// ```no_run
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use tower_admission::outbound::{LeaseStore, RegionLease, RegionalBudget};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let (eu, us) = ("redis://redis.eu.internal:6379/", "redis://redis.us.internal:6379/");
/// let deadline = Duration::from_millis(100);
/// let budget = RegionalBudget::builder(240)
///     .region("eu", eu, 120)
///     .region("us", us, 120)
///     .lease_store("eu", LeaseStore::new(eu, "payments", deadline)?)
///     .lease_store("us", LeaseStore::new(us, "payments", deadline)?)
///     .build()?;
/// let lease = RegionLease::new(budget, "eu", NonZeroU32::new(10).unwrap(), None)?;
/// let _task = lease.spawn();
/// if lease.lease().try_acquire(1).is_ok() { /* send */ }
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RegionLease {
    inner: Arc<Inner>,
}

struct Inner {
    budget: RegionalBudget,
    region: Box<str>,
    lease: RateLease,
    ceiling: Ceiling,
    view_max_age: Duration,
    /// The spendable allocation last read.
    view: Mutex<Option<u64>>,
}

impl fmt::Debug for RegionLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionLease")
            .field("region", &self.inner.region)
            .field("view", &*self.inner.view.lock())
            .field("lease", &self.inner.lease)
            .finish()
    }
}

impl RegionLease {
    /// One instance's lease on `region` of `budget`, leasing from the
    /// region's [lease store](super::RegionalBudgetBuilder::lease_store), in
    /// a region of about
    /// `expected_instances` instances: a new instance's first demand guess
    /// is the total divided by it, and an idle one reports a tenth of that.
    /// `instance_id` is this instance's id in the region's lease (random
    /// when `None`). The lease length, refresh period, view age and clock
    /// skew are the budget's ([`RegionalBudgetBuilder::lease_length`](super::RegionalBudgetBuilder::lease_length)
    /// and the settings after it), the same for every region. Its budget is
    /// zero until the first view is read.
    ///
    /// Errors name the field: `region` (not in the budget), `lease_store`
    /// (none for the region), `credit_hold`
    /// (below `1.01 × (L + S + Q + 2D)`, `D` the larger of the lease store's
    /// deadline and the budget's call timeout), and the lease's own fields.
    pub fn new(
        budget: RegionalBudget,
        region: &str,
        expected_instances: NonZeroU32,
        instance_id: Option<&str>,
    ) -> Result<Self, ConfigError> {
        if budget.regions().all(|(name, _)| name != region) {
            return Err(ConfigError::new(
                "region",
                format!("`{region}` is not a region of the budget"),
            ));
        }
        let store = budget
            .inner
            .lease_stores
            .iter()
            .find(|(name, _)| name == region)
            .map(|(_, store)| store.clone())
            .ok_or_else(|| {
                ConfigError::new(
                    "lease_store",
                    format!("region `{region}` has no lease store"),
                )
            })?;
        let settings = budget.inner.leases;
        let deadline = store.deadline().max(budget.call_timeout());
        let needed = (settings.lease + settings.max_skew + settings.view_max_age + 2 * deadline)
            * (100 + DRIFT_PERCENT)
            / 100;
        if budget.credit_hold() < needed {
            return Err(ConfigError::new(
                "credit_hold",
                format!(
                    "the credit hold {:?} is below 1.01 × (L + S + Q + 2D) = {needed:?}",
                    budget.credit_hold()
                ),
            ));
        }
        let total = budget.total();
        let ceiling = Ceiling::closed();
        let guess = (total / u64::from(expected_instances.get())).max(1);
        let mut lease = RateLease::builder(
            store,
            &format!("region-{region}"),
            Rate::per_second(total),
            // A fallback of zero: an instance whose grant ran out spends
            // nothing (the quotient is below one milli-unit per second).
            NonZeroU32::MAX,
        )
        .lease(settings.lease)
        .refresh_every(settings.refresh_every)
        .initial_demand(Rate::per_second(guess))
        // An idle instance still reports a tenth of its even share: a held
        // back one doubles its grant per refresh, so a grant near zero would
        // take many refresh periods to reach its share once callers come.
        .min_demand(Rate::from_milli(guess * 100))
        .ceiling(ceiling.clone());
        if let Some(id) = instance_id {
            lease = lease.instance_id(id);
        }
        let lease = lease.build()?;
        if lease.fallback_rate() != Rate::ZERO {
            return Err(ConfigError::new(
                "total",
                "a region lease needs a total below 4,294,967 per second",
            ));
        }
        Ok(RegionLease {
            inner: Arc::new(Inner {
                budget,
                region: region.into(),
                lease,
                ceiling,
                view_max_age: settings.view_max_age,
                view: Mutex::new(None),
            }),
        })
    }

    /// The rate lease to spend through.
    pub fn lease(&self) -> &RateLease {
        &self.inner.lease
    }

    /// The region's name.
    pub fn region(&self) -> &str {
        &self.inner.region
    }

    /// The region's spendable allocation as last read
    /// ([`RegionalBudget::spendable`]), if any: the budget its lease reports
    /// while that read is at most `view_max_age` old.
    pub fn view(&self) -> Option<u64> {
        *self.inner.view.lock()
    }

    /// Reads the region's spendable allocation once and sets the lease's
    /// budget to it, valid for `view_max_age` from the moment the read was
    /// sent; returns it. On failure the budget stays as it was until then,
    /// and zero after.
    pub async fn read_view(&self) -> Result<u64, RegionError> {
        let inner = &*self.inner;
        let sent_at = Instant::now();
        let view = inner.budget.spendable(&inner.region).await?;
        inner
            .ceiling
            .set(Rate::per_second(view), sent_at + inner.view_max_age);
        *inner.view.lock() = Some(view);
        Ok(view)
    }

    /// Starts the background work: the view read every `view_max_age / 4`
    /// and the lease's refresher. Dropping the handle does not stop it;
    /// abort it, and [`release`](RateLease::release) the lease on a clean
    /// shutdown.
    pub fn spawn(&self) -> JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let first = this.read_view().await;
            if let Err(e) = first {
                tracing::warn!(region = &*this.inner.region, error = %e, "region view unreadable");
            }
            let refresher = this.inner.lease.spawn_refresher();
            let _abort = AbortOnDrop(refresher);
            let mut tick = tokio::time::interval(this.inner.view_max_age / 4);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = this.read_view().await {
                    tracing::debug!(region = &*this.inner.region, error = %e, "region view unreadable");
                }
            }
        })
    }
}

struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
