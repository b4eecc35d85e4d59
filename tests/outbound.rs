//! The dependency budget per send attempt: shares, retries, waiting,
//! partitions. Time is tokio's paused clock, which the store reads too, so
//! every count is exact.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_admission::clock::{Clock, ManualClock};
use tower_admission::outbound::{
    Attempt, AttemptBudget, BudgetError, BudgetStats, DependencyBudget, DependencyBudgetLayer,
    RetryAttempts,
};
use tower_admission::quota::{MemoryStore, Policy};

const SECOND: Duration = Duration::from_secs(1);

/// The store's clock is tokio's (paused in these tests): µs since a start.
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

/// 240/s in all: 200/s first attempts (burst 20), 40/s retries (burst 4).
fn budget_240() -> DependencyBudget<MemoryStore<TokioClock>> {
    DependencyBudget::builder(store(), "dep")
        .normal(Policy::token_bucket("normal", 20, 200, SECOND).unwrap())
        .retry(Policy::token_bucket("retry", 4, 40, SECOND).unwrap())
        .build()
        .unwrap()
}

/// What the dependency saw: each arrival's time (µs from the start) and
/// attempt number.
#[derive(Clone, Default)]
struct Arrivals(Arc<Mutex<Vec<(u64, u32)>>>);

/// A dependency that fails every third arrival with 503.
fn dependency(
    arrivals: Arrivals,
    start: tokio::time::Instant,
) -> impl Service<Request<String>, Response = Response<String>, Error = Infallible, Future: Send>
       + Clone
       + Send {
    tower::service_fn(move |req: Request<String>| {
        let arrivals = arrivals.clone();
        async move {
            let attempt = req.extensions().get::<Attempt>().map_or(1, |a| a.number());
            let mut log = arrivals.0.lock().unwrap();
            log.push((start.elapsed().as_micros() as u64, attempt));
            let status = if log.len().is_multiple_of(3) {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::OK
            };
            Ok(Response::builder()
                .status(status)
                .body(String::new())
                .unwrap())
        }
    })
}

/// Most admitted in any interval of the log, against `floor(B + r·T)`.
fn check_bucket(times: &[u64], capacity: u64, per_second: u64, share: &str) {
    for (i, &t1) in times.iter().enumerate() {
        for (j, &t2) in times.iter().enumerate().skip(i) {
            let count = (j - i + 1) as u64;
            let bound = capacity + per_second * (t2 - t1) / 1_000_000;
            assert!(
                count <= bound,
                "{share}: {count} attempts in [{t1}, {t2}] µs, bound {bound}"
            );
        }
    }
}

/// 150 requests at once, each making 3 calls one after the other through
/// retry -> budget -> dependency, with every third arrival failing.
#[tokio::test(start_paused = true)]
async fn every_attempt_is_charged_to_its_share() {
    let start = tokio::time::Instant::now();
    let budget = budget_240();
    let arrivals = Arrivals::default();
    let client = ServiceBuilder::new()
        .retry(RetryAttempts::new(3).backoff(Duration::from_millis(5), Duration::from_millis(50)))
        .layer(DependencyBudgetLayer::new(budget.clone()).wait_up_to(Duration::from_secs(30)))
        .service(dependency(arrivals.clone(), start));
    let failed_calls = Arc::new(Mutex::new(0u64));
    let requests: Vec<_> = (0..150)
        .map(|_| {
            let client = client.clone();
            let failed_calls = failed_calls.clone();
            tokio::spawn(async move {
                for _ in 0..3 {
                    let response = client.clone().oneshot(Request::new(String::new())).await;
                    let response = response.expect("the budget waits, never refuses here");
                    if response.status() != StatusCode::OK {
                        *failed_calls.lock().unwrap() += 1;
                    }
                }
            })
        })
        .collect();
    for r in requests {
        r.await.unwrap();
    }
    let log = arrivals.0.lock().unwrap().clone();
    let stats = budget.stats();
    let first: Vec<u64> = log.iter().filter(|a| a.1 == 1).map(|a| a.0).collect();
    let retries: Vec<u64> = log.iter().filter(|a| a.1 > 1).map(|a| a.0).collect();
    // Every call's first attempt, and every retry, was charged and sent.
    assert_eq!(first.len(), 450);
    assert_eq!(stats.normal, 450);
    assert_eq!(stats.retry, retries.len() as u64);
    assert_eq!(log.len() as u64, stats.normal + stats.retry);
    // A third of the arrivals failed; each failure not on a third attempt
    // was retried once.
    let failures = log.len() as u64 / 3;
    let failed_calls = *failed_calls.lock().unwrap();
    assert_eq!(stats.retry, failures - failed_calls);
    assert!(stats.retry > 100, "{} retries", stats.retry);
    // Each share within its own bound in every interval.
    check_bucket(&first, 20, 200, "normal");
    check_bucket(&retries, 4, 40, "retry");
}

