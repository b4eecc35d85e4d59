//! The quota engine across features that touch the same state: shadow
//! policies, failure modes and settlement, through the public API.

use std::future::Future;
use std::num::NonZeroU64;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::{Extension, Router};
use futures_util::FutureExt;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::{Layer, Service, ServiceExt};
use tower_admission::clock::ManualClock;
use tower_admission::identity::Identity;
use tower_admission::quota::{
    Limiter, MemoryStore, Policy, Quota, QuotaDecision, QuotaLayer, Settlement, Store, StoreError,
};
use tower_admission::reject::Rejection;

const DAY: Duration = Duration::from_secs(86_400);

fn clock() -> ManualClock {
    ManualClock::new(Duration::from_secs(1_800_000_000))
}

fn memory(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::with_clock(clock.clone())
}

fn alice() -> Request<Body> {
    let mut req = Request::builder().uri("/").body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(Identity::new("alice", "acme", "free"));
    req
}

/// An enforcing bucket (a 1 s wait) beside a shadow daily window (a wait of
/// most of a day): the answer is the bucket's alone.
#[tokio::test]
async fn a_shadow_policy_changes_nothing_in_the_answer() {
    let clock = clock();
    let quota = Quota::new(
        "api",
        [
            Policy::token_bucket("burst", 1, 1, Duration::from_secs(1)).unwrap(),
            Policy::fixed_window("daily", 1, DAY).unwrap().shadow(),
        ],
    )
    .unwrap();
    let layer = QuotaLayer::builder(memory(&clock))
        .quota(quota)
        .headers_on_success(true)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);

    let ok = app.clone().oneshot(alice()).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    let header = |r: &http::Response<_>, name: &str| {
        r.headers()
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        header(&ok, "ratelimit-policy"),
        ["\"burst\";q=1;w=1".to_owned()]
    );

    let refused = app.clone().oneshot(alice()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&refused, "retry-after"), ["1".to_owned()]);
    assert_eq!(
        header(&refused, "ratelimit-policy"),
        ["\"burst\";q=1;w=1".to_owned()]
    );
    assert_eq!(
        header(&refused, "ratelimit"),
        ["\"burst\";r=0;t=1".to_owned()]
    );
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["retry_after"], 1);
    assert_eq!(problem["policies"], serde_json::json!(["burst"]));
}

/// The engine reports shadow decisions only to callers who ask for them.
#[tokio::test]
async fn shadow_decisions_are_there_when_asked_for() {
    let clock = clock();
    let limiter = Limiter::new(memory(&clock));
    let quota = Quota::new(
        "api",
        [
            Policy::token_bucket("burst", 1, 1, Duration::from_secs(1)).unwrap(),
            Policy::fixed_window("daily", 1, DAY).unwrap().shadow(),
        ],
    )
    .unwrap();
    let key: Arc<str> = "alice".into();
    assert!(limiter.check(&quota, &key, 1).await.is_admitted());
    let verdict = limiter.check(&quota, &key, 1).await;
    assert_eq!(verdict.retry_after(), Some(Duration::from_secs(1)));
    let names = |it: &mut dyn Iterator<Item = (&Policy, &tower_admission::quota::Decision)>| {
        it.map(|(p, d)| (p.name().to_owned(), d.admitted))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        names(&mut verdict.named(&quota)),
        [("burst".to_owned(), false)]
    );
    assert_eq!(
        names(&mut verdict.shadow(&quota)),
        [("daily".to_owned(), false)]
    );
    assert_eq!(limiter.stats().shadow_refusals, 1);
}

/// A store that fails every decision (or, with `hang`, never answers one),
/// and counts the settlements it gets.
#[derive(Clone, Default)]
struct Failing {
    unknown: Arc<AtomicBool>,
    hang: Arc<AtomicBool>,
    settles: Arc<AtomicU64>,
}

type Boxed<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send>>;

impl Store for Failing {
    type DecideFuture = Boxed<QuotaDecision>;
    type SettleFuture = Boxed<QuotaDecision>;

    fn decide(&self, _: &Quota, _: &Arc<str>, _: u64) -> Self::DecideFuture {
        let error = if self.unknown.load(Ordering::Relaxed) {
            StoreError::Timeout
        } else {
            StoreError::Unavailable {
                message: "down".into(),
            }
        };
        if self.hang.load(Ordering::Relaxed) {
            return Box::pin(std::future::pending());
        }
        Box::pin(async move { Err(error) })
    }

