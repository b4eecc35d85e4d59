//! Concurrency caps: exact counts under paused Tokio time.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_admission::concurrency::{ConcurrencyLayer, OverloadReason};
use tower_admission::identity::Identity;
use tower_admission::reject::Rejection;

/// Tracks how many handlers run at once and the most ever seen.
#[derive(Clone, Default)]
struct Gauge {
    now: Arc<AtomicUsize>,
    max: Arc<AtomicUsize>,
    calls: Arc<AtomicUsize>,
}

impl Gauge {
    async fn run(&self, work: Duration) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(n, Ordering::SeqCst);
        tokio::time::sleep(work).await;
        self.now.fetch_sub(1, Ordering::SeqCst);
    }
    fn max(&self) -> usize {
        self.max.load(Ordering::SeqCst)
    }
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

/// An axum app whose one route sleeps `work` (paused time) and answers "ok".
fn app(layer: &ConcurrencyLayer, gauge: &Gauge, work: Duration) -> Router {
    let gauge = gauge.clone();
    Router::new()
        .route(
            "/",
            get(move || {
                let gauge = gauge.clone();
                async move {
                    gauge.run(work).await;
                    "ok"
                }
            }),
        )
        .layer(layer.clone())
}

fn request(subject: Option<&str>) -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    if let Some(s) = subject {
        req.extensions_mut()
            .insert(Identity::new(s.to_owned(), "tenant", "free"));
    }
    req
}

/// One finished request as seen by the client.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Outcome {
    status: u16,
    /// Milliseconds from sending to the response headers.
    at_ms: u128,
    retry_after: Option<String>,
    reason: Option<String>,
    scope: Option<String>,
    /// `RateLimit-Policy`, then `RateLimit`, joined by ` | `.
    ratelimit: Option<String>,
}

async fn send(app: Router, req: Request<Body>) -> Outcome {
    let start = Instant::now();
    let response = app.oneshot(req).await.unwrap();
    let at_ms = start.elapsed().as_millis();
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get(RETRY_AFTER)
        .map(|v| v.to_str().unwrap().to_owned());
    let reason = response
        .extensions()
        .get::<OverloadReason>()
        .map(|r| r.as_str().to_owned());
    let scope = response.extensions().get::<Rejection>().map(|r| match r {
        Rejection::Overloaded { .. } => "global".to_owned(),
        Rejection::CallerBusy { .. } => "identity".to_owned(),
        other => format!("{other:?}"),
    });
    let ratelimit = {
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        header("ratelimit-policy").map(|p| format!("{p} | {}", header("ratelimit").unwrap()))
    };
    // Drain the body so the permit is released.
    let _ = response.into_body().collect().await.unwrap();
    Outcome {
        status,
        at_ms,
        retry_after,
        reason,
        scope,
        ratelimit,
    }
}

/// Sends every request at the same instant and waits for all answers.
async fn burst(app: &Router, reqs: Vec<Request<Body>>) -> Vec<Outcome> {
    let tasks: Vec<_> = reqs
        .into_iter()
        .map(|req| tokio::spawn(send(app.clone(), req)))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// Counts outcomes by (status, at_ms, reason).
fn tally(outcomes: &[Outcome]) -> BTreeMap<(u16, u128, Option<String>), usize> {
    let mut map = BTreeMap::new();
    for o in outcomes {
        *map.entry((o.status, o.at_ms, o.reason.clone()))
            .or_default() += 1;
    }
    map
}

fn key(status: u16, at_ms: u128, reason: Option<&str>) -> (u16, u128, Option<String>) {
    (status, at_ms, reason.map(str::to_owned))
}

#[tokio::test(start_paused = true)]
async fn global_cap_5_queue_10_deadline_100ms_slow_handler() {
    let layer = ConcurrencyLayer::builder()
        .global(5, 10, Duration::from_millis(100))
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_secs(1));

    let outcomes = burst(&app, (0..50).map(|_| request(None)).collect()).await;

    // 5 run for 1 s; 10 wait the whole 100 ms deadline; 35 find the queue
    // full and are refused at once.
    let expected = BTreeMap::from([
        (key(200, 1000, None), 5),
        (key(503, 0, Some("queue-full")), 35),
        (key(503, 100, Some("deadline-passed")), 10),
    ]);
    assert_eq!(tally(&outcomes), expected);
    assert_eq!(gauge.max(), 5);
    assert_eq!(gauge.calls(), 5);
    for o in outcomes.iter().filter(|o| o.status == 503) {
        // Retry-After is the queue deadline rounded up: 1 s.
        assert_eq!(o.retry_after.as_deref(), Some("1"));
        // The service-wide cap, advertised under its own name.
        assert_eq!(
            o.ratelimit.as_deref(),
            Some(
                r#""global-concurrency";q=5;qu="concurrent-requests" | "global-concurrency";r=0;t=1"#
            )
        );
        assert_eq!(o.scope.as_deref(), Some("global"));
    }
    let stats = layer.stats();
    assert_eq!(stats.refused_global_queue_full, 35);
    assert_eq!(stats.refused_global_deadline, 10);
    assert_eq!(layer.in_flight(), 0);
    assert_eq!(layer.queued(), 0);
}

#[tokio::test(start_paused = true)]
async fn global_cap_fast_handler_queue_drains_before_deadline() {
    let layer = ConcurrencyLayer::builder()
        .global(5, 10, Duration::from_millis(100))
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_millis(10));

    let outcomes = burst(&app, (0..50).map(|_| request(None)).collect()).await;

    // Three waves of 5, 10 ms each: the 10 queued all get through well
    // before the 100 ms deadline.
    let expected = BTreeMap::from([
        (key(200, 10, None), 5),
        (key(200, 20, None), 5),
        (key(200, 30, None), 5),
        (key(503, 0, Some("queue-full")), 35),
    ]);
    assert_eq!(tally(&outcomes), expected);
    assert_eq!(gauge.max(), 5);
    assert_eq!(gauge.calls(), 15);
    assert_eq!(layer.stats().refused_global_deadline, 0);
    assert_eq!(layer.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn global_cap_part_of_queue_passes_deadline() {
    let layer = ConcurrencyLayer::builder()
        .global(5, 10, Duration::from_millis(100))
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_millis(60));

    let outcomes = burst(&app, (0..50).map(|_| request(None)).collect()).await;

    // Wave 1 ends at 60 ms and lets the first 5 waiters in (done at 120 ms);
    // the other 5 waiters would get a permit at 120 ms, after their deadline.
    let expected = BTreeMap::from([
        (key(200, 60, None), 5),
        (key(200, 120, None), 5),
        (key(503, 0, Some("queue-full")), 35),
        (key(503, 100, Some("deadline-passed")), 5),
    ]);
    assert_eq!(tally(&outcomes), expected);
    assert_eq!(gauge.max(), 5);
}

#[tokio::test(start_paused = true)]
async fn load_shedding_form_answers_at_once() {
    let layer = ConcurrencyLayer::builder()
        .global(3, 0, Duration::ZERO)
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_secs(5));

    let outcomes = burst(&app, (0..10).map(|_| request(None)).collect()).await;

    let expected = BTreeMap::from([
        (key(200, 5000, None), 3),
        (key(503, 0, Some("queue-full")), 7),
    ]);
    assert_eq!(tally(&outcomes), expected);
    for o in outcomes.iter().filter(|o| o.status == 503) {
        assert_eq!(o.retry_after.as_deref(), Some("1"));
    }
    assert_eq!(gauge.calls(), 3);
    assert_eq!(gauge.max(), 3);
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_the_deadline_rounded_up() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 1, Duration::from_millis(2500))
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_secs(10));
    let outcomes = burst(&app, (0..3).map(|_| request(None)).collect()).await;
    let expected = BTreeMap::from([
        (key(200, 10_000, None), 1),
        (key(503, 0, Some("queue-full")), 1),
        (key(503, 2500, Some("deadline-passed")), 1),
    ]);
    assert_eq!(tally(&outcomes), expected);
    for o in outcomes.iter().filter(|o| o.status == 503) {
        assert_eq!(o.retry_after.as_deref(), Some("3"));
    }
}

