use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::quota::{
    Decision, Decisions, FailureMode, Holds, MemoryStore, Policy, Quota, QuotaDecision, Store,
    StoreError,
};
use crate::reject::Rejection;

/// The metadata `metrics::counter!` would give the decision counter, which
/// is registered by its prebuilt key instead.
#[cfg(feature = "metrics")]
static DECISION_METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// How long a refusal for an unavailable limiter asks clients to wait.
const UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The quota engine: a store plus the rules for when it fails (each
/// policy's failure mode, [`Policy::fail_open`] and its siblings), counting
/// and logging. It knows no protocol:
/// [`check`](Self::check) returns a [`Verdict`], which the inbound layers map
/// to HTTP or gRPC refusals and other callers to their own errors.
///
/// Clones share the store, the local fallback limiter and the counters.
///
/// ```
/// use tower_admission::clock::ManualClock;
/// use tower_admission::quota::{Limiter, MemoryStore, Policy, Quota};
/// use tower_admission::reject::Rejection;
/// use std::{sync::Arc, time::Duration};
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
/// let limiter = Limiter::new(MemoryStore::with_clock(clock));
/// let quota = Quota::new("api", [Policy::token_bucket("burst", 1, 1, Duration::from_secs(1))?])?;
/// let key: Arc<str> = "alice".into();
/// assert!(limiter.check(&quota, &key, 1).await.is_admitted());
/// let refused = limiter.check(&quota, &key, 1).await;
/// assert_eq!(refused.refusing_policies(), [Arc::<str>::from("burst")]);
/// assert_eq!(refused.retry_after(), Some(Duration::from_secs(1)));
/// assert!(matches!(refused.rejection(), Some(Rejection::QuotaExceeded { .. })));
/// # Ok::<(), tower_admission::ConfigError>(())
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct Limiter<S> {
    store: S,
    local: MemoryStore,
    stats: Arc<Counters>,
}

/// What a [`Limiter`] decided, read through [`Verdict`]'s methods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The request may proceed.
    Admitted,
    /// Enforcing policies refused; the same request can succeed after `wait`.
    Refused {
        /// The refusing enforcing policies.
        policies: Vec<Arc<str>>,
        /// The exact wait: the longest among the refusing policies.
        wait: Duration,
    },
    /// The cost is more than these enforcing policies can ever admit: no
    /// wait helps.
    CostExceedsCapacity {
        /// The policies whose limit is below the cost.
        policies: Vec<Arc<str>>,
    },
    /// The store could not decide and the failure modes refuse: a transient
    /// refusal, to retry after `wait`.
    Unavailable {
        /// How long to wait before retrying.
        wait: Duration,
    },
}

/// The answer of [`Limiter::check`]: admitted or not, why, the decisions
/// behind it and, when the store failed, how the failure was resolved.
///
/// A refusal is one of three, each read from the verdict or, whole, as its
/// [`rejection`](Self::rejection):
/// - refused by enforcing policies, which [`refusing_policies`](Self::refusing_policies)
///   names, until [`retry_after`](Self::retry_after)
///   ([`Rejection::QuotaExceeded`]);
/// - the cost is more than the named policies can ever admit: no
///   `retry_after`, since no wait helps ([`Rejection::CostExceedsCapacity`]);
/// - the store could not decide and the failure modes refuse: no policy
///   named, a transient refusal to retry after `retry_after`
///   ([`Rejection::LimiterUnavailable`]).
#[derive(Debug, Clone)]
pub struct Verdict {
    outcome: Outcome,
    cost: u64,
    decisions: Decisions,
    /// Set only when the store failed: boxed, so that every verdict of a
    /// store that answered is small to build and move.
    failed: Option<Box<Failed>>,
    pub(crate) recorded: Recorded,
}

/// How a store failure was resolved: see [`Verdict::store_error`] and
/// [`Verdict::local_quota`].
#[derive(Debug, Clone)]
struct Failed {
    error: StoreError,
    local_quota: Option<Quota>,
}