    fn peek(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        self.decide(quota, key, cost)
    }

    fn settle(
        &self,
        _: &Quota,
        _: &Arc<str>,
        decision: &QuotaDecision,
        _: i64,
    ) -> Self::SettleFuture {
        self.settles.fetch_add(1, Ordering::Relaxed);
        let decision = decision.clone();
        Box::pin(async move { Ok(decision) })
    }
}

/// Where [`charging_100`]'s handler leaves each request's settlement.
type SettlementSlot = Arc<parking_lot::Mutex<Option<Settlement>>>;

/// An app whose one route is charged 100 by `quota` over `store`, and whose
/// handler leaves the request's settlement in `slot`.
fn charging_100<St: Store + Clone>(store: St, quota: &Quota, slot: &SettlementSlot) -> Router {
    let layer = QuotaLayer::builder(store)
        .quota(quota.clone())
        .cost(|_| 100)
        .build()
        .unwrap();
    let slot = slot.clone();
    Router::new()
        .route(
            "/",
            get(
                move |Extension(settlement): Extension<Settlement>| async move {
                    *slot.lock() = Some(settlement);
                    "ok"
                },
            ),
        )
        .layer(layer)
}

/// A request charged 10, that settles at 0 and reports what it charged.
async fn settle_to_zero(Extension(settlement): Extension<Settlement>) -> String {
    settlement.settle(0).await.unwrap();
    format!("{:?}", settlement.charged())
}

fn app<St: Store>(limiter: Limiter<St>, quota: Quota) -> Router {
    let layer = QuotaLayer::with_limiter(limiter)
        .quota(quota)
        .cost(|_| 10)
        .build()
        .unwrap();
    Router::new().route("/", get(settle_to_zero)).layer(layer)
}

/// A quota of 100 per minute that admits while its store fails.
fn failing_open() -> Quota {
    let policy = Policy::fixed_window("per-minute", 100, Duration::from_secs(60)).unwrap();
    Quota::new("api", [policy.fail_open()]).unwrap()
}

/// Admissions that no shared store recorded (fail-open, or an unknown
/// outcome) never settle the shared store: a refund there would hand out
/// free quota once it is back.
#[tokio::test]
async fn open_and_unknown_admissions_never_settle_the_shared_store() {
    for unknown in [false, true] {
        let store = Failing::default();
        store.unknown.store(unknown, Ordering::Relaxed);
        let quota = failing_open();
        let limiter = Limiter::new(store.clone());
        for _ in 0..3 {
            let response = app(limiter.clone(), quota.clone())
                .oneshot(alice())
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::OK);
        }
        assert_eq!(
            store.settles.load(Ordering::Relaxed),
            0,
            "unknown: {unknown}"
        );
        assert_eq!(limiter.stats().failed_open, 3);
        assert_eq!(
            limiter.stats().unknown_outcomes,
            if unknown { 3 } else { 0 }
        );
    }
}

/// A local share that admits while the store's outcome is unknown keeps its
/// charge, as every unknown outcome does: the shared store may hold it too.
/// A local share of 5 (10 per minute, halved); each request costs 5 and
/// settles to 0. With the outcome known (the store refused the call), the
/// local charge is refunded and every request passes; with it unknown,
/// only the first does.
#[tokio::test]
async fn a_local_share_never_refunds_an_unknown_outcome() {
    for (unknown, statuses) in [(false, [200, 200, 200]), (true, [200, 429, 429])] {
        let store = Failing::default();
        store.unknown.store(unknown, Ordering::Relaxed);
        let policy = Policy::sliding_log("per-minute", 10, Duration::from_secs(60))
            .unwrap()
            .fail_to_local_share(NonZeroU64::new(2).unwrap());
        let layer = QuotaLayer::builder(store.clone())
            .quota(Quota::new("api", [policy]).unwrap())
            .cost(|_| 5)
            .build()
            .unwrap();
        let app = Router::new().route("/", get(settle_to_zero)).layer(layer);
        let mut seen = Vec::new();
        for _ in 0..3 {
            seen.push(
                app.clone()
                    .oneshot(alice())
                    .await
                    .unwrap()
                    .status()
                    .as_u16(),
            );
        }
        assert_eq!(seen, statuses, "unknown: {unknown}");
        assert_eq!(
            store.settles.load(Ordering::Relaxed),
            0,
            "unknown: {unknown}"
        );
    }
}

