//! Concurrency caps at their edges: inner readiness, panics,
//! extreme deadlines, callers that hang up.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{service_fn, Layer, Service, ServiceBuilder, ServiceExt};
use tower_admission::concurrency::{ConcurrencyLayer, OverloadReason};
use tower_admission::identity::Identity;

fn full_request(subject: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::default());
    if let Some(s) = subject {
        req.extensions_mut()
            .insert(Identity::new(s.to_owned(), "tenant", "free"));
    }
    req
}

async fn ok(_req: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"done"))))
}

/// A request waiting in the queue must not hold the inner service's
/// readiness: with tower's `ConcurrencyLimit` of 2 inside a global cap of 1
/// with 3 places, the third waiter still reaches the queue.
#[tokio::test(start_paused = true)]
async fn waiters_do_not_hold_the_inner_services_readiness() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 3, Duration::from_secs(10))
        .build()
        .unwrap();
    let mut svc = ServiceBuilder::new()
        .layer(layer.clone())
        .concurrency_limit(2)
        .service_fn(ok);
    let a = svc
        .ready()
        .await
        .unwrap()
        .call(full_request(None))
        .await
        .unwrap();
    assert_eq!(a.status(), StatusCode::OK);
    let mut waiters = Vec::new();
    for i in 0..3 {
        let ready = tokio::time::timeout(Duration::from_millis(1), svc.ready()).await;
        assert!(ready.is_ok(), "waiter {i} blocked in poll_ready");
        waiters.push(svc.call(full_request(None)));
    }
    assert_eq!((layer.in_flight(), layer.queued()), (1, 3));
    // The fourth is refused at once, queue full.
    let d = svc
        .ready()
        .await
        .unwrap()
        .call(full_request(None))
        .await
        .unwrap();
    assert_eq!(d.status(), StatusCode::SERVICE_UNAVAILABLE);
    drop(a);
    for w in waiters {
        let r = w.await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    assert_eq!((layer.in_flight(), layer.queued()), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_panicking_handler_gives_its_permits_back() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 1, Duration::from_secs(10))
        .per_identity(1, 1, Duration::from_secs(10))
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
        tokio::task::yield_now().await;
        if true {
            panic!("handler bug");
        }
        Ok::<Response<Full<Bytes>>, Infallible>(Response::new(Full::default()))
    }));
    let first = tokio::spawn(svc.clone().oneshot(full_request(Some("a"))));
    let second = tokio::spawn(svc.clone().oneshot(full_request(Some("a"))));
    assert!(first.await.unwrap_err().is_panic());
    assert!(second.await.unwrap_err().is_panic());
    let s = layer.stats();
    assert_eq!(
        (s.global_in_flight, s.global_queued, s.tracked_identities),
        (0, 0, 0)
    );
}

/// A deadline past one day is refused when built (`Duration::MAX` was taken
/// and sent as `Retry-After: 18446744073709551615`); one day is the most.
#[test]
fn a_deadline_or_retry_after_over_one_day_is_refused_when_built() {
    let day = Duration::from_secs(86_400);
    let over = day + Duration::from_nanos(1);
    let global = |deadline| ConcurrencyLayer::builder().global(1, 1, deadline).build();
    let identity = |deadline| {
        ConcurrencyLayer::builder()
            .per_identity(1, 1, deadline)
            .build()
    };
    for (built, field) in [
        (global(Duration::MAX), "global.deadline"),
        (global(over), "global.deadline"),
        (identity(Duration::MAX), "per_identity.deadline"),
        (
            ConcurrencyLayer::builder()
                .global(1, 1, day)
                .retry_after(over)
                .build(),
            "retry_after",
        ),
    ] {
        let e = built.expect_err(field);
        assert_eq!((e.field(), e.reason()), (field, "must be at most one day"));
    }
    assert!(global(day).is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_one_day_deadline_waits_and_retry_after_says_one_day() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 1, Duration::from_secs(86_400))
        .build()
        .unwrap();
    let mut svc = layer.layer(service_fn(ok));
    let a = svc.call(full_request(None)).await.unwrap();
    let waiter = svc.call(full_request(None));
    let refused = svc.call(full_request(None)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.extensions().get::<OverloadReason>(),
        Some(&OverloadReason::QueueFull)
    );
    assert_eq!(refused.headers()[RETRY_AFTER], "86400");
    tokio::time::sleep(Duration::from_secs(86_399)).await;
    drop(a);
    assert_eq!(waiter.await.unwrap().status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn sub_second_deadline_retry_after_is_1() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 1, Duration::from_nanos(1))
        .build()
        .unwrap();
    let mut svc = layer.layer(service_fn(ok));
    let a = svc.call(full_request(None)).await.unwrap();
    let waiter = svc.call(full_request(None)).await.unwrap();
    assert_eq!(waiter.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        waiter.extensions().get::<OverloadReason>(),
        Some(&OverloadReason::DeadlinePassed)
    );
    assert_eq!(waiter.headers()[RETRY_AFTER], "1");
    drop(a);
    assert_eq!(layer.queued(), 0);
}

