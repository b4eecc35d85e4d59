//! `GET /metrics` of the sample reporting API: the Prometheus text format,
//! checked by the official Python client's parser (`prometheus_client`,
//! installed with pip when missing), and counters that move by exact
//! amounts as requests are made.
//!
//! The Prometheus recorder is global to the process, so this file holds one
//! test and every check compares two scrapes.
#![cfg(feature = "metrics")]

#[path = "../examples/reporting_api/app.rs"]
#[allow(dead_code, reason = "these tests do not drain jobs")]
mod app;
#[path = "../examples/reporting_api/config.rs"]
#[allow(dead_code, reason = "these tests use the built-in config only")]
mod config;
#[path = "../examples/reporting_api/data.rs"]
mod data;
#[path = "../examples/reporting_api/dependency.rs"]
#[allow(dead_code, reason = "these tests build their own budgets")]
mod dependency;
#[path = "../examples/reporting_api/metrics.rs"]
mod metrics;
#[path = "../examples/mock_dependency/mock.rs"]
mod mock;
#[path = "../examples/reporting_api/overload.rs"]
mod overload;
#[path = "../examples/reporting_api/reload.rs"]
#[allow(dead_code, reason = "these tests do not reload")]
mod reload;

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use config::Config;
use dependency::Dependency;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tower::ServiceExt;
use tower_admission::clock::ManualClock;
use tower_admission::outbound::DependencyBudget;
use tower_admission::quota::{MemoryStore, Policy};

/// Parses the text format with `prometheus_client`'s parser, which raises on
/// any line that is not valid exposition text, and prints every sample.
const PARSE: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
samples = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        samples.append({"family": family.name, "type": family.type,
                        "name": s.name, "labels": s.labels, "value": s.value})
print(json.dumps(samples, allow_nan=False))
"#;

/// Makes sure `python3` can import `prometheus_client`, installing it with
/// pip when it cannot. Panics, saying why, when that fails.
fn ensure_parser() {
    let importable = || {
        Command::new("python3")
            .args(["-c", "import prometheus_client.parser"])
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
    };
    match importable() {
        Ok(true) => return,
        Ok(false) => {}
        Err(e) => panic!("this test needs python3 to run the Prometheus parser: {e}"),
    }
    let install = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "prometheus_client",
        ])
        .output()
        .expect("python3 -m pip could not be started");
    assert!(
        install.status.success() && importable().is_ok_and(|ok| ok),
        "could not install prometheus_client with pip ({}): {}",
        install.status,
        String::from_utf8_lossy(&install.stderr)
    );
}

/// One sample as the Python parser read it.
#[derive(Debug, Deserialize)]
struct Sample {
    family: String,
    #[serde(rename = "type")]
    kind: String,
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// One parsed scrape.
#[derive(Debug)]
struct Scrape(Vec<Sample>);

impl Scrape {
    /// The value of the sample `name` whose labels are exactly `labels`; 0
    /// when there is none (a series appears on its first change).
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let found: Vec<f64> = self
            .0
            .iter()
            .filter(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
            .collect();
        assert!(found.len() <= 1, "{name}{labels:?} twice: {found:?}");
        found.first().copied().unwrap_or(0.0)
    }

    /// The type the parser gave the family of sample `name`.
    fn kind(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.kind.as_str())
    }

    /// How much `name{labels}` moved since `before`.
    fn delta(&self, before: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels) - before.get(name, labels)
    }
}

async fn scrape(app: &Router) -> Scrape {
    let response = app
        .clone()
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()["content-type"],
        metrics::CONTENT_TYPE_TEXT
    );
    let text = response.into_body().collect().await.unwrap().to_bytes();
    let mut python = Command::new("python3")
        .args(["-c", PARSE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 could not be started");
    python
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(&text)
        .unwrap();
    let out = python.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus_client could not parse /metrics: {}\n---\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&text)
    );
    let samples: Vec<Sample> = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        samples.iter().all(|s| s.name.starts_with(&s.family)),
        "{samples:?}"
    );
    Scrape(samples)
}