/// A decision dropped before the store answered (the caller gave up while
/// the store stalled) is counted as abandoned, through the limiter and
/// through the layer alike, and as neither admitted nor refused; one the
/// store answered is not.
#[tokio::test]
async fn decisions_dropped_before_the_store_answers_are_counted_as_abandoned() {
    let store = Failing::default();
    store.hang.store(true, Ordering::Relaxed);
    let quota = failing_open();
    let limiter = Limiter::new(store.clone());
    let key: Arc<str> = "alice".into();
    assert!(limiter.check(&quota, &key, 1).now_or_never().is_none());
    assert_eq!(limiter.stats().abandoned, 1);
    let served = app(limiter.clone(), quota.clone()).oneshot(alice());
    assert!(served.now_or_never().is_none());
    // The layer sends the decision in `call`: a response future dropped
    // before its first poll has sent it all the same.
    let mut service = QuotaLayer::with_limiter(limiter.clone())
        .quota(quota.clone())
        .build()
        .unwrap()
        .layer(tower::service_fn(|_: Request<Body>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty()))
        }));
    drop(service.call(alice()));
    let stats = limiter.stats();
    assert_eq!((stats.abandoned, stats.admitted, stats.refused), (3, 0, 0));

    store.hang.store(false, Ordering::Relaxed);
    assert!(limiter.check(&quota, &key, 1).await.is_admitted());
    let response = app(limiter.clone(), quota).oneshot(alice()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let stats = limiter.stats();
    assert_eq!(
        (stats.abandoned, stats.admitted, stats.failed_open),
        (3, 2, 2)
    );
}

/// A local-share admission settles the local store that recorded it, and
/// only that one: its refund makes room in the local share again.
#[tokio::test]
async fn local_share_admissions_settle_the_local_store() {
    let store = Failing::default();
    let limiter = Limiter::new(store.clone());
    // The local store runs on the system clock: a log over a year, so
    // nothing leaves it during the test.
    let quota = Quota::new(
        "api",
        [Policy::sliding_log("per-year", 40, 365 * DAY)
            .unwrap()
            .fail_to_local_share(NonZeroU64::new(4).unwrap())],
    )
    .unwrap();
    // The local share is 10 and each request costs 10: every request fits
    // only because the one before it refunded itself.
    for _ in 0..5 {
        let response = app(limiter.clone(), quota.clone())
            .oneshot(alice())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert_eq!(store.settles.load(Ordering::Relaxed), 0);
    assert_eq!(limiter.stats().local_share, 5);
}

/// During an outage a cost above the local share but within the real limit
/// is a transient refusal (503 with Retry-After); 413 stays for a cost the
/// real policy can never admit.
#[tokio::test]
async fn local_share_refuses_a_big_cost_as_unavailable_not_too_large() {
    let limiter = Limiter::new(Failing::default());
    let quota = Quota::new(
        "api",
        [
            Policy::fixed_window("per-minute", 100, Duration::from_secs(60))
                .unwrap()
                .fail_to_local_share(NonZeroU64::new(10).unwrap()),
        ],
    )
    .unwrap();
    let key: Arc<str> = "alice".into();
    let verdict = limiter.check(&quota, &key, 50).await;
    assert_eq!(
        verdict.rejection(),
        Some(Rejection::LimiterUnavailable {
            retry_after: Duration::from_secs(1)
        })
    );
    let verdict = limiter.check(&quota, &key, 101).await;
    assert_eq!(
        verdict.refusing_policies(),
        [Arc::<str>::from("per-minute")]
    );
    assert_eq!(verdict.retry_after(), None);

    let layer = QuotaLayer::with_limiter(limiter)
        .quota(quota)
        .cost(|parts| parts.uri.query().map_or(1, |q| q.parse().unwrap()))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let with_cost = |cost: u64| {
        let mut req = Request::builder()
            .uri(format!("/?{cost}"))
            .body(Body::empty())
            .unwrap();
        req.extensions_mut()
            .insert(Identity::new("alice", "acme", "free"));
        req
    };
    let response = app.clone().oneshot(with_cost(50)).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()["retry-after"], "1");
    let response = app.clone().oneshot(with_cost(101)).await.unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(response.headers().get("retry-after").is_none());
}

