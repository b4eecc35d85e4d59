//! Edge cases of the dependency budget per send attempt, probed through the
//! public API as a user would: clones that are never sent, retries refused
//! by the retry share, services that are not ready, attempts dropped while
//! they wait, attempts marked by the caller, several budgets on one client
//! and a budget placed outside the retry layer. Time is tokio's paused
//! clock, which the store reads too, so every count is exact.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_admission::clock::Clock;
use tower_admission::outbound::{
    Attempt, BudgetError, DependencyBudget, DependencyBudgetLayer, RetryAttempts,
};
use tower_admission::quota::{MemoryStore, Policy};

const SECOND: Duration = Duration::from_secs(1);

/// The store's clock is tokio's (paused in these tests).
#[derive(Clone, Debug)]
struct TokioClock(tokio::time::Instant);

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        Duration::from_secs(1_800_000_000) + self.0.elapsed()
    }
}

fn store() -> MemoryStore<TokioClock> {
    MemoryStore::with_clock(TokioClock(tokio::time::Instant::now()))
}

type Budget = DependencyBudget<MemoryStore<TokioClock>>;

/// A budget of token buckets: `normal` and `retry` as (capacity, per second).
fn budget(name: &str, normal: (u64, u64), retry: (u64, u64)) -> Budget {
    DependencyBudget::builder(store(), name)
        .normal(Policy::token_bucket("normal", normal.0, normal.1, SECOND).unwrap())
        .retry(Policy::token_bucket("retry", retry.0, retry.1, SECOND).unwrap())
        .build()
        .unwrap()
}

/// Each arrival at the dependency: µs since the start and attempt number.
#[derive(Clone, Default)]
struct Arrivals(Arc<Mutex<Vec<(u64, u32)>>>);

impl Arrivals {
    fn attempts(&self) -> Vec<u32> {
        self.0.lock().unwrap().iter().map(|a| a.1).collect()
    }
}

/// A dependency that answers every arrival with `status`.
fn answering(
    status: StatusCode,
    arrivals: Arrivals,
    start: tokio::time::Instant,
) -> impl Service<Request<String>, Response = Response<String>, Error = Infallible, Future: Send>
       + Clone
       + Send {
    tower::service_fn(move |req: Request<String>| {
        let arrivals = arrivals.clone();
        async move {
            let attempt = req.extensions().get::<Attempt>().map_or(1, |a| a.number());
            arrivals
                .0
                .lock()
                .unwrap()
                .push((start.elapsed().as_micros() as u64, attempt));
            Ok(Response::builder()
                .status(status)
                .body(String::new())
                .unwrap())
        }
    })
}

/// `RetryAttempts` with no backoff, counting the clones it makes.
#[derive(Clone)]
struct CountingClones {
    inner: RetryAttempts,
    clones: Arc<AtomicUsize>,
}

impl<R, E: std::error::Error + 'static>
    tower::retry::Policy<Request<String>, Response<R>, BudgetError<E>> for CountingClones
{
    type Future = <RetryAttempts as tower::retry::Policy<
        Request<String>,
        Response<R>,
        BudgetError<E>,
    >>::Future;

    fn retry(
        &mut self,
        req: &mut Request<String>,
        result: &mut Result<Response<R>, BudgetError<E>>,
    ) -> Option<Self::Future> {
        self.inner.retry(req, result)
    }

    fn clone_request(&mut self, req: &Request<String>) -> Option<Request<String>> {
        self.clones.fetch_add(1, Ordering::Relaxed);
        <RetryAttempts as tower::retry::Policy<Request<String>, Response<R>, BudgetError<E>>>::clone_request(
            &mut self.inner,
            req,
        )
    }
}

fn no_backoff(max_attempts: u32) -> RetryAttempts {
    RetryAttempts::new(max_attempts).backoff(Duration::ZERO, Duration::ZERO)
}