/// A body of `chunks` chunks, one every 100 ms of paused time.
fn slow_body(chunks: usize) -> Body {
    let stream = futures_util::stream::unfold(0usize, move |i| async move {
        if i == chunks {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        Some((Ok::<_, Infallible>(Bytes::from(format!("chunk{i}"))), i + 1))
    });
    Body::from_stream(stream)
}

fn streaming_app(layer: &ConcurrencyLayer) -> Router {
    Router::new()
        .route("/", get(|| async { slow_body(3) }))
        .layer(layer.clone())
}

#[tokio::test(start_paused = true)]
async fn permit_is_held_until_streaming_body_is_drained() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 0, Duration::ZERO)
        .build()
        .unwrap();
    let app = streaming_app(&layer);

    let response = app.clone().oneshot(request(None)).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // The handler has returned, but the body has not been sent.
    assert_eq!(layer.in_flight(), 1);

    // A second request meanwhile is shed: the stream still counts.
    let second = send(app.clone(), request(None)).await;
    assert_eq!(second.status, 503);

    let mut body = response.into_body();
    let mut chunks = Vec::new();
    for _ in 0..3 {
        assert_eq!(layer.in_flight(), 1);
        let frame = body.frame().await.unwrap().unwrap();
        chunks.push(frame.into_data().unwrap());
    }
    assert_eq!(chunks, ["chunk0", "chunk1", "chunk2"]);
    // All data is out but the end of the stream has not been seen yet.
    assert_eq!(layer.in_flight(), 1);
    assert!(body.frame().await.is_none());
    assert_eq!(layer.in_flight(), 0);
    drop(body);
    assert_eq!(layer.in_flight(), 0);

    // And the cap is free again.
    let third = send(app, request(None)).await;
    assert_eq!(third.status, 200);
    assert_eq!(layer.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn permit_is_released_when_streaming_body_is_dropped() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 0, Duration::ZERO)
        .build()
        .unwrap();
    let app = streaming_app(&layer);

    let response = app.clone().oneshot(request(None)).await.unwrap();
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "chunk0");
    assert_eq!(layer.in_flight(), 1);
    // The client goes away mid-stream.
    drop(body);
    assert_eq!(layer.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn full_body_releases_with_its_last_frame() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 0, Duration::ZERO)
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
    }));
    let response = svc.oneshot(Request::new(Full::default())).await.unwrap();
    let mut body = response.into_body();
    assert_eq!(layer.in_flight(), 1);
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "done");
    // `Full` reports its end with the only frame: released without waiting
    // for another poll.
    assert_eq!(layer.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn per_identity_cap_refuses_a_with_429_while_b_passes() {
    let layer = ConcurrencyLayer::builder()
        .global(100, 0, Duration::ZERO)
        .per_identity(2, 0, Duration::ZERO)
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_secs(1));

    let mut reqs: Vec<_> = (0..6).map(|_| request(Some("a"))).collect();
    reqs.extend((0..2).map(|_| request(Some("b"))));
    reqs.extend((0..4).map(|_| request(None)));
    let outcomes = burst(&app, reqs).await;

    let a = &outcomes[0..6];
    let b = &outcomes[6..8];
    let anonymous = &outcomes[8..12];
    assert_eq!(
        tally(a),
        BTreeMap::from([
            (key(200, 1000, None), 2),
            (key(429, 0, Some("queue-full")), 4)
        ])
    );
    for o in a.iter().filter(|o| o.status == 429) {
        assert_eq!(o.scope.as_deref(), Some("identity"));
        assert_eq!(o.retry_after.as_deref(), Some("1"));
        // The caller's cap is advertised as a quota of concurrent requests.
        assert_eq!(
            o.ratelimit.as_deref(),
            Some(r#""concurrency";q=2;qu="concurrent-requests" | "concurrency";r=0;t=1"#)
        );
    }
    assert_eq!(tally(b), BTreeMap::from([(key(200, 1000, None), 2)]));
    // No identity: only the global cap applies.
    assert_eq!(
        tally(anonymous),
        BTreeMap::from([(key(200, 1000, None), 4)])
    );
    assert_eq!(gauge.max(), 8);
    assert_eq!(layer.stats().refused_identity_queue_full, 4);
    assert_eq!(layer.tracked_identities(), 0);
}

#[tokio::test(start_paused = true)]
async fn per_identity_queue_and_deadline() {
    let layer = ConcurrencyLayer::builder()
        .per_identity(1, 1, Duration::from_millis(100))
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_secs(1));

    let reqs = vec![
        request(Some("a")),
        request(Some("a")),
        request(Some("a")),
        request(Some("b")),
    ];
    let tasks: Vec<_> = reqs
        .into_iter()
        .map(|r| tokio::spawn(send(app.clone(), r)))
        .collect();
    // Let every request reach the layer, then look at the counters.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(layer.identity_in_flight("a"), 1);
    assert_eq!(layer.identity_queued("a"), 1);
    assert_eq!(layer.identity_in_flight("b"), 1);
    assert_eq!(layer.tracked_identities(), 2);
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap());
    }
    assert_eq!(
        tally(&outcomes[..3]),
        BTreeMap::from([
            (key(200, 1000, None), 1),
            (key(429, 0, Some("queue-full")), 1),
            (key(429, 100, Some("deadline-passed")), 1),
        ])
    );
    assert_eq!(
        tally(&outcomes[3..]),
        BTreeMap::from([(key(200, 1000, None), 1)])
    );
    assert_eq!(layer.tracked_identities(), 0);
}

#[tokio::test(start_paused = true)]
async fn per_identity_map_is_empty_after_10_000_identities() {
    let layer = ConcurrencyLayer::builder()
        .per_identity(1, 0, Duration::ZERO)
        .max_identities(10_000)
        .build()
        .unwrap();
    let peak = Arc::new(AtomicUsize::new(0));
    let app = {
        let probe = layer.clone();
        let peak = Arc::clone(&peak);
        Router::new()
            .route(
                "/",
                get(move || {
                    let probe = probe.clone();
                    let peak = Arc::clone(&peak);
                    async move {
                        peak.fetch_max(probe.tracked_identities(), Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        "ok"
                    }
                }),
            )
            .layer(layer.clone())
    };
    let names: Vec<String> = (0..10_000).map(|i| format!("user-{i}")).collect();
    let outcomes = burst(&app, names.iter().map(|n| request(Some(n))).collect()).await;
    assert_eq!(outcomes.iter().filter(|o| o.status == 200).count(), 10_000);
    // All 10,000 were in flight together, each with its own entry ...
    assert_eq!(peak.load(Ordering::SeqCst), 10_000);
    // ... and every entry is gone once they completed.
    assert_eq!(layer.tracked_identities(), 0);
    assert_eq!(layer.stats().tracked_identities, 0);
}

#[tokio::test(start_paused = true)]
async fn identity_queue_is_served_in_arrival_order_and_keeps_its_entry() {
    let layer = ConcurrencyLayer::builder()
        .per_identity(1, 2, Duration::from_secs(1))
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_millis(100));
    let tasks: Vec<_> = (0..3)
        .map(|_| tokio::spawn(send(app.clone(), request(Some("a")))))
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(layer.identity_in_flight("a"), 1);
    assert_eq!(layer.identity_queued("a"), 2);
    // The first request has finished and handed its permit to the second,
    // with the third still queued: the entry stays.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(layer.identity_in_flight("a"), 1);
    assert_eq!(layer.identity_queued("a"), 1);
    assert_eq!(layer.tracked_identities(), 1);
    let mut at = Vec::new();
    for t in tasks {
        let o = t.await.unwrap();
        assert_eq!(o.status, 200);
        at.push(o.at_ms);
    }
    // One after the other, in the order they came.
    assert_eq!(at, [100, 200, 300]);
    assert_eq!(gauge.max(), 1);
    assert_eq!(layer.identity_in_flight("a"), 0);
    assert_eq!(layer.tracked_identities(), 0);
}

