//! Live reconfiguration of the concurrency caps, under paused Tokio time:
//! a lowered cap holds once the requests admitted under the old one have
//! finished, a raised cap admits waiters at once (global and per identity),
//! and a change of shape is refused.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tower::ServiceExt;
use tower_admission::concurrency::{AdaptiveLimit, ConcurrencyLayer};
use tower_admission::identity::Identity;

const DEADLINE: Duration = Duration::from_secs(3600);

/// Handlers that run until the test lets one finish, counting how many run.
#[derive(Clone)]
struct Handlers {
    running: Arc<AtomicUsize>,
    /// The most running at once since [`Handlers::reset_peak`].
    peak: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
    finish: Arc<Semaphore>,
}

impl Handlers {
    fn new() -> Self {
        Handlers {
            running: Arc::default(),
            peak: Arc::default(),
            finished: Arc::default(),
            finish: Arc::new(Semaphore::new(0)),
        }
    }

    fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    fn reset_peak(&self) {
        self.peak.store(self.running(), Ordering::SeqCst);
    }

    fn app(&self, layer: &ConcurrencyLayer) -> Router {
        let this = self.clone();
        Router::new()
            .route(
                "/",
                get(move || {
                    let this = this.clone();
                    async move {
                        let n = this.running.fetch_add(1, Ordering::SeqCst) + 1;
                        this.peak.fetch_max(n, Ordering::SeqCst);
                        this.finish.acquire().await.unwrap().forget();
                        this.running.fetch_sub(1, Ordering::SeqCst);
                        this.finished.fetch_add(1, Ordering::SeqCst);
                        "ok"
                    }
                }),
            )
            .layer(layer.clone())
    }

    /// Lets `n` running handlers finish and waits until they have.
    async fn finish(&self, n: usize) {
        let before = self.finished.load(Ordering::SeqCst);
        self.finish.add_permits(n);
        settle(|| self.finished.load(Ordering::SeqCst) == before + n).await;
    }
}

/// Sends `n` requests of `subject` (none: no identity) in tasks of their own.
fn send(app: &Router, n: usize, subject: Option<&str>) -> Vec<JoinHandle<StatusCode>> {
    (0..n)
        .map(|_| {
            let mut req = Request::builder().uri("/").body(Body::empty()).unwrap();
            if let Some(subject) = subject {
                req.extensions_mut()
                    .insert(Identity::new(subject, "acme", "free"));
            }
            let app = app.clone();
            tokio::spawn(async move { app.oneshot(req).await.unwrap().status() })
        })
        .collect()
}

/// Lets every task run until `done` holds; panics after a bounded number of
/// rounds (paused time: each round is 1 ms of it).
async fn settle(done: impl Fn() -> bool) {
    for _ in 0..1_000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("the condition did not hold within 1,000 rounds");
}

