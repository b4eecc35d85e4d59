//! [`RegionalBudgetBuilder`]: a regional budget's settings, checked.

use std::sync::Arc;
use std::time::Duration;

use redis::Script;

use super::region::Region;
use super::{
    Inner, RegionalBudget, COMMON, CREDIT, DEBIT, MAX_NAME, MAX_TOTAL, PIN, RECEIVE, REFUND,
    RESTORE, SEED, SEND, VIEW,
};
use crate::outbound::LeaseStore;
use crate::redis::{Connector, Target, Timing};
use crate::ConfigError;

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
    pub(super) name: String,
    pub(super) total: u64,
    pub(super) regions: Vec<(String, String, u64)>,
    pub(super) call_timeout: Duration,
    pub(super) credit_hold: Duration,
    pub(super) leases: LeaseSettings,
    pub(super) lease_stores: Vec<(String, LeaseStore)>,
    pub(super) rebalance: Rebalance,
}

/// How each region's rebalancer moves its surplus (see
/// [`RegionalBudget::rebalance_once`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Rebalance {
    /// The most moved per period; `None`: 5 % of the total.
    pub(super) max_step: Option<u64>,
    /// Nothing is moved at or below it; `None`: 1 % of the total.
    pub(super) dead_band: Option<u64>,
    /// Never given away below it.
    pub(super) floor: u64,
}

/// The settings every region lease ([`RegionalBudget::lease`]) of a
/// budget shares: the invariant's proof takes one lease length, view age and
/// clock skew for all regions.
#[derive(Debug, Clone, Copy)]
pub(super) struct LeaseSettings {
    /// The lease length `L`.
    pub(super) lease: Duration,
    /// The leases' refresh period.
    pub(super) refresh_every: Duration,
    /// The view's maximum age `Q`.
    pub(super) view_max_age: Duration,
    /// The largest clock skew `S` between two regions' Redis servers.
    pub(super) max_skew: Duration,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        LeaseSettings {
            lease: Duration::from_secs(5),
            refresh_every: Duration::from_secs(4),
            view_max_age: Duration::from_secs(1),
            max_skew: Duration::from_millis(250),
        }
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

    /// The credit hold `H`, default 8 s: allocation a region received by an
    /// ordered transfer ([`RegionalBudget::send`]) counts as spendable, and
    /// may be given on, only `H` after its credit (on the receiver's Redis
    /// clock). Above zero, at most one hour. A
    /// region's [lease](RegionalBudget::lease) checks that `H` covers
    /// the lease length, clock skew, view age and deadlines.
    ///
    /// ```
    /// # use tower_admission::outbound::RegionalBudget;
    /// # use std::time::Duration;
    /// let budget = RegionalBudget::builder(10)
    ///     .region("eu", "redis://127.0.0.1/", 10)
    ///     .credit_hold(Duration::from_secs(12))
    ///     .build()?;
    /// assert_eq!(budget.credit_hold(), Duration::from_secs(12));
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn credit_hold(mut self, hold: Duration) -> Self {
        self.credit_hold = hold;
        self
    }

    /// The lease length `L` of the regions' rate leases
    /// ([`RegionalBudget::lease`]), default 5 s.
    ///
    /// ```
    /// # use tower_admission::outbound::RegionalBudget;
    /// # use std::time::Duration;
    /// let budget = RegionalBudget::builder(10)
    ///     .region("eu", "redis://127.0.0.1/", 10)
    ///     .lease_length(Duration::from_secs(2))
    ///     .refresh_every(Duration::from_millis(1500))
    ///     .credit_hold(Duration::from_secs(5))
    ///     .build()?;
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn lease_length(mut self, lease: Duration) -> Self {
        self.leases.lease = lease;
        self
    }

    /// The refresh period of the regions' rate leases, default 4 s.
    pub fn refresh_every(mut self, every: Duration) -> Self {
        self.leases.refresh_every = every;
        self
    }

    /// The view's maximum age `Q`, default 1 s: a region lease's refresh
    /// reports the spendable allocation of a view read at most `Q` before,
    /// else zero. Above zero.
    pub fn view_max_age(mut self, age: Duration) -> Self {
        self.leases.view_max_age = age;
        self
    }

    /// The largest clock skew `S` between two regions' Redis servers,
    /// default 250 ms.
    pub fn max_skew(mut self, skew: Duration) -> Self {
        self.leases.max_skew = skew;
        self
    }