#[tokio::test(start_paused = true)]
async fn identity_waiter_cancelled_mid_queue_is_skipped() {
    let layer = ConcurrencyLayer::builder()
        .per_identity(1, 2, Duration::from_secs(1))
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_millis(100));
    let first = tokio::spawn(send(app.clone(), request(Some("a"))));
    let second = tokio::spawn(send(app.clone(), request(Some("a"))));
    let third = tokio::spawn(send(app.clone(), request(Some("a"))));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(layer.identity_queued("a"), 2);
    second.abort();
    assert!(second.await.unwrap_err().is_cancelled());
    assert_eq!(layer.identity_in_flight("a"), 1);
    assert_eq!(layer.identity_queued("a"), 1);
    // The place the second left is free again: a fourth may queue.
    let fourth = tokio::spawn(send(app.clone(), request(Some("a"))));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(layer.identity_queued("a"), 2);
    let outcomes = [first, third, fourth].map(|t| async { t.await.unwrap() });
    let mut at = Vec::new();
    for o in outcomes {
        let o = o.await;
        assert_eq!(o.status, 200);
        at.push(o.at_ms);
    }
    // From each one's start: the third runs from 100 ms to 200 ms, then
    // the fourth (sent at 10 ms) until 300 ms.
    assert_eq!(at, [100, 200, 290]);
    assert_eq!(gauge.calls(), 3);
    assert_eq!(layer.tracked_identities(), 0);
    assert_eq!(layer.stats().refused_identity_queue_full, 0);
}

#[tokio::test(start_paused = true)]
async fn permit_handed_to_a_waiter_that_is_dropped_passes_on() {
    let layer = ConcurrencyLayer::builder()
        .per_identity(1, 2, Duration::from_secs(1))
        .build()
        .unwrap();
    let mut svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
    }));
    let request = || {
        let mut req = Request::new(Full::default());
        req.extensions_mut()
            .insert(Identity::new("a", "tenant", "free"));
        req
    };
    let first = svc.call(request()).await.unwrap();
    // Queued in `call`, before any poll.
    let second = svc.call(request());
    let third = svc.call(request());
    assert_eq!(layer.identity_in_flight("a"), 1);
    assert_eq!(layer.identity_queued("a"), 2);
    // The first body goes: its permit is handed to the second at once.
    drop(first);
    assert_eq!(layer.identity_in_flight("a"), 1);
    assert_eq!(layer.identity_queued("a"), 1);
    // The second gives up without having woken: the permit passes on.
    drop(second);
    assert_eq!(layer.identity_in_flight("a"), 1);
    assert_eq!(layer.identity_queued("a"), 0);
    assert_eq!(layer.tracked_identities(), 1);
    let third = third.await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    drop(third);
    assert_eq!(layer.identity_in_flight("a"), 0);
    assert_eq!(layer.tracked_identities(), 0);
    let stats = layer.stats();
    assert_eq!(stats.refused_identity_deadline, 0);
    assert_eq!(stats.refused_identity_queue_full, 0);
}

#[tokio::test(start_paused = true)]
async fn global_permit_handed_to_a_waiter_that_is_dropped_passes_on() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 2, Duration::from_secs(1))
        .build()
        .unwrap();
    let mut svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
    }));
    let first = svc.call(Request::new(Full::default())).await.unwrap();
    let second = svc.call(Request::new(Full::default()));
    let third = svc.call(Request::new(Full::default()));
    assert_eq!((layer.in_flight(), layer.queued()), (1, 2));
    drop(first);
    assert_eq!((layer.in_flight(), layer.queued()), (1, 1));
    drop(second);
    assert_eq!((layer.in_flight(), layer.queued()), (1, 0));
    // A newcomer does not pass the third, which holds the permit.
    let fourth = svc.call(Request::new(Full::default()));
    assert_eq!((layer.in_flight(), layer.queued()), (1, 1));
    let third = third.await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    drop(third);
    let fourth = fourth.await.unwrap();
    drop(fourth);
    assert_eq!((layer.in_flight(), layer.queued()), (0, 0));
    let stats = layer.stats();
    assert_eq!(stats.refused_global_deadline, 0);
    assert_eq!(stats.refused_global_queue_full, 0);
}

#[tokio::test(start_paused = true)]
async fn thousands_of_queueing_identities_leave_no_entries() {
    let layer = ConcurrencyLayer::builder()
        .per_identity(1, 1, Duration::from_millis(50))
        .max_identities(2_000)
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_millis(100));
    let names: Vec<String> = (0..2_000).map(|i| format!("user-{i}")).collect();
    // Three requests each: one runs, one waits out its deadline, one finds
    // the queue full.
    let reqs = names
        .iter()
        .flat_map(|n| [request(Some(n)), request(Some(n)), request(Some(n))])
        .collect();
    let tasks = tokio::spawn({
        let app = app.clone();
        async move { burst(&app, reqs).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(layer.tracked_identities(), 2_000);
    assert_eq!(layer.identity_queued("user-1999"), 1);
    let outcomes = tasks.await.unwrap();
    assert_eq!(
        tally(&outcomes),
        BTreeMap::from([
            (key(200, 100, None), 2_000),
            (key(429, 0, Some("queue-full")), 2_000),
            (key(429, 50, Some("deadline-passed")), 2_000),
        ])
    );
    let stats = layer.stats();
    assert_eq!(stats.refused_identity_queue_full, 2_000);
    assert_eq!(stats.refused_identity_deadline, 2_000);
    assert_eq!(stats.tracked_identities, 0);
    assert_eq!(layer.identity_queued("user-1999"), 0);
}

#[tokio::test(start_paused = true)]
async fn identity_map_full_refuses_new_subjects_with_503() {
    let layer = ConcurrencyLayer::builder()
        .per_identity(2, 0, Duration::ZERO)
        .max_identities(3)
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_secs(1));

    let reqs = vec![
        request(Some("u1")),
        request(Some("u2")),
        request(Some("u3")),
        request(Some("u4")),
        request(Some("u5")),
        // u1 is already tracked: still admitted up to its own cap.
        request(Some("u1")),
    ];
    let outcomes = burst(&app, reqs).await;
    let statuses: Vec<u16> = outcomes.iter().map(|o| o.status).collect();
    assert_eq!(statuses, [200, 200, 200, 503, 503, 200]);
    for o in &outcomes[3..5] {
        assert_eq!(o.reason.as_deref(), Some("too-many-identities"));
        assert_eq!(o.scope.as_deref(), Some("global"));
        assert_eq!(o.retry_after.as_deref(), Some("1"));
    }
    assert_eq!(layer.stats().refused_too_many_identities, 2);
    assert_eq!(layer.tracked_identities(), 0);
}

#[tokio::test(start_paused = true)]
async fn cancelled_waiter_leaves_the_queue() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 1, Duration::from_secs(10))
        .per_identity(1, 1, Duration::from_secs(10))
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_secs(5));

    let holder = tokio::spawn(send(app.clone(), request(Some("a"))));
    let waiter = tokio::spawn(send(app.clone(), request(Some("b"))));
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(layer.in_flight(), 1);
    assert_eq!(layer.queued(), 1);
    assert_eq!(layer.tracked_identities(), 2);
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    assert_eq!(layer.queued(), 0);
    assert_eq!(layer.tracked_identities(), 1);
    assert_eq!(holder.await.unwrap().status, 200);
    assert_eq!(layer.in_flight(), 0);
    assert_eq!(layer.tracked_identities(), 0);
}