/// Two threads settle clones of one request's settlement at once, from a
/// charge of 100 down to 12, meeting at a barrier before each round; 20,000
/// rounds, one key each. The charge is moved to 12 exactly once: the second
/// settle finds it settled and changes nothing, never refunds the same 88
/// again.
#[test]
fn concurrent_settles_of_one_charge_refund_it_once() {
    const ROUNDS: usize = 20_000;
    let clock = clock();
    let store = memory(&clock);
    let quota = Quota::new(
        "rows",
        [Policy::fixed_window("per-day", 1_000, DAY).unwrap()],
    )
    .unwrap();
    let slot = SettlementSlot::default();
    let app = charging_100(store.clone(), &quota, &slot);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let barrier = Arc::new(std::sync::Barrier::new(3));
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (slot, barrier) = (slot.clone(), barrier.clone());
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                for _ in 0..ROUNDS {
                    barrier.wait();
                    let settlement = slot.lock().clone().unwrap();
                    runtime.block_on(settlement.settle(12)).unwrap();
                    barrier.wait();
                }
            })
        })
        .collect();
    let mut refunded_twice = 0;
    for round in 0..ROUNDS {
        let subject = format!("user-{round}");
        let key: Arc<str> = subject.as_str().into();
        // 300 charged before, so a second refund has something to take.
        assert!(
            store
                .decide(&quota, &key, 300)
                .into_inner()
                .unwrap()
                .admitted
        );
        let mut req = Request::builder().uri("/").body(Body::empty()).unwrap();
        req.extensions_mut()
            .insert(Identity::new(subject.as_str(), "acme", "free"));
        let response = runtime.block_on(app.clone().oneshot(req)).unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        barrier.wait();
        barrier.wait();
        let remaining = store
            .decide(&quota, &key, 0)
            .into_inner()
            .unwrap()
            .decisions[0]
            .remaining;
        let charged = slot.lock().take().unwrap().charged();
        refunded_twice += usize::from(remaining != 1_000 - 300 - 12 || charged != [12]);
    }
    for thread in threads {
        thread.join().unwrap();
    }
    assert_eq!(refunded_twice, 0, "of {ROUNDS} rounds");
}

/// A memory store whose settles time out while `lose` says so: with
/// `Lost::Reply` the settle is applied and its reply lost, with
/// `Lost::Request` it never arrives; the caller gets `StoreError::Timeout`
/// either way, as from a Redis call past its deadline.
#[derive(Clone)]
struct LosesSettles {
    inner: MemoryStore<ManualClock>,
    lose: Arc<parking_lot::Mutex<Option<Lost>>>,
}

#[derive(Clone, Copy)]
enum Lost {
    Reply,
    Request,
    /// Applied, and no reply ever comes: the caller gives up.
    Hang,
}

impl Store for LosesSettles {
    type DecideFuture = <MemoryStore<ManualClock> as Store>::DecideFuture;
    type SettleFuture = Boxed<QuotaDecision>;

    fn decide(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
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
        let lost = *self.lose.lock();
        let applied = match lost {
            Some(Lost::Request) => None,
            _ => Some(self.inner.settle(quota, key, decision, delta)),
        };
        Box::pin(async move {
            let settled = match applied {
                Some(applied) => applied.await?,
                None => return Err(StoreError::Timeout),
            };
            match lost {
                Some(Lost::Hang) => std::future::pending().await,
                Some(_) => Err(StoreError::Timeout),
                None => Ok(settled),
            }
        })
    }
}

