//! The refusals of a quota layer over HTTP, as a client sees them: the
//! registered problem types, `Retry-After` and the RateLimit fields on every
//! 429 and 503.

#[path = "support/down_store.rs"]
mod down_store;

use down_store::Down;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;
use tower_admission::clock::ManualClock;
use tower_admission::identity::Identity;
use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer, Store};

const MINUTE: Duration = Duration::from_secs(60);

fn quota() -> Quota {
    Quota::new(
        "requests",
        [
            Policy::sliding_log("per-minute", 100, MINUTE).unwrap(),
            Policy::token_bucket("burst", 20, 100, MINUTE).unwrap(),
        ],
    )
    .unwrap()
}

fn app<St: Store>(store: St) -> Router {
    let layer = QuotaLayer::builder(store).quota(quota()).build().unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

fn alice() -> Request<Body> {
    let mut req = Request::builder().uri("/").body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(Identity::new("alice", "acme", "free"));
    req
}

async fn send(app: &Router) -> (StatusCode, HeaderMap, Value) {
    let response = app.clone().oneshot(alice()).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        headers,
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    )
}

/// 20 of 25 immediate requests pass the burst; the 21st is `quota-exceeded`
/// naming the burst policy, with the RateLimit fields and `Retry-After`.
#[tokio::test]
async fn quota_refusal_is_quota_exceeded_with_violated_policies() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let app = app(MemoryStore::with_clock(clock));
    let mut admitted = 0;
    let mut refusals = Vec::new();
    for _ in 0..25 {
        let (status, headers, doc) = send(&app).await;
        match status {
            StatusCode::OK => admitted += 1,
            _ => refusals.push((status, headers, doc)),
        }
    }
    assert_eq!(admitted, 20);
    assert_eq!(refusals.len(), 5);
    for (status, headers, doc) in refusals {
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(headers["content-type"], "application/problem+json");
        // One token every 0.6 s, rounded up.
        assert_eq!(headers["retry-after"], "1");
        assert_eq!(
            headers["ratelimit-policy"],
            "\"per-minute\";q=100;w=60, \"burst\";q=20;w=12"
        );
        assert_eq!(
            headers["ratelimit"],
            "\"per-minute\";r=80;t=60, \"burst\";r=0;t=12"
        );
        assert_eq!(
            doc,
            json!({
                "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
                "title": "Quota Exceeded",
                "status": 429,
                "detail": "quota policy burst refused; retry after 1 s",
                "violated-policies": ["burst"],
                "policies": ["burst"],
                "retry_after": 1,
            })
        );
    }
}

/// A limiter that cannot decide, with policies failing closed (the default):
/// 503 `temporary-reduced-capacity`, with `Retry-After` and the RateLimit
/// fields advertising nothing left until then.
#[tokio::test]
async fn limiter_outage_is_temporary_reduced_capacity() {
    let app = app(Down);
    let (status, headers, doc) = send(&app).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(
        headers["ratelimit-policy"],
        "\"per-minute\";q=100;w=60, \"burst\";q=20;w=12"
    );
    assert_eq!(
        headers["ratelimit"],
        "\"per-minute\";r=0;t=1, \"burst\";r=0;t=1"
    );
    assert_eq!(
        doc,
        json!({
            "type": "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity",
            "title": "Temporary Reduced Capacity",
            "status": 503,
            "detail": "the rate limiter could not decide in time",
            "retry_after": 1,
        })
    );
}

/// A limiter that cannot decide, with policies falling back to a local
/// share of a quarter: admitted responses advertise the share the request
/// was decided under (`q=25`, `q=5`), not the configured limits, and a
/// healthy store's answer advertises the configured ones.
#[tokio::test]
async fn a_local_share_advertises_its_own_limits() {
    let share = std::num::NonZeroU64::new(4).unwrap();
    let quota = Quota::new(
        "requests",
        quota()
            .policies()
            .iter()
            .map(|p| p.clone().fail_to_local_share(share)),
    )
    .unwrap();
    fn app<St: Store>(store: St, quota: &Quota) -> Router {
        let layer = QuotaLayer::builder(store)
            .quota(quota.clone())
            .headers_on_success(true)
            .build()
            .unwrap();
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer)
    }
    let (status, headers, _) = send(&app(MemoryStore::new(), &quota)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        headers["ratelimit-policy"],
        "\"per-minute\";q=100;w=60, \"burst\";q=20;w=12"
    );
    assert_eq!(
        headers["ratelimit"],
        "\"per-minute\";r=99;t=60, \"burst\";r=19;t=1"
    );

    let (status, headers, _) = send(&app(Down, &quota)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        headers["ratelimit-policy"],
        "\"per-minute\";q=25;w=60, \"burst\";q=5;w=12"
    );
    assert_eq!(
        headers["ratelimit"],
        "\"per-minute\";r=24;t=60, \"burst\";r=4;t=3"
    );
}