#[tokio::test(start_paused = true)]
async fn grpc_requests_get_grpc_statuses() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 0, Duration::ZERO)
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_secs(1));
    let grpc = || {
        Request::get("/")
            .header("content-type", "application/grpc")
            .body(Body::empty())
            .unwrap()
    };
    let first = tokio::spawn(app.clone().oneshot(grpc()));
    tokio::time::sleep(Duration::from_millis(1)).await;
    let refused = app.clone().oneshot(grpc()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::OK);
    assert_eq!(refused.headers()["grpc-status"], "14");
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn inner_error_releases_permits() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 0, Duration::ZERO)
        .build()
        .unwrap();
    let mut svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
        Err::<Response<Full<Bytes>>, _>("boom")
    }));
    let result = svc
        .ready()
        .await
        .unwrap()
        .call(Request::new(Full::default()))
        .await;
    assert_eq!(result.unwrap_err(), "boom");
    assert_eq!(layer.in_flight(), 0);
}

#[test]
fn bad_configuration_names_the_field() {
    let err = ConcurrencyLayer::builder()
        .global(0, 0, Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "global.limit");
    let err = ConcurrencyLayer::builder()
        .global(1, 5, Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "global.deadline");
    let err = ConcurrencyLayer::builder()
        .per_identity(0, 0, Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "per_identity.limit");
    let err = ConcurrencyLayer::builder()
        .per_identity(1, 0, Duration::ZERO)
        .max_identities(0)
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "max_identities");
    let err = ConcurrencyLayer::builder().build().unwrap_err();
    assert_eq!(err.field(), "global");
}

/// Any cap of at least 1 is a cap: the counts are plain integers, with no
/// semaphore's maximum behind them.
#[tokio::test(start_paused = true)]
async fn the_largest_caps_are_accepted_and_admit() {
    let layer = ConcurrencyLayer::builder()
        .global(usize::MAX, usize::MAX, Duration::from_secs(1))
        .per_identity(usize::MAX, 0, Duration::ZERO)
        .build()
        .unwrap();
    let gauge = Gauge::default();
    let app = app(&layer, &gauge, Duration::from_millis(10));
    let outcomes = burst(&app, (0..3).map(|_| request(Some("alice"))).collect()).await;
    assert_eq!(tally(&outcomes), BTreeMap::from([(key(200, 10, None), 3)]));
    assert_eq!(gauge.max(), 3);
    assert_eq!((layer.in_flight(), layer.queued()), (0, 0));
}

/// One handler running, counted on a [`Gauge`] until dropped.
struct Running<'a>(&'a Gauge);

impl<'a> Running<'a> {
    fn new(gauge: &'a Gauge) -> Self {
        gauge.calls.fetch_add(1, Ordering::SeqCst);
        let n = gauge.now.fetch_add(1, Ordering::SeqCst) + 1;
        gauge.max.fetch_max(n, Ordering::SeqCst);
        Running(gauge)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Real worker threads race for the caps: 4 workers, 2,000 requests from 20
/// identities, each handler yielding a few times, and every third caller
/// giving up (dropping its request) after a few polls, whether it is then
/// queued, running or sending its body. The global cap (4) and each
/// identity's (2) are never exceeded, every request not given up is
/// admitted (queues and deadlines are too large to refuse), and once all are
/// done nothing is held, queued or tracked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn caps_hold_across_worker_threads_with_callers_giving_up() {
    const USERS: usize = 20;
    const REQUESTS: usize = 2_000;
    let layer = ConcurrencyLayer::builder()
        .global(4, REQUESTS, Duration::from_secs(60))
        .per_identity(2, REQUESTS, Duration::from_secs(60))
        .build()
        .unwrap();
    let global = Gauge::default();
    let users: Arc<Vec<Gauge>> = Arc::new((0..USERS).map(|_| Gauge::default()).collect());
    let app = Router::new()
        .route(
            "/",
            get({
                let (global, users) = (global.clone(), users.clone());
                move |who: Identity| async move {
                    let user = &users[who.subject()[5..].parse::<usize>().unwrap()];
                    // Counted out on drop too: a caller that gives up drops
                    // the handler mid-run.
                    let _running = [Running::new(&global), Running::new(user)];
                    for _ in 0..3 {
                        tokio::task::yield_now().await;
                    }
                    "ok"
                }
            }),
        )
        .layer(layer.clone());
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move {
                let call = async {
                    let response = app
                        .oneshot(request(Some(&format!("user-{}", i % USERS))))
                        .await
                        .unwrap();
                    let status = response.status();
                    response.into_body().collect().await.unwrap();
                    status
                };
                if i % 3 != 0 {
                    return Some(call.await);
                }
                // Gives up after `i % 7` polls of its own.
                let give_up = async {
                    for _ in 0..i % 7 {
                        tokio::task::yield_now().await;
                    }
                };
                tokio::select! {
                    biased;
                    status = call => Some(status),
                    () = give_up => None,
                }
            })
        })
        .collect();
    let mut answered = 0;
    let mut gave_up = 0;
    for task in tasks {
        match task.await.unwrap() {
            Some(status) => {
                assert_eq!(status, StatusCode::OK);
                answered += 1;
            }
            None => gave_up += 1,
        }
    }
    assert_eq!(answered + gave_up, REQUESTS);
    // Every caller that never gives up is answered.
    let patient = (0..REQUESTS).filter(|i| i % 3 != 0).count();
    assert!(answered >= patient, "{answered} answered of {patient}");
    assert!(global.max() <= 4, "{} at once", global.max());
    for (i, user) in users.iter().enumerate() {
        assert!(user.max() <= 2, "user-{i}: {} at once", user.max());
    }
    assert_eq!((layer.in_flight(), layer.queued()), (0, 0));
    assert_eq!(layer.tracked_identities(), 0);
    let stats = layer.stats();
    assert_eq!(
        stats.refused_global_deadline + stats.refused_identity_deadline,
        0
    );
    assert_eq!(
        stats.refused_global_queue_full + stats.refused_identity_queue_full,
        0
    );
}

/// Two threads meet at a barrier, each sends one request through a global cap
/// of 1, and meet again once both are answered; 20,000 rounds. The one that
/// finds the permit taken must queue and be handed it when the other's
/// response is dropped, never wait for a permit freed while it was queueing:
/// no later request comes in the same round to hand it over, so such a wait
/// lasts the whole deadline and ends in a 503.
#[test]
fn a_permit_freed_while_a_caller_queues_reaches_it() {
    const ROUNDS: usize = 20_000;
    let layer = ConcurrencyLayer::builder()
        .global(1, 1, Duration::from_secs(5))
        .build()
        .unwrap();
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (layer, barrier) = (layer.clone(), barrier.clone());
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                    .unwrap();
                let service = layer.layer(service_fn(|_: Request<Body>| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                }));
                let mut refused = 0;
                for _ in 0..ROUNDS {
                    barrier.wait();
                    let response = runtime
                        .block_on(service.clone().oneshot(request(None)))
                        .unwrap();
                    refused += usize::from(response.status() != StatusCode::OK);
                    drop(response);
                    barrier.wait();
                }
                refused
            })
        })
        .collect();
    let refused: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(refused, [0, 0]);
    assert_eq!((layer.in_flight(), layer.queued()), (0, 0));
    assert_eq!(layer.stats().refused_global_deadline, 0);
}

/// A small deterministic generator for the random schedules below.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// Which request a handler call serves.
#[derive(Clone, Copy)]
struct RequestNo(usize);

/// Where each request of a random schedule is, as the test sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Seen {
    NotSent,
    Waiting,
    /// Its handler runs since this millisecond.
    Running(u64),
    Answered,
    GaveUp,
}

/// One request of a random schedule: every time is a whole millisecond and
/// even, so the checks, made at odd milliseconds, see no event half done.
#[derive(Debug, Clone, Copy)]
struct Planned {
    user: usize,
    arrive: u64,
    work: u64,
    /// When the caller gives up, after arriving, if it is still unanswered.
    give_up: Option<u64>,
}

