use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::quota::{
    Decision, Decisions, FailureMode, MemoryStore, Policy, Quota, QuotaDecision, Store, StoreError,
};
use crate::reject::Rejection;

/// How long a fail-closed refusal asks clients to wait.
const UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// A store plus the rules for when it fails: each policy's
/// [`FailureMode`], counting, and logging.
///
/// Clones share the store, the local fallback limiter and the counters.
///
/// ```
/// use tower_admission::clock::{ManualClock, Timestamp};
/// use tower_admission::quota::{Limiter, MemoryConfig, MemoryStore, Policy, Quota};
/// use std::{sync::Arc, time::Duration};
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let clock = ManualClock::new(Timestamp::from_secs(1_800_000_000));
/// let limiter = Limiter::new(MemoryStore::with_config(MemoryConfig::default(), clock));
/// let quota = Quota::new("api", [Policy::token_bucket("burst", 1, 1, Duration::from_secs(1))?])?;
/// let key: Arc<str> = "alice".into();
/// assert!(limiter.check(&quota, &key, 1).await.admitted);
/// let refused = limiter.check(&quota, &key, 1).await;
/// assert!(!refused.admitted);
/// assert_eq!(refused.rejection.unwrap().retry_after(), Some(Duration::from_secs(1)));
/// # Ok::<(), tower_admission::ConfigError>(())
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct Limiter<S> {
    store: S,
    local: MemoryStore,
    stats: Arc<Counters>,
}

/// The outcome of [`Limiter::check`].
#[derive(Debug, Clone)]
pub struct Verdict {
    /// True if the request may proceed.
    pub admitted: bool,
    /// Each policy's decision, in the order of the checked quota's policies,
    /// or of [`local_quota`](Self::local_quota) when that is set. Policies
    /// resolved by [`FailureMode::Open`] or [`FailureMode::Closed`] have no
    /// decision. [`named`](Self::named) pairs them with their names.
    pub decisions: Decisions,
    /// The local share of the quota that decided, when the store failed and
    /// [`FailureMode::LocalShare`] policies were decided in memory.
    pub local_quota: Option<Quota>,
    /// Why the request was refused, when it was.
    pub rejection: Option<Rejection>,
    /// The store error that failure modes resolved, if any.
    pub store_error: Option<StoreError>,
}

impl Verdict {
    /// Each decision with its policy's name; `quota` is the quota that was checked.
    pub fn named<'a>(
        &'a self,
        quota: &'a Quota,
    ) -> impl Iterator<Item = (&'a Arc<str>, &'a Decision)> {
        let policies = self.local_quota.as_ref().unwrap_or(quota).policies();
        policies.iter().map(Policy::name_arc).zip(&self.decisions)
    }

    fn failed(admitted: bool, rejection: Option<Rejection>, error: StoreError) -> Self {
        Verdict {
            admitted,
            decisions: Decisions::new(),
            local_quota: None,
            rejection,
            store_error: Some(error),
        }
    }
}

/// Counts of what a [`Limiter`] decided. A snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimiterStats {
    /// Requests admitted.
    pub admitted: u64,
    /// Requests refused by a policy.
    pub refused: u64,
    /// Store failures resolved by admitting ([`FailureMode::Open`]).
    pub failed_open: u64,
    /// Store failures resolved by refusing ([`FailureMode::Closed`]).
    pub failed_closed: u64,
    /// Store failures resolved by the local share ([`FailureMode::LocalShare`]).
    pub local_share: u64,
    /// Store calls that timed out after sending: counted as consumed.
    pub unknown_outcomes: u64,
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
    shadow_refusals: AtomicU64,
}