/// Where an admission was recorded, so that settling reaches that store only.
#[derive(Debug, Clone, Default)]
pub(crate) enum Recorded {
    /// In the shared store, with its holds.
    Shared(Holds),
    /// In the local fallback store, under the local share quota (boxed: it
    /// happens only while the shared store fails).
    Local(Box<(Quota, Holds)>),
    /// Nowhere that can be settled: refused, admitted by [`Policy::fail_open`],
    /// or an unknown outcome.
    #[default]
    Nowhere,
}

impl Verdict {
    /// What was decided, for the crate's own mappings.
    pub(crate) fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    /// True when the request may proceed.
    #[inline]
    pub fn is_admitted(&self) -> bool {
        matches!(self.outcome, Outcome::Admitted)
    }

    /// The wait on a refusal that a wait can cure: the longest among the
    /// refusing policies, or the failure modes' wait. `None` when admitted
    /// or when the cost is more than a policy can ever admit.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.outcome {
            Outcome::Refused { wait, .. } | Outcome::Unavailable { wait } => Some(wait),
            _ => None,
        }
    }

    /// The enforcing policies that refused, or, when no wait helps, those
    /// whose limit is below the cost. Empty when admitted or when the store
    /// could not decide and the failure modes refused.
    pub fn refusing_policies(&self) -> &[Arc<str>] {
        match &self.outcome {
            Outcome::Refused { policies, .. } | Outcome::CostExceedsCapacity { policies } => {
                policies
            }
            Outcome::Admitted | Outcome::Unavailable { .. } => &[],
        }
    }

    /// The refusal, as the inbound layers answer it; `None` when admitted.
    ///
    /// ```
    /// use tower_admission::quota::{Limiter, MemoryStore, Policy, Quota};
    /// use tower_admission::reject::Rejection;
    /// use std::{sync::Arc, time::Duration};
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let limiter = Limiter::new(MemoryStore::new());
    /// let quota = Quota::new("api", [Policy::token_bucket("burst", 5, 1, Duration::from_secs(1))?])?;
    /// let verdict = limiter.check(&quota, &"alice".into(), 8).await;
    /// let rejection = verdict.rejection().unwrap();
    /// assert_eq!(rejection, Rejection::CostExceedsCapacity { policies: vec!["burst".into()], cost: 8 });
    /// assert_eq!(rejection.status(), http::StatusCode::PAYLOAD_TOO_LARGE);
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// # }).unwrap();
    /// ```
    pub fn rejection(&self) -> Option<Rejection> {
        Some(match &self.outcome {
            Outcome::Admitted => return None,
            Outcome::Refused { policies, wait } => Rejection::QuotaExceeded {
                policies: policies.clone(),
                retry_after: *wait,
            },
            Outcome::CostExceedsCapacity { policies } => Rejection::CostExceedsCapacity {
                policies: policies.clone(),
                cost: self.cost,
            },
            Outcome::Unavailable { wait } => Rejection::LimiterUnavailable { retry_after: *wait },
        })
    }

    /// Every decision, shadow policies' included, in the order of the
    /// deciding quota's policies (see [`local_quota`](Self::local_quota)).
    /// Empty when no policy decided (the store failed and no local share
    /// applied).
    pub fn decisions(&self) -> &[Decision] {
        &self.decisions
    }

    /// The enforcing policies' decisions with their names, in policy order.
    /// Shadow policies are left out: they never shape the answer. `quota` is
    /// the checked quota; when the local share decided, its policies are used.
    pub fn named<'a>(
        &'a self,
        quota: &'a Quota,
    ) -> impl Iterator<Item = (&'a Policy, &'a Decision)> {
        self.all(quota).filter(|(p, _)| !p.is_shadow())
    }

    /// The shadow policies' decisions with their names: what they would have
    /// decided. Logged and counted, never applied.
    pub fn shadow<'a>(
        &'a self,
        quota: &'a Quota,
    ) -> impl Iterator<Item = (&'a Policy, &'a Decision)> {
        self.all(quota).filter(|(p, _)| p.is_shadow())
    }

    fn all<'a>(&'a self, quota: &'a Quota) -> impl Iterator<Item = (&'a Policy, &'a Decision)> {
        let policies = self.local_quota().unwrap_or(quota).policies();
        policies.iter().zip(&self.decisions)
    }

    /// The local share quota that decided, when the store failed and
    /// [`Policy::fail_to_local_share`] policies were decided in memory.
    pub fn local_quota(&self) -> Option<&Quota> {
        self.failed.as_ref()?.local_quota.as_ref()
    }

    /// The store error that the failure modes resolved, if any.
    pub fn store_error(&self) -> Option<&StoreError> {
        self.failed.as_ref().map(|f| &f.error)
    }

    /// True when the store may have recorded the request although it failed
    /// to answer: the request is counted as consumed.
    pub fn outcome_unknown(&self) -> bool {
        self.store_error().is_some_and(StoreError::outcome_unknown)
    }

    fn fail(&mut self, error: StoreError, local_quota: Option<Quota>) {
        self.failed = Some(Box::new(Failed { error, local_quota }));
    }

    fn new(outcome: Outcome, cost: u64, decisions: Decisions) -> Self {
        Verdict {
            outcome,
            cost,
            decisions,
            failed: None,
            recorded: Recorded::Nowhere,
        }
    }
}

