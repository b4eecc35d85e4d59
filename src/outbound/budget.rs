use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::outbound::{Attempt, BudgetError};
use crate::quota::algorithm::Algorithm;
use crate::quota::{Limiter, Outcome, Policy, Quota, Store};
use crate::reload::{Live, ReloadHandle, Target};
use crate::ConfigError;

/// How a budget that is split into partitions picks one for an attempt
/// ([`DependencyBudgetBuilder::partitions_home`] and
/// [`partitions_random`](DependencyBudgetBuilder::partitions_random)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pick {
    /// Always this instance's own partition (its index modulo `N`).
    Home(usize),
    /// A random partition, then up to `probes` others in turn when it refuses.
    Random {
        /// Other partitions tried after a refusal.
        probes: usize,
    },
}

/// A shared budget for calls to one dependency, charged before every send
/// attempt: a **normal** share for first attempts and a **retry** share for
/// retries, each a quota of its own over one [`Limiter`], optionally split
/// into partitions to spread a hot key.
///
/// A bound on send *starts* is not a bound on *arrivals* at the dependency:
/// requests that start within the budget can still arrive together (network
/// queues, connection pools, retries of the transport itself), and the
/// dependency sees them when they arrive.
///
/// Clones share the limiter, its store and the counters.
///
/// ```
/// use std::time::Duration;
/// use tower_admission::outbound::{Attempt, DependencyBudget};
/// use tower_admission::quota::{MemoryStore, Policy};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// // 240/s in all: 200/s for first attempts, 40/s for retries.
/// let budget = DependencyBudget::builder(MemoryStore::new(), "reports-db")
///     .normal(Policy::token_bucket("normal", 20, 200, Duration::from_secs(1))?)
///     .retry(Policy::token_bucket("retry", 4, 40, Duration::from_secs(1))?)
///     .build()?;
/// assert_eq!(budget.try_acquire(Attempt::FIRST, 1).await, Ok(()));
/// # Ok::<(), tower_admission::ConfigError>(())
/// # })?;
/// # Ok::<(), tower_admission::ConfigError>(())
/// ```
#[derive(Debug)]
pub struct DependencyBudget<St> {
    inner: Arc<Inner<St>>,
}

impl<St> Clone for DependencyBudget<St> {
    fn clone(&self) -> Self {
        DependencyBudget {
            inner: self.inner.clone(),
        }
    }
}

#[derive(Debug)]
struct Inner<St> {
    limiter: Limiter<St>,
    /// The shares' quotas, as one partition holds them; a reload replaces
    /// them whole.
    quotas: Live<[Quota; 2]>,
    /// The name, part of the quotas' names.
    name: String,
    /// One key per partition.
    keys: Vec<Arc<str>>,
    pick: Pick,
    stats: Counters,
}

/// The counters behind [`BudgetStats`], shared by every kind of budget.
///
/// With feature `metrics` each count is also emitted through the `metrics`
/// facade, labelled with the budget's name:
/// `tower_admission_dependency_attempts_total{budget,share}`,
/// `tower_admission_dependency_refused_total{budget}` and the histogram
/// `tower_admission_dependency_wait_seconds{budget}`.
#[derive(Debug)]
pub(crate) struct Counters {
    normal: AtomicU64,
    retry: AtomicU64,
    refused: AtomicU64,
    waited_micros: AtomicU64,
    /// The `budget` label.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    budget: Arc<str>,
}

impl Counters {
    /// Zeroed counters of the budget named `budget`. Its counter series
    /// are registered at 0 for every share, so that an alert on retries has
    /// a series to read before the first retry.
    pub(crate) fn new(budget: &str) -> Self {
        #[cfg(feature = "metrics")]
        {
            for share in ["normal", "retry"] {
                metrics::counter!(
                    "tower_admission_dependency_attempts_total",
                    "budget" => budget.to_owned(),
                    "share" => share
                )
                .increment(0);
            }
            metrics::counter!("tower_admission_dependency_refused_total", "budget" => budget.to_owned())
                .increment(0);
        }
        Counters {
            normal: AtomicU64::new(0),
            retry: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            waited_micros: AtomicU64::new(0),
            budget: Arc::from(budget),
        }
    }