/// Random arrivals of several users through a global cap and a per-identity
/// cap, each queueing with a deadline or shedding load, with handlers of
/// random length and callers that give up while queued or running. At
/// every millisecond between events:
///
/// - the handlers running stay within both caps, and the layer's counts
///   agree with what the callers see (in flight, queued, per identity);
/// - no permit idles while a request waits for it: a global queue only
///   while every global permit is held, an identity queue only while that
///   identity holds all its permits;
///
/// and each answer is the one its time allows: a 200 after its handler
/// ran, a queue-full refusal at once, an identity deadline exactly at its
/// deadline, a global one within both deadlines, every caller answered by
/// then, and a user's admitted requests started in arrival order. 1,000
/// schedules; `SEEDS=4,17` picks some.
#[test]
fn random_arrivals_deadlines_and_callers_giving_up_keep_both_caps_and_idle_no_permit() {
    let seeds: Vec<u64> = match std::env::var("SEEDS") {
        Ok(s) => s.split(',').map(|s| s.trim().parse().unwrap()).collect(),
        Err(_) => (0..1000).collect(),
    };
    for seed in seeds {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(random_schedule(seed));
    }
}

/// The longest handler, and the longest a caller waits before giving up.
const MAX_WORK_MS: u64 = 40;
const MAX_GIVE_UP_MS: u64 = 50;

async fn random_schedule(seed: u64) {
    let mut rng = SplitMix(seed);
    // Deadlines are even, so a deadline falls on an even millisecond.
    let g = rng.range(1, 4) as usize;
    let gq = rng.range(0, 6) as usize;
    let gd = 2 * rng.range(1, 15);
    let p = rng.range(1, 3) as usize;
    let pq = rng.range(0, 4) as usize;
    let pd = 2 * rng.range(1, 15);
    let users = rng.range(1, 5) as usize;
    let n = rng.range(20, 200) as usize;
    let mut at = 0;
    let plan: Vec<Planned> = (0..n)
        .map(|_| {
            at += 2 * rng.range(0, 3);
            Planned {
                user: rng.range(0, users as u64 - 1) as usize,
                arrive: at,
                work: 2 * rng.range(1, MAX_WORK_MS / 2),
                give_up: (rng.range(0, 3) == 0).then(|| 2 * rng.range(0, MAX_GIVE_UP_MS / 2)),
            }
        })
        .collect();
    let context = format!(
        "seed {seed}: global ({g}, {gq}, {gd} ms), per identity ({p}, {pq}, {pd} ms), {users} users"
    );
    let layer = ConcurrencyLayer::builder()
        .global(g, gq, Duration::from_millis(gd))
        .per_identity(p, pq, Duration::from_millis(pd))
        .build()
        .unwrap();
    let seen = Arc::new(std::sync::Mutex::new(vec![Seen::NotSent; n]));
    let start = Instant::now();
    let ms = move || u64::try_from(start.elapsed().as_millis()).unwrap();
    let handler = {
        let seen = seen.clone();
        service_fn(move |req: Request<Body>| {
            let seen = seen.clone();
            async move {
                let RequestNo(i) = *req.extensions().get::<RequestNo>().unwrap();
                seen.lock().unwrap()[i] = Seen::Running(ms());
                tokio::time::sleep(Duration::from_millis(work_of(&req))).await;
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
            }
        })
    };
    let service = layer.layer(handler);
    let callers: Vec<_> = plan
        .iter()
        .enumerate()
        .map(|(i, planned)| {
            let (service, seen, planned) = (service.clone(), seen.clone(), *planned);
            tokio::spawn(async move {
                tokio::time::sleep_until(start + Duration::from_millis(planned.arrive)).await;
                seen.lock().unwrap()[i] = Seen::Waiting;
                let mut req = request(Some(&format!("user-{}", planned.user)));
                req.extensions_mut().insert(RequestNo(i));
                req.extensions_mut().insert(Work(planned.work));
                let call = async {
                    let response = service.oneshot(req).await.unwrap();
                    let status = response.status().as_u16();
                    let reason = response.extensions().get::<OverloadReason>().copied();
                    let _ = response.into_body().collect().await.unwrap();
                    (status, reason)
                };
                let give_up = async {
                    match planned.give_up {
                        Some(after) => tokio::time::sleep(Duration::from_millis(after)).await,
                        None => std::future::pending().await,
                    }
                };
                let answer = tokio::select! {
                    biased;
                    answer = call => Some(answer),
                    () = give_up => None,
                };
                let was = std::mem::replace(
                    &mut seen.lock().unwrap()[i],
                    if answer.is_some() {
                        Seen::Answered
                    } else {
                        Seen::GaveUp
                    },
                );
                (answer, was, ms())
            })
        })
        .collect();
    // Every caller is answered or gone by then.
    let last = plan.last().map_or(0, |p| p.arrive) + (pd + gd + MAX_WORK_MS).max(MAX_GIVE_UP_MS);
    for tick in (1..=last + 1).step_by(2) {
        tokio::time::sleep_until(start + Duration::from_millis(tick)).await;
        check_caps(&layer, &seen.lock().unwrap(), &plan, (g, p), &context, tick);
    }
    let mut admitted_starts: Vec<Vec<(u64, u64)>> = vec![Vec::new(); users];
    let mut refused = [0u64; 4];
    for (i, caller) in callers.into_iter().enumerate() {
        let (answer, was, answered_at) = caller.await.unwrap();
        let planned = plan[i];
        let waited = answered_at - planned.arrive;
        let context = format!("{context}, request {i} {planned:?}: {answer:?} after {waited} ms");
        let Some((status, reason)) = answer else {
            assert_eq!(Some(waited), planned.give_up, "{context}");
            continue;
        };
        match (status, reason) {
            (200, None) => {
                let Seen::Running(started) = was else {
                    panic!("{context}: answered 200 from {was:?}");
                };
                assert_eq!(answered_at, started + planned.work, "{context}");
                assert!(started - planned.arrive <= pd + gd, "{context}");
                admitted_starts[planned.user].push((planned.arrive, started));
            }
            (429, Some(OverloadReason::QueueFull)) => {
                assert_eq!(waited, 0, "{context}");
                refused[0] += 1;
            }
            (429, Some(OverloadReason::DeadlinePassed)) => {
                assert!(pq > 0 && waited == pd, "{context}");
                refused[1] += 1;
            }
            (503, Some(OverloadReason::QueueFull)) => {
                assert!(waited <= pd, "{context}");
                refused[2] += 1;
            }
            (503, Some(OverloadReason::DeadlinePassed)) => {
                assert!(gq > 0 && (gd..=gd + pd).contains(&waited), "{context}");
                refused[3] += 1;
            }
            other => panic!("{context}: unexpected {other:?}"),
        }
    }
    for (user, mut starts) in admitted_starts.into_iter().enumerate() {
        starts.sort();
        for pair in starts.windows(2) {
            let ((a0, s0), (a1, s1)) = (pair[0], pair[1]);
            assert!(
                a0 == a1 || s0 <= s1,
                "{context}: user-{user} arrived at {a0} and {a1} but started at {s0} and {s1}"
            );
        }
    }
    let stats = layer.stats();
    assert_eq!(
        [
            stats.refused_identity_queue_full,
            stats.refused_identity_deadline,
            stats.refused_global_queue_full,
            stats.refused_global_deadline,
        ],
        refused,
        "{context}"
    );
    assert_eq!(stats.refused_too_many_identities, 0, "{context}");
    assert_eq!(
        (
            layer.in_flight(),
            layer.queued(),
            layer.tracked_identities()
        ),
        (0, 0, 0),
        "{context}"
    );
}

/// How long the handler of `req` works, in milliseconds.
#[derive(Clone, Copy)]
struct Work(u64);

fn work_of(req: &Request<Body>) -> u64 {
    req.extensions().get::<Work>().unwrap().0
}