impl<S: Store> Limiter<S> {
    /// A limiter over `store`, with a 100,000-key local fallback for
    /// [`FailureMode::LocalShare`].
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
            shadow_refusals: get(&c.shadow_refusals),
        }
    }

    /// Decides `cost` for `key` under `quota`, resolving store failures by
    /// each policy's failure mode.
    pub async fn check(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Verdict {
        let result = self.store.decide(quota, key, cost).await;
        self.resolve(quota, key, cost, result)
    }

    /// [`check`](Self::check) without awaiting, for stores that decide
    /// synchronously ([`Store::decide_sync`]); `None` for the others.
    pub fn check_sync(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Option<Verdict> {
        let result = self.store.decide_sync(quota, key, cost)?;
        Some(self.resolve(quota, key, cost, result))
    }

    fn resolve(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
        result: Result<QuotaDecision, StoreError>,
    ) -> Verdict {
        let verdict = match result {
            Ok(decision) => self.verdict(quota, decision, cost),
            Err(error) => self.on_failure(quota, key, cost, error),
        };
        let counter = if verdict.admitted {
            &self.stats.admitted
        } else {
            &self.stats.refused
        };
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::trace!(
            quota = quota.name(),
            key = &**key,
            cost,
            admitted = verdict.admitted,
            "quota decision"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "tower_admission_quota_decisions_total",
            "quota" => quota.name_arc().clone(),
            "result" => if verdict.admitted { "admitted" } else { "refused" }
        )
        .increment(1);
        verdict
    }

    /// Settles an earlier admission; see [`Store::adjust`].
    pub async fn adjust(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        delta: i64,
    ) -> Result<(), StoreError> {
        self.store.adjust(quota, key, delta).await
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
        let mut closed = false;
        let mut shared = Vec::new();
        for policy in quota.policies() {
            match policy.failure_mode() {
                FailureMode::Open => {
                    self.count(&self.stats.failed_open, quota, "open");
                }
                FailureMode::Closed if policy.is_shadow() => {}
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
        if closed {
            let retry_after = match error {
                StoreError::Full { retry_after } => retry_after.max(UNAVAILABLE_RETRY_AFTER),
                _ => UNAVAILABLE_RETRY_AFTER,
            };
            let rejection = Rejection::LimiterUnavailable { retry_after };
            return Verdict::failed(false, Some(rejection), error);
        }
        // No local-share policy: every enforcing policy failed open.
        let Ok(local_quota) = Quota::new(quota.name(), shared) else {
            return Verdict::failed(true, None, error);
        };
        // The local limiter decides the shared policies; it charges the
        // request even when the store's outcome is unknown.
        match self.local.decide_now(&local_quota, key, cost) {
            Ok(decision) => Verdict {
                local_quota: Some(local_quota.clone()),
                store_error: Some(error),
                ..self.verdict(&local_quota, decision, cost)
            },
            Err(local_error) => {
                tracing::warn!(quota = quota.name(), %local_error, "local share limiter is full");
                let rejection = Rejection::LimiterUnavailable {
                    retry_after: UNAVAILABLE_RETRY_AFTER,
                };
                Verdict::failed(false, Some(rejection), error)
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
}

impl<S: Store> Limiter<S> {
    /// Turns a store decision into a verdict: the rejection, shadow counts and logs.
    fn verdict(&self, quota: &Quota, mut decision: QuotaDecision, cost: u64) -> Verdict {
        if !decision.admitted {
            // Nothing was recorded: policies that would have admitted still hold
            // the cost they reported as taken.
            for d in decision.decisions.iter_mut().filter(|d| d.admitted) {
                d.remaining = d.remaining.saturating_add(cost).min(d.limit);
            }
        }
        let rejection = (!decision.admitted).then(|| {
            let refusing = || {
                decision
                    .decisions
                    .iter()
                    .zip(quota.policies())
                    .filter(|(d, p)| !d.admitted && !p.is_shadow())
            };
            let never: Vec<Arc<str>> = refusing()
                .filter(|(d, _)| d.cost_exceeds_limit())
                .map(|(_, p)| p.name_arc().clone())
                .collect();
            if never.is_empty() {
                Rejection::QuotaExceeded {
                    policies: refusing().map(|(_, p)| p.name_arc().clone()).collect(),
                    retry_after: decision.retry_after().unwrap_or(UNAVAILABLE_RETRY_AFTER),
                }
            } else {
                Rejection::CostExceedsCapacity {
                    policies: never,
                    cost,
                }
            }
        });
        for (p, d) in quota.policies().iter().zip(&decision.decisions) {
            if p.is_shadow() && !d.admitted {
                self.stats.shadow_refusals.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    quota = quota.name(),
                    policy = p.name(),
                    "shadow policy would refuse"
                );
            }
        }
        Verdict {
            admitted: decision.admitted,
            decisions: decision.decisions,
            local_quota: None,
            rejection,
            store_error: None,
        }
    }
}