/// A decision the store has not answered yet; see [`Limiter::pending`].
pub(crate) struct Pending<'a> {
    stats: Cow<'a, Arc<Counters>>,
    quota: Cow<'a, Quota>,
}

impl Pending<'_> {
    /// The store answered: nothing to count.
    pub(crate) fn answered(self) {
        std::mem::forget(self);
    }

    /// The same pending decision, for a future that outlives the limiter's borrow.
    pub(crate) fn into_owned(self) -> Pending<'static> {
        let owned = Pending {
            stats: Cow::Owned(Arc::clone(&self.stats)),
            quota: Cow::Owned(self.quota.clone().into_owned()),
        };
        self.answered();
        owned
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.stats.abandoned.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            quota = self.quota.name(),
            "quota decision dropped before the store answered"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!("tower_admission_abandoned_decisions_total", "quota" => self.quota.name_arc().clone())
            .increment(1);
    }
}

/// Counts of what a [`Limiter`] decided. A snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LimiterStats {
    /// Requests admitted.
    pub admitted: u64,
    /// Requests refused.
    pub refused: u64,
    /// Store failures resolved by admitting ([`Policy::fail_open`]).
    pub failed_open: u64,
    /// Store failures resolved by refusing ([`Policy::fail_closed`]).
    pub failed_closed: u64,
    /// Store failures resolved by the local share ([`Policy::fail_to_local_share`]).
    pub local_share: u64,
    /// Store calls that timed out after sending: counted as consumed.
    pub unknown_outcomes: u64,
    /// Decisions dropped by their caller before the store answered (a client
    /// that hung up while the store stalled, say). The store may have
    /// recorded them; none is counted as admitted or refused.
    pub abandoned: u64,
    /// Refusals by shadow policies, which never refuse a request.
    pub shadow_refusals: u64,
}

#[derive(Debug, Default)]
struct Counters {
    admitted: AtomicU64,
    refused: AtomicU64,
    failed_open: AtomicU64,
    failed_closed: AtomicU64,
    local_share: AtomicU64,
    unknown_outcomes: AtomicU64,
    abandoned: AtomicU64,
    shadow_refusals: AtomicU64,
}

impl<S: Store> Limiter<S> {
    /// A limiter over `store`, with a 100,000-key local fallback for
    /// [`Policy::fail_to_local_share`].
    pub fn new(store: S) -> Self {
        Self::with_local(store, MemoryStore::new())
    }

    /// A limiter with a given local fallback store.
    pub fn with_local(store: S, local: MemoryStore) -> Self {
        Limiter {
            store,
            local,
            stats: Arc::default(),
        }
    }

    /// The shared store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The local fallback store of [`Policy::fail_to_local_share`].
    pub fn local_store(&self) -> &MemoryStore {
        &self.local
    }