/// `tower::retry` clones the request before every send, the last send's
/// clone included, which is dropped unsent. The marker survives each clone
/// (attempts 1, 2, 3 arrive), and only what is sent is charged: 1 first
/// attempt and 2 retries for 3 clones.
#[tokio::test(start_paused = true)]
async fn a_clone_that_is_never_sent_is_never_charged() {
    let start = tokio::time::Instant::now();
    let budget = budget("dep", (20, 200), (4, 40));
    let arrivals = Arrivals::default();
    let clones = Arc::new(AtomicUsize::new(0));
    let client = ServiceBuilder::new()
        .retry(CountingClones {
            inner: no_backoff(3),
            clones: clones.clone(),
        })
        .layer(DependencyBudgetLayer::new(budget.clone()))
        .service(answering(
            StatusCode::SERVICE_UNAVAILABLE,
            arrivals.clone(),
            start,
        ));
    let response = client.oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(arrivals.attempts(), [1, 2, 3]);
    assert_eq!(clones.load(Ordering::Relaxed), 3);
    let stats = budget.stats();
    assert_eq!((stats.normal, stats.retry, stats.refused), (1, 2, 0));
}

/// A retry refused by the retry share ends the retries: `tower::retry` sees
/// `BudgetError::Refused` naming the retry share, which `RetryAttempts`
/// does not retry, and the caller gets it with the exact wait. Retry share
/// 1 token per second, fail fast: attempt 1 (normal) and attempt 2 (the
/// retry token) are sent, attempt 3 is refused with 1 s to wait.
#[tokio::test(start_paused = true)]
async fn a_retry_refused_by_the_retry_share_carries_its_wait() {
    let start = tokio::time::Instant::now();
    let budget = budget("dep", (20, 200), (1, 1));
    let arrivals = Arrivals::default();
    let client = ServiceBuilder::new()
        .retry(no_backoff(3))
        .layer(DependencyBudgetLayer::new(budget.clone()).fail_fast())
        .service(answering(
            StatusCode::SERVICE_UNAVAILABLE,
            arrivals.clone(),
            start,
        ));
    let refused = client
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap_err();
    assert!(
        matches!(
            refused,
            BudgetError::Exhausted {
                retry: true,
                wait
            } if wait == SECOND
        ),
        "{refused:?}"
    );
    assert_eq!(refused.wait(), Some(SECOND));
    assert_eq!(arrivals.attempts(), [1, 2]);
    let stats = budget.stats();
    assert_eq!((stats.normal, stats.retry, stats.refused), (1, 1, 1));

    // 400 ms later a second call's first attempt still goes (its own share),
    // and its retry is told the 600 ms left, not a rounded-down 0.
    tokio::time::advance(Duration::from_millis(400)).await;
    let refused = client
        .oneshot(Request::new(String::new()))
        .await
        .unwrap_err();
    assert_eq!(refused.wait(), Some(Duration::from_millis(600)));
    assert_eq!(arrivals.attempts(), [1, 2, 1]);
}

/// Every refusal's wait is at least the time to capacity, rounded up to
/// the µs: after it the attempt is admitted, and 1 µs before it is not,
/// at rates whose token interval is no whole number of µs (3/s, 7/min).
#[tokio::test(start_paused = true)]
async fn the_wait_is_rounded_up_never_zero_and_enough() {
    for (capacity, refill, period) in [
        (1, 3, SECOND),
        (2, 7, Duration::from_secs(60)),
        (5, 1_000_001, SECOND),
        (1, 1, Duration::from_micros(3)),
    ] {
        let budget = DependencyBudget::builder(store(), "odd")
            .normal(Policy::token_bucket("normal", capacity, refill, period).unwrap())
            .retry(Policy::token_bucket("retry", capacity, refill, period).unwrap())
            .build()
            .unwrap();
        for _ in 0..capacity {
            budget.try_acquire(Attempt::FIRST, 1).await.unwrap();
        }
        for round in 0..5 {
            let wait = budget
                .try_acquire(Attempt::FIRST, 1)
                .await
                .unwrap_err()
                .wait()
                .unwrap();
            let case = format!("{capacity} per {refill}/{period:?}, round {round}: {wait:?}");
            assert!(wait > Duration::ZERO, "{case}");
            tokio::time::advance(wait - Duration::from_micros(1)).await;
            assert!(
                budget.try_acquire(Attempt::FIRST, 1).await.is_err(),
                "{case}"
            );
            tokio::time::advance(Duration::from_micros(1)).await;
            assert_eq!(
                budget.try_acquire(Attempt::FIRST, 1).await,
                Ok(()),
                "{case}"
            );
        }
    }
}

