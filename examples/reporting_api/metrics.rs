//! `GET /metrics`: everything tower-admission counts, in the Prometheus text
//! format, rendered by `metrics-exporter-prometheus` from the `metrics`
//! facade that the crate emits into.
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `tower_admission_quota_decisions_total` | `quota`, `result` | decisions, `admitted` or `refused` |
//! | `tower_admission_policy_refused_total` | `quota`, `policy`, `reason` | refusals by each enforcing policy: `exhausted` or `cost-exceeds-capacity` |
//! | `tower_admission_shadow_refusals_total` | `quota`, `policy` | refusals a shadow policy would have made |
//! | `tower_admission_failure_mode_total` | `quota`, `mode` | failure modes taken while the store failed |
//! | `tower_admission_unknown_outcomes_total` | `quota` | store calls whose outcome is unknown (counted as consumed) |
//! | `tower_admission_abandoned_decisions_total` | `quota` | decisions dropped by their caller before the store answered |
//! | `tower_admission_store_keys` | `store` | keys a memory store holds, read at scrape time |
//! | `tower_admission_store_max_keys` | `store` | the most keys that store will hold |
//! | `tower_admission_concurrency_in_flight` | `scope` | requests holding a permit, `global` or summed over identities; `dependency`: calls in flight to the dependency |
//! | `tower_admission_concurrency_queued` | `scope` | requests waiting in a queue; `dependency`: calls waiting for the limit |
//! | `tower_admission_concurrency_limit` | `scope` | `dependency`: the adaptive limit on calls in flight |
//! | `tower_admission_concurrency_baseline_latency_seconds` | `scope` | `dependency`: its measured no-load latency (0 until measured) |
//! | `tower_admission_concurrency_latency_seconds` | `scope` | `dependency`: its latency in the last window that moved the limit |
//! | `tower_admission_concurrency_class_in_flight` | `scope`, `class` | calls in flight per class (`sheddable`, `default`, `critical`) |
//! | `tower_admission_concurrency_class_queued` | `scope`, `class` | calls waiting per class |
//! | `tower_admission_concurrency_shed_total` | `scope`, `class`, `reason` | calls the limit refused per class: `queue-full`, `tenant-queue-full`, `deadline-passed` |
//! | `tower_admission_concurrency_tracked_identities` | | identities with work queued or in flight |
//! | `tower_admission_concurrency_refused_total` | `scope`, `reason` | concurrency refusals |
//! | `tower_admission_dependency_attempts_total` | `budget`, `share` | dependency attempts admitted, `normal` or `retry` |
//! | `tower_admission_dependency_refused_total` | `budget` | dependency attempts the budget refused |
//! | `tower_admission_dependency_wait_seconds` | `budget` | histogram: time each admitted attempt waited for the budget |
//!
//! The route sits outside authentication, like `/healthz`; put it behind a
//! network policy or its own listener in production.

use std::sync::Arc;

use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use metrics::Unit;
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use tower_admission::clock::Clock;
use tower_admission::quota::MemoryStore;

/// The buckets of the budget-wait histogram, in seconds. The budget waits at
/// most `dependency.budget_wait` of the config (2 s); an attempt that did not wait lands
/// in the first bucket, since the decision itself takes microseconds.
const WAIT_BUCKETS: [f64; 10] = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0];

/// The text format's content type.
pub(crate) const CONTENT_TYPE_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Reads one store's key count and capacity.
type KeyCount = Arc<dyn Fn() -> (usize, usize) + Send + Sync>;

/// The installed Prometheus recorder and the stores whose keys are read at
/// scrape time. Clones share the recorder.
#[derive(Clone)]
pub(crate) struct Exporter {
    handle: PrometheusHandle,
    stores: Vec<(&'static str, KeyCount)>,
}

impl Exporter {
    /// Installs the Prometheus recorder as the process's global `metrics`
    /// recorder and describes every metric. Fails if a recorder is already
    /// installed.
    pub(crate) fn install() -> Result<Self, BuildError> {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Full("tower_admission_dependency_wait_seconds".into()),
                &WAIT_BUCKETS,
            )?
            .install_recorder()?;
        describe();
        Ok(Exporter {
            handle,
            stores: Vec::new(),
        })
    }