#[tokio::test(start_paused = true)]
async fn fail_fast_refuses_with_the_exact_wait() {
    let budget = budget_240();
    let arrivals = Arrivals::default();
    let mut client = DependencyBudgetLayer::new(budget.clone())
        .fail_fast()
        .layer(dependency(arrivals.clone(), tokio::time::Instant::now()));
    for _ in 0..20 {
        client
            .ready()
            .await
            .unwrap()
            .call(Request::new(String::new()))
            .await
            .unwrap();
    }
    let refused = client
        .ready()
        .await
        .unwrap()
        .call(Request::new(String::new()))
        .await
        .unwrap_err();
    // One token every 5 ms.
    assert!(matches!(
        refused,
        BudgetError::Exhausted {
            retry: false,
            wait
        } if wait == Duration::from_millis(5)
    ));
    assert_eq!(arrivals.0.lock().unwrap().len(), 20);
    assert_eq!(budget.stats().refused, 1);
}

#[tokio::test(start_paused = true)]
async fn waiting_ends_at_the_deadline() {
    let budget = DependencyBudget::builder(store(), "slow")
        .normal(Policy::token_bucket("normal", 1, 1, SECOND).unwrap())
        .retry(Policy::token_bucket("retry", 1, 1, SECOND).unwrap())
        .build()
        .unwrap();
    let arrivals = Arrivals::default();
    let start = tokio::time::Instant::now();
    let waits = DependencyBudgetLayer::new(budget.clone())
        .wait_up_to(Duration::from_secs(2))
        .layer(dependency(arrivals.clone(), start));
    waits
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    // The second waits exactly the refill of one token.
    waits
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(start.elapsed(), SECOND);
    // Waiting and then sent: no refusal counted, however often it looked.
    assert_eq!(budget.stats().refused, 0);
    // A wait past the deadline is refused at once.
    let short = DependencyBudgetLayer::new(budget.clone())
        .wait_up_to(Duration::from_millis(500))
        .layer(dependency(arrivals.clone(), start));
    let refused = short
        .oneshot(Request::new(String::new()))
        .await
        .unwrap_err();
    assert_eq!(refused.wait(), Some(SECOND));
    assert_eq!(start.elapsed(), SECOND);
    assert_eq!(budget.stats().waited_micros, 1_000_000);
    assert_eq!(budget.stats().refused, 1);
}

/// A budget of 100 per minute, in a store that stands still.
fn partitioned(
    store: &MemoryStore<ManualClock>,
    n: usize,
    pick: Pick,
) -> DependencyBudget<MemoryStore<ManualClock>> {
    DependencyBudget::builder(store.clone(), "hot")
        .normal(Policy::fixed_window("normal", 100, Duration::from_secs(60)).unwrap())
        .retry(Policy::fixed_window("retry", 10, Duration::from_secs(60)).unwrap())
        .pick(n, pick)
        .build()
        .unwrap()
}

async fn admitted<St: tower_admission::quota::Store>(
    budget: &DependencyBudget<St>,
    n: usize,
) -> usize {
    let mut admitted = 0;
    for _ in 0..n {
        if budget.try_acquire(Attempt::FIRST, 1).await.is_ok() {
            admitted += 1;
        }
    }
    admitted
}

#[tokio::test]
async fn partitions_split_the_budget_so_the_total_holds() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock);
    // Four instances, each on its home partition of 25.
    let homes: Vec<_> = (0..4)
        .map(|i| partitioned(&store, 4, Pick::Home(i)))
        .collect();
    let mut total = 0;
    for home in &homes {
        let n = admitted(home, 1_000).await;
        assert_eq!(n, 25);
        total += n;
    }
    assert_eq!(total, 100);

    // Random with probes uses the whole budget from one instance, and no more.
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock);
    let random = partitioned(&store, 4, Pick::Random { probes: 3 });
    assert_eq!(admitted(&random, 1_000).await, 100);
    // Without probes, a single instance gets only what its random picks
    // find: at most the total, and refusals once any partition is empty.
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock);
    let random = partitioned(&store, 4, Pick::Random { probes: 0 });
    assert_eq!(admitted(&random, 1_000).await, 100);
}