/// A request charged 100 settles at 50, and that settle times out (or is
/// dropped before the store answers); it then
/// settles at 50 again and at 12. Whether the first settle was applied (its
/// reply lost) or not (the request lost), the charge never gives back more
/// than the 88 it was charged above 12: exactly 88 when it was applied, 38
/// (the store keeps 50 it could have refunded) when it was not. Before the
/// fix a lost reply refunded 50, then 50 again, then 38: 138 of 100.
#[tokio::test]
async fn a_settle_of_unknown_outcome_is_never_given_back_twice() {
    for (lost, remaining) in [
        (Lost::Reply, 1_000 - 300 - 12),
        (Lost::Request, 1_000 - 300 - 62),
        (Lost::Hang, 1_000 - 300 - 12),
    ] {
        let clock = clock();
        let store = LosesSettles {
            inner: memory(&clock),
            lose: Arc::default(),
        };
        let quota = Quota::new(
            "rows",
            [Policy::fixed_window("per-day", 1_000, DAY).unwrap()],
        )
        .unwrap();
        let key: Arc<str> = "alice".into();
        // 300 charged before, so an extra refund has something to take.
        assert!(
            store
                .inner
                .decide(&quota, &key, 300)
                .into_inner()
                .unwrap()
                .admitted
        );
        let slot = SettlementSlot::default();
        let app = charging_100(store.clone(), &quota, &slot);
        assert_eq!(app.oneshot(alice()).await.unwrap().status(), StatusCode::OK);
        let settlement = slot.lock().take().unwrap();

        *store.lose.lock() = Some(lost);
        match lost {
            // Given up on at its first poll, once the store has applied it.
            Lost::Hang => assert_eq!(settlement.settle(50).now_or_never(), None),
            _ => assert_eq!(settlement.settle(50).await, Err(StoreError::Timeout)),
        }
        assert_eq!(settlement.charged(), [50]);
        *store.lose.lock() = None;
        settlement.settle(50).await.unwrap();
        settlement.settle(12).await.unwrap();
        assert_eq!(settlement.charged(), [12]);
        let left = store.inner.decide(&quota, &key, 0).into_inner().unwrap();
        assert_eq!(left.decisions[0].remaining, remaining);
    }
}

/// What the shared store does with one call in [`flaky_settlement_run`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    /// Answers.
    Answers,
    /// Fails before recording anything.
    Down,
    /// Records, then times out: the outcome is unknown to the caller.
    Lost,
}

/// A memory store whose next decide and settle each do as told.
#[derive(Clone)]
struct Flaky {
    inner: MemoryStore<ManualClock>,
    decide: Arc<parking_lot::Mutex<Call>>,
    settle: Arc<parking_lot::Mutex<Call>>,
}

impl Store for Flaky {
    type DecideFuture = Boxed<QuotaDecision>;
    type SettleFuture = Boxed<QuotaDecision>;

    fn decide(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        let call = *self.decide.lock();
        Box::pin(std::future::ready(
            call.apply(|| self.inner.decide(quota, key, cost).into_inner()),
        ))
    }

    fn peek(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        Box::pin(self.inner.peek(quota, key, cost))
    }

    fn settle(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        decision: &QuotaDecision,
        delta: i64,
    ) -> Self::SettleFuture {
        let call = *self.settle.lock();
        Box::pin(std::future::ready(call.apply(|| {
            self.inner.settle(quota, key, decision, delta).into_inner()
        })))
    }
}

impl Call {
    /// The answer to a call that `store` would answer.
    fn apply<T>(self, store: impl FnOnce() -> Result<T, StoreError>) -> Result<T, StoreError> {
        match self {
            Call::Answers => store(),
            Call::Down => Err(StoreError::Unavailable {
                message: "down".into(),
            }),
            Call::Lost => {
                // Applied; the reply is what is lost.
                drop(store());
                Err(StoreError::Timeout)
            }
        }
    }
}

/// One request of [`flaky_settlement_run`]: how the shared store takes its
/// decide and its settle, its cost, and what it settles at (none: it never
/// settles).
#[derive(Debug, Clone, Copy)]
struct FlakyStep {
    decide: Call,
    settle: Call,
    cost: u64,
    actual: Option<u64>,
}

/// The shared limit, and the local share while the store fails (a quarter).
const SHARED: u64 = 40;
const LOCAL: u64 = 10;

/// The net cost of a charge of `cost` settled at `actual`, in a store that
/// held `used` of `limit` before the charge: a refund gives back what the
/// charge holds, an extra charge takes at most what is left.
fn settled(used: u64, limit: u64, cost: u64, actual: u64) -> u64 {
    if actual <= cost {
        actual
    } else {
        cost + (actual - cost).min(limit - used - cost)
    }
}