/// The API over a memory store on a manual clock, with `/metrics` reading
/// that store's keys.
fn api(exporter: &metrics::Exporter, dependency: Dependency) -> (Router, MemoryStore<ManualClock>) {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock);
    let exporter = exporter.clone().memory_store("quotas", &store);
    let api = app::app(&Config::builtin(), store.clone(), dependency).unwrap();
    (api.router.merge(exporter.router()), store)
}

/// The dependency at `url` through `budget`, as the built-in config says.
fn dependency(url: &str, budget: DependencyBudget<MemoryStore>) -> Dependency {
    let config = Config::builtin();
    Dependency::new(url, budget, &config.dependency, config.batch.active_items).unwrap()
}

/// A budget named `name` of `per_hour` attempts per share, each an hour
/// apart after the first; `None` never refuses these tests' calls.
fn budget(name: &str, per_hour: Option<u64>) -> DependencyBudget<MemoryStore> {
    let policy = |share| match per_hour {
        Some(n) => Policy::token_bucket(share, n, n, Duration::from_secs(3_600)),
        None => Policy::token_bucket(share, 1_000_000, 1_000_000, Duration::from_secs(1)),
    };
    DependencyBudget::builder(MemoryStore::new(), name)
        .normal(policy("normal").unwrap())
        .retry(policy("retry").unwrap())
        .build()
        .unwrap()
}

/// The mock dependency on a free port; every `fail_every`-th accepted call
/// answers 503.
async fn mock_dependency(fail_every: u64) -> (String, mock::MockHandle) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (router, handle) = mock::router(mock::MockConfig {
        limit: std::num::NonZeroU32::MAX,
        fail_every: std::num::NonZeroU64::new(fail_every),
        ..mock::MockConfig::default()
    });
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, handle)
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, Value) {
    let response = app.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

fn get(uri: &str, key: &str) -> Request<Body> {
    Request::get(uri)
        .header("authorization", format!("Bearer {key}"))
        .body(Body::empty())
        .unwrap()
}

fn post_batch(key: &str, items: usize) -> Request<Body> {
    let item =
        json!({"metric": "latency", "from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z"});
    Request::post("/v1/reports/batch")
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Body::from(
            serde_json::to_vec(&json!({ "items": vec![item; items] })).unwrap(),
        ))
        .unwrap()
}

