//! The quota layer through axum: keys, cost, settlement, headers and
//! Retry-After, on a manual clock.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::{Extension, Router};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_admission::bounds::{QueryRules, ValidateQueryLayer, ValidatedQuery};
use tower_admission::clock::ManualClock;
use tower_admission::identity::{ClientIp, ClientIpLayer, Identity};
use tower_admission::quota::{
    MemoryStore, Policy, Quota, QuotaDecision, QuotaLayer, Settlement, Store, StoreError,
};
use tower_admission::reject::Rejection;

const MINUTE: Duration = Duration::from_secs(60);

fn store(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::with_clock(clock.clone())
}

fn request(identity: Option<Identity>, uri: &str) -> Request<Body> {
    let mut req = Request::builder().uri(uri).body(Body::empty()).unwrap();
    if let Some(id) = identity {
        req.extensions_mut().insert(id);
    }
    req
}

#[tokio::test]
async fn refusal_is_429_with_headers_and_problem_json() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let quota = Quota::new(
        "q",
        [Policy::fixed_window("per-minute", 2, MINUTE).unwrap()],
    )
    .unwrap();
    let layer = QuotaLayer::builder(store(&clock))
        .quota(quota)
        .headers_on_success(true)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let alice = Identity::new("alice", "acme", "free");
    for remaining in [1, 0] {
        let ok = app
            .clone()
            .oneshot(request(Some(alice.clone()), "/"))
            .await
            .unwrap();
        assert_eq!(ok.status(), StatusCode::OK);
        assert_eq!(ok.headers()["ratelimit-policy"], "\"per-minute\";q=2;w=60");
        assert_eq!(
            ok.headers()["ratelimit"],
            format!("\"per-minute\";r={remaining};t=60").as_str()
        );
    }
    clock.advance(Duration::from_millis(20_500));
    let refused = app
        .clone()
        .oneshot(request(Some(alice), "/"))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "40");
    assert_eq!(refused.headers()["ratelimit"], "\"per-minute\";r=0;t=40");
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(doc["status"], 429);
    assert_eq!(doc["policies"], serde_json::json!(["per-minute"]));
    assert_eq!(doc["retry_after"], 40);
    assert_eq!(
        doc["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
}

#[tokio::test]
async fn per_identity_quota_without_identity_is_401() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let quota = Quota::new("q", [Policy::fixed_window("m", 2, MINUTE).unwrap()]).unwrap();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaLayer::builder(store(&clock))
            .quota(quota)
            .build()
            .unwrap(),
    );
    let response = app.oneshot(request(None, "/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn spoofed_identity_headers_do_not_change_the_key() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let quota = Quota::new("q", [Policy::fixed_window("m", 3, MINUTE).unwrap()]).unwrap();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaLayer::builder(store(&clock))
            .quota(quota)
            .build()
            .unwrap(),
    );
    let alice = Identity::new("alice", "acme", "free");
    let mut statuses = Vec::new();
    for i in 0..6 {
        let mut req = request(Some(alice.clone()), "/");
        req.headers_mut()
            .insert("x-user-id", format!("someone-{i}").parse().unwrap());
        req.headers_mut()
            .insert("x-forwarded-for", format!("203.0.113.{i}").parse().unwrap());
        statuses.push(app.clone().oneshot(req).await.unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
}

#[tokio::test]
async fn ip_quota_ignores_forwarded_for_from_untrusted_peers() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let quota = Quota::new("per-ip", [Policy::fixed_window("m", 3, MINUTE).unwrap()]).unwrap();
    let by_ip = |parts: &http::request::Parts| {
        parts
            .extensions
            .get::<ClientIp>()
            .map(|ip| Arc::from(ip.key_network().to_string()))
    };
    let layer = QuotaLayer::builder(store(&clock))
        .quota(quota)
        .key(by_ip)
        .build()
        .unwrap();
    let proxies = ClientIpLayer::new(["10.0.0.0/8"]).unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
        .layer(proxies);
    let send = |peer: &str, xff: String| {
        let mut req = request(None, "/");
        req.extensions_mut()
            .insert(ConnectInfo(peer.parse::<SocketAddr>().unwrap()));
        req.headers_mut()
            .insert("x-forwarded-for", xff.parse().unwrap());
        app.clone().oneshot(req)
    };
    // An untrusted peer inventing a new address each time is still one key.
    let mut statuses = Vec::new();
    for i in 0..5 {
        statuses.push(
            send("198.51.100.7:5000", format!("192.0.2.{i}"))
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    // Through the trusted proxy each real client has its own key; the spoofed
    // leftmost hop is ignored.
    let mut statuses = Vec::new();
    for i in 0..4 {
        statuses.push(
            send("10.0.0.1:443", format!("6.6.6.{i}, 192.0.2.50"))
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
}

#[tokio::test]
async fn page_size_is_the_cost_and_settle_refunds_exactly() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = store(&clock);
    let quota = Quota::new(
        "rows",
        [Policy::fixed_window("rows-per-minute", 200, MINUTE).unwrap()],
    )
    .unwrap();
    let layer = QuotaLayer::builder(store.clone())
        .quota(quota.clone())
        .cost(ValidatedQuery::page_cost)
        .build()
        .unwrap();
    let rules = QueryRules::new();
    let app = Router::new()
        .route(
            "/",
            get(
                |q: ValidatedQuery, Extension(settlement): Extension<Settlement>| async move {
                    assert_eq!(settlement.charged(), vec![u64::from(q.page_size)]);
                    // Only 12 rows existed.
                    settlement.settle(12).await.unwrap();
                    "ok"
                },
            ),
        )
        .layer(layer)
        .layer(ValidateQueryLayer::new(rules));
    let alice = Identity::new("alice", "acme", "free");
    let key: Arc<str> = "alice".into();
    let remaining = || {
        store
            .decide(&quota, &key, 0)
            .into_inner()
            .unwrap()
            .decisions[0]
            .remaining
    };

    let response = app
        .clone()
        .oneshot(request(Some(alice.clone()), "/?page_size=50"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(remaining(), 200 - 12, "charged 50, settled to 12");

    // Without settling, page_size=50 consumes exactly 50.
    let plain = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            QuotaLayer::builder(store.clone())
                .quota(quota.clone())
                .cost(ValidatedQuery::page_cost)
                .build()
                .unwrap(),
        )
        .layer(ValidateQueryLayer::new(QueryRules::new()));
    let page = |size: u32| {
        plain
            .clone()
            .oneshot(request(Some(alice.clone()), &format!("/?page_size={size}")))
    };
    assert_eq!(page(50).await.unwrap().status(), StatusCode::OK);
    assert_eq!(remaining(), 200 - 12 - 50);
    assert_eq!(page(100).await.unwrap().status(), StatusCode::OK);
    assert_eq!(remaining(), 38);

    // A refused request over what is left consumes nothing and locks nobody out.
    assert_eq!(
        page(100).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(remaining(), 38);
    assert_eq!(page(38).await.unwrap().status(), StatusCode::OK);
    assert_eq!(remaining(), 0);
}

#[tokio::test]
async fn cost_over_capacity_is_413_without_retry_after() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let quota = Quota::new(
        "q",
        [Policy::token_bucket("burst", 20, 100, MINUTE).unwrap()],
    )
    .unwrap();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaLayer::builder(store(&clock))
            .quota(quota)
            .cost(|parts| parts.uri.query().map_or(1, |q| q.len() as u64))
            .build()
            .unwrap(),
    );
    let alice = Identity::new("alice", "acme", "free");
    let response = app
        .oneshot(request(Some(alice), "/?xxxxxxxxxxxxxxxxxxxxx"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(response.headers().get("retry-after").is_none());
    assert!(matches!(
        response.extensions().get::<Rejection>(),
        Some(Rejection::CostExceedsCapacity { cost: 21, .. })
    ));
}

#[tokio::test]
async fn aggregate_scope_shares_one_key_and_plans_pick_limits() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let free = Quota::new("free", [Policy::fixed_window("m", 2, MINUTE).unwrap()]).unwrap();
    let pro = Quota::new("pro", [Policy::fixed_window("m", 5, MINUTE).unwrap()]).unwrap();
    let per_plan = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaLayer::builder(store(&clock))
            .quota(free.clone())
            .plan("pro", pro)
            .build()
            .unwrap(),
    );
    let count_ok = |app: Router, id: Identity, n: usize| async move {
        let mut ok = 0;
        for _ in 0..n {
            ok += usize::from(
                app.clone()
                    .oneshot(request(Some(id.clone()), "/"))
                    .await
                    .unwrap()
                    .status()
                    == StatusCode::OK,
            );
        }
        ok
    };
    assert_eq!(
        count_ok(per_plan.clone(), Identity::new("alice", "acme", "free"), 10).await,
        2
    );
    assert_eq!(
        count_ok(per_plan.clone(), Identity::new("bob", "acme", "pro"), 10).await,
        5
    );

    let aggregate = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaLayer::builder(store(&clock))
            .quota(free)
            .aggregate()
            .build()
            .unwrap(),
    );
    assert_eq!(
        count_ok(
            aggregate.clone(),
            Identity::new("alice", "acme", "free"),
            10
        )
        .await,
        2
    );
    assert_eq!(
        count_ok(aggregate, Identity::new("bob", "acme", "pro"), 10).await,
        0
    );
}

/// A store that always awaits before deciding, like a networked one.
#[derive(Clone)]
struct AwaitingStore(MemoryStore<ManualClock>);

impl tower_admission::quota::Store for AwaitingStore {
    type DecideFuture = Pin<Box<dyn Future<Output = Result<QuotaDecision, StoreError>> + Send>>;
    type SettleFuture = Pin<Box<dyn Future<Output = Result<QuotaDecision, StoreError>> + Send>>;

    fn decide(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        let decision = self.0.decide(quota, key, cost).into_inner();
        Box::pin(async move {
            tokio::task::yield_now().await;
            decision
        })
    }

    fn peek(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        let decision = self.0.peek(quota, key, cost).into_inner();
        Box::pin(std::future::ready(decision))
    }

    fn settle(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        decision: &QuotaDecision,
        delta: i64,
    ) -> Self::SettleFuture {
        let settled = self.0.settle(quota, key, decision, delta).into_inner();
        Box::pin(async move {
            tokio::task::yield_now().await;
            settled
        })
    }
}

#[tokio::test]
async fn awaiting_store_gives_the_same_answers() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let quota = Quota::new(
        "q",
        [Policy::fixed_window("per-minute", 2, MINUTE).unwrap()],
    )
    .unwrap();
    let layer = QuotaLayer::builder(AwaitingStore(store(&clock)))
        .quota(quota)
        .headers_on_success(true)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let alice = Identity::new("alice", "acme", "free");
    let mut seen = Vec::new();
    for _ in 0..3 {
        let response = app
            .clone()
            .oneshot(request(Some(alice.clone()), "/"))
            .await
            .unwrap();
        seen.push((
            response.status().as_u16(),
            response.headers()["ratelimit"].to_str().unwrap().to_owned(),
        ));
    }
    assert_eq!(
        seen,
        [
            (200, "\"per-minute\";r=1;t=60".to_owned()),
            (200, "\"per-minute\";r=0;t=60".to_owned()),
            (429, "\"per-minute\";r=0;t=60".to_owned()),
        ]
    );
}

/// A store that records every key it is asked about, over a memory store.
#[derive(Clone)]
struct KeyLog {
    inner: MemoryStore<ManualClock>,
    keys: Arc<std::sync::Mutex<Vec<Arc<str>>>>,
}

impl Store for KeyLog {
    type DecideFuture = <MemoryStore<ManualClock> as Store>::DecideFuture;
    type SettleFuture = <MemoryStore<ManualClock> as Store>::SettleFuture;

    fn decide(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        self.keys.lock().unwrap().push(key.clone());
        self.inner.decide(quota, key, cost)
    }

    fn peek(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        self.inner.peek(quota, key, cost)
    }

    fn settle(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        decision: &QuotaDecision,
        delta: i64,
    ) -> Self::SettleFuture {
        self.inner.settle(quota, key, decision, delta)
    }
}

/// A store never holds more than 65 bytes of key per tracked key, however
/// long the subject or the key function's answer (a 64 KiB subject was
/// kept whole: 100,000 such keys are 6.4 GB), and long keys stay apart:
/// two that differ in their last byte have their own state, and a short key
/// spelled as a long key's stored form does not reach it.
#[tokio::test]
async fn long_keys_are_stored_bounded_and_stay_distinct() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = KeyLog {
        inner: store(&clock),
        keys: Default::default(),
    };
    let one = Quota::new(
        "one",
        [Policy::fixed_window("per-minute", 1, MINUTE).unwrap()],
    )
    .unwrap();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaLayer::builder(store.clone())
            .quota(one.clone())
            .build()
            .unwrap(),
    );
    let long = |last: char| Identity::new(format!("{}{last}", "s".repeat(65_535)), "acme", "free");
    let status = |id: Identity| {
        let app = app.clone();
        async move { app.oneshot(request(Some(id), "/")).await.unwrap().status() }
    };
    assert_eq!(status(long('a')).await, StatusCode::OK);
    assert_eq!(status(long('a')).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(status(long('b')).await, StatusCode::OK);
    let stored_a = store.keys.lock().unwrap()[0].clone();
    assert!(stored_a.len() <= 65, "{} bytes", stored_a.len());
    // The stored form, sent as a subject of its own, is another key.
    assert_eq!(
        status(Identity::new(stored_a.clone(), "acme", "free")).await,
        StatusCode::OK
    );
    // Short keys are kept as they are.
    assert_eq!(
        status(Identity::new("bob", "acme", "free")).await,
        StatusCode::OK
    );
    let keys = store.keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 5);
    assert_eq!(&*keys[4], "bob");
    assert!(keys.iter().all(|k| k.len() <= 65));
    assert_eq!(keys[0], keys[1]);
    let distinct: std::collections::HashSet<_> = keys.iter().collect();
    assert_eq!(distinct.len(), 4);
}