/// Runs `steps` through the quota layer over a flaky shared store and
/// checks every answer and both stores' use against a model: an admission
/// the shared store answered is recorded and settled there (a settle lost
/// after it was applied counts as applied, one that failed changes
/// nothing); one it failed to answer falls back to the local share, which
/// records and settles it, and a decide lost after the store recorded it
/// stays consumed there, and in the local share, never given back.
async fn flaky_settlement_run(steps: &[FlakyStep]) {
    let clock = clock();
    let flaky = Flaky {
        inner: memory(&clock),
        decide: Arc::new(parking_lot::Mutex::new(Call::Answers)),
        settle: Arc::new(parking_lot::Mutex::new(Call::Answers)),
    };
    // The local store runs on the system clock: a log over a year, so
    // nothing leaves either store during the run.
    let quota = Quota::new(
        "api",
        [Policy::sliding_log("per-year", SHARED, 365 * DAY)
            .unwrap()
            .fail_to_local_share(NonZeroU64::new(SHARED / LOCAL).unwrap())],
    )
    .unwrap();
    let limiter = Limiter::new(flaky.clone());
    let app = settling_app(limiter.clone(), quota.clone());
    let key: Arc<str> = "alice".into();
    let shared_used = || {
        SHARED
            - flaky
                .inner
                .decide(&quota, &key, 0)
                .into_inner()
                .unwrap()
                .decisions[0]
                .remaining
    };
    let (mut shared, mut local) = (0u64, 0u64);
    for (i, step) in steps.iter().enumerate() {
        *flaky.decide.lock() = step.decide;
        *flaky.settle.lock() = step.settle;
        let status = app
            .clone()
            .oneshot(charged(step.cost, step.actual))
            .await
            .unwrap()
            .status();
        let settle = |used: u64, limit: u64, shared_store: bool| match step.actual {
            // A settle that failed at the shared store changes nothing.
            Some(_) if shared_store && step.settle == Call::Down => step.cost,
            Some(actual) => settled(used, limit, step.cost, actual),
            None => step.cost,
        };
        let expected = match step.decide {
            Call::Answers if shared + step.cost <= SHARED => {
                shared += settle(shared, SHARED, true);
                StatusCode::OK
            }
            Call::Answers => StatusCode::TOO_MANY_REQUESTS,
            Call::Down | Call::Lost => {
                if step.decide == Call::Lost && shared + step.cost <= SHARED {
                    // Recorded, unknown to the caller: consumed for good.
                    shared += step.cost;
                }
                if step.cost > LOCAL {
                    // More than the share can ever admit, not more than
                    // the real limit: a transient refusal.
                    StatusCode::SERVICE_UNAVAILABLE
                } else if local + step.cost <= LOCAL {
                    // An unknown outcome is never refunded, locally either.
                    local += match step.decide {
                        Call::Lost => step.cost,
                        _ => settle(local, LOCAL, false),
                    };
                    StatusCode::OK
                } else {
                    StatusCode::TOO_MANY_REQUESTS
                }
            }
        };
        assert_eq!(status, expected, "step {i} of {steps:?}");
        assert_eq!(
            shared_used(),
            shared,
            "shared store's use after step {i} of {steps:?}"
        );
    }
    let stats = limiter.stats();
    let lost = steps.iter().filter(|s| s.decide == Call::Lost).count() as u64;
    assert_eq!(stats.unknown_outcomes, lost, "{steps:?}");
}

/// Alice's request to [`settling_app`], charged `cost` and settled at
/// `actual`, if any.
fn charged(cost: u64, actual: Option<u64>) -> Request<Body> {
    let mut req = alice();
    req.headers_mut().insert("x-cost", cost.into());
    if let Some(actual) = actual {
        req.headers_mut().insert("x-actual", actual.into());
    }
    req
}

/// The number in header `name`, if any.
fn header(headers: &http::HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.parse().ok()
}

/// Failure modes and settlement through the layer, on random requests:
/// each is decided by a shared store that answers, is down or loses the
/// reply, costs 1 to 15, and settles at 0 to 20 (or never) through a shared
/// store that answers, is down or loses that reply. Every answer and both
/// stores' use match the model of [`flaky_settlement_run`] after every
/// request: no refund reaches a store that did not record the charge, no
/// unknown outcome is given back, and neither the shared limit nor the
/// local share is exceeded.
#[tokio::test]
async fn failure_modes_and_settlement_keep_each_store_to_what_it_recorded() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let call = |rng: &mut StdRng| match rng.random_range(0..4) {
        0 | 1 => Call::Answers,
        2 => Call::Down,
        _ => Call::Lost,
    };
    for seed in 0..2_000 {
        let mut rng = StdRng::seed_from_u64(seed);
        let steps: Vec<FlakyStep> = (0..rng.random_range(1..=30))
            .map(|_| FlakyStep {
                decide: call(&mut rng),
                settle: call(&mut rng),
                cost: rng.random_range(1..=15),
                actual: rng.random_bool(0.7).then(|| rng.random_range(0..=20)),
            })
            .collect();
        flaky_settlement_run(&steps).await;
    }
}

