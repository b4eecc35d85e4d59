//! [`RegionalBudget::lease`]: a region's instances spend the region's
//! allocation through rate leases. The proof of the invariant is in
//! `docs/regions.md`.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use super::RegionalBudget;
use crate::outbound::lease::{Ceiling, Source};
use crate::outbound::{Rate, RateLease};
use crate::ConfigError;

/// The clock rate error the hold allows for, 1 %.
const DRIFT_PERCENT: u32 = 1;

impl RegionalBudget {
    /// One instance's share of `region`'s allocation: a [`RateLease`] on the
    /// region's [lease store](super::RegionalBudgetBuilder::lease_store) whose
    /// budget follows the region's *spendable* allocation
    /// ([`spendable`](Self::spendable)).
    ///
    /// Spend through it as through any lease (its `try_acquire`, or a
    /// [`LeasedBudget`](crate::outbound::LeasedBudget) built on it for a
    /// [`DependencyBudgetLayer`](crate::outbound::DependencyBudgetLayer)), and
    /// run its [`spawn_refresher`](RateLease::spawn_refresher): beside the
    /// refreshes, it reads the region's spendable allocation every
    /// `view_max_age / 4` (refreshed by hand, without it, the lease is
    /// granted nothing).
    ///
    /// The region has about `expected_instances` instances: a new
    /// instance's first demand guess is the total divided by it, and an idle
    /// one reports a tenth of that. `instance_id` is this instance's id in
    /// the region's lease (random when `None`). The lease length, refresh
    /// period, view age and clock skew are the budget's
    /// ([`RegionalBudgetBuilder::lease_length`](super::RegionalBudgetBuilder::lease_length)
    /// and the settings after it), the same for every region. Its budget is
    /// zero until the first read.
    ///
    /// # What it guarantees
    ///
    /// **At every moment, the grants that any instance of any region may
    /// still spend sum to at most the total**, provided allocation moves only
    /// by ordered transfers ([`send`](Self::send)) and the credit hold `H`
    /// covers `1.01 × (L + S + Q + 2D)`: the lease length `L`, the clock skew
    /// `S` between the regions' Redis servers, the view's maximum age `Q` and
    /// the Redis deadline `D`, the larger of the lease store's deadline and
    /// the budget's call timeout. This method checks it. In short: a
    /// region's grants never sum above the spendable allocation reported by
    /// a read at most `Q` old (the lease script keeps its grants under the
    /// lowest budget reported); a donor's lowered allocation binds grants
    /// issued before it only when they expire, at most `Q + D + L` after the
    /// debit; and the receiver counts what it received as spendable only `H`
    /// after the credit, which comes after the debit. `docs/regions.md` has
    /// the proof.
    ///
    /// # Failing closed
    ///
    /// A read older than `Q` (the region's Redis unreachable, or its state
    /// lost) makes the next refreshes report a budget of zero: grants in hand
    /// run out at their expiry, and no new ones are issued. The lease's
    /// fallback capacity is zero too: an instance whose grant expired without
    /// renewal spends nothing.
    ///
    /// Errors name the field: `region` (not in the budget), `lease_store`
    /// (none for the region), `credit_hold` (below the bound above), `total`
    /// (not below 4,294,967 per second, which would give a fallback above
    /// zero), and the lease's own fields.
    ///
    /// ```no_run
    /// use std::num::NonZeroU32;
    /// use std::time::Duration;
    /// use tower_admission::outbound::{LeaseStore, RegionalBudget};
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
    /// let lease = budget.lease("eu", NonZeroU32::new(10).unwrap(), None)?;
    /// let _task = lease.spawn_refresher();
    /// if lease.try_acquire(1).is_ok() { /* send */ }
    /// # Ok(())
    /// # }
    /// ```
    pub fn lease(
        &self,
        region: &str,
        expected_instances: NonZeroU32,
        instance_id: Option<&str>,
    ) -> Result<RateLease, ConfigError> {
        if self.region(region).is_none() {
            return Err(ConfigError::new(
                "region",
                format!("`{region}` is not a region of the budget"),
            ));
        }
        let store = self
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
        let settings = self.inner.leases;
        let deadline = store.deadline().max(self.call_timeout());
        let needed = (settings.lease + settings.max_skew + settings.view_max_age + 2 * deadline)
            * (100 + DRIFT_PERCENT)
            / 100;
        if self.credit_hold() < needed {
            return Err(ConfigError::new(
                "credit_hold",
                format!(
                    "the credit hold {:?} is below 1.01 × (L + S + Q + 2D) = {needed:?}",
                    self.credit_hold()
                ),
            ));
        }
        let total = self.total();
        let guess = (total / u64::from(expected_instances.get())).max(1);
        let view = View {
            budget: self.clone(),
            region: region.into(),
            max_age: settings.view_max_age,
            first: AtomicBool::new(true),
        };
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
        .ceiling(Ceiling::new(view));
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
        Ok(lease)
    }
}

/// A region's spendable allocation as its leases' ceiling: each read holds
/// for `view_max_age` from the moment it was sent.
struct View {
    budget: RegionalBudget,
    region: Box<str>,
    max_age: Duration,
    /// No read was made yet: its failure is logged at `warn`, later ones at
    /// `debug`.
    first: AtomicBool,
}

impl Source for View {
    fn read(&self) -> BoxFuture<'_, Option<(Rate, Instant)>> {
        Box::pin(async move {
            let sent_at = Instant::now();
            let first = self.first.swap(false, Ordering::Relaxed);
            match self.budget.spendable(&self.region).await {
                Ok(view) => Some((Rate::per_second(view), sent_at + self.max_age)),
                Err(e) if first => {
                    tracing::warn!(region = &*self.region, error = %e, "region view unreadable");
                    None
                }
                Err(e) => {
                    tracing::debug!(region = &*self.region, error = %e, "region view unreadable");
                    None
                }
            }
        })
    }

    fn every(&self) -> Duration {
        self.max_age / 4
    }
}