    /// Checks that the store can decide `quota`: call it once per quota
    /// before deciding. The quota layer calls it when it is built. With the
    /// `metrics` feature it also registers every series the quota can emit
    /// at 0 (decisions, refusals per policy and reason, its failure modes,
    /// unknown outcomes, shadow refusals), so that an alert on their rate
    /// has a series to read before the first event.
    pub fn validate(&self, quota: &Quota) -> Result<(), crate::ConfigError> {
        self.store.validate(quota)?;
        #[cfg(feature = "metrics")]
        register_at_zero(quota);
        Ok(())
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> LimiterStats {
        let c = &self.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        LimiterStats {
            admitted: get(&c.admitted),
            refused: get(&c.refused),
            failed_open: get(&c.failed_open),
            failed_closed: get(&c.failed_closed),
            local_share: get(&c.local_share),
            unknown_outcomes: get(&c.unknown_outcomes),
            abandoned: get(&c.abandoned),
            shadow_refusals: get(&c.shadow_refusals),
        }
    }

    /// Decides `cost` for `key` under `quota`, resolving store failures by
    /// each policy's failure mode.
    pub async fn check(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Verdict {
        let pending = self.pending(quota);
        let result = self.store.decide(quota, key, cost).await;
        pending.answered();
        self.resolve(quota, key, cost, result)
    }

    /// The verdict [`check`](Self::check) would give now, recording nothing
    /// anywhere: no admission, no counter, no metric, no log. A store failure
    /// is returned as it is, since a failure mode's answer would have to
    /// charge the local share to mean anything. Another decision may change
    /// the answer before the caller acts on it.
    ///
    /// ```
    /// use tower_admission::quota::{Limiter, MemoryStore, Policy, Quota};
    /// use std::{sync::Arc, time::Duration};
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let limiter = Limiter::new(MemoryStore::new());
    /// let quota = Quota::new("api", [Policy::token_bucket("burst", 2, 1, Duration::from_secs(1))?])?;
    /// let key: Arc<str> = "alice".into();
    /// for _ in 0..10 {
    ///     assert!(limiter.peek(&quota, &key, 2).await?.is_admitted());
    /// }
    /// // Ten peeks spent nothing: the whole burst is still there.
    /// assert!(limiter.check(&quota, &key, 2).await.is_admitted());
    /// assert!(!limiter.peek(&quota, &key, 1).await?.is_admitted());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn peek(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> Result<Verdict, StoreError> {
        let decision = self.store.peek(quota, key, cost).await?;
        Ok(outcome_of(quota, cost, decision, |_| Recorded::Nowhere))
    }

    /// A decision sent to the store: dropped before
    /// [`answered`](Pending::answered), it counts as
    /// [`abandoned`](LimiterStats::abandoned).
    pub(crate) fn pending<'a>(&'a self, quota: &'a Quota) -> Pending<'a> {
        Pending {
            stats: Cow::Borrowed(&self.stats),
            quota: Cow::Borrowed(quota),
        }
    }

    /// Turns the store's answer into a verdict, applying failure modes.
    #[inline(always)]
    pub(crate) fn resolve(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
        result: Result<QuotaDecision, StoreError>,
    ) -> Verdict {
        let verdict = match result {
            Ok(decision) => self.verdict(quota, cost, decision, Recorded::Shared),
            Err(error) => self.on_failure(quota, key, cost, error),
        };
        let admitted = verdict.is_admitted();
        let counter = if admitted {
            &self.stats.admitted
        } else {
            &self.stats.refused
        };
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::trace!(
            quota = quota.name(),
            key = &**key,
            cost,
            admitted,
            "quota decision"
        );
        // The key is the quota's own, built once: no labels to build, hash
        // or free per decision.
        #[cfg(feature = "metrics")]
        metrics::with_recorder(|r| {
            r.register_counter(quota.decision_key(admitted), &DECISION_METADATA)
        })
        .increment(1);
        #[cfg(feature = "metrics")]
        if !admitted {
            count_policy_refusals(quota, &verdict);
        }
        verdict
    }

    fn on_failure(&self, quota: &Quota, key: &Arc<str>, cost: u64, error: StoreError) -> Verdict {
        let unknown = error.outcome_unknown();
        if unknown {
            self.stats.unknown_outcomes.fetch_add(1, Ordering::Relaxed);
            #[cfg(feature = "metrics")]
            metrics::counter!("tower_admission_unknown_outcomes_total", "quota" => quota.name_arc().clone())
                .increment(1);
        }
        tracing::warn!(quota = quota.name(), %error, unknown_outcome = unknown, "quota store failed; applying failure modes");
        // A cost no enforcing policy could ever admit is refused as such,
        // whether or not the store answers.
        let never: Vec<Arc<str>> = quota
            .policies()
            .iter()
            .filter(|p| !p.is_shadow() && cost > p.algorithm().limit())
            .map(|p| p.name_arc().clone())
            .collect();
        if !never.is_empty() {
            let mut verdict = Verdict::new(
                Outcome::CostExceedsCapacity { policies: never },
                cost,
                Decisions::new(),
            );
            verdict.fail(error, None);
            return verdict;
        }
        let mut closed = false;
        let mut shared = Vec::new();
        for policy in quota.policies().iter().filter(|p| !p.is_shadow()) {
            match policy.failure_mode() {
                FailureMode::Open => self.count(&self.stats.failed_open, quota, "open"),
                FailureMode::Closed => {
                    self.count(&self.stats.failed_closed, quota, "closed");
                    closed = true;
                }
                FailureMode::LocalShare { divisor } => {
                    self.count(&self.stats.local_share, quota, "local_share");
                    shared.push(policy.share(divisor));
                }
            }
        }
        let unavailable = |error: StoreError, wait: Duration| {
            let mut verdict = Verdict::new(Outcome::Unavailable { wait }, cost, Decisions::new());
            verdict.fail(error, None);
            verdict
        };
        if closed {
            let wait = match error {
                StoreError::Full { retry_after } => retry_after.max(UNAVAILABLE_RETRY_AFTER),
                _ => UNAVAILABLE_RETRY_AFTER,
            };
            return unavailable(error, wait);
        }
        // No local-share policy: every enforcing policy failed open. The
        // admission is recorded nowhere that could be settled.
        let Ok(local_quota) = Quota::new(quota.name(), shared) else {
            let mut verdict = Verdict::new(Outcome::Admitted, cost, Decisions::new());
            verdict.fail(error, None);
            return verdict;
        };
        // The local limiter decides the shared policies; it charges the
        // request even when the store's outcome is unknown.
        match self.local.decide_now(&local_quota, key, cost) {
            Ok(decision) => {
                // An unknown outcome may stand in the shared store too: it is
                // never refunded, so its local charge is not settleable.
                let recorded = |holds| match unknown {
                    true => Recorded::Nowhere,
                    false => Recorded::Local(Box::new((local_quota.clone(), holds))),
                };
                let mut verdict = self.verdict(&local_quota, cost, decision, recorded);
                if let Outcome::CostExceedsCapacity { .. } = verdict.outcome {
                    // Over the local share but within the real limit: a
                    // transient refusal while the store is down.
                    verdict.outcome = Outcome::Unavailable {
                        wait: UNAVAILABLE_RETRY_AFTER,
                    };
                }
                verdict.fail(error, Some(local_quota));
                verdict
            }
            Err(local_error) => {
                tracing::warn!(quota = quota.name(), %local_error, "local share limiter is full");
                unavailable(error, UNAVAILABLE_RETRY_AFTER)
            }
        }
    }

    fn count(&self, counter: &AtomicU64, quota: &Quota, mode: &'static str) {
        counter.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!("tower_admission_failure_mode_total", "quota" => quota.name_arc().clone(), "mode" => mode)
            .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = (quota, mode);
    }

    /// Turns a store decision into a verdict ([`outcome_of`]), counting and
    /// logging each shadow policy that would refuse.
    #[inline(always)]
    fn verdict(
        &self,
        quota: &Quota,
        cost: u64,
        decision: QuotaDecision,
        recorded: impl FnOnce(Holds) -> Recorded,
    ) -> Verdict {
        let lone_admission = matches!(
            (quota.policies(), decision.admitted),
            ([policy], true) if !policy.is_shadow() || decision.decisions[0].admitted
        );
        if !lone_admission {
            self.count_shadow_refusals(quota, &decision);
        }
        outcome_of(quota, cost, decision, recorded)
    }

    fn count_shadow_refusals(&self, quota: &Quota, decision: &QuotaDecision) {
        for (p, d) in quota.policies().iter().zip(&decision.decisions) {
            if p.is_shadow() && !d.admitted {
                self.stats.shadow_refusals.fetch_add(1, Ordering::Relaxed);
                #[cfg(feature = "metrics")]
                metrics::counter!(
                    "tower_admission_shadow_refusals_total",
                    "quota" => quota.name_arc().clone(),
                    "policy" => p.name_arc().clone()
                )
                .increment(1);
                tracing::info!(
                    quota = quota.name(),
                    policy = p.name(),
                    "shadow policy would refuse"
                );
            }
        }
    }

    /// Settles an admission recorded in the shared store.
    pub(crate) async fn settle_shared(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        decision: &QuotaDecision,
        delta: i64,
    ) -> Result<QuotaDecision, StoreError> {
        self.store.settle(quota, key, decision, delta).await
    }
}

/// Turns a store decision into a verdict: the outcome from the enforcing
/// policies only. An admission is recorded where `recorded` says, with the
/// decision's holds.
#[inline(always)]
fn outcome_of(
    quota: &Quota,
    cost: u64,
    mut decision: QuotaDecision,
    recorded: impl FnOnce(Holds) -> Recorded,
) -> Verdict {
    let holds = std::mem::take(&mut decision.holds);
    if decision.admitted {
        return Verdict {
            outcome: Outcome::Admitted,
            cost,
            decisions: decision.decisions,
            failed: None,
            recorded: recorded(holds),
        };
    }
    let refusing = || {
        quota
            .policies()
            .iter()
            .zip(&decision.decisions)
            .filter(|(p, d)| !d.admitted && !p.is_shadow())
    };
    let never: Vec<Arc<str>> = refusing()
        .filter(|(_, d)| d.cost_exceeds_limit())
        .map(|(p, _)| p.name_arc().clone())
        .collect();
    let outcome = if never.is_empty() {
        Outcome::Refused {
            policies: refusing().map(|(p, _)| p.name_arc().clone()).collect(),
            wait: decision
                .retry_after(quota)
                .unwrap_or(UNAVAILABLE_RETRY_AFTER),
        }
    } else {
        Outcome::CostExceedsCapacity { policies: never }
    };
    Verdict::new(outcome, cost, decision.decisions)
}

/// Registers every series `quota` can emit at 0, labelled as they are
/// emitted.
#[cfg(feature = "metrics")]
fn register_at_zero(quota: &Quota) {
    let name = quota.name_arc();
    for admitted in [true, false] {
        let key = quota.decision_key(admitted);
        metrics::with_recorder(|r| r.register_counter(key, &DECISION_METADATA)).increment(0);
    }
    metrics::counter!("tower_admission_unknown_outcomes_total", "quota" => name.clone())
        .increment(0);
    for policy in quota.policies() {
        let policy_name = policy.name_arc().clone();
        if policy.is_shadow() {
            metrics::counter!(
                "tower_admission_shadow_refusals_total",
                "quota" => name.clone(),
                "policy" => policy_name
            )
            .increment(0);
            continue;
        }
        for reason in ["exhausted", "cost-exceeds-capacity"] {
            metrics::counter!(
                "tower_admission_policy_refused_total",
                "quota" => name.clone(),
                "policy" => policy_name.clone(),
                "reason" => reason
            )
            .increment(0);
        }
        let mode = match policy.failure_mode() {
            FailureMode::Open => "open",
            FailureMode::Closed => "closed",
            FailureMode::LocalShare { .. } => "local_share",
        };
        metrics::counter!("tower_admission_failure_mode_total", "quota" => name.clone(), "mode" => mode)
            .increment(0);
    }
}

/// Counts each enforcing policy behind a refusal once, with why it refused:
/// `exhausted` (a wait helps) or `cost-exceeds-capacity` (no wait helps).
/// A refusal by the failure modes names no policy and is counted in
/// `tower_admission_failure_mode_total` instead.
#[cfg(feature = "metrics")]
fn count_policy_refusals(quota: &Quota, verdict: &Verdict) {
    let (policies, reason) = match verdict.outcome() {
        Outcome::Refused { policies, .. } => (policies, "exhausted"),
        Outcome::CostExceedsCapacity { policies } => (policies, "cost-exceeds-capacity"),
        Outcome::Admitted | Outcome::Unavailable { .. } => return,
    };
    for policy in policies {
        metrics::counter!(
            "tower_admission_policy_refused_total",
            "quota" => quota.name_arc().clone(),
            "policy" => policy.clone(),
            "reason" => reason
        )
        .increment(1);
    }
}