    /// Counts an admitted first attempt, or retry if `retry`.
    pub(crate) fn admitted(&self, retry: bool) {
        let counter = if retry { &self.retry } else { &self.normal };
        counter.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "tower_admission_dependency_attempts_total",
            "budget" => self.budget.clone(),
            "share" => crate::outbound::layer::share_name(retry)
        )
        .increment(1);
    }

    pub(crate) fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!("tower_admission_dependency_refused_total", "budget" => self.budget.clone())
            .increment(1);
    }

    pub(crate) fn waited(&self, waited: Duration) {
        let micros = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        self.waited_micros.fetch_add(micros, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::histogram!("tower_admission_dependency_wait_seconds", "budget" => self.budget.clone())
            .record(waited.as_secs_f64());
    }

    pub(crate) fn snapshot(&self) -> BudgetStats {
        BudgetStats {
            normal: self.normal.load(Ordering::Relaxed),
            retry: self.retry.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            waited_micros: self.waited_micros.load(Ordering::Relaxed),
        }
    }
}

/// What a [`DependencyBudgetLayer`](crate::outbound::DependencyBudgetLayer)
/// charges before each send attempt: [`DependencyBudget`] (any
/// [`Store`]: memory, Redis) or, with feature `redis`, `LeasedBudget` (a
/// rate lease spent locally, no Redis call per attempt).
///
/// Clones share one budget.
pub trait AttemptBudget: Clone + Send + Sync + 'static {
    /// Charges `attempt` of `cost` now, to the retry share if it
    /// [is a retry](Attempt::is_retry), else to the normal share, or says
    /// why not. Never waits for capacity. Counts an admission but not a refusal: a caller
    /// that looks again after a refusal reports the attempt's final refusal
    /// once, with [`record_refusal`](Self::record_refusal).
    fn charge(
        &self,
        attempt: Attempt,
        cost: u64,
    ) -> impl std::future::Future<Output = Result<(), BudgetError>> + Send;

    /// [`charge`](Self::charge) for an attempt that already looked and was
    /// refused (a queue's head looking again after the wait it was told):
    /// the budget counts it toward its demand once, not once per look. The
    /// default charges as `charge` does.
    fn charge_again(
        &self,
        attempt: Attempt,
        cost: u64,
    ) -> impl std::future::Future<Output = Result<(), BudgetError>> + Send {
        self.charge(attempt, cost)
    }

    /// Counts `attempt` of `cost` toward its share's demand when it
    /// arrives at a queue in front of the budget, before its first look;
    /// the queue then charges it with [`charge_again`](Self::charge_again)
    /// only. A queue's head alone looks, so counting on the first look
    /// counted the attempts queued behind it only when they reached the
    /// head: too few while the queue grows, too many while it drains. The
    /// default counts nothing (and `charge_again`'s default counts as
    /// `charge` does): implement both or neither.
    fn note_arrival(&self, attempt: Attempt, cost: u64) {
        let _ = (attempt, cost);
    }

    /// Counts one attempt refused for good.
    fn record_refusal(&self);

    /// Adds `waited`, the time an admitted attempt waited, to the counters.
    fn record_wait(&self, waited: Duration);

    /// A snapshot of the counters.
    fn stats(&self) -> BudgetStats;

    /// Records that the dependency pushed back on an attempt, as a
    /// [`PushbackLayer`](crate::outbound::PushbackLayer) reports it. The
    /// default ignores it: the budget stays as configured. `LeasedBudget`
    /// (feature `redis`) lowers the fleet's effective budget through its
    /// lease.
    fn record_pushback(&self) {}
}