/// The checks made between events; see the test above.
fn check_caps(
    layer: &ConcurrencyLayer,
    seen: &[Seen],
    plan: &[Planned],
    (g, p): (usize, usize),
    context: &str,
    tick: u64,
) {
    let context = format!("{context}, at {tick} ms");
    let users = plan.iter().map(|r| r.user).max().unwrap_or(0) + 1;
    let mut running = vec![0; users];
    let mut waiting = vec![0; users];
    for (state, planned) in seen.iter().zip(plan) {
        match state {
            Seen::Running(_) => running[planned.user] += 1,
            Seen::Waiting => waiting[planned.user] += 1,
            _ => {}
        }
    }
    let total: usize = running.iter().sum();
    assert!(total <= g, "{context}: {total} running");
    assert_eq!(layer.in_flight(), total, "{context}");
    let global_queue = layer.queued();
    if total < g {
        assert_eq!(global_queue, 0, "{context}: a global permit idles");
    }
    let mut waiting_for_global = 0;
    let mut tracked = 0;
    for user in 0..users {
        let subject = format!("user-{user}");
        let holding = layer.identity_in_flight(&subject);
        let queued = layer.identity_queued(&subject);
        let context = format!("{context}, {subject}");
        assert!(
            running[user] <= p && holding <= p,
            "{context}: {holding} held"
        );
        assert!(holding >= running[user], "{context}: {holding} held");
        // Holding a permit and not running: waiting in the global queue.
        waiting_for_global += holding - running[user];
        assert_eq!(
            waiting[user],
            queued + holding - running[user],
            "{context}: waiting"
        );
        if holding < p {
            assert_eq!(queued, 0, "{context}: an identity permit idles");
        }
        tracked += usize::from(holding + queued > 0);
    }
    assert_eq!(waiting_for_global, global_queue, "{context}");
    assert_eq!(layer.tracked_identities(), tracked, "{context}");
}

#[tokio::test(start_paused = true)]
async fn a_full_identity_map_advertises_no_cap_and_retries_after_its_own_rule() {
    let layer = |global: bool, retry_after: Option<Duration>| {
        let mut builder = ConcurrencyLayer::builder()
            .per_identity(2, 1, Duration::from_secs(5))
            .max_identities(1);
        if global {
            builder = builder.global(10, 0, Duration::ZERO);
        }
        if let Some(wait) = retry_after {
            builder = builder.retry_after(wait);
        }
        builder.build().unwrap()
    };
    for (global, retry_after, expected) in [
        (true, None, "1"),
        (false, None, "1"),
        (true, Some(Duration::from_millis(6500)), "7"),
    ] {
        let layer = layer(global, retry_after);
        let gauge = Gauge::default();
        let app = app(&layer, &gauge, Duration::from_secs(1));
        let outcomes = burst(&app, vec![request(Some("alice")), request(Some("bob"))]).await;
        let context = format!("global {global}, retry_after {retry_after:?}");
        assert_eq!(outcomes[0].status, 200, "{context}");
        let bob = &outcomes[1];
        assert_eq!(
            (
                bob.status,
                bob.at_ms,
                bob.reason.as_deref(),
                bob.scope.as_deref()
            ),
            (503, 0, Some("too-many-identities"), Some("global")),
            "{context}"
        );
        // The map counts callers, not requests: no concurrency quota to name.
        assert_eq!(bob.ratelimit, None, "{context}");
        assert_eq!(bob.retry_after.as_deref(), Some(expected), "{context}");
        assert_eq!(layer.tracked_identities(), 0, "{context}");
    }
}

/// The inner service of [`holding_service`]: answers at once.
fn answer(
    _req: Request<Full<Bytes>>,
) -> std::future::Ready<Result<Response<Full<Bytes>>, Infallible>> {
    std::future::ready(Ok(Response::new(Full::new(Bytes::from_static(b"done")))))
}

type Answer =
    fn(Request<Full<Bytes>>) -> std::future::Ready<Result<Response<Full<Bytes>>, Infallible>>;

/// A service whose responses hold their permits until they are dropped.
fn holding_service(
    layer: &ConcurrencyLayer,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<tower_admission::concurrency::PermitBody<Full<Bytes>>>,
    Error = Infallible,
> {
    layer.layer(service_fn(answer as Answer))
}

fn full_request(subject: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::default());
    if let Some(s) = subject {
        req.extensions_mut()
            .insert(Identity::new(s.to_owned(), "tenant", "free"));
    }
    req
}

fn reason_of<B>(response: &Response<B>) -> Option<OverloadReason> {
    response.extensions().get::<OverloadReason>().copied()
}

/// With `max_identities == limit + queue` of the global cap, a new subject
/// that finds the global cap full is refused by the global cap (queue
/// full), never for the map: a subject has an entry only while one of its
/// requests holds or waits for a global permit, including the instant a
/// leaving request hands its identity permit to the subject's next waiter.
#[tokio::test(start_paused = true)]
async fn a_map_sized_for_the_global_cap_never_refuses_too_many_identities() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 1, Duration::from_secs(10))
        .per_identity(1, 1, Duration::from_secs(10))
        .max_identities(2)
        .build()
        .unwrap();
    let mut svc = holding_service(&layer);
    let a1 = svc.call(full_request(Some("a"))).await.unwrap();
    assert_eq!(a1.status(), StatusCode::OK);
    // Queued in `call`, before any poll: a2 for a's permit, b1 for the
    // global one.
    let a2 = svc.call(full_request(Some("a")));
    let b1 = svc.call(full_request(Some("b")));
    assert_eq!((layer.in_flight(), layer.queued()), (1, 1));
    assert_eq!(layer.tracked_identities(), 2);
    // The global cap is full: c is refused by it, not by the map.
    let c = svc.call(full_request(Some("c"))).await.unwrap();
    assert_eq!(c.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reason_of(&c), Some(OverloadReason::QueueFull));
    // a1 goes: the global permit reaches b1, and a2 takes a's permit and the
    // global place b1 left, in the same step.
    drop(a1);
    assert_eq!((layer.in_flight(), layer.queued()), (1, 1));
    assert_eq!(layer.identity_in_flight("a"), 1);
    assert_eq!(layer.identity_queued("a"), 0);
    let d = svc.call(full_request(Some("d"))).await.unwrap();
    assert_eq!(d.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reason_of(&d), Some(OverloadReason::QueueFull));
    // Both queued requests are admitted in turn.
    let b1 = b1.await.unwrap();
    assert_eq!(b1.status(), StatusCode::OK);
    drop(b1);
    let a2 = a2.await.unwrap();
    assert_eq!(a2.status(), StatusCode::OK);
    drop(a2);
    let stats = layer.stats();
    assert_eq!(stats.refused_too_many_identities, 0);
    assert_eq!(stats.refused_global_queue_full, 2);
    assert_eq!((stats.global_in_flight, stats.global_queued), (0, 0));
    assert_eq!(stats.tracked_identities, 0);
}

/// A request that leaves hands its identity permit to its subject's next
/// waiter together with the global permit it frees (no global waiter being
/// there): a newcomer that comes before that waiter wakes up finds the
/// global cap full and is refused; it does not take the permit the waiter
/// is owed.
#[tokio::test(start_paused = true)]
async fn a_newcomer_does_not_take_the_global_permit_an_identity_waiter_is_owed() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 0, Duration::ZERO)
        .per_identity(1, 1, Duration::from_secs(10))
        .build()
        .unwrap();
    let mut svc = holding_service(&layer);
    let a1 = svc.call(full_request(Some("a"))).await.unwrap();
    let a2 = svc.call(full_request(Some("a")));
    assert_eq!(layer.identity_queued("a"), 1);
    drop(a1);
    let newcomer = svc.call(full_request(None)).await.unwrap();
    assert_eq!(newcomer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reason_of(&newcomer), Some(OverloadReason::QueueFull));
    // a2 holds both permits before it is polled.
    assert_eq!(layer.in_flight(), 1);
    assert_eq!(layer.identity_in_flight("a"), 1);
    let a2 = a2.await.unwrap();
    assert_eq!(a2.status(), StatusCode::OK);
    drop((newcomer, a2));
    let stats = layer.stats();
    assert_eq!(stats.refused_global_queue_full, 1);
    assert_eq!((stats.global_in_flight, stats.tracked_identities), (0, 0));
}