/// The trap: splitting a hot key into N keys but granting each the whole
/// budget multiplies the allowance by N.
#[tokio::test]
async fn the_naive_split_admits_n_times_the_budget() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock);
    let mut total = 0;
    for i in 0..4 {
        // Each "partition" is a budget of its own holding the full 100.
        let naive = DependencyBudget::builder(store.clone(), &format!("naive{i}"))
            .normal(Policy::fixed_window("normal", 100, Duration::from_secs(60)).unwrap())
            .retry(Policy::fixed_window("retry", 10, Duration::from_secs(60)).unwrap())
            .build()
            .unwrap();
        total += admitted(&naive, 1_000).await;
    }
    assert_eq!(total, 400);
}

#[test]
fn bad_budgets_name_the_field() {
    let build = |n| {
        DependencyBudget::builder(MemoryStore::new(), "b")
            .normal(Policy::token_bucket("n", 1, 1, SECOND).unwrap())
            .retry(Policy::token_bucket("r", 1, 1, SECOND).unwrap())
            .partitions_home(n, 0)
            .build()
            .map(|_| ())
    };
    assert_eq!(build(0).unwrap_err().field(), "partitions");
    assert_eq!(build(1025).unwrap_err().field(), "partitions");
    let missing = DependencyBudget::builder(MemoryStore::new(), "b")
        .normal(Policy::token_bucket("n", 1, 1, SECOND).unwrap())
        .build()
        .unwrap_err();
    assert_eq!(missing.field(), "retry");
    // The name is checked as given, not as the shares' quota names built
    // from it: an empty one, and one too long once `-normal` is added.
    let named = |name: &str| {
        DependencyBudget::builder(MemoryStore::new(), name)
            .normal(Policy::token_bucket("n", 1, 1, SECOND).unwrap())
            .retry(Policy::token_bucket("r", 1, 1, SECOND).unwrap())
            .build()
            .map(|_| ())
    };
    for bad in ["", "a b", "a{b}", &"x".repeat(58)] {
        let err = named(bad).unwrap_err();
        assert_eq!(err.field(), "name", "{bad:?}");
        assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
    }
    assert!(named(&"x".repeat(57)).is_ok());
}

/// 5/s, a burst of one, for either share: a token every 200 ms.
fn budget_5() -> DependencyBudget<MemoryStore<TokioClock>> {
    DependencyBudget::builder(store(), "dep")
        .normal(Policy::token_bucket("normal", 1, 5, SECOND).unwrap())
        .retry(Policy::token_bucket("retry", 1, 5, SECOND).unwrap())
        .build()
        .unwrap()
}

/// A client that records each request's body and the ms since `start` at
/// which it was sent.
type Sent = Arc<Mutex<Vec<(String, u64)>>>;

fn recording(
    start: tokio::time::Instant,
    sent: &Sent,
) -> impl Service<Request<String>, Response = Response<String>, Error = Infallible, Future: Send>
       + Clone
       + Send {
    let sent = sent.clone();
    tower::service_fn(move |req: Request<String>| {
        let sent = sent.clone();
        async move {
            let at = u64::try_from(start.elapsed().as_millis()).unwrap();
            sent.lock().unwrap().push((req.into_body(), at));
            Ok::<_, Infallible>(Response::new(String::new()))
        }
    })
}

/// Waiting attempts are served in arrival order: one that arrives while
/// another waits goes behind it, even at the instant capacity frees.
#[tokio::test(start_paused = true)]
async fn a_waiting_attempt_is_not_overtaken_by_a_later_one() {
    let start = tokio::time::Instant::now();
    let budget = budget_5();
    let sent: Sent = Arc::default();
    let service = DependencyBudgetLayer::new(budget).layer(recording(start, &sent));
    let call = |name: &str| {
        let service = service.clone();
        let req = Request::new(name.to_owned());
        async move { service.oneshot(req).await.map(|_| ()) }
    };
    // `late` wakes at 200 ms, the instant the second token frees and before
    // `waiter` (asleep since 0 ms for that same token) is woken.
    let late = tokio::spawn({
        let call = call("late");
        async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            call.await
        }
    });
    tokio::task::yield_now().await;
    call("first").await.unwrap();
    let waiter = tokio::spawn(call("waiter"));
    waiter.await.unwrap().unwrap();
    late.await.unwrap().unwrap();
    assert_eq!(
        *sent.lock().unwrap(),
        [
            ("first".to_owned(), 0),
            ("waiter".to_owned(), 200),
            ("late".to_owned(), 400)
        ]
    );
}

/// A budget whose first refusal reaches its caller only `delay` after it
/// was decided, as the answer of a remote store or of a thread descheduled
/// in between may.
#[derive(Clone)]
struct SlowFirstRefusal<Bu> {
    inner: Bu,
    delay: Duration,
    delayed: Arc<std::sync::atomic::AtomicBool>,
}