/// Counts of a [`DependencyBudget`]. A snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BudgetStats {
    /// First attempts admitted.
    pub normal: u64,
    /// Retries admitted.
    pub retry: u64,
    /// Attempts refused, each once however often it looked while waiting.
    pub refused: u64,
    /// Total time attempts spent waiting for the budget, in µs.
    pub waited_micros: u64,
}

/// Builds a [`DependencyBudget`]; [`build`](Self::build) checks it.
#[derive(Debug)]
pub struct DependencyBudgetBuilder<St> {
    limiter: Limiter<St>,
    name: String,
    normal: Option<Policy>,
    retry: Option<Policy>,
    partitions: usize,
    pick: Pick,
}

impl<St: Store> DependencyBudget<St> {
    /// A budget named `name` (part of its store keys: 1 to 57 characters of
    /// `[A-Za-z0-9._-]`, checked at [`build`](DependencyBudgetBuilder::build))
    /// over `store`.
    pub fn builder(store: St, name: &str) -> DependencyBudgetBuilder<St> {
        Self::with_limiter(Limiter::new(store), name)
    }

    /// A budget over an existing [`Limiter`], to share its counters or its
    /// local fallback.
    pub fn with_limiter(limiter: Limiter<St>, name: &str) -> DependencyBudgetBuilder<St> {
        DependencyBudgetBuilder {
            limiter,
            name: name.to_owned(),
            normal: None,
            retry: None,
            partitions: 1,
            pick: Pick::Home(0),
        }
    }

    /// The quota in force of the share `attempt` draws on (the retry share
    /// for a retry), as one partition holds it.
    pub fn quota(&self, attempt: Attempt) -> Quota {
        self.inner.quotas.load()[usize::from(attempt.is_retry())].clone()
    }

    /// Changes the shares of this budget and its clones while they run:
    /// each [`BudgetShares`] is checked as
    /// [`build`](DependencyBudgetBuilder::build) checks the shares, and split
    /// into the same partitions. A share's state (its bucket's level, its
    /// window's count) carries over under the redeploy rules: a lowered
    /// rate holds from the next attempt on.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::outbound::{Attempt, BudgetShares, DependencyBudget};
    /// use tower_admission::quota::{MemoryStore, Policy};
    ///
    /// let second = Duration::from_secs(1);
    /// let shares = |normal, retry| -> Result<BudgetShares, tower_admission::ConfigError> {
    ///     Ok(BudgetShares::new(
    ///         Policy::token_bucket("normal", normal / 10, normal, second)?,
    ///         Policy::token_bucket("retry", retry / 10, retry, second)?,
    ///     ))
    /// };
    /// let budget = DependencyBudget::builder(MemoryStore::new(), "reports-db")
    ///     .shares(shares(200, 40)?)
    ///     .build()?;
    /// budget.reload_handle().apply(shares(100, 20)?)?;
    /// assert_eq!(budget.quota(Attempt::FIRST).policies()[0].limit(), 10);
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn reload_handle(&self) -> ReloadHandle<BudgetShares> {
        ReloadHandle::new(Arc::new(BudgetTarget(Arc::clone(&self.inner))))
    }