/// The global permit a request frees goes to the first global waiter; the
/// identity waiter it hands its own permit to takes a global place in the
/// same step, so a newcomer that arrives before the identity waiter wakes
/// up queues behind it and is served after it.
#[tokio::test(start_paused = true)]
async fn an_identity_waiter_joins_the_global_queue_before_a_newcomer() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 2, Duration::from_secs(10))
        .per_identity(1, 1, Duration::from_secs(10))
        .build()
        .unwrap();
    let mut svc = holding_service(&layer);
    let a1 = svc.call(full_request(Some("a"))).await.unwrap();
    let a2 = svc.call(full_request(Some("a")));
    let g1 = svc.call(full_request(None));
    assert_eq!((layer.in_flight(), layer.queued()), (1, 1));
    drop(a1);
    let g2 = svc.call(full_request(None));
    let g1 = g1.await.unwrap();
    assert_eq!(g1.status(), StatusCode::OK);
    drop(g1);
    // The permit g1 frees reaches a2, the first in the queue, not g2.
    let a2 = tokio::time::timeout(Duration::from_secs(1), a2)
        .await
        .expect("a2 is served before g2")
        .unwrap();
    assert_eq!(a2.status(), StatusCode::OK);
    // g2 still waits.
    assert_eq!((layer.in_flight(), layer.queued()), (1, 1));
    drop(a2);
    let g2 = g2.await.unwrap();
    assert_eq!(g2.status(), StatusCode::OK);
    drop(g2);
    let stats = layer.stats();
    assert_eq!((stats.global_in_flight, stats.global_queued), (0, 0));
    assert_eq!(
        stats.refused_global_deadline + stats.refused_global_queue_full,
        0
    );
    assert_eq!(stats.tracked_identities, 0);
}

/// Real worker threads race many distinct identities through a global cap
/// of 8 with 8 places and a map of exactly 16 identities: requests are
/// refused by the global cap (queue full) or by their own (queue full),
/// never for the map, and each request is either admitted or counted in
/// exactly one of those refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_map_sized_for_the_global_cap_never_refuses_across_worker_threads() {
    const REQUESTS: usize = 8_000;
    const USERS: usize = 1_000;
    let layer = ConcurrencyLayer::builder()
        .global(8, 8, Duration::from_secs(60))
        .per_identity(1, 1, Duration::from_secs(60))
        .max_identities(16)
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            get(|| async {
                for _ in 0..2 {
                    tokio::task::yield_now().await;
                }
                "ok"
            }),
        )
        .layer(layer.clone());
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move {
                let response = app
                    .oneshot(request(Some(&format!("user-{}", i % USERS))))
                    .await
                    .unwrap();
                let status = response.status();
                let reason = reason_of(&response);
                response.into_body().collect().await.unwrap();
                (status, reason)
            })
        })
        .collect();
    let mut seen: BTreeMap<(u16, Option<&'static str>), usize> = BTreeMap::new();
    for task in tasks {
        let (status, reason) = task.await.unwrap();
        *seen
            .entry((status.as_u16(), reason.map(OverloadReason::as_str)))
            .or_default() += 1;
    }
    let stats = layer.stats();
    assert_eq!(stats.refused_too_many_identities, 0, "{seen:?}");
    let admitted = seen.get(&(200, None)).copied().unwrap_or(0);
    let global_full = seen.get(&(503, Some("queue-full"))).copied().unwrap_or(0);
    let identity_full = seen.get(&(429, Some("queue-full"))).copied().unwrap_or(0);
    assert_eq!(admitted + global_full + identity_full, REQUESTS, "{seen:?}");
    assert_eq!(stats.refused_global_queue_full as usize, global_full);
    assert_eq!(stats.refused_identity_queue_full as usize, identity_full);
    assert_eq!(
        stats.refused_global_deadline + stats.refused_identity_deadline,
        0
    );
    assert_eq!((stats.global_in_flight, stats.global_queued), (0, 0));
    assert_eq!(stats.tracked_identities, 0);
}

/// One step of [`every_step_keeps_both_caps`].
#[derive(Debug, Clone)]
enum Step {
    /// A request of `user-N`, or without an identity.
    Arrive(Option<u8>),
    /// The admitted response at this index (modulo) is sent and dropped.
    Complete(usize),
    /// The waiting caller at this index (modulo) gives up.
    Cancel(usize),
    /// Time passes, one millisecond at a time.
    Advance(u64),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        4 => proptest::option::weighted(0.85, 0u8..3).prop_map(Step::Arrive),
        2 => any::<usize>().prop_map(Step::Complete),
        1 => any::<usize>().prop_map(Step::Cancel),
        2 => (1u64..25).prop_map(Step::Advance),
    ]
}

/// A request the handler has started and whose response is not yet
/// dropped; it lives in the response's extensions.
struct Started {
    counts: Arc<std::sync::Mutex<BTreeMap<Option<String>, usize>>>,
    user: Option<String>,
}

impl Drop for Started {
    fn drop(&mut self) {
        // After a failed check the lock is poisoned: nothing left to count.
        let Ok(mut counts) = self.counts.lock() else {
            return;
        };
        let n = counts.get_mut(&self.user).unwrap();
        *n -= 1;
        if *n == 0 {
            counts.remove(&self.user);
        }
    }
}

type PermitAnswer = Response<tower_admission::concurrency::PermitBody<Full<Bytes>>>;
type Pending =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<PermitAnswer, Infallible>>>>;

/// Arrivals, completions, callers giving up (queued or admitted) and
/// deadlines, interleaved at random, several in one instant: after every
/// step (once every waiter woken has been polled) the requests running
/// stay within the global cap and each user's cap (either alone, or
/// both), every permit held
/// belongs to a running request, no permit idles while a request waits,
/// every waiter is counted in exactly one queue, and each refusal comes at
/// its exact time. At the end nothing is held, queued or tracked.
#[test]
fn every_step_keeps_every_cap() {
    use proptest::prelude::*;
    let caps = (
        1usize..4,
        0usize..4,
        1u64..30,
        1usize..3,
        0usize..3,
        1u64..30,
        // Both caps, the global one alone, or the per-identity one alone.
        0u8..3,
    );
    let plan = proptest::collection::vec(step(), 1..120);
    proptest!(ProptestConfig::with_cases(500), |(caps in caps, plan in plan)| {
        let run = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap()
                .block_on(run_steps(caps, &plan));
        };
        #[cfg(feature = "metrics")]
        metrics::with_local_recorder(&gauges::RECORDER.with(|r| r.clone()), run);
        #[cfg(not(feature = "metrics"))]
        run();
    });
}

/// With the `metrics` feature, the gauges are checked against the layer's
/// own counts at every step too.
#[cfg(feature = "metrics")]
mod gauges {
    use std::cell::RefCell;
    use std::sync::Arc;

    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    use metrics_util::MetricKind;

    thread_local! {
        /// This thread's recorder, and the gauges summed over its snapshots
        /// (each snapshot holds the moves since the one before).
        pub(super) static RECORDER: Arc<DebuggingRecorder> = Arc::new(DebuggingRecorder::new());
        static TOTALS: RefCell<(Option<Snapshotter>, [f64; 5])> = const { RefCell::new((None, [0.0; 5])) };
    }

    const SERIES: [(&str, Option<&str>); 5] = [
        ("tower_admission_concurrency_in_flight", Some("global")),
        ("tower_admission_concurrency_queued", Some("global")),
        ("tower_admission_concurrency_in_flight", Some("identity")),
        ("tower_admission_concurrency_queued", Some("identity")),
        ("tower_admission_concurrency_tracked_identities", None),
    ];

