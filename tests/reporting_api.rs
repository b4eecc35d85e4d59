//! The sample reporting API, end to end through its router.

#[path = "../examples/reporting_api/app.rs"]
#[allow(dead_code, reason = "reloads are tested on the process")]
mod app;
#[path = "../examples/reporting_api/args.rs"]
mod args;
#[path = "../examples/reporting_api/config.rs"]
mod config;
#[path = "../examples/reporting_api/data.rs"]
mod data;
#[path = "../examples/reporting_api/dependency.rs"]
mod dependency;
#[path = "../examples/mock_dependency/mock.rs"]
mod mock;
#[path = "../examples/reporting_api/overload.rs"]
mod overload;
#[path = "../examples/reporting_api/reload.rs"]
#[allow(dead_code, reason = "these tests do not reload")]
mod reload;
// The region flags' parser, which args.rs uses.
#[path = "../examples/reporting_api/regions.rs"]
#[allow(dead_code)]
mod regions;

use std::time::Duration;

use axum::body::Body;
use axum::Router;
use config::Config;
use dependency::Dependency;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;
use tower_admission::clock::ManualClock;
use tower_admission::outbound::DependencyBudget;
use tower_admission::quota::{MemoryStore, Policy};

fn api() -> (Router, ManualClock) {
    // Nothing here reaches the dependency's budget.
    api_with(dependency("http://127.0.0.1:1", roomy_budget()))
}

fn api_with(dependency: Dependency) -> (Router, ManualClock) {
    api_of(&Config::builtin(), dependency)
}

fn api_of(config: &Config, dependency: Dependency) -> (Router, ManualClock) {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock.clone());
    (app::app(config, store, dependency).unwrap().router, clock)
}

/// The dependency at `url` through `budget`, as the built-in config says.
fn dependency<Bu: tower_admission::outbound::AttemptBudget>(url: &str, budget: Bu) -> Dependency {
    let config = Config::builtin();
    Dependency::new(url, budget, &config.dependency, config.batch.active_items).unwrap()
}

/// A budget that never refuses these tests' calls.
fn roomy_budget() -> DependencyBudget<MemoryStore> {
    let policy = |name| Policy::token_bucket(name, 1_000_000, 1_000_000, Duration::from_secs(1));
    DependencyBudget::builder(MemoryStore::new(), "dependency")
        .normal(policy("normal").unwrap())
        .retry(policy("retry").unwrap())
        .build()
        .unwrap()
}

/// The mock dependency (300/s) on a free loopback port.
async fn mock_dependency(fail_every: u64) -> (String, mock::MockHandle) {
    serve_mock(mock::MockConfig {
        fail_every: std::num::NonZeroU64::new(fail_every),
        ..mock::MockConfig::default()
    })
    .await
}

/// A mock that never answers 429, for tests that send many batches.
async fn roomy_mock() -> (String, mock::MockHandle) {
    serve_mock(mock::MockConfig {
        limit: std::num::NonZeroU32::MAX,
        ..mock::MockConfig::default()
    })
    .await
}

async fn serve_mock(config: mock::MockConfig) -> (String, mock::MockHandle) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (router, handle) = mock::router(config);
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, handle)
}

fn get(uri: &str, key: Option<&str>) -> Request<Body> {
    let mut builder = Request::builder().uri(uri);
    if let Some(key) = key {
        builder = builder.header("authorization", format!("Bearer {key}"));
    }
    builder.body(Body::empty()).unwrap()
}

fn post_batch(key: &str, items: usize) -> Request<Body> {
    let item =
        json!({"metric": "latency", "from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z"});
    let body = json!({ "items": vec![item; items] });
    Request::post("/v1/reports/batch")
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(&body).unwrap()))
        .unwrap()
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, http::HeaderMap, Value) {
    let response = app.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        headers,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test]