/// A dependency that is not ready until it is opened, counting sends.
#[derive(Clone, Default)]
struct Gate {
    open: Arc<std::sync::atomic::AtomicBool>,
    waiting: Arc<Mutex<Vec<std::task::Waker>>>,
    sent: Arc<AtomicU64>,
}

impl Gate {
    fn open(&self) {
        self.open.store(true, Ordering::Relaxed);
        for waker in self.waiting.lock().unwrap().drain(..) {
            waker.wake();
        }
    }
}

impl Service<Request<String>> for Gate {
    type Response = Response<String>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<String>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        if self.open.load(Ordering::Relaxed) {
            Poll::Ready(Ok(()))
        } else {
            self.waiting.lock().unwrap().push(cx.waker().clone());
            Poll::Pending
        }
    }

    fn call(&mut self, _req: Request<String>) -> Self::Future {
        self.sent.fetch_add(1, Ordering::Relaxed);
        std::future::ready(Ok(Response::new(String::new())))
    }
}

/// Readiness comes first, the charge at call: while the dependency is not
/// ready nothing is charged, and a caller that gives up waiting for
/// readiness spends nothing.
#[tokio::test(start_paused = true)]
async fn nothing_is_charged_while_the_dependency_is_not_ready() {
    let budget = budget("dep", (1, 1), (1, 1));
    let gate = Gate::default();
    let service = DependencyBudgetLayer::new(budget.clone()).layer(gate.clone());
    let given_up = tokio::time::timeout(
        Duration::from_millis(500),
        service.clone().oneshot(Request::new(String::new())),
    )
    .await;
    assert!(given_up.is_err());
    assert_eq!(budget.stats().normal, 0);
    gate.open();
    service
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(budget.stats().normal, 1);
    assert_eq!(gate.sent.load(Ordering::Relaxed), 1);
}

/// An attempt dropped while it waits for the budget is charged nothing and
/// frees its place: the one behind it takes the next token, at 1 s, and
/// the budget counts one admission, no refusal and only the admitted
/// attempt's wait.
#[tokio::test(start_paused = true)]
async fn an_attempt_dropped_while_it_waits_is_charged_nothing() {
    let start = tokio::time::Instant::now();
    let budget = budget("dep", (1, 1), (1, 1));
    let arrivals = Arrivals::default();
    let service = DependencyBudgetLayer::new(budget.clone())
        .wait_up_to(2 * SECOND)
        .layer(answering(StatusCode::OK, arrivals.clone(), start));
    service
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    let dropped = tokio::spawn(service.clone().oneshot(Request::new(String::new())));
    tokio::task::yield_now().await;
    let behind = tokio::spawn(service.clone().oneshot(Request::new(String::new())));
    tokio::time::sleep(Duration::from_millis(300)).await;
    dropped.abort();
    assert!(dropped.await.unwrap_err().is_cancelled());
    behind.await.unwrap().unwrap();
    let times: Vec<u64> = arrivals.0.lock().unwrap().iter().map(|a| a.0).collect();
    assert_eq!(times, [0, 1_000_000]);
    let stats = budget.stats();
    assert_eq!((stats.normal, stats.refused), (1 + 1, 0));
    assert_eq!(stats.waited_micros, 1_000_000);
}

/// A refusal followed by the caller dropping it leaves nothing behind: the
/// next attempt, at the wait, is admitted.
#[tokio::test(start_paused = true)]
async fn a_dropped_refusal_leaves_nothing_behind() {
    let budget = budget("dep", (1, 1), (1, 1));
    let arrivals = Arrivals::default();
    let start = tokio::time::Instant::now();
    let service = DependencyBudgetLayer::new(budget.clone())
        .fail_fast()
        .layer(answering(StatusCode::OK, arrivals.clone(), start));
    service
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    for _ in 0..10 {
        let refused = service
            .clone()
            .oneshot(Request::new(String::new()))
            .await
            .unwrap_err();
        assert_eq!(refused.wait(), Some(SECOND));
    }
    tokio::time::advance(SECOND).await;
    service
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(arrivals.0.lock().unwrap().len(), 2);
    let stats = budget.stats();
    assert_eq!((stats.normal, stats.refused), (2, 10));
}