    /// The store that `region`'s leases lease from (its own Redis, as a
    /// rule): every [lease](RegionalBudget::lease) of the
    /// region leases from it, and the rebalancers read each region's demand
    /// from it ([`RegionalBudget::rebalance_once`]). A region without one has
    /// no leases, and its demand counts as unknown.
    ///
    /// ```
    /// # use tower_admission::outbound::{LeaseStore, RegionalBudget};
    /// # use std::time::Duration;
    /// let url = "redis://127.0.0.1:6380/";
    /// let budget = RegionalBudget::builder(10)
    ///     .region("eu", url, 10)
    ///     .lease_store("eu", LeaseStore::new(url, "payments", Duration::from_millis(100))?)
    ///     .build()?;
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn lease_store(mut self, region: &str, store: LeaseStore) -> Self {
        self.lease_stores.push((region.to_owned(), store));
        self
    }

    /// The most a rebalancer moves per period, default 5 % of the total (at
    /// least 1); above zero.
    pub fn rebalance_step(mut self, max_step: u64) -> Self {
        self.rebalance.max_step = Some(max_step);
        self
    }

    /// A rebalancer moves nothing unless both the surplus and the
    /// receiver's need exceed `band`, default 1 % of the total: transfers
    /// that undo each other are not worth their records.
    pub fn dead_band(mut self, band: u64) -> Self {
        self.rebalance.dead_band = Some(band);
        self
    }

    /// A rebalancer never gives its region's allocation away below `floor`
    /// (default 0): a reserve for demand that appears later, which a region
    /// would otherwise wait for (its measurement, the transfers and the
    /// credit hold) after giving everything away while idle.
    pub fn keep_at_least(mut self, floor: u64) -> Self {
        self.rebalance.floor = floor;
        self
    }

    /// Checks the settings and builds the budget. Nothing connects yet.
    ///
    /// The error names the field: `name`, `total` (zero, or not below
    /// 2^53), `regions` (none, or the split does not sum to the total),
    /// `region` (a bad or repeated name), `url`, `call_timeout`,
    /// `credit_hold` or `view_max_age` (zero), `lease_store` (not a region,
    /// or given twice), `rebalance_step` (zero). The region leases check the
    /// lease length and the credit hold against each other
    /// ([`RegionalBudget::lease`]).
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
        if self.credit_hold.is_zero() || self.credit_hold > Duration::from_secs(3600) {
            return Err(ConfigError::new(
                "credit_hold",
                "the credit hold must be above zero and at most one hour",
            ));
        }
        if self.leases.view_max_age.is_zero() {
            return Err(ConfigError::new("view_max_age", "must be above zero"));
        }
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
        for (i, (name, _)) in self.lease_stores.iter().enumerate() {
            if regions.iter().all(|r| &*r.name != name) {
                return Err(ConfigError::new(
                    "lease_store",
                    format!("`{name}` is not a region of the budget"),
                ));
            }
            if self.lease_stores[..i].iter().any(|(n, _)| n == name) {
                return Err(ConfigError::new(
                    "lease_store",
                    format!("region `{name}` has two lease stores"),
                ));
            }
        }
        if self.rebalance.max_step == Some(0) {
            return Err(ConfigError::new("rebalance_step", "must be at least 1"));
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
                hold_us: crate::clock::duration_to_micros(self.credit_hold),
                leases: self.leases,
                lease_stores: self.lease_stores,
                rebalance: self.rebalance,
                regions,
                debit: Script::new(DEBIT),
                credit: Script::new(&format!("{COMMON}{CREDIT}")),
                seed: Script::new(SEED),
                refund: Script::new(REFUND),
                pin: Script::new(PIN),
                send: Script::new(&with_clock(SEND)),
                receive: Script::new(&with_clock(&format!("{COMMON}{RECEIVE}"))),
                view: Script::new(&with_clock(VIEW)),
                restore: Script::new(&with_clock(RESTORE)),
            }),
        })
    }
}

pub(super) fn check_name(field: &'static str, name: &str) -> Result<(), ConfigError> {
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

/// A script body after the one clock prelude (Redis `TIME`).
fn with_clock(body: &str) -> String {
    format!("{}{body}", crate::redis::prelude(None))
}