/// A long-lived service driven `ready` then `call`, over tower's
/// `ConcurrencyLimit` of 1: a request the caps queue gives up the inner
/// permit its `poll_ready` reserved, so the waiter holding the caps' permit
/// can take it.
#[tokio::test(start_paused = true)]
async fn a_queued_call_gives_up_the_inner_permit_its_readiness_reserved() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 2, Duration::from_secs(10))
        .build()
        .unwrap();
    let mut svc = ServiceBuilder::new()
        .layer(layer.clone())
        .concurrency_limit(1)
        .service_fn(ok);
    let a = svc
        .ready()
        .await
        .unwrap()
        .call(full_request(None))
        .await
        .unwrap();
    let mut b = Box::pin(svc.ready().await.unwrap().call(full_request(None)));
    // The caller polls ready again, reserving the one inner permit, and a
    // leaves: b holds the caps' permit and waits for the inner one.
    svc.ready().await.unwrap();
    drop(a);
    let waited = tokio::time::timeout(Duration::from_secs(1), &mut b).await;
    assert!(
        waited.is_err(),
        "the caller's readiness holds the inner permit"
    );
    assert_eq!((layer.in_flight(), layer.queued()), (1, 0));
    // The caller's next call is queued and gives up that readiness: b runs.
    let c = svc.call(full_request(None));
    assert_eq!((layer.in_flight(), layer.queued()), (1, 1));
    let b = tokio::time::timeout(Duration::from_secs(1), b)
        .await
        .expect("b gets the inner permit")
        .unwrap();
    assert_eq!(b.status(), StatusCode::OK);
    drop(b);
    assert_eq!(c.await.unwrap().status(), StatusCode::OK);
    assert_eq!((layer.in_flight(), layer.queued()), (0, 0));
}

/// tower's `Buffer` inside the caps: queued requests hold no buffer slot.
#[tokio::test(start_paused = true)]
async fn a_buffer_inside_the_caps_is_not_filled_by_waiters() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 4, Duration::from_secs(10))
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .buffer(1)
        .service_fn(ok);
    let a = svc.clone().oneshot(full_request(None)).await.unwrap();
    let waiters: Vec<_> = (0..4)
        .map(|_| tokio::spawn(svc.clone().oneshot(full_request(None))))
        .collect();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!((layer.in_flight(), layer.queued()), (1, 4));
    let refused = svc.clone().oneshot(full_request(None)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    drop(a);
    for w in waiters {
        assert_eq!(w.await.unwrap().unwrap().status(), StatusCode::OK);
    }
    assert_eq!((layer.in_flight(), layer.queued()), (0, 0));
}