    /// Global in flight and queued, identity in flight and queued, tracked.
    pub(super) fn now() -> [f64; 5] {
        TOTALS.with(|totals| {
            let mut totals = totals.borrow_mut();
            let (snapshotter, sums) = &mut *totals;
            let snapshotter = snapshotter.get_or_insert_with(|| RECORDER.with(|r| r.snapshotter()));
            for (key, _, _, value) in snapshotter.snapshot().into_vec() {
                let (MetricKind::Gauge, DebugValue::Gauge(moved)) = (key.kind(), value) else {
                    continue;
                };
                let scope = key.key().labels().find(|l| l.key() == "scope");
                let series = SERIES.iter().position(|(name, want)| {
                    *name == key.key().name() && scope.map(|l| l.value()) == *want
                });
                if let Some(i) = series {
                    sums[i] += moved.into_inner();
                }
            }
            *sums
        })
    }
}

async fn run_steps(
    (g, gq, gd, p, pq, pd, caps): (usize, usize, u64, usize, usize, u64, u8),
    plan: &[Step],
) {
    use std::task::{Context, Poll};
    let (global, per_identity) = (caps != 2, caps != 1);
    let context = format!(
        "global ({g}, {gq}, {gd} ms) {global}, per identity ({p}, {pq}, {pd} ms) {per_identity}"
    );
    let mut builder = ConcurrencyLayer::builder();
    if global {
        builder = builder.global(g, gq, Duration::from_millis(gd));
    }
    if per_identity {
        builder = builder.per_identity(p, pq, Duration::from_millis(pd));
    }
    let layer = builder.build().unwrap();
    let caps = (global.then_some(g), per_identity.then_some(p));
    let counts: Arc<std::sync::Mutex<BTreeMap<Option<String>, usize>>> = Arc::default();
    let service = layer.layer(service_fn({
        let counts = counts.clone();
        move |req: Request<Full<Bytes>>| {
            let user = req
                .extensions()
                .get::<Identity>()
                .map(|id| id.subject().to_owned());
            *counts.lock().unwrap().entry(user.clone()).or_default() += 1;
            let running = Arc::new(Started {
                counts: counts.clone(),
                user,
            });
            async move {
                let mut response = Response::new(Full::new(Bytes::from_static(b"ok")));
                response.extensions_mut().insert(running);
                Ok::<_, Infallible>(response)
            }
        }
    }));
    let start = Instant::now();
    let mut waiting: Vec<(Pending, Option<String>, Instant)> = Vec::new();
    let mut admitted: Vec<PermitAnswer> = Vec::new();
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let settle = |waiting: &mut Vec<(Pending, Option<String>, Instant)>,
                  admitted: &mut Vec<PermitAnswer>,
                  cx: &mut Context<'_>,
                  at: &str| {
        // Poll every waiter until none moves: one that leaves may wake another.
        loop {
            let mut moved = false;
            let mut i = 0;
            while i < waiting.len() {
                let Poll::Ready(answer) = waiting[i].0.as_mut().poll(cx) else {
                    i += 1;
                    continue;
                };
                moved = true;
                let (_, user, arrived) = waiting.swap_remove(i);
                let answer = answer.unwrap();
                let waited = (Instant::now() - arrived).as_millis() as u64;
                let reason = answer.extensions().get::<OverloadReason>().copied();
                let context = format!("{at}: {user:?} waited {waited} ms: {reason:?}");
                // Only an identified request can wait in both queues.
                let identified = user.is_some() && per_identity;
                match (answer.status().as_u16(), reason) {
                    (200, None) => admitted.push(answer),
                    (429, Some(OverloadReason::QueueFull)) => assert_eq!(waited, 0, "{context}"),
                    (429, Some(OverloadReason::DeadlinePassed)) => {
                        assert!(pq > 0 && waited == pd, "{context}")
                    }
                    (503, Some(OverloadReason::QueueFull)) => {
                        assert!(waited == 0 || (identified && waited <= pd), "{context}")
                    }
                    (503, Some(OverloadReason::DeadlinePassed)) => {
                        let most = if identified { gd + pd } else { gd };
                        assert!(gq > 0 && (gd..=most).contains(&waited), "{context}")
                    }
                    other => panic!("{context}: unexpected {other:?}"),
                }
            }
            if !moved {
                return;
            }
        }
    };
    for (n, step) in plan.iter().enumerate() {
        match *step {
            Step::Arrive(user) => {
                let user = user.map(|u| format!("user-{u}"));
                let mut req = Request::new(Full::default());
                if let Some(user) = &user {
                    req.extensions_mut()
                        .insert(Identity::new(user.as_str(), "t", "p"));
                }
                let call: Pending = Box::pin(service.clone().oneshot(req));
                waiting.push((call, user, Instant::now()));
            }
            Step::Complete(i) if !admitted.is_empty() => {
                drop(admitted.swap_remove(i % admitted.len()));
            }
            Step::Cancel(i) if !waiting.is_empty() => {
                drop(waiting.swap_remove(i % waiting.len()));
            }
            Step::Advance(ms) => {
                for _ in 0..ms {
                    tokio::time::advance(Duration::from_millis(1)).await;
                    let at = format!("{context}, step {n}, at {} ms", start.elapsed().as_millis());
                    settle(&mut waiting, &mut admitted, &mut cx, &at);
                    check_every_cap(&layer, &counts, waiting.len(), caps, &at);
                }
                continue;
            }
            _ => {}
        }
        let at = format!(
            "{context}, step {n} {step:?}, at {} ms",
            start.elapsed().as_millis()
        );
        settle(&mut waiting, &mut admitted, &mut cx, &at);
        check_every_cap(&layer, &counts, waiting.len(), caps, &at);
    }
    drop(waiting);
    drop(admitted);
    assert!(counts.lock().unwrap().is_empty(), "{context}");
    let left = (
        layer.in_flight(),
        layer.queued(),
        layer.tracked_identities(),
    );
    assert_eq!(
        left,
        (0, 0, 0),
        "{context}: held, queued, tracked at the end"
    );
}

fn check_every_cap(
    layer: &ConcurrencyLayer,
    counts: &std::sync::Mutex<BTreeMap<Option<String>, usize>>,
    waiting: usize,
    (global, per_identity): (Option<usize>, Option<usize>),
    at: &str,
) {
    let counts = counts.lock().unwrap();
    let total: usize = counts.values().sum();
    if let Some(g) = global {
        assert!(total <= g, "{at}: {total} running, global cap {g}");
        assert_eq!(layer.in_flight(), total, "{at}: global permits held");
        if total < g {
            assert_eq!(layer.queued(), 0, "{at}: a global permit idles");
        }
    } else {
        assert_eq!((layer.in_flight(), layer.queued()), (0, 0), "{at}");
    }
    let mut identity_queued = 0;
    let mut tracked = 0;
    for u in 0..3 {
        let user = format!("user-{u}");
        let running = counts.get(&Some(user.clone())).copied().unwrap_or(0);
        let (held, queued) = (
            layer.identity_in_flight(&user),
            layer.identity_queued(&user),
        );
        let Some(p) = per_identity else {
            assert_eq!((held, queued), (0, 0), "{at}: {user} without a cap");
            continue;
        };
        assert!(
            running <= p && held <= p,
            "{at}: {user} runs {running}, holds {held}"
        );
        assert!(held >= running, "{at}: {user} runs {running}, holds {held}");
        if held < p {
            assert_eq!(queued, 0, "{at}: an identity permit of {user} idles");
        }
        identity_queued += queued;
        tracked += usize::from(held + queued > 0);
    }
    assert_eq!(
        waiting,
        layer.queued() + identity_queued,
        "{at}: every waiter in one queue"
    );
    assert_eq!(
        layer.tracked_identities(),
        tracked,
        "{at}: identities tracked"
    );
    #[cfg(feature = "metrics")]
    {
        let held: usize = (0..3)
            .map(|u| layer.identity_in_flight(&format!("user-{u}")))
            .sum();
        let counts = [
            layer.in_flight(),
            layer.queued(),
            held,
            identity_queued,
            tracked,
        ];
        assert_eq!(gauges::now(), counts.map(|n| n as f64), "{at}: gauges");
    }
}