impl<Bu: AttemptBudget> AttemptBudget for SlowFirstRefusal<Bu> {
    async fn charge(&self, attempt: Attempt, cost: u64) -> Result<(), BudgetError> {
        let result = self.inner.charge(attempt, cost).await;
        if result.is_err()
            && !self
                .delayed
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tokio::time::sleep(self.delay).await;
        }
        result
    }

    fn record_refusal(&self) {
        self.inner.record_refusal();
    }

    fn record_wait(&self, waited: Duration) {
        self.inner.record_wait(waited);
    }

    fn stats(&self) -> BudgetStats {
        self.inner.stats()
    }
}

/// Arrival order holds from an attempt's first look at the budget, not only
/// from the moment it queues: an attempt refused at 0 ms whose refusal
/// reaches it at 250 ms is not passed by one arriving at 210 ms, when the
/// token of 200 ms is free.
#[tokio::test(start_paused = true)]
async fn an_attempt_is_not_overtaken_while_its_refusal_is_on_the_way() {
    let start = tokio::time::Instant::now();
    let budget = SlowFirstRefusal {
        inner: budget_5(),
        delay: Duration::from_millis(250),
        delayed: Arc::default(),
    };
    let sent: Sent = Arc::default();
    let service = DependencyBudgetLayer::new(budget).layer(recording(start, &sent));
    let call = |name: &str| service.clone().oneshot(Request::new(name.to_owned()));
    call("first").await.unwrap();
    let waiter = tokio::spawn(call("waiter"));
    let late = tokio::spawn({
        let call = call("late");
        async move {
            tokio::time::sleep(Duration::from_millis(210)).await;
            call.await
        }
    });
    waiter.await.unwrap().unwrap();
    late.await.unwrap().unwrap();
    let order: Vec<String> = sent
        .lock()
        .unwrap()
        .iter()
        .map(|(n, _)| n.clone())
        .collect();
    assert_eq!(
        order,
        ["first", "waiter", "late"],
        "sent: {:?}",
        sent.lock().unwrap()
    );
}

/// A deadline too far for the clock (`Duration::MAX`) means waiting as long
/// as it takes: the second attempt waits the refill of one token, 1 s.
#[tokio::test(start_paused = true)]
async fn an_endless_deadline_waits_as_long_as_it_takes() {
    let start = tokio::time::Instant::now();
    let budget = budget_5();
    let sent: Sent = Arc::default();
    let service = DependencyBudgetLayer::new(budget.clone())
        .wait_up_to(Duration::MAX)
        .layer(recording(start, &sent));
    for name in ["first", "second"] {
        service
            .clone()
            .oneshot(Request::new(name.to_owned()))
            .await
            .unwrap();
    }
    assert_eq!(
        *sent.lock().unwrap(),
        [("first".to_owned(), 0), ("second".to_owned(), 200)]
    );
    assert_eq!(budget.stats().waited_micros, 200_000);
}

/// An attempt whose deadline passes while it waits behind an earlier one
/// never takes what that one waits for: it is refused with the earlier
/// one's refusal and the wait that one still has. Bucket 10 at 10/s,
/// empty: `A` (cost 5) waits 500 ms; `B` (cost 1, 1 ms later, 200 ms
/// deadline) is refused at 201 ms, told 299 ms, and `A` is sent at 500 ms.
#[tokio::test(start_paused = true)]
async fn a_waiter_whose_deadline_passes_never_takes_the_heads_capacity() {
    let start = tokio::time::Instant::now();
    let budget = DependencyBudget::builder(store(), "order")
        .normal(Policy::token_bucket("normal", 10, 10, SECOND).unwrap())
        .retry(Policy::token_bucket("retry", 10, 10, SECOND).unwrap())
        .build()
        .unwrap();
    for _ in 0..10 {
        budget.try_acquire(Attempt::FIRST, 1).await.unwrap();
    }
    let sent: Sent = Arc::default();
    let long = DependencyBudgetLayer::new(budget.clone())
        .cost(|req: &Request<String>| if req.body() == "A" { 5 } else { 1 })
        .wait_up_to(Duration::from_millis(500));
    let short = long.clone().wait_up_to(Duration::from_millis(200));
    let a = tokio::spawn(
        long.layer(recording(start, &sent))
            .oneshot(Request::new("A".to_owned())),
    );
    tokio::task::yield_now().await;
    tokio::time::advance(Duration::from_millis(1)).await;
    let b = tokio::spawn(
        short
            .layer(recording(start, &sent))
            .oneshot(Request::new("B".to_owned())),
    );
    let refused = b.await.unwrap().unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_millis(201));
    assert!(
        matches!(
            refused,
            BudgetError::Exhausted {
                retry: false,
                wait
            } if wait == Duration::from_millis(299)
        ),
        "{refused:?}"
    );
    a.await.unwrap().unwrap();
    assert_eq!(*sent.lock().unwrap(), [("A".to_owned(), 500)]);
    assert_eq!(budget.stats().refused, 1);
}

