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
use crate::outbound::{LeaseStore, Rate, RateLease};
use crate::ConfigError;

/// The clock rate error the hold allows for, 1 %.
const DRIFT_PERCENT: u32 = 1;

/// One instance's share of its region's allocation (feature `redis`): a
/// [`RateLease`] on the region's lease store whose budget follows the
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
/// the Redis deadline `D`. [`build`](RegionLeaseBuilder::build) checks it.
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
/// use tower_admission::outbound::{LeaseStore, RegionLease, RegionalBudget};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let budget = RegionalBudget::builder(240)
///     .region("eu", "redis://redis.eu.internal:6379/", 120)
///     .region("us", "redis://redis.us.internal:6379/", 120)
///     .build()?;
/// let store = LeaseStore::builder("redis://redis.eu.internal:6379/").build()?;
/// let lease = RegionLease::builder(budget, "eu", store, NonZeroU32::new(10).unwrap()).build()?;
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

/// Settings for a [`RegionLease`]; [`build`](Self::build) checks them.
#[derive(Debug)]
pub struct RegionLeaseBuilder {
    budget: RegionalBudget,
    region: String,
    store: LeaseStore,
    expected: NonZeroU32,
    instance_id: Option<String>,
    lease: Duration,
    refresh_every: Duration,
    view_max_age: Duration,
    max_skew: Duration,
}

impl RegionLease {
    /// Settings for one instance of `region` of `budget`, leasing from
    /// `store` (the region's own Redis, as a rule), in a region of about
    /// `expected_instances` instances: a new instance's first demand guess
    /// is the total divided by it, and an idle one reports a tenth of that.
    pub fn builder(
        budget: RegionalBudget,
        region: &str,
        store: LeaseStore,
        expected_instances: NonZeroU32,
    ) -> RegionLeaseBuilder {
        RegionLeaseBuilder {
            budget,
            region: region.to_owned(),
            store,
            expected: expected_instances,
            instance_id: None,
            lease: Duration::from_secs(5),
            refresh_every: Duration::from_secs(4),
            view_max_age: Duration::from_secs(1),
            max_skew: Duration::from_millis(250),
        }
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

impl RegionLeaseBuilder {
    /// This instance's id in the region's lease (default random).
    pub fn instance_id(mut self, id: &str) -> Self {
        self.instance_id = Some(id.to_owned());
        self
    }

    /// The lease length `L`, default 5 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The lease's refresh period, default 4 s.
    pub fn refresh_every(mut self, every: Duration) -> Self {
        self.refresh_every = every;
        self
    }

    /// The view's maximum age `Q`, default 1 s: a refresh reports the
    /// spendable allocation of a view read at most `Q` before, else zero.
    pub fn view_max_age(mut self, age: Duration) -> Self {
        self.view_max_age = age;
        self
    }

    /// The largest clock skew `S` between two regions' Redis servers,
    /// default 250 ms.
    pub fn max_skew(mut self, skew: Duration) -> Self {
        self.max_skew = skew;
        self
    }

    /// Checks the settings and builds the lease, its budget at zero until
    /// the first view is read.
    ///
    /// Errors name the field: `region` (not in the budget), `view_max_age`
    /// (zero), `credit_hold` (below `1.01 × (L + S + Q + 2D)`, `D` the
    /// larger of the lease store's deadline and the budget's call timeout),
    /// and the lease's own fields.
    pub fn build(self) -> Result<RegionLease, ConfigError> {
        if self.budget.regions().all(|(name, _)| name != self.region) {
            return Err(ConfigError::new(
                "region",
                format!("`{}` is not a region of the budget", self.region),
            ));
        }
        if self.view_max_age.is_zero() {
            return Err(ConfigError::new("view_max_age", "must be above zero"));
        }
        let deadline = self.store.deadline().max(self.budget.call_timeout());
        let needed = (self.lease + self.max_skew + self.view_max_age + 2 * deadline)
            * (100 + DRIFT_PERCENT)
            / 100;
        if self.budget.credit_hold() < needed {
            return Err(ConfigError::new(
                "credit_hold",
                format!(
                    "the credit hold {:?} is below 1.01 × (L + S + Q + 2D) = {needed:?}",
                    self.budget.credit_hold()
                ),
            ));
        }
        let total = self.budget.total();
        let ceiling = Ceiling::closed();
        let guess = (total / u64::from(self.expected.get())).max(1);
        let mut lease = RateLease::builder(
            self.store,
            &format!("region-{}", self.region),
            Rate::per_second(total),
            // A fallback of zero: an instance whose grant ran out spends
            // nothing (the quotient is below one milli-unit per second).
            NonZeroU32::MAX,
        )
        .lease(self.lease)
        .refresh_every(self.refresh_every)
        .initial_demand(Rate::per_second(guess))
        // An idle instance still reports a tenth of its even share: a held
        // back one doubles its grant per refresh, so a grant near zero would
        // take many refresh periods to reach its share once callers come.
        .min_demand(Rate::from_milli(guess * 100))
        .ceiling(ceiling.clone());
        if let Some(id) = &self.instance_id {
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
                budget: self.budget,
                region: self.region.into(),
                lease,
                ceiling,
                view_max_age: self.view_max_age,
                view: Mutex::new(None),
            }),
        })
    }
}