    /// Also reports the keys of `store` as `tower_admission_store_keys{store=name}`.
    pub(crate) fn memory_store<C: Clock>(
        mut self,
        name: &'static str,
        store: &MemoryStore<C>,
    ) -> Self
    where
        MemoryStore<C>: Send + Sync + 'static,
    {
        let store = store.clone();
        self.stores
            .push((name, Arc::new(move || (store.len(), store.capacity()))));
        self
    }

    /// The scrape: sets the gauges read at scrape time, then renders every
    /// metric in the text format.
    pub(crate) fn render(&self) -> String {
        for (name, count) in &self.stores {
            let (keys, max) = count();
            metrics::gauge!("tower_admission_store_keys", "store" => *name).set(keys as f64);
            metrics::gauge!("tower_admission_store_max_keys", "store" => *name).set(max as f64);
        }
        self.handle.run_upkeep();
        self.handle.render()
    }

    /// `GET /metrics`, to merge beside the authenticated routes.
    pub(crate) fn router(self) -> Router {
        Router::new().route(
            "/metrics",
            get(move || {
                let exporter = self.clone();
                async move { ([(CONTENT_TYPE, CONTENT_TYPE_TEXT)], exporter.render()).into_response() }
            }),
        )
    }
}

/// `# HELP` and `# TYPE` lines for every metric the crate emits.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "tower_admission_quota_decisions_total",
        "Quota decisions, by quota and result (admitted or refused)."
    );
    describe_counter!(
        "tower_admission_policy_refused_total",
        "Refusals by each enforcing policy, by quota, policy and reason."
    );
    describe_counter!(
        "tower_admission_shadow_refusals_total",
        "Refusals a shadow policy would have made; nothing was refused."
    );
    describe_counter!(
        "tower_admission_failure_mode_total",
        "Failure modes taken while a quota store failed, by quota and mode."
    );
    describe_counter!(
        "tower_admission_unknown_outcomes_total",
        "Store calls sent whose outcome is unknown, counted as consumed."
    );
    describe_counter!(
        "tower_admission_abandoned_decisions_total",
        "Quota decisions dropped by their caller before the store answered."
    );
    describe_gauge!(
        "tower_admission_store_keys",
        "Keys a memory store holds, read at scrape time."
    );
    describe_gauge!(
        "tower_admission_store_max_keys",
        "The most keys a memory store will hold."
    );
    describe_gauge!(
        "tower_admission_concurrency_in_flight",
        "Requests holding a concurrency permit, by scope."
    );
    describe_gauge!(
        "tower_admission_concurrency_queued",
        "Requests waiting in a concurrency queue, by scope."
    );
    describe_gauge!(
        "tower_admission_concurrency_tracked_identities",
        "Identities with a request queued or in flight."
    );
    describe_counter!(
        "tower_admission_concurrency_refused_total",
        "Requests refused by a concurrency cap, by scope and reason."
    );
    describe_gauge!(
        "tower_admission_concurrency_limit",
        "The adaptive limit on requests in flight, by scope."
    );
    describe_gauge!(
        "tower_admission_concurrency_baseline_latency_seconds",
        Unit::Seconds,
        "The measured no-load latency the adaptive limit aims near (0 until measured)."
    );
    describe_gauge!(
        "tower_admission_concurrency_latency_seconds",
        Unit::Seconds,
        "The latency of the last window that moved the adaptive limit (0 until then)."
    );
    describe_gauge!(
        "tower_admission_concurrency_class_in_flight",
        "Requests in flight under an adaptive limit, by scope and class."
    );
    describe_gauge!(
        "tower_admission_concurrency_class_queued",
        "Requests waiting for an adaptive limit, by scope and class."
    );
    describe_counter!(
        "tower_admission_concurrency_shed_total",
        "Requests an adaptive limit refused, by scope, class and reason."
    );
    describe_counter!(
        "tower_admission_dependency_attempts_total",
        "Dependency attempts the budget admitted, by budget and share."
    );
    describe_counter!(
        "tower_admission_dependency_refused_total",
        "Dependency attempts the budget refused, by budget."
    );
    describe_histogram!(
        "tower_admission_dependency_wait_seconds",
        Unit::Seconds,
        "Time each admitted dependency attempt waited for its budget."
    );
}
