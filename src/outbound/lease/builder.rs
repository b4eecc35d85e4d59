//! [`RateLeaseBuilder`]: a lease's settings, checked.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::rate::MAX_RATE_MILLI;
use super::state::{Phase, Settings, State, Trial};
use super::{LeaseStore, Rate, RateLease, Shared};
use crate::clock::{duration_to_micros, Clock, SystemClock, Timestamp};
use crate::outbound::bucket::Bucket;
use crate::redis::valid_key_part;
use crate::reload::Live;
use crate::ConfigError;

/// Checks a lease's fleet-wide rate: above zero, at most the largest the
/// script sums exactly.
pub(super) fn check_rate(rate: Rate) -> Result<(), ConfigError> {
    if rate.0 == 0 || rate.0 > MAX_RATE_MILLI {
        return Err(ConfigError::new(
            "rate",
            format!(
                "must be more than zero and at most {}",
                Rate(MAX_RATE_MILLI)
            ),
        ));
    }
    Ok(())
}

/// Settings for a [`RateLease`]; [`build`](Self::build) checks them.
#[derive(Debug, Clone)]
pub struct RateLeaseBuilder<C: Clock = SystemClock> {
    pub(super) store: LeaseStore,
    pub(super) budget: String,
    pub(super) rate: Rate,
    pub(super) expected: NonZeroU32,
    pub(super) id: Option<String>,
    pub(super) lease: Duration,
    pub(super) refresh_every: Duration,
    pub(super) retry_every: Duration,
    pub(super) burst: Duration,
    pub(super) expiry_margin: Duration,
    pub(super) max_cost: NonZeroU32,
    pub(super) min_demand: Option<Rate>,
    pub(super) initial_demand: Option<Rate>,
    pub(super) fail_open: bool,
    pub(super) ceiling: Option<super::Ceiling>,
    pub(super) clock: C,
}

impl RateLease<SystemClock> {
    /// Settings for a lease on `budget` (1 to 64 characters of
    /// `[A-Za-z0-9._:-]`), a fleet-wide `rate`, shared by up to
    /// `expected_instances` instances: the fallback capacity is
    /// `rate / expected_instances`, so it must be the largest fleet size.
    pub fn builder(
        store: LeaseStore,
        budget: &str,
        rate: Rate,
        expected_instances: NonZeroU32,
    ) -> RateLeaseBuilder<SystemClock> {
        RateLeaseBuilder {
            store,
            budget: budget.to_owned(),
            rate,
            expected: expected_instances,
            id: None,
            lease: Duration::from_secs(5),
            refresh_every: Duration::from_secs(4),
            retry_every: Duration::from_millis(250),
            burst: Duration::from_millis(25),
            expiry_margin: Duration::from_millis(5),
            max_cost: NonZeroU32::MIN,
            min_demand: None,
            initial_demand: None,
            fail_open: false,
            ceiling: None,
            clock: SystemClock::new(),
        }
    }
}

impl<C: Clock> RateLeaseBuilder<C> {
    /// This instance's id, unique in the fleet: 1 to 128 characters of
    /// `[A-Za-z0-9._:-]`. Default: 16 random hex digits.
    ///
    /// An id in use by another live lease (a copied config) is detected: its
    /// refreshes are refused with
    /// [`LeaseError::InstanceIdInUse`](super::LeaseError::InstanceIdInUse)
    /// while the other's grants last, logged once at `error`, and it spends the
    /// fallback capacity meanwhile (see [`RateLease`], "One id, one holder").
    pub fn instance_id(mut self, id: &str) -> Self {
        self.id = Some(id.to_owned());
        self
    }

    /// The lease length `L` on Redis time, default 5 s: how long a grant
    /// lasts without renewal, how late a dead instance's share returns and
    /// how late a new instance may get its full share.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The refresh period `P`, default 4 s, less than the lease. Redis
    /// sees `instances / P` calls per second; at 40 instances and 240/s that
    /// is 10 calls/s, 0.042 per admitted send.
    pub fn refresh_every(mut self, every: Duration) -> Self {
        self.refresh_every = every;
        self
    }

    /// The wait after a failed refresh, default 250 ms.
    pub fn retry_every(mut self, every: Duration) -> Self {
        self.retry_every = every;
        self
    }

    /// The local burst as a span of the current rate, default 25 ms: the
    /// bucket holds `max(max_cost, rate × burst)` cost units.
    pub fn burst(mut self, burst: Duration) -> Self {
        self.burst = burst;
        self
    }

    /// The largest cost of one attempt, default 1; the bucket always holds
    /// at least this much, so every attempt up to it can pass. Costs above it
    /// are refused with `Duration::MAX`.
    pub fn max_cost(mut self, max_cost: NonZeroU32) -> Self {
        self.max_cost = max_cost;
        self
    }

    /// Taken off every grant's local lifetime, default 5 ms: covers a local
    /// clock that runs up to `margin / lease` (1,000 ppm) slower than
    /// Redis's.
    pub fn expiry_margin(mut self, margin: Duration) -> Self {
        self.expiry_margin = margin;
        self
    }

    /// The least demand reported, default a fortieth of the fallback
    /// capacity: an idle instance keeps a small grant, so its first send
    /// after a quiet spell does not wait for a refresh, and the floors of a
    /// whole idle fleet of the expected size hold a fortieth of the budget.
    pub fn min_demand(mut self, rate: Rate) -> Self {
        self.min_demand = Some(rate);
        self
    }

    /// The demand of the first refresh, before anything was measured;
    /// default the fallback capacity `rate / expected_instances`.
    pub fn initial_demand(mut self, rate: Rate) -> Self {
        self.initial_demand = Some(rate);
        self
    }

