//! Concurrency caps on their hot path: the per-identity map and the global
//! cap share one lock, and a request finds its entry again by the address
//! of the entry's key. These tests pin the counts around the cases that
//! design must get right: entries removed and made again, a subject's
//! requests carrying different `Identity` values, and identified and
//! unidentified requests meeting in one global cap and queue.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{service_fn, Layer, ServiceExt};
use tower_admission::concurrency::{ConcurrencyLayer, OverloadReason, PermitBody};
use tower_admission::identity::Identity;

type Reply = Response<PermitBody<Full<Bytes>>>;

fn request(subject: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::default());
    if let Some(s) = subject {
        // A new `Identity` (and a new subject allocation) every time, as
        // an authentication layer makes one per request.
        req.extensions_mut()
            .insert(Identity::new(s.to_owned(), "tenant", "free"));
    }
    req
}

async fn ok(_req: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"done"))))
}

/// The caps' counts: global in flight and queued, tracked identities, and
/// alice's in flight and queued.
fn counts(layer: &ConcurrencyLayer) -> [usize; 5] {
    [
        layer.in_flight(),
        layer.queued(),
        layer.tracked_identities(),
        layer.identity_in_flight("alice"),
        layer.identity_queued("alice"),
    ]
}

/// Requests of one subject come and go in an overlapping chain, so the
/// subject's entry is made by one request and given back by another, and
/// (when the chain breaks) removed and made again by a request with a key
/// of its own: every permit goes back to the entry that holds it.
#[tokio::test(start_paused = true)]
async fn a_subjects_entry_made_by_one_request_and_emptied_by_another_counts_exactly() {
    let layer = ConcurrencyLayer::builder()
        .global(4, 0, Duration::ZERO)
        .per_identity(2, 0, Duration::ZERO)
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let mut held: Option<Reply> = None;
    for round in 0..200 {
        let next = svc.clone().oneshot(request(Some("alice"))).await.unwrap();
        assert_eq!(next.status(), StatusCode::OK, "round {round}");
        let expected = if held.is_some() { 2 } else { 1 };
        assert_eq!(
            counts(&layer),
            [expected, 0, 1, expected, 0],
            "round {round}"
        );
        // The one who made the entry leaves first; every third round the
        // newcomer leaves too, and the entry is removed.
        held = None;
        if round % 3 == 2 {
            drop(next);
            assert_eq!(counts(&layer), [0, 0, 0, 0, 0], "round {round}");
        } else {
            held = Some(next);
            assert_eq!(counts(&layer), [1, 0, 1, 1, 0], "round {round}");
        }
    }
    drop(held);
    assert_eq!(counts(&layer), [0, 0, 0, 0, 0]);
    assert_eq!(layer.stats().refused_identity_queue_full, 0);
}