/// What `store` has left of `quota` for `key` (a decision of cost 0).
async fn left<St: Store>(store: &St, quota: &Quota, key: &str) -> u64 {
    let decision = store.decide(quota, &key.into(), 0).await.unwrap();
    decision.decisions[0].remaining
}

/// With `refund_inner_refusals`, a per-user charge is given back when the
/// aggregate quota inside it refuses, on a store that answers at once and
/// on one that awaits: alice's 3rd and 4th requests, refused by the
/// aggregate (2 per minute), leave her 3 of 5 per-user requests, not 1.
/// Without it they cost her: 1 left.
#[tokio::test]
async fn a_request_refused_further_in_costs_its_caller_nothing() {
    for (refund, awaiting, expected) in [(true, false, 3), (true, true, 3), (false, false, 1)] {
        let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
        let memory = store(&clock);
        let per_user =
            Quota::new("per-user", [Policy::fixed_window("m", 5, MINUTE).unwrap()]).unwrap();
        let all = Quota::new("all", [Policy::fixed_window("m", 2, MINUTE).unwrap()]).unwrap();
        let aggregate = QuotaLayer::builder(memory.clone())
            .quota(all)
            .aggregate()
            .build()
            .unwrap();
        let route = Router::new().route("/", get(|| async { "ok" }));
        let app = if awaiting {
            let outer = QuotaLayer::builder(AwaitingStore(memory.clone()))
                .quota(per_user.clone())
                .refund_inner_refusals(refund)
                .build()
                .unwrap();
            route.layer(aggregate).layer(outer)
        } else {
            let outer = QuotaLayer::builder(memory.clone())
                .quota(per_user.clone())
                .refund_inner_refusals(refund)
                .build()
                .unwrap();
            route.layer(aggregate).layer(outer)
        };
        let alice = Identity::new("alice", "acme", "free");
        let mut statuses = Vec::new();
        for _ in 0..4 {
            let response = app.clone().oneshot(request(Some(alice.clone()), "/")).await;
            statuses.push(response.unwrap().status().as_u16());
        }
        // A refund on an awaiting store runs in a task of its own.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(statuses, [200, 200, 429, 429]);
        assert_eq!(
            left(&memory, &per_user, "alice").await,
            expected,
            "refund {refund}, awaiting {awaiting}"
        );
    }
}