/// Partitions hold at least 1 of every limit each, so a limit or capacity
/// below the partition count would let them admit more than the whole: such
/// a split is refused, naming `partitions` and the most the budget allows.
#[test]
fn partitions_that_would_admit_more_than_the_whole_are_refused() {
    let build = |normal: Policy, retry: Policy, n| {
        DependencyBudget::builder(MemoryStore::new(), "b")
            .normal(normal)
            .retry(retry)
            .partitions_random(n, 1)
            .build()
            .map(|_| ())
    };
    let bucket = |capacity, refill| Policy::token_bucket("tb", capacity, refill, SECOND).unwrap();
    // Sliding log 5 per s over 8 partitions would admit 8 at one instant.
    let log = || Policy::sliding_log("sl", 5, SECOND).unwrap();
    let err = build(log(), log(), 8).unwrap_err();
    assert_eq!(err.field(), "partitions");
    assert!(err.reason().contains("at most 5 partitions"), "{err}");
    // Retry burst 4 over 8 partitions would admit 8 at one instant.
    let err = build(bucket(20, 200), bucket(4, 40), 8).unwrap_err();
    assert_eq!(err.field(), "partitions");
    assert!(err.reason().contains("at most 4 partitions"), "{err}");
    let window = Policy::fixed_window("fw", 3, SECOND).unwrap();
    assert_eq!(
        build(window.clone(), window, 10).unwrap_err().field(),
        "partitions"
    );
    // As many partitions as the smallest capacity: each holds exactly 1.
    assert_eq!(build(bucket(20, 200), bucket(4, 40), 4), Ok(()));
    // A refill below the partition count divides exactly (a slower refill).
    assert_eq!(build(bucket(20, 3), bucket(4, 3), 4), Ok(()));
}

/// A dependency that answers its first arrival with `first` (status and
/// headers) and every later one with 200, logging arrivals.
fn failing_once(
    arrivals: Arrivals,
    start: tokio::time::Instant,
    first: Response<String>,
) -> impl Service<Request<String>, Response = Response<String>, Error = Infallible, Future: Send>
       + Clone
       + Send {
    let first = Arc::new(Mutex::new(Some(first)));
    tower::service_fn(move |req: Request<String>| {
        let arrivals = arrivals.clone();
        let first = first.clone();
        async move {
            let attempt = req.extensions().get::<Attempt>().map_or(1, |a| a.number());
            arrivals
                .0
                .lock()
                .unwrap()
                .push((start.elapsed().as_micros() as u64, attempt));
            let response = first.lock().unwrap().take();
            Ok(response.unwrap_or_else(|| Response::new(String::new())))
        }
    })
}

/// The dependency's own wait is obeyed: a 429 with `Retry-After: 1` is
/// retried after exactly 1 s (the jittered backoff is at most 10 ms), a
/// trailers-only gRPC `UNAVAILABLE` with a pushback of 300 ms after 300 ms,
/// and a wait above `max_server_wait` or a negative pushback is not retried:
/// the caller gets the dependency's answer. Before, every one of them was
/// retried within 10 ms.
#[tokio::test(start_paused = true)]
async fn a_retry_waits_as_long_as_the_dependency_asks() {
    let grpc = |status: &str, pushback: &str| {
        Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", status)
            .header("grpc-retry-pushback-ms", pushback)
            .body(String::new())
            .unwrap()
    };
    let http = |status: StatusCode, retry_after: &str| {
        Response::builder()
            .status(status)
            .header("retry-after", retry_after)
            .body(String::new())
            .unwrap()
    };
    // (first answer, expected arrival times in µs, expected final status)
    let cases = [
        (
            http(StatusCode::TOO_MANY_REQUESTS, "1"),
            vec![0, 1_000_000],
            200,
        ),
        (
            http(StatusCode::SERVICE_UNAVAILABLE, "2"),
            vec![0, 2_000_000],
            200,
        ),
        (http(StatusCode::TOO_MANY_REQUESTS, "3"), vec![0], 429),
        (grpc("14", "300"), vec![0, 300_000], 200),
        (grpc("8", "-1"), vec![0], 200),
    ];
    for (first, expected, status) in cases {
        let asked = format!("{:?}", first.headers());
        let start = tokio::time::Instant::now();
        let arrivals = Arrivals::default();
        let client = ServiceBuilder::new()
            .retry(RetryAttempts::new(3).max_server_wait(2 * SECOND))
            .layer(DependencyBudgetLayer::new(budget_240()))
            .service(failing_once(arrivals.clone(), start, first));
        let response = client.oneshot(Request::new(String::new())).await.unwrap();
        assert_eq!(response.status().as_u16(), status, "{asked}");
        let times: Vec<u64> = arrivals.0.lock().unwrap().iter().map(|a| a.0).collect();
        assert_eq!(times, expected, "{asked}");
    }
}