/// A `Buffer` outside the caps: its worker hands each request to the caps
/// at once, so the caps' queue, not the buffer, decides.
#[tokio::test(start_paused = true)]
async fn a_buffer_outside_the_caps_hands_requests_on_at_once() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 3, Duration::from_millis(100))
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .buffer(1)
        .layer(layer.clone())
        .service_fn(ok);
    let a = svc.clone().oneshot(full_request(None)).await.unwrap();
    let waiters: Vec<_> = (0..3)
        .map(|_| tokio::spawn(svc.clone().oneshot(full_request(None))))
        .collect();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!((layer.in_flight(), layer.queued()), (1, 3));
    let refused = svc.clone().oneshot(full_request(None)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    for w in waiters {
        let r = w.await.unwrap().unwrap();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            r.extensions().get::<OverloadReason>(),
            Some(&OverloadReason::DeadlinePassed)
        );
    }
    drop(a);
    assert_eq!((layer.in_flight(), layer.queued()), (0, 0));
}

/// An inner service whose `poll_ready` fails once `broken` is set.
#[derive(Clone)]
struct Breaks(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Service<Request<Full<Bytes>>> for Breaks {
    type Response = Response<Full<Bytes>>;
    type Error = &'static str;
    type Future = std::future::Ready<Result<Response<Full<Bytes>>, &'static str>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        if self.0.load(std::sync::atomic::Ordering::SeqCst) {
            std::task::Poll::Ready(Err("broken"))
        } else {
            std::task::Poll::Ready(Ok(()))
        }
    }

    fn call(&mut self, _req: Request<Full<Bytes>>) -> Self::Future {
        std::future::ready(Ok(Response::new(Full::default())))
    }
}

/// A waiter handed its permits polls the inner service ready; when that
/// fails, the error is its answer and the permits go back at once.
#[tokio::test(start_paused = true)]
async fn a_waiter_whose_inner_service_fails_ready_gives_its_permits_back() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 1, Duration::from_secs(10))
        .per_identity(1, 1, Duration::from_secs(10))
        .build()
        .unwrap();
    let broken = Breaks(Default::default());
    let mut svc = layer.layer(broken.clone());
    let a = svc
        .ready()
        .await
        .unwrap()
        .call(full_request(Some("a")))
        .await
        .unwrap();
    let b = svc.ready().await.unwrap().call(full_request(Some("a")));
    assert_eq!(layer.identity_queued("a"), 1);
    broken.0.store(true, std::sync::atomic::Ordering::SeqCst);
    drop(a);
    assert_eq!(b.await.unwrap_err(), "broken");
    let s = layer.stats();
    assert_eq!(
        (s.global_in_flight, s.global_queued, s.tracked_identities),
        (0, 0, 0)
    );
}

/// A caller that hangs up while queued (its future dropped, never polled)
/// frees its place at once and never takes a permit: the next waiter and a
/// newcomer in the freed place are served in order.
#[tokio::test(start_paused = true)]
async fn a_caller_that_hangs_up_while_queued_frees_its_place_at_once() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 2, Duration::from_secs(10))
        .per_identity(1, 2, Duration::from_secs(10))
        .build()
        .unwrap();
    let mut svc = layer.layer(service_fn(ok));
    let a = svc.call(full_request(Some("a"))).await.unwrap();
    let b = svc.call(full_request(None));
    let a2 = svc.call(full_request(Some("a")));
    assert_eq!((layer.in_flight(), layer.queued()), (1, 1));
    assert_eq!(layer.identity_queued("a"), 1);
    drop(b);
    drop(a2);
    assert_eq!((layer.in_flight(), layer.queued()), (1, 0));
    assert_eq!(layer.identity_queued("a"), 0);
    let c = svc.call(full_request(None));
    let d = svc.call(full_request(None));
    assert_eq!(layer.queued(), 2);
    drop(a);
    assert_eq!((layer.in_flight(), layer.queued()), (1, 1));
    let c = c.await.unwrap();
    assert_eq!(c.status(), StatusCode::OK);
    drop(c);
    let d = d.await.unwrap();
    assert_eq!(d.status(), StatusCode::OK);
    drop(d);
    let s = layer.stats();
    assert_eq!(
        (s.global_in_flight, s.global_queued, s.tracked_identities),
        (0, 0, 0)
    );
}