    /// The limiter: store, failure modes, decision counters.
    pub fn limiter(&self) -> &Limiter<St> {
        &self.inner.limiter
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> BudgetStats {
        self.inner.stats.snapshot()
    }

    /// Charges `attempt` of `cost` now to its share (the retry share for a
    /// retry), or says why not. Never waits; see [`DependencyBudgetLayer`](crate::outbound::DependencyBudgetLayer)
    /// for waiting up to a deadline.
    pub async fn try_acquire(&self, attempt: Attempt, cost: u64) -> Result<(), BudgetError> {
        let result = self.charge_uncounted(attempt.is_retry(), cost).await;
        if result.is_err() {
            self.inner.stats.refused();
        }
        result
    }

    /// [`try_acquire`](Self::try_acquire) without counting a refusal; to
    /// the retry share if `retry`.
    async fn charge_uncounted(&self, retry: bool, cost: u64) -> Result<(), BudgetError> {
        let inner = &*self.inner;
        // Held across the store's answer: the attempt is decided wholly
        // under the shares in force when it began.
        let quotas = inner.quotas.load_full();
        let quota = &quotas[usize::from(retry)];
        let n = inner.keys.len();
        let (first, tries) = match inner.pick {
            Pick::Home(i) => (i % n, 1),
            Pick::Random { probes } => (rand::random_range(0..n), (1 + probes).min(n)),
        };
        let mut refusal = None;
        for k in 0..tries {
            let key = &inner.keys[(first + k) % n];
            let verdict = inner.limiter.check(quota, key, cost).await;
            let this = match verdict.outcome() {
                Outcome::Admitted => {
                    inner.stats.admitted(retry);
                    return Ok(());
                }
                Outcome::Refused { wait, .. } => BudgetError::Exhausted { retry, wait: *wait },
                // Every partition holds the same part: none can admit it.
                Outcome::CostExceedsCapacity { .. } => {
                    return Err(BudgetError::CostExceedsBudget { retry, cost })
                }
                Outcome::Unavailable { wait } => BudgetError::Unavailable { wait: *wait },
            };
            refusal = Some(match refusal {
                None => this,
                Some(kept) => most_useful(kept, this),
            });
        }
        Err(refusal.unwrap_or(BudgetError::Unavailable {
            wait: Duration::from_secs(1),
        }))
    }
}

/// The refusal to report of two partitions' refusals, whatever the order
/// they were probed in: across partitions the attempt can go as soon as any
/// one frees, so an `Exhausted` wait beats a store failure and the shorter
/// wait of two of a kind wins.
fn most_useful(a: BudgetError, b: BudgetError) -> BudgetError {
    match (a, b) {
        (BudgetError::Exhausted { retry, wait: a }, BudgetError::Exhausted { wait: b, .. }) => {
            BudgetError::Exhausted {
                retry,
                wait: a.min(b),
            }
        }
        (BudgetError::Unavailable { wait: a }, BudgetError::Unavailable { wait: b }) => {
            BudgetError::Unavailable { wait: a.min(b) }
        }
        (exhausted @ BudgetError::Exhausted { .. }, _)
        | (_, exhausted @ BudgetError::Exhausted { .. }) => exhausted,
        (a, _) => a,
    }
}

impl<St: Store> AttemptBudget for DependencyBudget<St> {
    fn charge(
        &self,
        attempt: Attempt,
        cost: u64,
    ) -> impl std::future::Future<Output = Result<(), BudgetError>> + Send {
        self.charge_uncounted(attempt.is_retry(), cost)
    }

    fn record_refusal(&self) {
        self.inner.stats.refused();
    }

    fn record_wait(&self, waited: Duration) {
        self.inner.stats.waited(waited);
    }

    fn stats(&self) -> BudgetStats {
        DependencyBudget::stats(self)
    }
}

/// The two shares of a budget, first attempts and retries: what its
/// reload handle applies. A [`DependencyBudget`]'s are policies
/// ([`reload_handle`](DependencyBudget::reload_handle)); with feature
/// `redis`, a `LeasedBudget`'s are rates, whose sum is its lease's
/// fleet-wide rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetShares<T = Policy> {
    pub(crate) normal: T,
    pub(crate) retry: T,
}

impl<T> BudgetShares<T> {
    /// `normal` for first attempts, `retry` for attempt 2 and later.
    pub fn new(normal: T, retry: T) -> Self {
        BudgetShares { normal, retry }
    }
}

/// The budget's side of its [`ReloadHandle`].
struct BudgetTarget<St>(Arc<Inner<St>>);