    /// **Breaks the budget during an outage.** When the grant expires
    /// without renewal, admit every attempt, with no limit at all, until a
    /// refresh succeeds, instead of spending the fallback capacity
    /// `rate / expected_instances`. A fleet that loses Redis then sends as
    /// fast as its callers ask, which is what the budget exists to prevent;
    /// choose it only for a dependency that protects itself. Entering this
    /// mode is logged at `warn` each time.
    pub fn fail_open(mut self) -> Self {
        self.fail_open = true;
        self
    }

    /// The local clock (default [`SystemClock`]); a
    /// [`ManualClock`](crate::clock::ManualClock) makes the send path testable.
    pub fn clock<C2: Clock>(self, clock: C2) -> RateLeaseBuilder<C2> {
        RateLeaseBuilder {
            store: self.store,
            budget: self.budget,
            rate: self.rate,
            expected: self.expected,
            id: self.id,
            lease: self.lease,
            refresh_every: self.refresh_every,
            retry_every: self.retry_every,
            burst: self.burst,
            expiry_margin: self.expiry_margin,
            max_cost: self.max_cost,
            min_demand: self.min_demand,
            initial_demand: self.initial_demand,
            fail_open: self.fail_open,
            ceiling: self.ceiling,
            clock,
        }
    }

    /// Caps the budget each refresh reports at `ceiling`'s current value
    /// (never above the rate): its owner lowers or raises what the fleet is
    /// granted at run time.
    pub(crate) fn ceiling(mut self, ceiling: super::Ceiling) -> Self {
        self.ceiling = Some(ceiling);
        self
    }

    /// Checks the settings and creates the lease,
    /// [starting](super::LeaseStatus::is_starting): nothing is sent until
    /// the first refresh.
    pub fn build(self) -> Result<RateLease<C>, ConfigError> {
        if !valid_key_part(&self.budget, 64) {
            return Err(ConfigError::new(
                "budget",
                format!(
                    "{:?} must be 1 to 64 characters of [A-Za-z0-9._:-]",
                    self.budget
                ),
            ));
        }
        check_rate(self.rate)?;
        let id = match self.id {
            Some(id) if valid_key_part(&id, 128) => id,
            Some(id) => {
                return Err(ConfigError::new(
                    "instance_id",
                    format!("{id:?} must be 1 to 128 characters of [A-Za-z0-9._:-]"),
                ))
            }
            None => format!("{:016x}", rand::random::<u64>()),
        };
        let us = duration_to_micros;
        let (lease, refresh, margin) = (
            us(self.lease),
            us(self.refresh_every),
            us(self.expiry_margin),
        );
        if lease == 0 || lease > 86_400_000_000 {
            return Err(ConfigError::new(
                "lease",
                "must be more than zero and at most a day",
            ));
        }
        if margin >= lease {
            return Err(ConfigError::new(
                "expiry_margin",
                "must be less than the lease, which it is taken off",
            ));
        }
        if refresh == 0 || refresh.saturating_add(margin) >= lease {
            return Err(ConfigError::new(
                "refresh_every",
                "must be more than zero and less than the lease minus the expiry margin",
            ));
        }
        if us(self.retry_every) == 0 {
            return Err(ConfigError::new("retry_every", "must be more than zero"));
        }
        let fallback = Rate(self.rate.0 / u64::from(self.expected.get()));
        let cfg = Settings {
            rate: self.rate,
            fallback,
            lease_us: lease,
            refresh_us: refresh,
            retry_us: us(self.retry_every),
            burst_us: us(self.burst),
            margin_us: margin,
            max_cost: u64::from(self.max_cost.get()),
            min_demand: self.min_demand.unwrap_or(Rate(fallback.0 / 40)),
            initial_demand: self.initial_demand.unwrap_or(fallback),
            fail_open: self.fail_open,
        };
        let now = Timestamp::now(&self.clock);
        let state = State {
            phase: Phase::Starting,
            grant: Rate::ZERO,
            until: Timestamp(0),
            kept: Rate::ZERO,
            kept_until: Timestamp(0),
            fallback: false,
            bucket: Bucket::EMPTY,
            last: now,
            window_start: now,
            attempted: 0,
            share_attempted: [0; 2],
            trial: Trial::default(),
            held_back_us: 0,
            held_back_until: now,
            guessing: true,
            demand: Rate::ZERO,
            target: Rate::ZERO,
            next_refresh: now,
            failures: 0,
            epoch: 0,
            changed_at: now,
            id_taken: false,
            id_in_use: 0,
            effective: self.rate,
            pushed: false,
            pushbacks: 0,
            pushback_woke: Timestamp(0),
            calls: 0,
            unmeasured: true,
            carried: false,
        };
        // Registered at their resting values, so a dashboard shows them
        // before the first pushback.
        #[cfg(feature = "metrics")]
        {
            metrics::counter!(
                "tower_admission_dependency_pushback_total",
                "budget" => self.budget.clone()
            )
            .increment(0);
            metrics::gauge!(
                "tower_admission_lease_effective_rate",
                "budget" => self.budget.clone()
            )
            .set(self.rate.as_f64());
        }
        Ok(RateLease {
            inner: Arc::new(Shared {
                key: self.store.key(&self.budget),
                store: self.store,
                budget: self.budget.into(),
                id: id.into(),
                life: rand::random(),
                cfg: Live::new(cfg),
                expected: self.expected,
                ceiling: self.ceiling,
                clock: self.clock,
                state: Mutex::new(state),
                refreshing: tokio::sync::Mutex::new(()),
                wake: Arc::new(tokio::sync::Notify::new()),
                ready: tokio::sync::watch::Sender::new(false),
            }),
        })
    }
}