#[derive(Clone)]
struct RetryErrorsOnce;

impl<R> tower::retry::Policy<Request<String>, R, BudgetError<&'static str>> for RetryErrorsOnce {
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        req: &mut Request<String>,
        result: &mut Result<R, BudgetError<&'static str>>,
    ) -> Option<Self::Future> {
        let attempt = req.extensions().get::<Attempt>().copied();
        match (result, attempt) {
            (Err(BudgetError::Inner(_)), Some(attempt)) if !attempt.is_retry() => {
                req.extensions_mut().insert(attempt.next());
                Some(std::future::ready(()))
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &Request<String>) -> Option<Request<String>> {
        let mut clone = Request::new(req.body().clone());
        *clone.extensions_mut() = req.extensions().clone();
        clone.extensions_mut().get_or_insert(Attempt::FIRST);
        Some(clone)
    }
}

/// Before, `Attempt` could not be built past `Attempt::FIRST`, so a policy
/// of one's own could not mark a retry and every retry it made drew on the
/// normal share.
#[tokio::test(start_paused = true)]
async fn a_policy_of_ones_own_marks_its_retries() {
    let budget = budget("dep", (20, 200), (4, 40));
    let seen = Arrivals::default();
    let start = tokio::time::Instant::now();
    let flaky = {
        let seen = seen.clone();
        tower::service_fn(move |req: Request<String>| {
            let seen = seen.clone();
            async move {
                let attempt = req.extensions().get::<Attempt>().map_or(1, |a| a.number());
                seen.0
                    .lock()
                    .unwrap()
                    .push((start.elapsed().as_micros() as u64, attempt));
                if attempt == 1 {
                    Err("connection reset")
                } else {
                    Ok(Response::new(String::new()))
                }
            }
        })
    };
    let client = ServiceBuilder::new()
        .retry(RetryErrorsOnce)
        .layer(DependencyBudgetLayer::new(budget.clone()))
        .service(flaky);
    for _ in 0..3 {
        client
            .clone()
            .oneshot(Request::new(String::new()))
            .await
            .unwrap();
    }
    assert_eq!(seen.attempts(), [1, 2, 1, 2, 1, 2]);
    let stats = budget.stats();
    assert_eq!((stats.normal, stats.retry), (3, 3));
}

/// Most in any closed interval of `times` (µs) against `floor(B + r·T)`,
/// and at most `B + r` in every window of 1 s.
fn check_bucket(times: &[u64], capacity: u64, per_second: u64, what: &str) {
    for (i, &t1) in times.iter().enumerate() {
        for (j, &t2) in times.iter().enumerate().skip(i) {
            let count = (j - i + 1) as u64;
            let bound = capacity + per_second * (t2 - t1) / 1_000_000;
            assert!(
                count <= bound,
                "{what}: {count} in [{t1}, {t2}] µs, bound {bound}"
            );
            if t2 - t1 < 1_000_000 {
                assert!(count <= capacity + per_second, "{what}: 1 s window");
            }
        }
    }
}

/// Hedged attempts of one logical request: 300 requests, each sending a
/// first attempt and, 20 ms later, a hedge marked as the second attempt,
/// at once through one waiting layer on the 240/s budget. Every attempt is
/// sent and charged on its own share (300 normal, 300 retry), and in every
/// interval first attempts stay within `20 + 200·T`, hedges within
/// `4 + 40·T` and all sends within `24 + 240·T`.
#[tokio::test(start_paused = true)]
async fn hedges_draw_on_the_retry_share_and_every_interval_holds() {
    let start = tokio::time::Instant::now();
    let budget = budget("dep", (20, 200), (4, 40));
    let arrivals = Arrivals::default();
    let client = DependencyBudgetLayer::new(budget.clone())
        .wait_up_to(Duration::from_secs(60))
        .layer(answering(StatusCode::OK, arrivals.clone(), start));
    let tasks: Vec<_> = (0..300)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                let primary = client.clone().oneshot(Request::new(String::new()));
                let hedge = async {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let mut req = Request::new(String::new());
                    req.extensions_mut().insert(Attempt::FIRST.next());
                    client.clone().oneshot(req).await
                };
                let (a, b) = tokio::join!(primary, hedge);
                a.unwrap();
                b.unwrap();
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let log = arrivals.0.lock().unwrap().clone();
    let first: Vec<u64> = log.iter().filter(|a| a.1 == 1).map(|a| a.0).collect();
    let hedges: Vec<u64> = log.iter().filter(|a| a.1 == 2).map(|a| a.0).collect();
    let all: Vec<u64> = log.iter().map(|a| a.0).collect();
    assert_eq!((first.len(), hedges.len()), (300, 300));
    let stats = budget.stats();
    assert_eq!((stats.normal, stats.retry, stats.refused), (300, 300, 0));
    check_bucket(&first, 20, 200, "first attempts");
    check_bucket(&hedges, 4, 40, "hedges");
    check_bucket(&all, 24, 240, "all sends");
}

/// The attempt number saturates instead of overflowing, and the first is 1.
#[test]
fn attempt_numbers_saturate() {
    assert_eq!(Attempt::FIRST.number(), 1);
    assert!(!Attempt::FIRST.is_retry());
    let second = Attempt::FIRST.next();
    assert_eq!((second.number(), second.is_retry()), (2, true));
    let mut far = Attempt::FIRST;
    for _ in 0..64 {
        far = far.next();
    }
    assert_eq!(far.number(), 65);
}

/// Zero and huge numbers in a budget's configuration: zero is refused
/// naming the field; the largest numbers build, split into the most
/// partitions, and admit without overflow.
#[tokio::test(start_paused = true)]
async fn zero_and_huge_numbers_are_refused_or_held_exactly() {
    assert_eq!(
        Policy::token_bucket("normal", 0, 200, SECOND)
            .unwrap_err()
            .field(),
        "capacity"
    );
    assert_eq!(
        Policy::token_bucket("normal", 20, 0, SECOND)
            .unwrap_err()
            .field(),
        "refill"
    );
    assert_eq!(
        Policy::token_bucket("normal", 20, 200, Duration::ZERO)
            .unwrap_err()
            .field(),
        "period"
    );
    // A rate too fine for the bucket's arithmetic is refused, named.
    assert_eq!(
        Policy::token_bucket("normal", u64::MAX, u64::MAX, SECOND)
            .unwrap_err()
            .field(),
        "refill"
    );
    // So is a capacity whose refill outlasts the bucket's clock range.
    assert_eq!(
        Policy::token_bucket("retry", u64::MAX, 1, SECOND)
            .unwrap_err()
            .field(),
        "capacity"
    );
    let rate = u64::from(u32::MAX);
    let huge = DependencyBudget::builder(store(), "huge")
        .normal(Policy::token_bucket("normal", u64::MAX, rate, SECOND).unwrap())
        .retry(Policy::token_bucket("retry", 1 << 42, 1, SECOND).unwrap())
        .partitions_home(1024, 3)
        .build()
        .unwrap();
    // Each partition holds 1/1024 of the capacity: that much at once, and
    // not one more.
    let part = u64::MAX / 1024;
    assert_eq!(huge.try_acquire(Attempt::FIRST, part).await, Ok(()));
    assert!(matches!(
        huge.try_acquire(Attempt::FIRST, 1).await,
        Err(BudgetError::Exhausted { wait, .. }) if wait > Duration::ZERO
    ));
    let retry_part = (1 << 42) / 1024;
    assert_eq!(
        huge.try_acquire(Attempt::FIRST.next(), retry_part + 1)
            .await,
        Err(BudgetError::CostExceedsBudget {
            retry: true,
            cost: retry_part + 1
        })
    );
    assert_eq!(huge.try_acquire(Attempt::FIRST.next(), 1).await, Ok(()));
}