/// A shadow policy refuses nothing, so as a share it would admit every
/// attempt: the builder refuses it and names the share.
#[tokio::test]
async fn a_shadow_policy_cannot_be_a_share() {
    let bucket = |name| Policy::token_bucket(name, 2, 2, SECOND).unwrap();
    let normal = DependencyBudget::builder(store(), "dep")
        .normal(bucket("normal").shadow())
        .retry(bucket("retry"))
        .build()
        .unwrap_err();
    assert_eq!(normal.field(), "normal");
    let retry = DependencyBudget::builder(store(), "dep")
        .normal(bucket("normal"))
        .retry(bucket("retry").shadow())
        .build()
        .unwrap_err();
    assert_eq!(retry.field(), "retry");
}

/// A store that fails every decision for the partition keys in `down`
/// (the limiter cannot be reached for them) and passes the rest to `inner`.
#[derive(Clone, Debug)]
struct PartlyDown<St> {
    inner: St,
    down: Arc<[&'static str]>,
}

type StoreFuture<T> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<T, tower_admission::quota::StoreError>> + Send>,
>;

impl<St: tower_admission::quota::Store> tower_admission::quota::Store for PartlyDown<St> {
    type DecideFuture = StoreFuture<tower_admission::quota::QuotaDecision>;
    type SettleFuture = StoreFuture<tower_admission::quota::QuotaDecision>;