/// A wait of `Duration::MAX` (a budget that never admits again) saturates
/// every advertised wait instead of overflowing.
#[test]
fn an_endless_wait_saturates_retry_after() {
    use tower_admission::reject::Rejection;
    let endless = Rejection::DependencyUnavailable {
        retry_after: Duration::MAX,
    };
    let http = endless.clone().into_response(&HeaderMap::new());
    assert_eq!(http.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(http.headers()["retry-after"], u64::MAX.to_string().as_str());
    let mut grpc_call = HeaderMap::new();
    grpc_call.insert(
        http::header::CONTENT_TYPE,
        "application/grpc".parse().unwrap(),
    );
    let grpc = endless.into_response(&grpc_call);
    assert_eq!(grpc.headers()["grpc-status"], "14");
    assert_eq!(
        grpc.headers()["grpc-retry-pushback-ms"],
        i64::MAX.to_string().as_str()
    );
}

/// Media types are case-insensitive (RFC 9110 §8.3.1), so `Application/gRPC`
/// is gRPC like `application/grpc`: every `+codec` form and gRPC-Web too,
/// answered with the gRPC status (in gRPC-Web's own content type for a
/// gRPC-Web caller), never problem+json. Other types are HTTP.
#[tokio::test]
async fn every_grpc_content_type_gets_a_grpc_status_in_any_case() {
    use tower_admission::reject::Rejection;
    // Whether a request is gRPC, as the layers tell it: its refusals are
    // gRPC statuses.
    let is_grpc = |headers: &HeaderMap| {
        Rejection::Unauthenticated { reason: "probe" }
            .into_response(headers)
            .headers()
            .contains_key("grpc-status")
    };

    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let app = app(MemoryStore::with_clock(clock));
    // Each with the content type of its refusal: gRPC-Web callers get their
    // own media type back.
    let answered = [
        ("application/grpc", "application/grpc"),
        ("application/grpc+proto", "application/grpc"),
        ("application/grpc; charset=utf-8", "application/grpc"),
        ("Application/gRPC+proto", "application/grpc"),
        ("APPLICATION/GRPC", "application/grpc"),
        ("application/grpc-web", "application/grpc-web"),
        (
            "application/grpc-web-text+proto",
            "application/grpc-web-text+proto",
        ),
    ];
    let grpc_types = answered.map(|(sent, _)| sent);
    for content_type in grpc_types {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_TYPE, content_type.parse().unwrap());
        assert!(is_grpc(&headers), "{content_type}");
    }
    for content_type in ["application/json", "text/plain", "application/gr", ""] {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_TYPE, content_type.parse().unwrap());
        assert!(!is_grpc(&headers), "{content_type}");
    }
    assert!(!is_grpc(&HeaderMap::new()));

    // Alice's burst of 20, then a refusal for each gRPC type.
    for _ in 0..20 {
        assert_eq!(send(&app).await.0, StatusCode::OK);
    }
    for (content_type, answer) in answered {
        let mut request = alice();
        request
            .headers_mut()
            .insert(http::header::CONTENT_TYPE, content_type.parse().unwrap());
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{content_type}");
        let headers = response.headers();
        assert_eq!(headers["grpc-status"], "8", "{content_type}");
        assert_eq!(headers["content-type"], answer, "{content_type}");
        assert_eq!(headers["grpc-retry-pushback-ms"], "1000", "{content_type}");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert!(body.is_empty(), "{content_type}: trailers-only");
    }
}