async fn health_needs_no_key_and_reports_need_one() {
    let (app, _) = api();
    assert_eq!(send(&app, get("/healthz", None)).await.0, StatusCode::OK);
    let (status, headers, body) = send(&app, get("/v1/reports", None)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(body["status"], 401);
    assert_eq!(
        send(&app, get("/v1/reports", Some("demo-nobody"))).await.0,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn free_plan_bursts_20_then_429_with_retry_after() {
    let (app, clock) = api();
    let mut statuses = Vec::new();
    for _ in 0..25 {
        let (status, headers, body) =
            send(&app, get("/v1/reports?page_size=1", Some("demo-free"))).await;
        if status == StatusCode::TOO_MANY_REQUESTS {
            // One token every 600 ms: the exact wait rounds up to 1 s.
            assert_eq!(headers["retry-after"], "1");
            assert_eq!(body["policies"], json!(["burst"]));
        }
        statuses.push(status.as_u16());
    }
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 20);
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 5);
    // Another user, another quota; a spoofed header changes nothing.
    let mut req = get("/v1/reports?page_size=1", Some("demo-globex"));
    req.headers_mut()
        .insert("x-user-id", "alice".parse().unwrap());
    assert_eq!(send(&app, req).await.0, StatusCode::OK);
    let mut req = get("/v1/reports?page_size=1", Some("demo-free"));
    req.headers_mut()
        .insert("x-user-id", "carol".parse().unwrap());
    assert_eq!(send(&app, req).await.0, StatusCode::TOO_MANY_REQUESTS);
    // 600 ms later one more token has arrived.
    clock.advance(Duration::from_millis(600));
    assert_eq!(
        send(&app, get("/v1/reports?page_size=1", Some("demo-free")))
            .await
            .0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn reports_page_is_validated() {
    let (app, _) = api();
    let (status, _, body) = send(&app, get("/v1/reports", Some("demo-pro"))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["page_size"], 20);
    assert_eq!(body["rows"].as_array().unwrap().len(), 20);
    for (query, param) in [
        ("page_size=0", "page_size"),
        ("page_size=101", "page_size"),
        ("page_size=-1", "page_size"),
        ("page_size=99999999999999999999", "page_size"),
        ("page_size=abc", "page_size"),
        ("page_size=5&page_size=6", "page_size"),
        ("from=2026-02-01T00:00:00Z&to=2026-01-01T00:00:00Z", "to"),
        ("from=2026-01-01T00:00:00Z&to=2026-03-01T00:00:00Z", "to"),
        ("from=yesterday&to=2026-01-01T00:00:00Z", "from"),
        // Not a parameter of this route: refused, not silently ignored.
        ("metric=latency", "metric"),
    ] {
        let (status, _, body) =
            send(&app, get(&format!("/v1/reports?{query}"), Some("demo-pro"))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}");
        let names: Vec<&str> = body["errors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert!(names.contains(&param), "{query}: {names:?}");
    }
}

#[tokio::test]
async fn a_batch_of_100_makes_exactly_200_dependency_calls_5_items_at_a_time() {
    let (url, mock) = mock_dependency(0).await;
    let (app, _) = api_with(dependency(&url, roomy_budget()));
    let (status, _, body) = send(&app, post_batch("demo-pro", 100)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["dependency"], json!({"attempts": 200, "retries": 0}));
    let stats = mock.stats();
    assert_eq!(stats.total, 200, "two calls per item");
    assert!(
        (2..=5).contains(&stats.max_concurrent),
        "at most 5 items, one call each, in flight: {}",
        stats.max_concurrent
    );
}

#[tokio::test]
async fn failed_calls_are_retried_and_every_attempt_is_counted() {
    // Every 20th accepted arrival answers 503.
    let (url, mock) = mock_dependency(20).await;
    let budget = roomy_budget();
    let (app, _) = api_with(dependency(&url, budget.clone()));
    let (status, _, body) = send(&app, post_batch("demo-pro", 100)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let stats = mock.stats();
    let (attempts, retries) = (
        body["dependency"]["attempts"].as_u64().unwrap(),
        body["dependency"]["retries"].as_u64().unwrap(),
    );
    assert_eq!(
        attempts, stats.total,
        "the answer counts what the dependency saw"
    );
    assert_eq!(
        retries, stats.failed,
        "every injected failure was retried once"
    );
    assert!(retries >= 10, "200 calls, every 20th failed: {retries}");
    assert_eq!(attempts, 200 + retries);
    // Retries drew on the retry share.
    let counts = budget.stats();
    assert_eq!((counts.normal, counts.retry), (200, retries));
}

#[tokio::test]
async fn an_exhausted_dependency_budget_answers_503_with_retry_after() {
    let (url, mock) = mock_dependency(0).await;
    // One first attempt, then one an hour: far past the 2 s the example waits.
    let hourly = |name| Policy::token_bucket(name, 1, 1, Duration::from_secs(3_600)).unwrap();
    let budget = DependencyBudget::builder(MemoryStore::new(), "dependency")
        .normal(hourly("normal"))
        .retry(hourly("retry"))
        .build()
        .unwrap();
    let (app, _) = api_with(dependency(&url, budget));
    let (status, headers, body) = send(&app, post_batch("demo-pro", 2)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(headers["retry-after"], "3600");
    assert_eq!(body["retry_after"], 3600);
    assert_eq!(
        body["type"],
        "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
    );
    assert_eq!(body["status"], 503);
    // Item 1's first call went out; item 2's was refused, so no item started
    // another call.
    assert_eq!(body["dependency"], json!({"attempts": 1, "retries": 0}));
    assert_eq!(mock.stats().total, 1);
}

#[tokio::test]
async fn batches_answer_200_202_or_413_by_size() {
    let (url, _mock) = roomy_mock().await;
    let (app, clock) = api_with(dependency(&url, roomy_budget()));
    let (status, _, body) = send(&app, post_batch("demo-pro", 100)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["items"].as_array().unwrap().len(), 100);

    let (status, headers, _) = send(&app, post_batch("demo-pro", 101)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let location = headers["location"].to_str().unwrap().to_owned();
    assert!(location.starts_with("/v1/jobs/"));

    let (status, _, body) = send(&app, post_batch("demo-pro", 1001)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body["cap"], "items");
    assert_eq!(body["limit"], 1000);

    // The job is visible to its owner only. It makes 202 calls over
    // loopback; each look at it moves the quota clock a minute on, so the
    // looks never run out of quota.
    let mut status = json!(null);
    for _ in 0..100_000 {
        clock.advance(Duration::from_secs(60));
        let (code, _, body) = send(&app, get(&location, Some("demo-pro"))).await;
        assert_eq!(code, StatusCode::OK);
        status = body;
        if status["status"] == "succeeded" {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(status["status"], "succeeded");
    assert_eq!(status["items"].as_array().unwrap().len(), 101);
    assert_eq!(
        send(&app, get(&location, Some("demo-free"))).await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        send(&app, get("/v1/jobs/not-a-job", Some("demo-pro")))
            .await
            .0,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn batch_items_are_charged_to_the_work_quota() {
    let (url, _mock) = roomy_mock().await;
    // Room for every job of the user, so the work quota alone refuses.
    let config = Config::parse(&edited("jobs_per_user = 4", "jobs_per_user = 20")).unwrap();
    let (app, _) = api_of(&config, dependency(&url, roomy_budget()));
    // The free work quota is 2,000 units per minute, one per item: 13 batches
    // of 150 use 1,950, and the 14th (2,100) is refused by that policy alone.
    for _ in 0..13 {
        assert_eq!(
            send(&app, post_batch("demo-free", 150)).await.0,
            StatusCode::ACCEPTED
        );
    }
    let (status, headers, body) = send(&app, post_batch("demo-free", 150)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // The work quota's fields, and the request quota's added by its layer.
    let policies: Vec<&str> = headers
        .get_all("ratelimit-policy")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert_eq!(
        policies,
        [
            "\"units-per-minute\";q=2000;w=60",
            "\"per-minute\";q=100;w=60, \"burst\";q=20;w=12"
        ]
    );
    assert_eq!(body["policies"], json!(["units-per-minute"]));
    // 50 units are left: a batch of 50 still fits.
    assert_eq!(
        send(&app, post_batch("demo-free", 50)).await.0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn wire_cap_is_one_mib() {
    let (app, _) = api();
    let req = Request::post("/v1/reports/batch")
        .header("authorization", "Bearer demo-pro")
        .header("content-type", "application/json")
        .body(Body::from(vec![b' '; 2 << 20]))
        .unwrap();
    let (status, _, body) = send(&app, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body["cap"], "wire-bytes");
}

#[cfg(feature = "redis")]
mod support;

/// The example on Redis (`--redis URL`): two instances share one quota.
#[cfg(feature = "redis")]
mod on_redis {
    use super::*;
    use tower_admission::quota::RedisStore;

    use crate::support;

    #[tokio::test]
    async fn two_instances_share_the_free_burst_of_20() {
        let server = support::RedisServer::start();
        let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
        let instance = || {
            let store = RedisStore::builder(server.url())
                .prefix("reporting-api")
                .test_clock(clock.clone())
                .build()
                .unwrap();
            let dependency = dependency("http://127.0.0.1:1", roomy_budget());
            app::app(&Config::builtin(), store, dependency)
                .unwrap()
                .router
        };
        let (a, b) = (instance(), instance());
        let mut admitted = 0;
        for i in 0..30 {
            let app = if i % 2 == 0 { &a } else { &b };
            let (status, _, _) = send(app, get("/v1/reports?page_size=1", Some("demo-free"))).await;
            admitted += usize::from(status == StatusCode::OK);
        }
        assert_eq!(admitted, 20);
        // Every quota of the request lives in Redis, under one hash tag per
        // quota and key (a quota with a log or weighted window keeps its
        // expiry in `:x` too), and every key expires.
        let keys = server.cli(&["--scan", "--pattern", "reporting-api:*"]);
        let mut keys: Vec<&str> = keys.lines().collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "reporting-api:{all-callers:*}:0:tb",
                "reporting-api:{requests-free:alice}:0:sl",
                "reporting-api:{requests-free:alice}:1:tb",
                "reporting-api:{requests-free:alice}:x",
                "reporting-api:{work-free:alice}:0:sw",
                "reporting-api:{work-free:alice}:x",
            ]
        );
        for key in keys {
            let ttl: i64 = server.cli(&["pttl", key]).trim().parse().unwrap();
            assert!(ttl > 0, "{key} has no expiry");
        }
    }
}

#[tokio::test]
async fn the_single_instance_budget_is_200_plus_40_per_second_with_25_ms_bursts() {
    use tower_admission::outbound::Attempt;
    let budget = dependency::memory_budget(&Config::builtin().dependency).unwrap();
    let mut admitted = [0; 2];
    for (i, share) in [Attempt::FIRST, Attempt::FIRST.next()]
        .into_iter()
        .enumerate()
    {
        while budget.try_acquire(share, 1).await.is_ok() {
            admitted[i] += 1;
        }
    }
    // At one instant: the bursts, 200/s × 25 ms and 40/s × 25 ms.
    assert_eq!(admitted, [5, 1]);
}

// ---------------------------------------------------------------------------
// The config file.
// ---------------------------------------------------------------------------

const SHIPPED: &str = "examples/reporting_api/reporting.toml";

#[test]
fn the_built_in_defaults_are_the_shipped_file() {
    let shipped = Config::load(std::path::Path::new(SHIPPED)).unwrap();
    assert_eq!(Config::builtin(), shipped);
    // The article's numbers: 100 per minute, bursts of 20.
    let free = &shipped.plans["free"].policies;
    assert_eq!(
        free[0],
        config::PolicySpec::SlidingLog {
            name: "per-minute".into(),
            limit: 100,
            window: config::Span(Duration::from_secs(60)),
        }
    );
    assert_eq!(
        free[1],
        config::PolicySpec::TokenBucket {
            name: "burst".into(),
            capacity: 20,
            refill: 100,
            period: config::Span(Duration::from_secs(60)),
        }
    );
    assert_eq!(
        (
            shipped.dependency.normal_per_second,
            shipped.dependency.retry_per_second
        ),
        (200, 40)
    );
    assert_eq!(shipped.batch.active_items, 5);
}

/// The shipped file with `from` replaced by `to` (exactly once).
fn edited(from: &str, to: &str) -> String {
    let text = std::fs::read_to_string(SHIPPED).unwrap();
    assert_eq!(text.matches(from).count(), 1, "{from:?} must occur once");
    text.replace(from, to)
}

#[test]
fn a_broken_file_is_refused_with_its_key_path_and_reason() {
    let cases = [
        (
            ("capacity = 20, refill = 100", "capacity = 20, refill = 0"),
            "plans.free.policies[1].refill: must be at least 1",
        ),
        (
            (
                "\"sliding_log\", limit = 100,",
                "\"leaky_bucket\", limit = 100,",
            ),
            "plans.free.policies[0].algorithm: unknown variant `leaky_bucket`, expected one of",
        ),
        (
            ("max_page_size = 100", "max_page_size = \"lots\""),
            "query.max_page_size: invalid type: string \"lots\", expected u32",
        ),
        (
            ("job_retention = \"10m\"", "job_retention = \"10 minutes\""),
            "batch.job_retention: \"10 minutes\": the unit must be ms, s, m, h or d",
        ),
        (
            ("plan = \"pro\"", "plan = \"gold\""),
            "keys[1].plan: no plan named \"gold\"",
        ),
        (
            (
                "default_plan = \"free\"",
                "default_plan = \"free\"\nlisten = 1",
            ),
            "listen: unknown field `listen`, expected one of `default_plan`",
        ),
        (
            ("per_identity = { limit = 4,", "per_identity = { limit = 0,"),
            "concurrency.per_identity",
        ),
        // A plan's class and the limit on dependency calls, by their keys.
        (
            ("class = \"sheddable\"", "class = \"urgent\""),
            "plans.free.class: unknown variant `urgent`, expected one of `sheddable`, `default`, `critical`",
        ),
        (
            ("mode = \"adaptive\"", "mode = \"auto\""),
            "dependency.concurrency.mode: unknown variant `auto`",
        ),
        (
            ("floor = 1\n", "floor = 0\n"),
            "dependency.concurrency.floor: must be at least 1",
        ),
        (
            ("ceiling = 64", "ceiling = 0"),
            "dependency.concurrency.ceiling: must be at least the floor",
        ),
        (
            ("tolerance = 0.5", "tolerance = -1"),
            "dependency.concurrency.tolerance: must be in [0, 10]",
        ),
    ];
    for ((from, to), expected) in cases {
        let error = Config::parse(&edited(from, to)).unwrap_err().to_string();
        assert!(
            error.starts_with(expected),
            "{from:?} -> {to:?}: got {error:?}, expected it to start with {expected:?}"
        );
    }
    // From a file, the message starts with the file's name and the line.
    let line = std::fs::read_to_string(SHIPPED)
        .unwrap()
        .lines()
        .position(|l| l.contains("capacity = 20, refill = 100"))
        .unwrap()
        + 1;
    let dir = std::env::temp_dir().join(format!("reporting-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("broken.toml");
    std::fs::write(
        &path,
        edited("capacity = 20, refill = 100", "capacity = 20, refill = 0"),
    )
    .unwrap();
    let error = Config::load(&path).unwrap_err();
    assert_eq!(
        error,
        format!(
            "{}:{line}: plans.free.policies[1].refill: must be at least 1",
            path.display()
        )
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn clashing_or_unsendable_keys_bad_caps_and_fractions_are_refused_clearly() {
    let cases = [
        // A second entry of one key would silently take the first's place.
        (
            ("key = \"demo-pro\"", "key = \"demo-free\""),
            "keys[1].key: the same key as keys[0]",
        ),
        // One subject is one user: its quotas, caps and jobs are shared.
        (
            ("subject = \"carol\"", "subject = \"alice\""),
            "keys[2].subject: \"alice\" is keys[0]'s subject with another tenant or plan",
        ),
        // `Authorization: Bearer ` cannot carry these, so they never match.
        (
            ("key = \"demo-pro\"", "key = \"\""),
            "keys[1].key: must be 1 or more visible ASCII characters (! to ~)",
        ),
        (
            ("key = \"demo-pro\"", "key = \"demo pro\""),
            "keys[1].key: must be 1 or more visible ASCII characters (! to ~)",
        ),
        (
            ("subject = \"bob\"", "subject = \"\""),
            "keys[1].subject: must not be empty",
        ),
        // `Bearer ` and the key must fit the 4096 bytes of header read.
        (
            ("key = \"demo-pro\"", &format!("key = \"{}\"", "k".repeat(4090))),
            "keys[1].key: is 4090 bytes; a request can present at most 4089 \
             (an Authorization header is read up to 4096)",
        ),
        // The key path once, then the reason.
        (
            ("per_identity = { limit = 4,", "per_identity = { limit = 0,"),
            "concurrency.per_identity.limit: must be at least 1",
        ),
        (
            (
                "name = \"burst\", algorithm = \"token_bucket\", capacity = 20",
                "name = \"per-minute\", algorithm = \"token_bucket\", capacity = 20",
            ),
            "plans.free.policies: policy name \"per-minute\" is used twice",
        ),
        // A fraction is not a unit the file does not know.
        (
            ("deadline = \"500ms\"", "deadline = \"1.5s\""),
            "concurrency.global.deadline: \"1.5s\": use a whole number with its unit, e.g. \"1500ms\" for 1.5 s",
        ),
    ];
    for ((from, to), expected) in cases {
        let error = Config::parse(&edited(from, to)).unwrap_err().to_string();
        assert_eq!(error, expected, "{from:?} -> {to:?}");
    }
    // Two keys of one user (a key being rotated) are fine.
    let rotated = edited(
        "key = \"demo-pro\"\nsubject = \"bob\"\ntenant = \"acme\"\nplan = \"pro\"",
        "key = \"demo-pro\"\nsubject = \"bob\"\ntenant = \"acme\"\nplan = \"pro\"\n\n\
         [[keys]]\nkey = \"demo-pro-2\"\nsubject = \"bob\"\ntenant = \"acme\"\nplan = \"pro\"",
    );
    assert_eq!(Config::parse(&rotated).map(|c| c.keys.len()), Ok(4));
}

#[tokio::test]
async fn a_changed_free_burst_changes_the_burst_admitted() {
    let config = Config::parse(&edited(
        "capacity = 20, refill = 100",
        "capacity = 7, refill = 100",
    ))
    .unwrap();
    let (app, _) = api_of(&config, dependency("http://127.0.0.1:1", roomy_budget()));
    let mut admitted = 0;
    for _ in 0..25 {
        let (status, _, _) = send(&app, get("/v1/reports?page_size=1", Some("demo-free"))).await;
        admitted += usize::from(status == StatusCode::OK);
    }
    assert_eq!(admitted, 7);
}

#[tokio::test]
async fn a_drain_waits_for_every_accepted_job_and_takes_no_more() {
    let (url, mock) = roomy_mock().await;
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock.clone());
    let api = app::app(&Config::builtin(), store, dependency(&url, roomy_budget())).unwrap();
    let (status, headers, _) = send(&api.router, post_batch("demo-pro", 150)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let location = headers["location"].to_str().unwrap().to_owned();
    api.drain().await;
    assert_eq!(
        mock.stats().total,
        300,
        "the job made all its calls before the drain ended"
    );
    let (status, _, body) = send(&api.router, get(&location, Some("demo-pro"))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["status"], "succeeded");
    let (status, headers, _) = send(&api.router, post_batch("demo-pro", 150)).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "no job is taken after a drain"
    );
    assert!(headers.contains_key("retry-after"));
}

#[tokio::test]
async fn unknown_routes_methods_and_media_types_are_problems() {
    let (app, _) = api();
    let (status, headers, body) = send(&app, get("/nope", Some("demo-pro"))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(body["status"], 404);
    let req = Request::delete("/v1/reports")
        .header("authorization", "Bearer demo-pro")
        .body(Body::empty())
        .unwrap();
    let (status, headers, body) = send(&app, req).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(body["status"], 405);
    let req = Request::post("/v1/reports/batch")
        .header("authorization", "Bearer demo-pro")
        .header("content-type", "text/plain")
        .body(Body::from("{\"items\":[]}"))
        .unwrap();
    let (status, headers, body) = send(&app, req).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(body["status"], 415);
    let req = Request::post("/v1/reports/batch")
        .header("authorization", "Bearer demo-pro")
        .header("content-type", "application/json")
        .body(Body::from("{\"items\": [1,"))
        .unwrap();
    let (status, headers, _) = send(&app, req).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(headers["content-type"], "application/problem+json");
}

/// `GET /v1/reports` on `range` from `cursor`: status, rows and next cursor.
async fn report_page(app: &Router, query: &str) -> (StatusCode, usize, Value) {
    let (status, _, body) = send(app, get(&format!("/v1/reports?{query}"), Some("demo-pro"))).await;
    let rows = body["rows"].as_array().map_or(0, Vec::len);
    (status, rows, body["next_cursor"].clone())
}

#[tokio::test]
async fn a_cursor_past_the_range_is_an_empty_last_page() {
    let (app, _) = api();
    let range = "page_size=5&from=2026-01-01T00:00:00Z&to=2026-01-02T00:00:00Z";
    // The one-day range has 24 hourly rows: from 20, the last 4.
    let last = report_page(&app, &format!("{range}&cursor=20")).await;
    assert_eq!(last, (StatusCode::OK, 4, Value::Null));
    // At or past the end, however large (2^63 and u64::MAX included): an
    // empty page with no next cursor.
    for cursor in [
        "24",
        "100000000",
        "9223372036854775807",
        "9223372036854775808",
        "18446744073709551615",
    ] {
        let page = report_page(&app, &format!("{range}&cursor={cursor}")).await;
        assert_eq!(page, (StatusCode::OK, 0, Value::Null), "cursor {cursor}");
    }
}

#[tokio::test]
async fn a_cursor_past_u64_is_past_the_end_and_a_garbled_one_is_refused_uncharged() {
    let (app, clock) = api();
    let range = "page_size=5&from=2026-01-01T00:00:00Z&to=2026-01-02T00:00:00Z";
    // Digits beyond u64::MAX are still past the end, not the first page.
    for cursor in ["18446744073709551616", "99999999999999999999999999"] {
        let page = report_page(&app, &format!("{range}&cursor={cursor}")).await;
        assert_eq!(page, (StatusCode::OK, 0, Value::Null), "cursor {cursor}");
    }
    // A cursor this API never gave out is refused with 400 naming it, not
    // answered with the first page again (whose next cursor would loop).
    for cursor in ["abc", "-5", "1e3", "0x10", "%2B5", "5.0"] {
        let uri = format!("/v1/reports?{range}&cursor={cursor}");
        let (status, headers, body) = send(&app, get(&uri, Some("demo-pro"))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "cursor {cursor}: {body}");
        assert_eq!(headers["content-type"], "application/problem+json");
        assert_eq!(body["errors"][0]["name"], "cursor", "{body}");
    }
    // Refused, they keep no work charge: 20 refused pages of 100 rows
    // would use the free plan's 2,000 units, yet a page of 100 still passes.
    let garbled = "/v1/reports?page_size=100&cursor=garbled";
    for _ in 0..20 {
        let (status, _, body) = send(&app, get(garbled, Some("demo-free"))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    }
    // The burst of 20 refills in 12 s; the 60 s work window still counts.
    clock.advance(Duration::from_secs(12));
    let (status, _, body) = send(&app, get("/v1/reports?page_size=100", Some("demo-free"))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["rows"].as_array().map(Vec::len), Some(24));
}

#[tokio::test]
async fn ranges_that_end_in_the_year_9999_are_answered() {
    use time::format_description::well_known::Rfc3339;
    use time::OffsetDateTime;
    let at = |t: &str| OffsetDateTime::parse(t, &Rfc3339).unwrap();
    let (from, to) = (at("9999-12-31T00:00:00Z"), at("9999-12-31T23:30:00Z"));
    // The 25th hour cannot be represented: it ends the range, as `to` does.
    let (rows, next) = data::page("m", from, to, 30, 0);
    assert_eq!((rows.len(), next), (24, None));
    assert_eq!(rows[23].at, "9999-12-31T23:00:00Z");
    assert_eq!(data::page("m", from, to, 30, u64::MAX).0.len(), 0);

    let (app, _) = api();
    let range = "from=9999-12-31T00:00:00Z&to=9999-12-31T23:30:00Z";
    let first = report_page(&app, &format!("page_size=10&{range}")).await;
    assert_eq!(first, (StatusCode::OK, 10, json!("10")));
    let rest = report_page(&app, &format!("page_size=30&{range}&cursor=10")).await;
    assert_eq!(rest, (StatusCode::OK, 14, Value::Null));

    // A batch item over the same range reads its 24 rows.
    let (url, _mock) = roomy_mock().await;
    let (app, _) = api_with(dependency(&url, roomy_budget()));
    let item =
        json!({"metric": "latency", "from": "9999-12-31T00:00:00Z", "to": "9999-12-31T23:30:00Z"});
    let req = Request::post("/v1/reports/batch")
        .header("authorization", "Bearer demo-pro")
        .header("content-type", "application/json")
        .body(Body::from(json!({ "items": [item] }).to_string()))
        .unwrap();
    let (status, _, body) = send(&app, req).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["items"], json!([{"metric": "latency", "rows": 24}]));
}

#[test]
fn job_span_and_dependency_values_are_refused_with_their_key_paths() {
    let cases = [
        (
            ("job_queue = 100", "job_queue = 0"),
            "batch.job_queue: must be at least 1",
        ),
        (
            ("job_workers = 2", "job_workers = 0"),
            "batch.job_workers: must be at least 1",
        ),
        // Each worker is a task spawned at start: 100 million never listen.
        (
            ("job_workers = 2", "job_workers = 100000000"),
            "batch.job_workers: must be at most 1024: each worker is a task spawned at once",
        ),
        (
            ("jobs_per_user = 4", "jobs_per_user = 0"),
            "batch.jobs_per_user: must be at least 1",
        ),
        (
            ("job_retention = \"10m\"", "job_retention = \"0ms\""),
            "batch.job_retention: must be above zero",
        ),
        (
            ("max_span = \"31d\"", "max_span = \"0d\""),
            "query.max_span: must be above zero",
        ),
        (
            ("\ntimeout = \"10s\"", "\ntimeout = \"0s\""),
            "dependency.timeout: must be above zero",
        ),
        (
            (
                "header_read_timeout = \"10s\"",
                "header_read_timeout = \"0s\"",
            ),
            "server.header_read_timeout: must be above zero",
        ),
        (
            ("normal_per_second = 200", "normal_per_second = 10000000001"),
            "dependency.normal_per_second: ",
        ),
        (
            (
                "retry_per_second = 40",
                "retry_per_second = 18446744073709551615",
            ),
            "dependency.retry_per_second: ",
        ),
    ];
    for ((from, to), expected) in cases {
        match Config::parse(&edited(from, to)) {
            Ok(_) => panic!("{to:?} was accepted; expected {expected:?}"),
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.starts_with(expected),
                    "{to:?}: got {e:?}, expected {expected:?}"
                );
            }
        }
    }
}

/// A batch request of `items` for `key`, item `bad` replaced by `with`.
fn batch_with(key: &str, items: usize, bad: usize, with: Value) -> Request<Body> {
    let item =
        json!({"metric": "latency", "from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z"});
    let mut items = vec![item; items];
    items[bad] = with;
    Request::post("/v1/reports/batch")
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Body::from(json!({ "items": items }).to_string()))
        .unwrap()
}

#[tokio::test]
async fn a_batch_refused_for_a_bad_item_keeps_no_work_charge() {
    let (app, _) = api();
    let bad_from = json!({"metric": "latency", "from": "yesterday", "to": "2026-01-02T00:00:00Z"});
    let backwards =
        json!({"metric": "latency", "from": "2026-01-02T00:00:00Z", "to": "2026-01-01T00:00:00Z"});
    // Sync-sized and job-sized batches, each refused 400 with the crate's
    // invalid-parameters problem, naming the item and its field.
    let not_a_time = "not an RFC 3339 time: the 'year' component could not be parsed";
    let refused = [
        (
            batch_with("demo-free", 100, 99, bad_from.clone()),
            "items[99].from",
            not_a_time,
        ),
        (
            batch_with("demo-free", 100, 0, backwards),
            "items[0].to",
            "must be after from, by at most 2678400 s",
        ),
        (
            batch_with("demo-free", 150, 149, bad_from),
            "items[149].from",
            not_a_time,
        ),
    ];
    // The base of the crate's own problem types, as docs/reject.md gives it.
    const PROBLEM_TYPE_BASE: &str =
        "https://docs.rs/tower-admission/latest/tower_admission/reject/";
    let invalid_parameters = format!("{PROBLEM_TYPE_BASE}#invalid-parameters");
    for (req, name, reason) in refused {
        let (status, headers, body) = send(&app, req).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(headers["content-type"], "application/problem+json");
        assert_eq!(body["type"], invalid_parameters.as_str(), "{body}");
        assert_eq!(body["errors"], json!([{"name": name, "reason": reason}]));
    }
    let (status, _, body) = send(&app, batch_with("demo-free", 100, 50, json!(7))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["type"], invalid_parameters.as_str(), "{body}");
    assert_eq!(body["errors"][0]["name"], "items[50]");
    // Not JSON: 415 before anything is read or charged.
    let mut req = post_batch("demo-free", 100);
    req.headers_mut()
        .insert("content-type", http::HeaderValue::from_static("text/plain"));
    assert_eq!(send(&app, req).await.0, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    // The whole 2,000 units of the free work quota are still there.
    for _ in 0..2 {
        let (status, _, body) = send(&app, post_batch("demo-free", 1000)).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let (status, headers, body) = send(&app, post_batch("demo-free", 1)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let left: Vec<&str> = headers
        .get_all("ratelimit")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert!(left[0].starts_with("\"units-per-minute\";r=0;"), "{left:?}");
}

#[tokio::test]
async fn a_batch_refused_by_a_full_job_queue_keeps_no_work_charge() {
    // A dependency that accepts connections and never answers: the first
    // job runs (and waits) for as long as the test does.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let config = Config::parse(
        &edited("job_queue = 100", "job_queue = 1").replace("job_workers = 2", "job_workers = 1"),
    )
    .unwrap();
    let (app, _) = api_of(&config, dependency(&url, roomy_budget()));
    let (status, headers, _) = send(&app, post_batch("demo-free", 500)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let running = headers["location"].to_str().unwrap().to_owned();
    let mut started = false;
    for _ in 0..10 {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        let (_, _, body) = send(&app, get(&running, Some("demo-free"))).await;
        if body["status"] == "running" {
            started = true;
            break;
        }
    }
    assert!(started, "the first job never started");
    // One job waits; 1,000 of the 2,000 free units are charged.
    assert_eq!(
        send(&app, post_batch("demo-free", 500)).await.0,
        StatusCode::ACCEPTED
    );
    // The queue is full: 503, and the charge is given back each time. Were
    // the 600 kept, the first 1,000 would be 429; were that 1,000 kept too,
    // the second would be.
    for items in [600, 1000, 1000] {
        let (status, headers, body) = send(&app, post_batch("demo-free", items)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{items}: {body}");
        // No job has finished, so one is assumed to take 10 s (1,000 items
        // x 2 calls at 200/s); the running one started milliseconds ago.
        assert_eq!(headers["retry-after"], "10");
    }
    drop(silent);
}

#[tokio::test]
async fn a_user_with_jobs_per_user_jobs_gets_429_and_others_still_get_in() {
    // A dependency that never answers: accepted jobs stay waiting or running.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let config = Config::parse(&edited("jobs_per_user = 4", "jobs_per_user = 2")).unwrap();
    let (app, _) = api_of(&config, dependency(&url, roomy_budget()));
    for _ in 0..2 {
        assert_eq!(
            send(&app, post_batch("demo-free", 101)).await.0,
            StatusCode::ACCEPTED
        );
    }
    // 25 refusals, more than the burst of 20: each gives its request and
    // work charges back, so the quotas never refuse in the job cap's place.
    for _ in 0..25 {
        let (status, headers, body) = send(&app, post_batch("demo-free", 101)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
        // alice's running job is assumed to end 10 s after it started.
        assert_eq!(headers["retry-after"], "10");
        assert_eq!(
            headers["ratelimit-policy"],
            "\"jobs-per-owner\";q=2;qu=\"concurrent-requests\""
        );
    }
    // Another user of the same plan is not held back by alice's jobs.
    assert_eq!(
        send(&app, post_batch("demo-globex", 101)).await.0,
        StatusCode::ACCEPTED
    );
    drop(silent);
}

/// A dependency that asks for 30 s is not retried at once (its `Retry-After`
/// is above the retries' 1 s), and the batch's 503 passes the 30 s on.
/// Before, the client dropped the dependency's headers: the retries never
/// saw the wait and sent all 3 attempts at once, and the 503 said 1 s.
#[tokio::test]
async fn a_dependency_asking_for_30_s_is_not_retried_and_its_wait_is_passed_on() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let busy = axum::Router::new().fallback(|| async {
        (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "30")],
            "busy",
        )
    });
    tokio::spawn(async move { axum::serve(listener, busy).await });
    let (app, _) = api_with(dependency(&url, roomy_budget()));
    let (status, headers, body) = send(&app, post_batch("demo-pro", 1)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(headers["retry-after"], "30");
    assert_eq!(body["dependency"], json!({"attempts": 1, "retries": 0}));
}

/// The region flags: whole regions, with `--redis`, or a clear refusal.
#[test]
fn region_flags_describe_whole_regions() {
    let parse = |line: &[&str]| args::parse(line.iter().map(|a| a.to_string()));
    let parsed = parse(&[
        "--redis",
        "redis://127.0.0.1:6380/",
        "--region",
        "eu",
        "--region-redis",
        "eu=redis://127.0.0.1:6381/",
        "--region-share",
        "eu=140",
        "--region-redis",
        "us=redis://127.0.0.1:6382/",
        "--region-share",
        "us=100",
    ])
    .unwrap()
    .unwrap();
    assert_eq!(parsed.regions.name.as_deref(), Some("eu"));
    assert_eq!(
        parsed.regions.shares,
        [("eu".to_owned(), 140), ("us".to_owned(), 100)]
    );
    assert_eq!(parsed.regions.redis[1].1, "redis://127.0.0.1:6382/");
    assert_eq!(
        parse(&["--region", "eu"]),
        Err("--region \"eu\" is not among the --region-redis regions".to_owned())
    );
    assert_eq!(
        parse(&["--region-share", "eu=x"]),
        Err("--region-share \"eu=x\": the share must be a whole number".to_owned())
    );
    assert_eq!(
        parse(&["--region-redis", "eu"]),
        Err(
            "--region-redis \"eu\": expected NAME=VALUE, e.g. eu=redis://10.0.0.1:6379/".to_owned()
        )
    );
    assert_eq!(
        parse(&[
            "--region",
            "eu",
            "--region-redis",
            "eu=redis://h/",
            "--region-share",
            "eu=1"
        ]),
        Err("--region needs --redis: the regions share one budget through Redis".to_owned())
    );
}

/// Flags that only shape the fleet's lease in Redis have no effect without
/// `--redis`: the start refuses them rather than ignore them.
#[test]
fn lease_flags_without_redis_are_refused_at_start() {
    let parse = |line: &[&str]| args::parse(line.iter().map(|a| a.to_string()));
    for flag in [
        &["--expected-instances", "10"][..],
        &["--instance-id", "api-1"],
        &["--budget-redis", "redis://127.0.0.1:6380/"],
        &["--pushback"],
    ] {
        assert_eq!(
            parse(flag),
            Err(format!(
                "{} needs --redis: it shapes the fleet's lease of the dependency budget \
                 in Redis, and without --redis each instance has a whole budget of its own",
                flag[0]
            ))
        );
    }
    let parsed = parse(&[
        "--expected-instances",
        "10",
        "--redis",
        "redis://127.0.0.1:6380/",
        "--instance-id",
        "api-1",
        "--listen",
        "127.0.0.1:3001",
        "--config",
        "x.toml",
        "--dependency-url",
        "http://127.0.0.1:3300",
        "--pushback",
    ])
    .unwrap()
    .unwrap();
    assert!(parsed.pushback, "--pushback with --redis");
    assert_eq!(parsed.expected_instances.get(), 10);
    assert_eq!(parsed.redis.as_deref(), Some("redis://127.0.0.1:6380/"));
    assert_eq!(parsed.budget_redis, None);
    assert_eq!(parsed.instance_id.as_deref(), Some("api-1"));
    assert_eq!(parsed.listen.to_string(), "127.0.0.1:3001");
    assert_eq!(parsed.config, Some("x.toml".into()));
    assert_eq!(
        parsed.dependency_url.as_deref(),
        Some("http://127.0.0.1:3300")
    );
    assert_eq!(parse(&["--help"]), Ok(None));
    assert!(args::USAGE.contains("--expected-instances N"));
    // `--help` is the usage, then every flag described.
    let usage = args::USAGE.lines().next().unwrap();
    assert!(args::HELP.contains(usage), "{}", args::HELP);
}

/// A bad value in a file is refused with the file, the line it is on, its
/// own key path (a policy's field included) and the reason. Before, no line
/// was given, and a policy's bad value named only its policy
/// (`plans.free.policies[0]: invalid type: string "x", expected u64`).
#[test]
fn a_bad_value_is_refused_with_its_file_line_and_its_own_key() {
    let shipped = std::fs::read_to_string(SHIPPED).unwrap();
    // The line (from 1) of the one line that contains `needle`.
    let line_of = |needle: &str| {
        let lines: Vec<usize> = shipped
            .lines()
            .enumerate()
            .filter(|(_, l)| l.contains(needle))
            .map(|(i, _)| i + 1)
            .collect();
        assert_eq!(lines.len(), 1, "{needle:?} must be on one line");
        lines[0]
    };
    let free_log = line_of("\"per-minute\", algorithm = \"sliding_log\", limit = 100,");
    let free_burst = line_of("capacity = 20, refill = 100");
    let cases = [
        (
            ("limit = 100, window", "limit = \"x\", window"),
            free_log,
            "plans.free.policies[0].limit: invalid type: string \"x\", expected u64",
        ),
        (
            (
                "limit = 100, window = \"60s\"",
                "limit = 100, window = \"60\"",
            ),
            free_log,
            "plans.free.policies[0].window: \"60\": the unit must be ms, s, m, h or d",
        ),
        (
            ("capacity = 20, refill = 100", "capacity = -1, refill = 100"),
            free_burst,
            "plans.free.policies[1].capacity: invalid value: integer `-1`, expected u64",
        ),
        (
            ("capacity = 20, refill = 100", "capacity = 20, refill = 0"),
            free_burst,
            "plans.free.policies[1].refill: must be at least 1",
        ),
        (
            ("capacity = 20, refill = 100", "refill = 100"),
            free_burst,
            "plans.free.policies[1]: missing field `capacity`: a token_bucket policy \
             takes `name`, `capacity`, `refill`, `period`",
        ),
        (
            (
                "capacity = 20, refill = 100",
                "capacity = 20, limit = 5, refill = 100",
            ),
            free_burst,
            "plans.free.policies[1]: unknown field `limit`: a token_bucket policy \
             takes `name`, `capacity`, `refill`, `period`",
        ),
        (
            ("max_page_size = 100", "max_page_size = \"lots\""),
            line_of("max_page_size = 100"),
            "query.max_page_size: invalid type: string \"lots\", expected u32",
        ),
        (
            ("max_page_size = 100", "max_page_size = 5"),
            line_of("max_page_size = 100"),
            "query.max_page_size: must be at least query.default_page_size",
        ),
        (
            ("job_workers = 2", "job_workers = 0"),
            line_of("job_workers = 2"),
            "batch.job_workers: must be at least 1",
        ),
        (
            ("per_identity = { limit = 4,", "per_identity = { limit = 0,"),
            line_of("per_identity = { limit = 4,"),
            "concurrency.per_identity.limit: must be at least 1",
        ),
        (
            ("plan = \"pro\"", "plan = \"gold\""),
            line_of("plan = \"pro\""),
            "keys[1].plan: no plan named \"gold\"",
        ),
        (
            ("default_plan = \"free\"", "default_plan = \"gold\""),
            line_of("default_plan = \"free\""),
            "default_plan: no plan named \"gold\"",
        ),
        // A key missing from its table: the table's line.
        (
            ("job_retention = \"10m\"", ""),
            line_of("[batch]"),
            "batch: missing field `job_retention`",
        ),
        // A syntax error: its line, and no key path.
        (
            ("job_workers = 2", "job_workers = 2\njob_workers = 3"),
            line_of("job_workers = 2") + 1,
            "duplicate key",
        ),
    ];
    let dir = std::env::temp_dir().join(format!("reporting-config-lines-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    for ((from, to), line, expected) in cases {
        std::fs::write(&path, edited(from, to)).unwrap();
        let error = Config::load(&path).unwrap_err();
        let expected = format!("{}:{line}: {expected}", path.display());
        assert!(
            error.starts_with(&expected),
            "{from:?} -> {to:?}:\n got      {error:?}\n expected {expected:?}"
        );
    }
    // A missing top-level key is on no line.
    std::fs::write(&path, edited("default_plan = \"free\"", "")).unwrap();
    assert_eq!(
        Config::load(&path).unwrap_err(),
        format!("{}: (file): missing field `default_plan`", path.display())
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Admission times (ms from the start) of demo-free's `GET /v1/reports`
/// under `config`, sent greedily on the manual clock: every 100 ms for
/// 60 s, requests until one is refused.
async fn greedy_free_admissions(config: &Config) -> Vec<u64> {
    let (app, clock) = api_of(config, dependency("http://127.0.0.1:1", roomy_budget()));
    let mut admitted = Vec::new();
    for step in 0..=600u64 {
        if step > 0 {
            clock.advance(Duration::from_millis(100));
        }
        for _ in 0..30 {
            let (status, _, body) =
                send(&app, get("/v1/reports?page_size=1", Some("demo-free"))).await;
            if status != StatusCode::OK {
                assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
                break;
            }
            admitted.push(step * 100);
        }
    }
    admitted
}

/// The article's numbers end to end: the free plan's bucket (20, 100 per
/// minute) admits 23 in 2 s and 120 in 60 s; the exact per-minute log beside
/// it keeps every 60 s to 100.
#[tokio::test]
async fn the_free_plan_admits_23_in_2_s_and_at_most_100_in_any_60_s() {
    let within = |admitted: &[u64], from: u64, to: u64| {
        admitted.iter().filter(|t| (from..=to).contains(t)).count()
    };
    let both = greedy_free_admissions(&Config::builtin()).await;
    assert_eq!(within(&both, 0, 2_000), 23);
    assert_eq!(within(&both, 0, 59_999), 100);
    // Every window (t - 60 s, t] ending at an admission holds at most 100.
    let busiest = both
        .iter()
        .map(|&t| both.iter().filter(|&&s| s + 60_000 > t && s <= t).count())
        .max();
    assert_eq!(busiest, Some(100));

    let log = "  { name = \"per-minute\", algorithm = \"sliding_log\", limit = 100, window = \"60s\" },\n";
    let burst_only = greedy_free_admissions(&Config::parse(&edited(log, "")).unwrap()).await;
    assert_eq!(within(&burst_only, 0, 2_000), 23);
    assert_eq!(within(&burst_only, 0, 60_000), 120);
}

/// `[dependency.concurrency] mode`: the adaptive limit (its first baseline
/// probe at 3 in flight), a fixed cap of `fixed`, or no limit.
#[tokio::test]
async fn the_dependency_limit_is_adaptive_fixed_or_off() {
    let limit = |mode: &str| {
        Config::parse(&edited("mode = \"adaptive\"", mode))
            .unwrap()
            .dependency
            .concurrency
            .limit()
            .unwrap()
            .and_then(|limit| limit.stats().limit)
    };
    assert_eq!(limit("mode = \"adaptive\""), Some(3));
    assert_eq!(limit("mode = \"fixed\""), Some(16));
    assert_eq!(limit("mode = \"off\""), None);
    let error = Config::parse(&edited("fixed = 16", "fixed = 0"))
        .unwrap()
        .dependency
        .concurrency;
    // Unused in mode "adaptive"; refused where it is used.
    assert_eq!(error.fixed, 0);
    let fixed_zero =
        edited("fixed = 16", "fixed = 0").replace("mode = \"adaptive\"", "mode = \"fixed\"");
    assert_eq!(
        Config::parse(&fixed_zero).unwrap_err().to_string(),
        "dependency.concurrency.fixed: must be at least 1"
    );
}