/// With a cost function the refund is the settlement's own charge: a
/// handler that settles to 0 and then refuses (its job queue is full) is
/// not refunded twice. Bob's first request keeps its 4; his second is
/// settled to 0 by the handler, and the layer's refund finds nothing more
/// to give: 6 of 10 left (a second refund of 4 would leave 10).
#[tokio::test]
async fn a_handler_settle_and_the_refund_never_give_back_twice() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let memory = store(&clock);
    let work = Quota::new("work", [Policy::fixed_window("m", 10, MINUTE).unwrap()]).unwrap();
    let full = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = {
        let full = full.clone();
        move |Extension(settlement): Extension<Settlement>| {
            let full = full.clone();
            async move {
                if !full.load(std::sync::atomic::Ordering::SeqCst) {
                    return axum::response::IntoResponse::into_response("ok");
                }
                settlement.settle(0).await.unwrap();
                let refusal = Rejection::Overloaded {
                    retry_after: Duration::from_secs(1),
                    cap: Some(("job-queue", 1)),
                };
                let refusal = refusal.into_response(&http::HeaderMap::new());
                axum::response::IntoResponse::into_response(refusal)
            }
        }
    };
    let app = Router::new().route("/", get(handler)).layer(
        QuotaLayer::builder(memory.clone())
            .quota(work.clone())
            .cost(|_| 4)
            .refund_inner_refusals(true)
            .build()
            .unwrap(),
    );
    let bob = Identity::new("bob", "acme", "pro");
    let first = app.clone().oneshot(request(Some(bob.clone()), "/")).await;
    assert_eq!(first.unwrap().status(), StatusCode::OK);
    full.store(true, std::sync::atomic::Ordering::SeqCst);
    let second = app.clone().oneshot(request(Some(bob.clone()), "/")).await;
    assert_eq!(second.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(left(&memory, &work, "bob").await, 6);
}