/// An app charged by `quota` through `limiter` at the request's `x-cost`,
/// with `RateLimit` fields on every answer, whose handler settles at
/// `x-actual` when the request carries it and answers `ok`, or `settle
/// failed` (the charge is then as it was, or as if applied when the outcome
/// is unknown).
fn settling_app<St: Store>(limiter: Limiter<St>, quota: Quota) -> Router {
    let layer = QuotaLayer::with_limiter(limiter)
        .quota(quota)
        .cost(|parts| header(&parts.headers, "x-cost").unwrap_or(1))
        .headers_on_success(true)
        .build()
        .unwrap();
    Router::new()
        .route(
            "/",
            get(
                |Extension(settlement): Extension<Settlement>, headers: http::HeaderMap| async move {
                    match header(&headers, "x-actual") {
                        Some(actual) if settlement.settle(actual).await.is_err() => "settle failed",
                        _ => "ok",
                    }
                },
            ),
        )
        .layer(layer)
}

/// The status, `Retry-After`, `RateLimit-Policy`, `RateLimit` and body of a
/// response, as they reach the caller.
async fn answer(response: http::Response<Body>) -> (StatusCode, Vec<String>, String) {
    let status = response.status();
    let fields = ["retry-after", "ratelimit-policy", "ratelimit"]
        .iter()
        .flat_map(|name| {
            response
                .headers()
                .get_all(*name)
                .iter()
                .map(move |v| format!("{name}: {}", v.to_str().unwrap()))
        })
        .collect();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, fields, String::from_utf8_lossy(&body).into_owned())
}

/// A shadow policy is invisible to callers through everything that touches
/// the same key: on 300 random sequences of requests (gaps of 0 to 20 s,
/// costs of 1 to 6, two in three settled at 0 to 8), a quota of a sliding
/// log and a bucket beside a tight shadow window answers exactly as the same
/// quota without it, status, `Retry-After`, `RateLimit` fields and problem
/// body alike. The shadow window refuses in at least a third of the
/// sequences, or the test would prove nothing.
#[tokio::test]
async fn a_shadow_policy_is_invisible_through_random_admissions_and_settlements() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let enforcing = || {
        [
            Policy::sliding_log("per-minute", 10, Duration::from_secs(60)).unwrap(),
            Policy::token_bucket("burst", 4, 10, Duration::from_secs(60)).unwrap(),
        ]
    };
    let shadow = Policy::fixed_window("per-hour", 3, Duration::from_secs(3_600))
        .unwrap()
        .shadow();
    let [log, bucket] = enforcing();
    let shadowed = Quota::new("api", [log, bucket, shadow]).unwrap();
    let bare = Quota::new("api", enforcing()).unwrap();
    let mut refusing = 0;
    for seed in 0..300 {
        let mut rng = StdRng::seed_from_u64(seed);
        let clock = clock();
        let limiter = Limiter::new(memory(&clock));
        let app_with = settling_app(limiter.clone(), shadowed.clone());
        let app_without = settling_app(Limiter::new(memory(&clock)), bare.clone());
        for _ in 0..rng.random_range(1..=25) {
            clock.advance(Duration::from_millis(rng.random_range(0..=20_000)));
            let cost = rng.random_range(1..=6u64);
            let actual = rng.random_bool(0.66).then(|| rng.random_range(0..=8u64));
            let a = answer(
                app_with
                    .clone()
                    .oneshot(charged(cost, actual))
                    .await
                    .unwrap(),
            )
            .await;
            let b = answer(
                app_without
                    .clone()
                    .oneshot(charged(cost, actual))
                    .await
                    .unwrap(),
            )
            .await;
            assert_eq!(a, b, "seed {seed}: cost {cost}, settled at {actual:?}");
        }
        refusing += u64::from(limiter.stats().shadow_refusals > 0);
    }
    assert!(
        refusing * 3 >= 300,
        "the shadow window refused in {refusing} of 300 sequences"
    );
    println!("the shadow window refused in {refusing} of 300 sequences");
}
