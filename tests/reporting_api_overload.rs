//! The sample reporting API as a process against a mock dependency that
//! slows down: `mock_dependency --capacity C --latency-ms 20` serves C calls
//! at once in 20 ms and shares its capacity above that (n in flight each
//! take 20 ms x n / C), so it serves 50 calls per second per unit of
//! capacity however many are sent. Its capacity drops from 8 to 2 (100
//! calls/s, below the 200/s budget, so the budget alone cannot protect it)
//! while free-plan callers (class `sheddable`) flood it with batches and a
//! pro-plan caller (class `critical`) sends batches one after the other.
//!
//! Real processes in real time, so the test asserts bounds that hold in a
//! debug build on a shared machine, never exact latencies; the figures of a
//! release build come from `scripts/overload` (BENCHMARKS.md, "Overload over
//! the wire"), which runs the same scenario longer, with the limit and
//! without it. Nothing sleeps to wait for a condition: readiness and the end
//! of the first baseline probe are polled with a deadline; the load runs for
//! fixed windows.

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::Client;
use serde_json::{json, Value};
use support::process::{metrics_text, mock_dependency, reporting_api, Served};
use support::TempDir;

const FREE: [&str; 2] = ["demo-free", "demo-globex"]; // alice (acme), carol (globex): free
const PRO: &str = "demo-pro"; // bob: pro

/// Batch loops per free caller (the per-identity cap admits 4 at once).
const FLOOD_LOOPS: usize = 4;
/// Items per free batch: 5 at once each, so 2 x 4 x 5 = 40 calls offered at
/// once, 20 times the capacity of 2.
const FLOOD_ITEMS: usize = 10;
/// Items per pro batch: 2 calls each, one after the other, 4 per batch.
const PRO_ITEMS: usize = 2;

/// The shipped configuration with quotas that never refuse this load, so
/// that only the dependency's limit decides, the limit's `mode`, and with
/// `classes` false every plan of class `default`.
fn config(dir: &TempDir, mode: &str, classes: bool) -> PathBuf {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/reporting_api/reporting.toml"
    );
    let mut text = std::fs::read_to_string(path).expect("read reporting.toml");
    let roomy = [
        ("limit = 100, window", "limit = 1000000, window"),
        (
            "capacity = 20, refill = 100,",
            "capacity = 1000000, refill = 1000000,",
        ),
        ("limit = 2000, window", "limit = 100000000, window"),
        ("limit = 1000, window", "limit = 1000000, window"),
        (
            "capacity = 100, refill = 1000,",
            "capacity = 1000000, refill = 1000000,",
        ),
        ("limit = 20000, window", "limit = 100000000, window"),
        (
            "capacity = 500, refill = 250,",
            "capacity = 1000000, refill = 1000000,",
        ),
        ("mode = \"adaptive\"", &format!("mode = \"{mode}\"")),
    ];
    let one_class = [
        ("class = \"sheddable\"", "class = \"default\""),
        ("class = \"critical\"", "class = \"default\""),
    ];
    let edits = roomy
        .iter()
        .chain(if classes { &[][..] } else { &one_class[..] });
    for (from, to) in edits {
        assert_eq!(text.matches(from).count(), 1, "reporting.toml: {from:?}");
        text = text.replace(from, to);
    }
    let copy = dir.path().join("reporting.toml");
    std::fs::write(&copy, text).expect("write the config copy");
    copy
}

fn client() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("a reqwest client")
}

async fn json(client: &Client, method: reqwest::Method, url: String, body: Option<Value>) -> Value {
    let mut request = client.request(method, &url);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let status = response.status();
    let text = response.text().await.expect("a body");
    assert!(status.is_success(), "{url}: {status} {text}");
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

/// `GET /metrics`: every sample of the `tower_admission_concurrency_*`
/// series of scope `dependency`, keyed `name{label=value,...}` with the
/// labels sorted (scope left out).
async fn dependency_metrics(client: &Client, api: &Served) -> BTreeMap<String, f64> {
    let text = metrics_text(client, &api.url)
        .await
        .expect("GET /metrics and its text");
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Some((name, labels)) = series.split_once('{') else {
            continue;
        };
        if !name.starts_with("tower_admission_concurrency_") {
            continue;
        }
        let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
        if !labels.contains(&"scope=\"dependency\"") {
            continue;
        }
        labels.retain(|l| !l.starts_with("scope="));
        labels.sort_unstable();
        let key = format!("{name}{{{}}}", labels.join(",").replace('"', ""));
        samples.insert(key, value.parse().expect("a number"));
    }
    samples
}

/// Shed calls of `class`, every reason.
fn shed(metrics: &BTreeMap<String, f64>, class: &str) -> f64 {
    metrics
        .iter()
        .filter(|(k, _)| {
            k.starts_with("tower_admission_concurrency_shed_total{")
                && k.contains(&format!("class={class},"))
        })
        .map(|(_, v)| v)
        .sum()
}