/// A hot reload swaps the quota layer for one of the same quota name and
/// kinds but a larger bucket, on the same store, while a request admitted by
/// the old layer is still running. The new layer takes what it allows; then
/// the old request settles its real cost, under the old quota. Before, that
/// settle clamped the bucket to the old capacity of 1 and refilled it: the
/// new layer admitted 99 more at the same instant, 198 in all from a bucket
/// of 100. Now the settle gives back only the old charge's token.
#[tokio::test]
async fn a_request_from_before_a_reload_settles_without_refilling_the_new_quota() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = store(&clock);
    let bucket = |capacity| {
        let policy = Policy::token_bucket("burst", capacity, 1, Duration::from_secs(1));
        Quota::new("api", [policy.unwrap()]).unwrap()
    };
    let app = |quota: Quota| {
        let layer = QuotaLayer::builder(store.clone())
            .quota(quota)
            .cost(|_| 1)
            .build()
            .unwrap();
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer)
    };
    let alice = Identity::new("alice", "acme", "free");
    // The request of the old deploy, as its handler sees it mid-flight.
    let (tx, rx) = tokio::sync::oneshot::channel::<Settlement>();
    let tx = Arc::new(std::sync::Mutex::new(Some(tx)));
    let old = Router::new()
        .route(
            "/",
            get(move |Extension(settlement): Extension<Settlement>| {
                if let Some(tx) = tx.lock().unwrap().take() {
                    let _ = tx.send(settlement);
                }
                async { "ok" }
            }),
        )
        .layer(
            QuotaLayer::builder(store.clone())
                .quota(bucket(1))
                .cost(|_| 1)
                .build()
                .unwrap(),
        );
    let response = old
        .oneshot(request(Some(alice.clone()), "/"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let pending = rx.await.unwrap();

    let new = app(bucket(100));
    let admit_all = || async {
        let mut admitted = 0;
        loop {
            let response = new
                .clone()
                .oneshot(request(Some(alice.clone()), "/"))
                .await
                .unwrap();
            if response.status() != StatusCode::OK {
                return admitted;
            }
            admitted += 1;
        }
    };
    assert_eq!(admit_all().await, 99);
    // The old request did no work: its actual cost is 0.
    pending.settle(0).await.unwrap();
    assert_eq!(admit_all().await, 1);
}