    fn decide(
        &self,
        quota: &tower_admission::quota::Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> Self::DecideFuture {
        if self.down.contains(&&**key) {
            return Box::pin(async {
                Err(tower_admission::quota::StoreError::Unavailable {
                    message: "partition down".into(),
                })
            });
        }
        Box::pin(self.inner.decide(quota, key, cost))
    }

    fn peek(
        &self,
        quota: &tower_admission::quota::Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> Self::DecideFuture {
        if self.down.contains(&&**key) {
            return self.decide(quota, key, cost);
        }
        Box::pin(self.inner.peek(quota, key, cost))
    }

    fn settle(
        &self,
        quota: &tower_admission::quota::Quota,
        key: &Arc<str>,
        decision: &tower_admission::quota::QuotaDecision,
        delta: i64,
    ) -> Self::SettleFuture {
        Box::pin(self.inner.settle(quota, key, decision, delta))
    }
}

/// Four partitions of a token bucket of 4 per 40 s (each: 1 token per
/// 40 s), on a store that stands still, with the keys in `down` failing.
fn four_buckets(
    store: &PartlyDown<MemoryStore<ManualClock>>,
    pick: Pick,
) -> DependencyBudget<PartlyDown<MemoryStore<ManualClock>>> {
    DependencyBudget::builder(store.clone(), "probed")
        .normal(Policy::token_bucket("normal", 4, 4, Duration::from_secs(40)).unwrap())
        .retry(Policy::token_bucket("retry", 4, 4, Duration::from_secs(40)).unwrap())
        .pick(4, pick)
        .build()
        .unwrap()
}

/// When every probed partition refuses, the refusal reported is the most
/// useful one whatever the probe order: the shortest `Exhausted` wait, not
/// the last partition's answer, and never a store failure while another
/// partition gave a wait.
#[tokio::test]
async fn a_refusal_across_partitions_is_the_shortest_wait_whatever_the_order() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = PartlyDown {
        inner: MemoryStore::with_clock(clock.clone()),
        down: Arc::from(["p1"]),
    };
    // Empty p0 at 0 s, p2 at 20 s and p3 at 30 s through their home
    // partitions (same name and store, so the same keys); p1 is down.
    for (home, at) in [(0, 0), (2, 20), (3, 30)] {
        clock.set(Duration::from_secs(1_800_000_000 + at));
        let budget = four_buckets(&store, Pick::Home(home));
        assert_eq!(budget.try_acquire(Attempt::FIRST, 1).await, Ok(()));
    }
    // At 30 s: p0 frees in 10 s, p1 is down, p2 in 30 s, p3 in 40 s.
    let random = four_buckets(&store, Pick::Random { probes: 3 });
    for _ in 0..200 {
        assert_eq!(
            random.try_acquire(Attempt::FIRST, 1).await,
            Err(BudgetError::Exhausted {
                retry: false,
                wait: Duration::from_secs(10),
            })
        );
    }
    assert_eq!(random.stats().refused, 200);

    // Only when every probed partition is down is the refusal Unavailable.
    let all_down = PartlyDown {
        inner: MemoryStore::with_clock(clock.clone()),
        down: Arc::from(["p0", "p1", "p2", "p3"]),
    };
    let random = four_buckets(&all_down, Pick::Random { probes: 3 });
    for _ in 0..20 {
        assert!(matches!(
            random.try_acquire(Attempt::FIRST, 1).await,
            Err(BudgetError::Unavailable { .. })
        ));
    }
    // A cost no partition can ever admit is refused as such, at once.
    let random = four_buckets(&store, Pick::Random { probes: 3 });
    for _ in 0..20 {
        assert_eq!(
            random.try_acquire(Attempt::FIRST, 2).await,
            Err(BudgetError::CostExceedsBudget {
                retry: false,
                cost: 2,
            })
        );
    }
}

/// One step of a random interleaving: an attempt (first or retry) of a cost,
/// after the clock moved on by some µs.
#[derive(Debug, Clone, Copy)]
struct Step {
    advance_us: u64,
    retry: bool,
    cost: u64,
}

fn steps() -> impl proptest::strategy::Strategy<Value = Vec<Step>> {
    use proptest::prelude::*;
    let advance = prop_oneof![
        6 => Just(0u64),
        10 => 0u64..=10_000,
        3 => 0u64..=100_000,
        1 => 0u64..=2_000_000,
    ];
    let cost = prop_oneof![8 => Just(1u64), 3 => 1u64..=4, 1 => 1u64..=25];
    proptest::collection::vec(
        (advance, proptest::bool::weighted(0.3), cost).prop_map(|(advance_us, retry, cost)| Step {
            advance_us,
            retry,
            cost,
        }),
        1..400,
    )
}

/// A token bucket in µs of refill: `level` is the tokens held times the µs
/// one token takes to refill; it starts full.
struct ModelBucket {
    capacity: u64,
    us_per_token: u64,
    level: u64,
}

impl ModelBucket {
    fn new(capacity: u64, per_second: u64) -> Self {
        let us_per_token = 1_000_000 / per_second;
        ModelBucket {
            capacity,
            us_per_token,
            level: capacity * us_per_token,
        }
    }

    fn advance(&mut self, us: u64) {
        self.level = (self.level + us).min(self.capacity * self.us_per_token);
    }