impl<St: Store> Target<BudgetShares> for BudgetTarget<St> {
    fn check(&self, new: &BudgetShares) -> Result<(), ConfigError> {
        self.quotas(new).map(drop)
    }

    fn swap(&self, new: BudgetShares) {
        let Ok(quotas) = self.quotas(&new) else {
            unreachable!("swapped after a check")
        };
        self.0.quotas.store(quotas);
    }
}

impl<St: Store> BudgetTarget<St> {
    fn quotas(&self, new: &BudgetShares) -> Result<[Quota; 2], ConfigError> {
        let inner = &*self.0;
        share_quotas(
            &inner.limiter,
            &inner.name,
            inner.keys.len(),
            Some(&new.normal),
            Some(&new.retry),
        )
    }
}

/// The shares' quotas of a budget named `name` split into `n` partitions,
/// checked: each share given and enforcing, `n` parts that together hold
/// no more than the whole, and quotas the store can decide.
fn share_quotas<St: Store>(
    limiter: &Limiter<St>,
    name: &str,
    n: usize,
    normal: Option<&Policy>,
    retry: Option<&Policy>,
) -> Result<[Quota; 2], ConfigError> {
    let divisor = std::num::NonZeroU64::new(n as u64).unwrap_or(std::num::NonZeroU64::MIN);
    let required = |policy: Option<&Policy>, field| match policy {
        None => Err(ConfigError::new(field, "is required")),
        // A shadow refuses nothing: the share would admit every attempt.
        Some(policy) if policy.is_shadow() => Err(ConfigError::new(
            field,
            "must enforce: a shadow policy refuses nothing",
        )),
        Some(policy) => Ok(policy.clone()),
    };
    let (normal, retry) = (required(normal, "normal")?, required(retry, "retry")?);
    let most = normal.algorithm().limit().min(retry.algorithm().limit());
    let share = |policy: &Policy, field: &'static str| {
        let part = policy.share(divisor);
        if let Some(quantity) = exceeded_by_parts(policy, &part, divisor.get()) {
            return Err(ConfigError::new(
                "partitions",
                format!(
                    "{n} partitions would each hold at least 1 of the {field} share's {quantity}, \
                     more than the whole together; at most {most} partitions fit this budget"
                ),
            ));
        }
        Quota::new(&format!("{name}-{field}"), [part])
    };
    let normal = share(&normal, "normal")?;
    let retry = share(&retry, "retry")?;
    limiter.validate(&normal)?;
    limiter.validate(&retry)?;
    Ok([normal, retry])
}

impl<St: Store> DependencyBudgetBuilder<St> {
    /// Both shares at once, replacing those given before.
    pub fn shares(mut self, shares: BudgetShares) -> Self {
        self.normal = Some(shares.normal);
        self.retry = Some(shares.retry);
        self
    }

    /// The normal share, for first attempts (required).
    pub fn normal(mut self, policy: Policy) -> Self {
        self.normal = Some(policy);
        self
    }

    /// The retry share, for attempt 2 and later (required).
    pub fn retry(mut self, policy: Policy) -> Self {
        self.retry = Some(policy);
        self
    }

    /// Splits the budget into `n` partitions (at most the smallest limit of
    /// either share; default one), and charges every attempt to this
    /// instance's own partition, `home` modulo `n`.
    ///
    /// Each of the `n` partitions holds `1/n` of every policy (limit and
    /// rate), so together they never admit more than the whole budget,
    /// whichever is picked. A part holds at least 1, so a budget whose
    /// smallest limit (a token bucket's capacity) is below `n` is refused at
    /// [`build`](Self::build). An attempt is charged to one partition, so a
    /// cost above one part's capacity is refused
    /// ([`BudgetError::CostExceedsBudget`]) even when it is within the whole
    /// budget.
    ///
    /// Strict and cheap: one decision per attempt. An instance can use only
    /// its own `1/n`, so with uneven load across instances the budget is
    /// under-used; [`partitions_random`](Self::partitions_random) uses all
    /// of it.
    pub fn partitions_home(mut self, n: usize, home: usize) -> Self {
        self.partitions = n;
        self.pick = Pick::Home(home);
        self
    }