/// A third request of alice over her cap of 2 is refused while both
/// permits are held by requests with other `Identity` values, and the
/// refusal takes nothing from the global cap.
#[tokio::test(start_paused = true)]
async fn a_refusal_over_the_identity_cap_takes_nothing_of_the_global_cap() {
    let layer = ConcurrencyLayer::builder()
        .global(3, 0, Duration::ZERO)
        .per_identity(2, 0, Duration::ZERO)
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let a = svc.clone().oneshot(request(Some("alice"))).await.unwrap();
    let b = svc.clone().oneshot(request(Some("alice"))).await.unwrap();
    let c = svc.clone().oneshot(request(Some("alice"))).await.unwrap();
    assert_eq!(c.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(c.extensions().get(), Some(&OverloadReason::QueueFull));
    assert_eq!(counts(&layer), [2, 0, 1, 2, 0]);
    // The global permit left is still there for someone else.
    let u = svc.clone().oneshot(request(None)).await.unwrap();
    assert_eq!(u.status(), StatusCode::OK);
    assert_eq!(counts(&layer), [3, 0, 1, 2, 0]);
    drop((a, b, c, u));
    assert_eq!(counts(&layer), [0, 0, 0, 0, 0]);
    assert_eq!(layer.stats().refused_identity_queue_full, 1);
}

/// Identified and unidentified requests share one global cap and queue
/// in arrival order: an unidentified request queued first gets the permit
/// an identified one gives back, and a new subject that finds the global
/// cap full is refused by it.
#[tokio::test(start_paused = true)]
async fn identified_and_unidentified_requests_share_the_global_queue_in_order() {
    let layer = ConcurrencyLayer::builder()
        .global(2, 1, Duration::from_secs(10))
        .per_identity(1, 0, Duration::ZERO)
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let u1 = svc.clone().oneshot(request(None)).await.unwrap();
    let a = svc.clone().oneshot(request(Some("alice"))).await.unwrap();
    let u2 = tokio::spawn(svc.clone().oneshot(request(None)));
    tokio::task::yield_now().await;
    assert_eq!(counts(&layer), [2, 1, 1, 1, 0]);
    let bob = svc.clone().oneshot(request(Some("bob"))).await.unwrap();
    assert_eq!(bob.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(bob.extensions().get(), Some(&OverloadReason::QueueFull));
    assert_eq!(layer.identity_in_flight("bob"), 0);
    // Alice leaves: her global permit goes to the queued request.
    drop(a);
    let u2 = u2.await.unwrap().unwrap();
    assert_eq!(u2.status(), StatusCode::OK);
    assert_eq!(counts(&layer), [2, 0, 0, 0, 0]);
    drop((u1, u2));
    assert_eq!(counts(&layer), [0, 0, 0, 0, 0]);
    let stats = layer.stats();
    assert_eq!(stats.refused_global_queue_full, 1);
    assert_eq!(stats.refused_too_many_identities, 0);
}

/// Alice's identity permit is handed to her waiter while an unidentified
/// request waits first in the global queue: the freed global permit goes to
/// that request and alice's waiter takes the place behind it, then gets the
/// next permit.
#[tokio::test(start_paused = true)]
async fn a_handed_identity_permit_queues_behind_an_unidentified_waiter() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 1, Duration::from_secs(10))
        .per_identity(1, 1, Duration::from_secs(10))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let a = svc.clone().oneshot(request(Some("alice"))).await.unwrap();
    let b = tokio::spawn(svc.clone().oneshot(request(Some("alice"))));
    tokio::task::yield_now().await;
    let u = tokio::spawn(svc.clone().oneshot(request(None)));
    tokio::task::yield_now().await;
    assert_eq!(counts(&layer), [1, 1, 1, 1, 1]);
    drop(a);
    let u = u.await.unwrap().unwrap();
    assert_eq!(u.status(), StatusCode::OK);
    tokio::task::yield_now().await;
    // Alice's waiter holds her identity permit and the global queue's
    // place.
    assert_eq!(counts(&layer), [1, 1, 1, 1, 0]);
    drop(u);
    let b = b.await.unwrap().unwrap();
    assert_eq!(b.status(), StatusCode::OK);
    assert_eq!(counts(&layer), [1, 0, 1, 1, 0]);
    drop(b);
    assert_eq!(counts(&layer), [0, 0, 0, 0, 0]);
}

/// A waiter that is cancelled after it was handed its identity permit and
/// a global place gives back both, and the entry goes.
#[tokio::test(start_paused = true)]
async fn a_cancelled_handed_waiter_gives_everything_back() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 1, Duration::from_secs(10))
        .per_identity(1, 1, Duration::from_secs(10))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    let a = svc.clone().oneshot(request(Some("alice"))).await.unwrap();
    let b = tokio::spawn(svc.clone().oneshot(request(Some("alice"))));
    tokio::task::yield_now().await;
    let u = tokio::spawn(svc.clone().oneshot(request(None)));
    tokio::task::yield_now().await;
    drop(a);
    let u = u.await.unwrap().unwrap();
    tokio::task::yield_now().await;
    assert_eq!(counts(&layer), [1, 1, 1, 1, 0]);
    b.abort();
    let _ = b.await;
    assert_eq!(counts(&layer), [1, 0, 0, 0, 0]);
    drop(u);
    assert_eq!(counts(&layer), [0, 0, 0, 0, 0]);
}