/// What the batches of one class got.
#[derive(Debug, Default, Clone)]
struct Outcomes {
    /// Batches answered 200.
    ok: u64,
    /// Batches answered the overload 503 of the dependency's limit.
    shed: u64,
    /// Anything else, each with its answer.
    other: Vec<String>,
    /// Retries reported by every batch answer.
    retries: u64,
}

/// Sends batches of `items` as `key`, one after the other, until `stop`.
async fn batch_loop(
    client: Client,
    url: String,
    key: &'static str,
    items: usize,
    stop: Arc<AtomicBool>,
) -> Outcomes {
    let item =
        json!({"metric": "latency", "from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z"});
    let body = json!({ "items": vec![item; items] });
    let mut outcomes = Outcomes::default();
    while !stop.load(Ordering::Relaxed) {
        let response = client
            .post(format!("{url}/v1/reports/batch"))
            .bearer_auth(key)
            .json(&body)
            .send()
            .await
            .expect("a batch answer");
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        outcomes.retries += answer["dependency"]["retries"].as_u64().unwrap_or(0);
        let overloaded = answer["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("overloaded"));
        match status {
            200 => outcomes.ok += 1,
            503 if overloaded && retry_after.is_some_and(|s| s >= 1) => outcomes.shed += 1,
            _ => outcomes
                .other
                .push(format!("{status} retry-after {retry_after:?}: {answer}")),
        }
    }
    outcomes
}

/// The figures of one run.
#[derive(Debug)]
struct Figures {
    /// The dependency's p50 and p99 latency of answered calls, ms.
    p50_ms: u64,
    p99_ms: u64,
    /// Calls it answered per second.
    goodput: f64,
    /// The most calls in flight at the dependency at once.
    max_concurrent: u64,
    /// The limit on /metrics at the end of the window.
    limit: f64,
    free: Outcomes,
    pro: Outcomes,
    /// `/metrics` before any traffic and at the end.
    before: BTreeMap<String, f64>,
    after: BTreeMap<String, f64>,
}

/// The scenario: a mock of capacity 8 and 20 ms; the flood and the pro loop
/// start; after `warm` its capacity drops to 2; after `settle` more, its
/// counts are reset and measured for `window`.
async fn run(
    mode: &str,
    classes: bool,
    warm: Duration,
    settle: Duration,
    window: Duration,
) -> Figures {
    let dir = TempDir::new("overload");
    let mock =
        mock_dependency(&["--capacity", "8", "--latency-ms", "20", "--limit", "100000"]).await;
    let args = vec![
        "--config".to_owned(),
        config(&dir, mode, classes).display().to_string(),
        "--dependency-url".to_owned(),
        mock.url.clone(),
    ];
    let api = reporting_api(&args).await;
    let client = client();
    let before = dependency_metrics(&client, &api).await;

    let stop = Arc::new(AtomicBool::new(false));
    let mut flood = Vec::new();
    for key in FREE {
        for _ in 0..FLOOD_LOOPS {
            let run = batch_loop(
                client.clone(),
                api.url.clone(),
                key,
                FLOOD_ITEMS,
                stop.clone(),
            );
            flood.push(tokio::spawn(run));
        }
    }
    let pro = tokio::spawn(batch_loop(
        client.clone(),
        api.url.clone(),
        PRO,
        PRO_ITEMS,
        stop.clone(),
    ));
    tokio::time::sleep(warm).await;
    json(
        &client,
        reqwest::Method::POST,
        format!("{}/config", mock.url),
        Some(json!({"capacity": 2})),
    )
    .await;
    tokio::time::sleep(settle).await;
    let reset = reqwest::Method::POST;
    client
        .request(reset, format!("{}/stats/reset", mock.url))
        .send()
        .await
        .expect("reset the mock's counts");
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let stats = json(
        &client,
        reqwest::Method::GET,
        format!("{}/stats", mock.url),
        None,
    )
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    let after = dependency_metrics(&client, &api).await;
    stop.store(true, Ordering::Relaxed);
    let mut free = Outcomes::default();
    for task in flood {
        let o = task.await.expect("a flood loop");
        free.ok += o.ok;
        free.shed += o.shed;
        free.retries += o.retries;
        free.other.extend(o.other);
    }
    let pro = pro.await.expect("the pro loop");
    let count = |field: &str| {
        stats[field]
            .as_u64()
            .unwrap_or_else(|| panic!("{field}: {stats}"))
    };
    let answered = count("total") - count("rejected") - count("failed");
    Figures {
        p50_ms: count("p50_ms"),
        p99_ms: count("p99_ms"),
        goodput: answered as f64 / elapsed,
        max_concurrent: count("max_concurrent"),
        limit: after
            .get("tower_admission_concurrency_limit{}")
            .copied()
            .unwrap_or(f64::NAN),
        free,
        pro,
        before,
        after,
    }
}

/// The window of the measured part: `OVERLOAD_SECONDS` (scripts/overload)
/// or 3 s.
fn window() -> Duration {
    let seconds = std::env::var("OVERLOAD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    Duration::from_secs(seconds)
}

fn report(mode: &str, f: &Figures) {
    let ms = |name: &str| {
        f.after
            .get(&format!("tower_admission_concurrency_{name}{{}}"))
            .map_or(f64::NAN, |s| s * 1000.0)
    };
    println!(
        "overload mode={mode}: dependency p50 {} ms, p99 {} ms, {:.1} answered/s, \
         at most {} in flight; limit {} \
         (baseline {:.1} ms, latency {:.1} ms); pro batches ok {} shed {} other {}; \
         free batches ok {} shed {} other {}; retries {}",
        f.p50_ms,
        f.p99_ms,
        f.goodput,
        f.max_concurrent,
        f.limit,
        ms("baseline_latency_seconds"),
        ms("latency_seconds"),
        f.pro.ok,
        f.pro.shed,
        f.pro.other.len(),
        f.free.ok,
        f.free.shed,
        f.free.other.len(),
        f.free.retries + f.pro.retries,
    );
}

/// With the adaptive limit, the slowed dependency's p99 stays bounded
/// while it serves most of its 100 calls per second; the free plan's
/// sheddable calls are refused (503 with Retry-After, never retried) and
/// the pro plan's critical ones never; and every series is on `/metrics`
/// at 0 before any traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowed_dependency_keeps_its_latency_and_sheds_free_work_first() {
    let f = run(
        "adaptive",
        true,
        Duration::from_millis(1500),
        Duration::from_millis(1500),
        window(),
    )
    .await;
    report("adaptive", &f);

    // Before any traffic: the probe's limit of 3, and every other series,
    // each class and each reason, at 0.
    let mut zero: Vec<String> = [
        "baseline_latency_seconds",
        "latency_seconds",
        "in_flight",
        "queued",
    ]
    .iter()
    .map(|name| format!("tower_admission_concurrency_{name}{{}}"))
    .collect();
    for class in ["critical", "default", "sheddable"] {
        for gauge in ["class_in_flight", "class_queued"] {
            zero.push(format!(
                "tower_admission_concurrency_{gauge}{{class={class}}}"
            ));
        }
        for reason in ["deadline-passed", "queue-full", "tenant-queue-full"] {
            zero.push(format!(
                "tower_admission_concurrency_shed_total{{class={class},reason={reason}}}"
            ));
        }
    }
    let mut expected: BTreeMap<String, f64> = zero.into_iter().map(|k| (k, 0.0)).collect();
    expected.insert("tower_admission_concurrency_limit{}".to_owned(), 3.0);
    assert_eq!(f.before, expected);

    // The slowed dependency: p99 within 7.5 times its base latency, serving
    // at least half its capacity. A bound for a debug build on a loaded
    // machine, whose timers run late; the release figures on a quiet one are
    // in BENCHMARKS.md. Without the limit the same run's p50 is about 400 ms
    // (the 40 calls offered share the capacity of 2).
    assert!(f.p99_ms <= 150, "{f:?}");
    assert!(f.goodput >= 50.0, "{f:?}");
    assert!(f.limit >= 1.0 && f.limit <= 8.0, "{f:?}");
    // Critical work is never refused; sheddable work is, with 503 and
    // Retry-After, and no refusal was retried.
    assert!(f.pro.other.is_empty() && f.free.other.is_empty(), "{f:?}");
    assert_eq!(f.pro.shed, 0, "{f:?}");
    assert!(f.pro.ok >= 5, "{f:?}");
    assert!(f.free.shed >= 1, "{f:?}");
    assert_eq!(f.free.retries + f.pro.retries, 0, "{f:?}");
    assert_eq!(shed(&f.after, "critical"), 0.0, "{f:?}");
    assert_eq!(shed(&f.after, "default"), 0.0, "{f:?}");
    // Each shed batch had at least one call refused.
    assert!(shed(&f.after, "sheddable") >= f.free.shed as f64, "{f:?}");
    assert!(f.after["tower_admission_concurrency_baseline_latency_seconds{}"] > 0.0);
}

/// The same scenario without a limit on calls in flight (`mode = "off"`):
/// only a measurement, run by `scripts/overload` for BENCHMARKS.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement for scripts/overload"]
async fn figures_without_a_limit() {
    let f = run(
        "off",
        true,
        Duration::from_millis(1500),
        Duration::from_millis(1500),
        window(),
    )
    .await;
    report("off", &f);
}

/// The adaptive limit with every plan of one class (`default`), so that no
/// share of the limit is reserved: only a measurement, run by
/// `scripts/overload` for BENCHMARKS.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement for scripts/overload"]
async fn figures_with_one_class() {
    let f = run(
        "adaptive",
        false,
        Duration::from_millis(1500),
        Duration::from_millis(1500),
        window(),
    )
    .await;
    report("adaptive, one class", &f);
}