    /// Splits the budget into `n` partitions as
    /// [`partitions_home`](Self::partitions_home) does, and charges every
    /// attempt to a random partition, then to up to `probes` others in turn
    /// when it refuses.
    ///
    /// Uses the whole budget under uneven load, at the cost of up to
    /// `1 + probes` decisions for a refused attempt. Still never more than
    /// the total, since every partition holds only its part.
    ///
    /// When every probed partition refuses, the refusal does not depend on
    /// the order they were probed in: [`BudgetError::Exhausted`] with the
    /// shortest wait among the partitions that were exhausted, or, only when
    /// every probed partition's store failed, [`BudgetError::Unavailable`] with
    /// the shortest wait among them. A cost above one partition's capacity
    /// is refused at once ([`BudgetError::CostExceedsBudget`]): no partition can
    /// admit it.
    pub fn partitions_random(mut self, n: usize, probes: usize) -> Self {
        self.partitions = n;
        self.pick = Pick::Random { probes };
        self
    }

    /// The budget. Fails when the name is not valid, a share is missing or a shadow policy (which
    /// refuses nothing), the partition count is 0, above 1,024 or above a
    /// share's limit (a token bucket's capacity), or the store cannot
    /// decide the shares.
    pub fn build(self) -> Result<DependencyBudget<St>, ConfigError> {
        check_name(&self.name)?;
        let n = self.partitions;
        if n == 0 || n > 1024 {
            return Err(ConfigError::new("partitions", "must be 1 to 1,024"));
        }
        let quotas = share_quotas(
            &self.limiter,
            &self.name,
            n,
            self.normal.as_ref(),
            self.retry.as_ref(),
        )?;
        let keys = (0..n).map(|i| Arc::from(format!("p{i}"))).collect();
        Ok(DependencyBudget {
            inner: Arc::new(Inner {
                limiter: self.limiter,
                quotas: Live::new(quotas),
                keys,
                pick: self.pick,
                stats: Counters::new(&self.name),
                name: self.name,
            }),
        })
    }
}

/// The longest budget name: the shares' quota names add `-normal` to it,
/// and a quota name has at most 64 characters.
const MAX_NAME: usize = 64 - "-normal".len();

/// Checks a budget's name as given, before the quota names built from it.
fn check_name(name: &str) -> Result<(), ConfigError> {
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if valid {
        Ok(())
    } else {
        Err(ConfigError::new(
            "name",
            format!("{name:?} must be 1 to {MAX_NAME} characters of [A-Za-z0-9._-]"),
        ))
    }
}

/// The quantity of `whole` that `n` copies of `part` exceed together, if
/// any: the limit (a token bucket's capacity), which [`Policy::share`] keeps
/// at least 1, or a token bucket's refill rate.
fn exceeded_by_parts(whole: &Policy, part: &Policy, n: u64) -> Option<&'static str> {
    let (whole, part) = (whole.algorithm(), part.algorithm());
    let limit = match whole {
        Algorithm::TokenBucket(_) => "capacity",
        _ => "limit",
    };
    if u128::from(part.limit()) * u128::from(n) > u128::from(whole.limit()) {
        return Some(limit);
    }
    if let (Algorithm::TokenBucket(whole), Algorithm::TokenBucket(part)) = (whole, part) {
        // One token every p/q µs: n parts refill n·q'/p' per µs, the whole q/p.
        let (p, q) = whole.interval_micros();
        let (p_part, q_part) = part.interval_micros();
        if u128::from(n) * u128::from(q_part) * u128::from(p) > u128::from(q) * u128::from(p_part) {
            return Some("refill");
        }
    }
    None
}