    /// The refusal the share should give, or `None` after taking `cost`.
    fn take(&mut self, retry: bool, cost: u64) -> Option<BudgetError> {
        if cost > self.capacity {
            return Some(BudgetError::CostExceedsBudget { retry, cost });
        }
        let need = cost * self.us_per_token;
        if self.level >= need {
            self.level -= need;
            return None;
        }
        Some(BudgetError::Exhausted {
            retry,
            wait: Duration::from_micros(need - self.level),
        })
    }
}

/// The most any closed interval of `log` (time µs, cost) holds, against
/// `floor(B + r·T)`; panics with the interval that breaks it.
fn check_intervals(
    log: &[(u64, u64)],
    capacity: u64,
    per_second: u64,
    what: &str,
) -> Result<(), proptest::test_runner::TestCaseError> {
    for i in 0..log.len() {
        let mut sum = 0;
        for j in i..log.len() {
            sum += log[j].1;
            let span = log[j].0 - log[i].0;
            let bound = capacity + per_second * span / 1_000_000;
            proptest::prop_assert!(
                sum <= bound,
                "{}: {} admitted in [{}, {}] µs, bound {}",
                what,
                sum,
                log[i].0,
                log[j].0,
                bound
            );
            if span <= 1_000_000 {
                // Every window of 1 s: at most B + r.
                proptest::prop_assert!(sum <= capacity + per_second, "{what}: 1 s window");
            }
        }
    }
    Ok(())
}

/// Random interleavings of first attempts and retries of random costs, with
/// random clock advances, on the 240/s budget (200/s + burst 20 for first
/// attempts, 40/s + burst 4 for retries): in every interval of length T,
/// normal admissions stay within `floor(20 + 200·T)`, retries within
/// `floor(4 + 40·T)` and all of them within `24 + 240·T` (so at most 220,
/// 44 and 264 in any window of 1 s). One partition is decided exactly as a
/// reference token bucket (admissions and waits); four partitions picked at
/// random with probes keep the same bounds.
#[test]
fn random_attempts_and_retries_keep_every_share_and_the_total_within_bound() {
    use proptest::test_runner::{Config, TestRunner};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(64);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&(steps(), proptest::bool::ANY), |(steps, partitioned)| {
            let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
            let store = MemoryStore::with_clock(clock.clone());
            let mut builder = DependencyBudget::builder(store, "dep")
                .normal(Policy::token_bucket("normal", 20, 200, SECOND).unwrap())
                .retry(Policy::token_bucket("retry", 4, 40, SECOND).unwrap());
            if partitioned {
                builder = builder.partitions_random(4, 3);
            }
            let budget = builder.build().unwrap();
            let mut model = [ModelBucket::new(20, 200), ModelBucket::new(4, 40)];
            let (mut normal, mut retry, mut total) = (Vec::new(), Vec::new(), Vec::new());
            let mut now = 0u64;
            for step in &steps {
                clock.advance(Duration::from_micros(step.advance_us));
                now += step.advance_us;
                for bucket in &mut model {
                    bucket.advance(step.advance_us);
                }
                let attempt = if step.retry {
                    Attempt::FIRST.next()
                } else {
                    Attempt::FIRST
                };
                let result = runtime.block_on(budget.try_acquire(attempt, step.cost));
                if !partitioned {
                    let expected = model[usize::from(step.retry)].take(step.retry, step.cost);
                    proptest::prop_assert_eq!(result.clone().err(), expected, "at {} µs", now);
                }
                if result.is_ok() {
                    total.push((now, step.cost));
                    if step.retry {
                        retry.push((now, step.cost));
                    } else {
                        normal.push((now, step.cost));
                    }
                }
            }
            check_intervals(&normal, 20, 200, "normal")?;
            check_intervals(&retry, 4, 40, "retry")?;
            check_intervals(&total, 24, 240, "total")?;
            let stats = budget.stats();
            proptest::prop_assert_eq!(stats.normal, normal.len() as u64);
            proptest::prop_assert_eq!(stats.retry, retry.len() as u64);
            proptest::prop_assert_eq!(
                stats.refused,
                (steps.len() - normal.len() - retry.len()) as u64
            );
            Ok(())
        })
        .unwrap();
}

/// Every attempt is a send, so it costs at least 1 whatever the cost
/// function says: an empty batch priced at its item count (0) must not
/// pass uncounted. Ten such attempts at one instant on a budget of one
/// token per second: one is sent, nine are refused. Before, all ten passed
/// and the budget counted nothing.
#[tokio::test(start_paused = true)]
async fn an_attempt_priced_at_zero_still_costs_one() {
    let budget = DependencyBudget::builder(store(), "empty")
        .normal(Policy::token_bucket("normal", 1, 1, SECOND).unwrap())
        .retry(Policy::token_bucket("retry", 1, 1, SECOND).unwrap())
        .build()
        .unwrap();
    let arrivals = Arrivals::default();
    let client = DependencyBudgetLayer::new(budget.clone())
        .cost(|_req: &Request<String>| 0)
        .fail_fast()
        .layer(dependency(arrivals.clone(), tokio::time::Instant::now()));
    let mut refused = 0;
    for _ in 0..10 {
        match client.clone().oneshot(Request::new(String::new())).await {
            Ok(_) => {}
            Err(BudgetError::Exhausted { wait, .. }) => {
                assert_eq!(wait, SECOND);
                refused += 1;
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    assert_eq!(arrivals.0.lock().unwrap().len(), 1);
    assert_eq!(refused, 9);
    assert_eq!((budget.stats().normal, budget.stats().refused), (1, 9));
}

/// How the tests pick a partition: one of the builder's two ways.
#[derive(Debug, Clone, Copy)]
enum Pick {
    /// `partitions_home`.
    Home(usize),
    /// `partitions_random`.
    Random { probes: usize },
}

/// The builder with `n` partitions picked by `pick`.
trait PickExt: Sized {
    fn pick(self, n: usize, pick: Pick) -> Self;
}

impl<St: tower_admission::quota::Store> PickExt
    for tower_admission::outbound::DependencyBudgetBuilder<St>
{
    fn pick(self, n: usize, pick: Pick) -> Self {
        match pick {
            Pick::Home(home) => self.partitions_home(n, home),
            Pick::Random { probes } => self.partitions_random(n, probes),
        }
    }
}