#[tokio::test]
async fn metrics_parse_as_prometheus_text_and_count_exactly() {
    ensure_parser();
    let exporter = metrics::Exporter::install().unwrap();

    // Quotas: 25 requests of the free plan, 20 admitted and 5 refused by
    // its burst policy; the concurrency gauges are back at 0 after them.
    let (url, _mock) = mock_dependency(0).await;
    let (app, store) = api(&exporter, dependency(&url, budget("roomy", None)));
    let before = scrape(&app).await;
    let mut statuses = Vec::new();
    for _ in 0..25 {
        statuses.push(
            send(&app, get("/v1/reports?page_size=1", "demo-free"))
                .await
                .0,
        );
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == StatusCode::OK).count(),
        20
    );
    let after = scrape(&app).await;
    let decisions = "tower_admission_quota_decisions_total";
    let free = |result| [("quota", "requests-free"), ("result", result)];
    assert_eq!(after.delta(&before, decisions, &free("admitted")), 20.0);
    assert_eq!(after.delta(&before, decisions, &free("refused")), 5.0);
    let burst = [
        ("quota", "requests-free"),
        ("policy", "burst"),
        ("reason", "exhausted"),
    ];
    let refused = "tower_admission_policy_refused_total";
    assert_eq!(after.delta(&before, refused, &burst), 5.0);
    let per_minute = [
        ("quota", "requests-free"),
        ("policy", "per-minute"),
        ("reason", "exhausted"),
    ];
    assert_eq!(after.delta(&before, refused, &per_minute), 0.0);
    // Only admitted requests reach the aggregate and the work quota.
    let all = [("quota", "all-callers"), ("result", "admitted")];
    assert_eq!(after.delta(&before, decisions, &all), 20.0);
    // Keys tracked: alice's request and work keys, and the aggregate key.
    assert_eq!(store.len(), 3);
    let keys = "tower_admission_store_keys";
    assert_eq!(after.get(keys, &[("store", "quotas")]), 3.0);
    assert_eq!(
        after.get("tower_admission_store_max_keys", &[("store", "quotas")]),
        store.capacity() as f64
    );
    for scope in ["global", "identity"] {
        let scope = [("scope", scope)];
        assert_eq!(
            after.get("tower_admission_concurrency_in_flight", &scope),
            0.0
        );
        assert_eq!(after.get("tower_admission_concurrency_queued", &scope), 0.0);
    }
    assert_eq!(
        after.get("tower_admission_concurrency_tracked_identities", &[]),
        0.0
    );
    assert_eq!(after.kind(decisions), Some("counter"));
    assert_eq!(after.kind(keys), Some("gauge"));

    // Dependency: a batch of 10 items is 20 first attempts, none waiting.
    let roomy = [("budget", "roomy")];
    let normal = [("budget", "roomy"), ("share", "normal")];
    let retry = [("budget", "roomy"), ("share", "retry")];
    let attempts = "tower_admission_dependency_attempts_total";
    let waits = "tower_admission_dependency_wait_seconds_count";
    let before = scrape(&app).await;
    let (status, body) = send(&app, post_batch("demo-pro", 10)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let after = scrape(&app).await;
    assert_eq!(after.delta(&before, attempts, &normal), 20.0);
    assert_eq!(after.delta(&before, attempts, &retry), 0.0);
    assert_eq!(after.delta(&before, waits, &roomy), 20.0);
    assert_eq!(
        after.delta(
            &before,
            "tower_admission_dependency_wait_seconds_bucket",
            &[("budget", "roomy"), ("le", "+Inf")]
        ),
        20.0
    );
    assert_eq!(
        after.delta(&before, "tower_admission_dependency_refused_total", &roomy),
        0.0
    );
    assert_eq!(
        after.kind("tower_admission_dependency_wait_seconds_sum"),
        Some("histogram")
    );

    // Retries: every 20th call fails and is retried from the retry share.
    let (url, mock) = mock_dependency(20).await;
    let (app, _) = api(&exporter, dependency(&url, budget("flaky", None)));
    let before = scrape(&app).await;
    let (status, body) = send(&app, post_batch("demo-pro", 50)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let after = scrape(&app).await;
    let retries = body["dependency"]["retries"].as_u64().unwrap();
    assert_eq!(retries, mock.stats().failed);
    assert!(retries >= 5, "100 calls, every 20th failed: {retries}");
    let flaky = |share| [("budget", "flaky"), ("share", share)];
    assert_eq!(after.delta(&before, attempts, &flaky("normal")), 100.0);
    assert_eq!(
        after.delta(&before, attempts, &flaky("retry")),
        retries as f64
    );

    // Refusals: one first attempt an hour; item 1's goes out, item 2's is
    // refused (the hour is past the 2 s the example waits).
    let (app, _) = api(&exporter, dependency(&url, budget("hourly", Some(1))));
    let before = scrape(&app).await;
    let (status, body) = send(&app, post_batch("demo-pro", 2)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let after = scrape(&app).await;
    let hourly = [("budget", "hourly")];
    assert_eq!(
        after.delta(
            &before,
            attempts,
            &[("budget", "hourly"), ("share", "normal")]
        ),
        1.0
    );
    assert_eq!(
        after.delta(&before, "tower_admission_dependency_refused_total", &hourly),
        1.0
    );
    assert_eq!(after.delta(&before, waits, &hourly), 1.0);
}