#[tokio::test(start_paused = true)]
async fn lowering_the_global_cap_from_64_to_8_holds_once_the_64_have_finished() {
    let layer = ConcurrencyLayer::builder()
        .global(64, 1_000, DEADLINE)
        .build()
        .unwrap();
    let reload = layer.reload_handle();
    let handlers = Handlers::new();
    let app = handlers.app(&layer);
    let mut requests = send(&app, 64, None);
    settle(|| handlers.running() == 64).await;
    requests.extend(send(&app, 200, None));
    settle(|| layer.queued() == 200).await;

    reload
        .apply(ConcurrencyLayer::builder().global(8, 1_000, DEADLINE))
        .unwrap();
    assert_eq!(reload.generation(), 1);
    // Those admitted under 64 run on; no waiter is admitted until fewer
    // than 8 hold a permit.
    assert_eq!(handlers.running(), 64);
    for left in (8..64).rev() {
        handlers.finish(1).await;
        assert_eq!(handlers.running(), left);
        assert_eq!(layer.in_flight(), left);
        assert_eq!(layer.queued(), 200);
    }
    // From here on exactly 8 run while waiters remain, never more.
    handlers.reset_peak();
    for waiting in (0..200).rev() {
        handlers.finish(1).await;
        settle(|| layer.queued() == waiting).await;
        assert_eq!(handlers.running(), 8);
    }
    assert_eq!(handlers.peak(), 8);
    handlers.finish(8).await;
    for request in requests {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(layer.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn raising_the_caps_admits_waiters_at_once_global_and_per_identity() {
    let layer = ConcurrencyLayer::builder()
        .global(4, 100, DEADLINE)
        .per_identity(2, 100, DEADLINE)
        .build()
        .unwrap();
    let reload = layer.reload_handle();
    let handlers = Handlers::new();
    let app = handlers.app(&layer);
    // alice: 2 run, 6 wait in her queue; bob and carol: 2 run between them
    // (the global cap), the rest wait in the global queue.
    let mut requests = send(&app, 8, Some("alice"));
    requests.extend(send(&app, 3, Some("bob")));
    requests.extend(send(&app, 3, Some("carol")));
    settle(|| handlers.running() == 4).await;
    assert_eq!(layer.identity_in_flight("alice"), 2);
    assert_eq!(layer.identity_queued("alice"), 6);

    // Raised with no request finishing: the waiters are admitted now.
    reload
        .apply(
            ConcurrencyLayer::builder()
                .global(100, 100, DEADLINE)
                .per_identity(5, 100, DEADLINE),
        )
        .unwrap();
    settle(|| handlers.running() == 5 + 3 + 3).await;
    assert_eq!(layer.identity_in_flight("alice"), 5);
    assert_eq!(layer.identity_queued("alice"), 3);
    assert_eq!(layer.queued(), 0);

    // Lowered per identity: alice's 5 run on; her waiters wait until fewer
    // than 1 of hers hold a permit.
    reload
        .apply(
            ConcurrencyLayer::builder()
                .global(100, 100, DEADLINE)
                .per_identity(1, 100, DEADLINE),
        )
        .unwrap();
    handlers.finish(handlers.running()).await;
    settle(|| layer.identity_in_flight("alice") == 1).await;
    handlers.reset_peak();
    for waiting in (0..3).rev() {
        assert_eq!(layer.identity_queued("alice"), waiting);
        handlers.finish(1).await;
        settle(|| layer.identity_queued("alice") == waiting.saturating_sub(1)).await;
    }
    assert_eq!(handlers.peak(), 1);
    handlers.finish(handlers.running()).await;
    for request in requests {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
}

#[tokio::test(start_paused = true)]
async fn a_gate_takes_a_new_fixed_limit_and_an_adaptive_one_new_bounds() {
    use tower_admission::concurrency::Criticality;
    let classified = |limit| {
        ConcurrencyLayer::builder()
            .global(limit, 100, DEADLINE)
            .criticality(|_| Criticality::Critical)
    };
    let layer = classified(2).build().unwrap();
    let reload = layer.reload_handle();
    let handlers = Handlers::new();
    let app = handlers.app(&layer);
    let requests = send(&app, 6, None);
    settle(|| handlers.running() == 2).await;
    reload.apply(classified(5)).unwrap();
    settle(|| handlers.running() == 5).await;
    handlers.finish(6).await;
    for request in requests {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }

    let adaptive = |floor, ceiling| {
        ConcurrencyLayer::builder().global_adaptive(
            AdaptiveLimit::default()
                .bounds(floor, ceiling)
                .initial(floor),
            10,
            DEADLINE,
        )
    };
    let layer = adaptive(50, 100).build().unwrap();
    let reload = layer.reload_handle();
    let limit = || layer.stats().limit.unwrap();
    // Clamped into the new bounds at once, also while a probe runs.
    reload.apply(adaptive(2, 4)).unwrap();
    assert!((2..=4).contains(&limit()), "{}", limit());
    // Anything else of an adaptive limit cannot change while running.
    let other = ConcurrencyLayer::builder().global_adaptive(
        AdaptiveLimit::default()
            .bounds(2, 4)
            .initial(2)
            .backoff(0.5),
        10,
        DEADLINE,
    );
    let err = reload.apply(other).unwrap_err();
    assert_eq!(err.field(), "global_adaptive");
    assert_eq!(reload.generation(), 1);
}

#[test]
fn a_change_of_shape_or_a_bad_number_is_refused_and_changes_nothing() {
    let second = Duration::from_secs(1);
    let layer = ConcurrencyLayer::builder()
        .global(64, 128, second)
        .build()
        .unwrap();
    let reload = layer.reload_handle();
    let refused = |builder| reload.apply(builder).unwrap_err();
    // The same error as build().
    let zero = ConcurrencyLayer::builder().global(0, 128, second);
    assert_eq!(refused(zero.clone()).field(), "global.limit");
    assert_eq!(refused(zero.clone()), zero.build().unwrap_err());
    let per_identity = ConcurrencyLayer::builder().per_identity(2, 2, second);
    assert_eq!(refused(per_identity).field(), "global");
    let adaptive =
        ConcurrencyLayer::builder().global_adaptive(AdaptiveLimit::default(), 10, second);
    assert_eq!(refused(adaptive).field(), "global");
    assert_eq!(reload.generation(), 0);
    assert_eq!(
        format!("{layer:?}").matches("limit: 64").count(),
        1,
        "{layer:?}"
    );
}
