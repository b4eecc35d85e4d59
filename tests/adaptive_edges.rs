//! The adaptive limit below capacity, with cancelled callers, and its
//! refusals, configuration errors and metrics; in virtual time.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_admission::concurrency::{
    AdaptiveLimit, AdaptiveLimitLayer, ConcurrencyLayer, Criticality, LimitError, OverloadReason,
};
use tower_admission::identity::Identity;

/// A dependency whose every call takes `latency_ms`, whatever the load.
fn fixed_latency(
    latency_ms: Arc<AtomicU64>,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl std::future::Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send,
> + Clone
       + Send
       + 'static {
    service_fn(move |_req: Request<Full<Bytes>>| {
        let wait = Duration::from_millis(latency_ms.load(Ordering::Relaxed));
        async move {
            tokio::time::sleep(wait).await;
            Ok::<_, Infallible>(Response::new(Full::default()))
        }
    })
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Sends `per_ms` requests each ms for `run`, each answered in 20 ms;
/// returns (admitted, refused) and the highest limit seen outside probes.
async fn load<S>(
    svc: &S,
    layer: &ConcurrencyLayer,
    per_ms: usize,
    run: Duration,
) -> (usize, usize, usize)
where
    S: Service<
            Request<Full<Bytes>>,
            Response = Response<tower_admission::concurrency::PermitBody<Full<Bytes>>>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let mut tasks = Vec::new();
    let mut highest = 0;
    let start = tokio::time::Instant::now();
    for n in 0..run.as_millis() as u64 {
        tokio::time::sleep_until(start + ms(n)).await;
        let stats = layer.stats();
        if !stats.probing {
            highest = highest.max(stats.limit.unwrap());
        }
        for _ in 0..per_ms {
            let svc = svc.clone();
            tasks.push(tokio::spawn(async move {
                let response = svc.oneshot(Request::new(Full::default())).await.unwrap();
                response.extensions().get::<OverloadReason>().is_none()
            }));
        }
    }
    let mut admitted = 0;
    let mut refused = 0;
    for task in tasks {
        if task.await.unwrap() {
            admitted += 1;
        } else {
            refused += 1;
        }
    }
    (admitted, refused, highest)
}

/// At half its capacity (10 in flight against an initial limit of 40) the
/// limit never grows, refuses nothing (the queue carries the requests of
/// the baseline probes, at start and after 60 s), and stays put while the
/// service idles.
#[tokio::test(start_paused = true)]
async fn below_capacity_the_limit_neither_grows_nor_refuses() {
    let layer = ConcurrencyLayer::builder()
        .global_adaptive(
            AdaptiveLimit::default().initial(40),
            256,
            Duration::from_secs(1),
        )
        .build()
        .unwrap();
    let svc = layer.layer(fixed_latency(Arc::new(AtomicU64::new(20))));
    // One request every 2 ms for 130 s: 10 in flight.
    let mut admitted = 0;
    let mut highest = 0;
    for _ in 0..65 {
        let (a, refused, h) = load_every_2ms(&svc, &layer, Duration::from_secs(2)).await;
        assert_eq!(refused, 0);
        admitted += a;
        highest = highest.max(h);
    }
    assert_eq!(admitted, 65_000);
    assert_eq!(highest, 40);
    let stats = layer.stats();
    assert_eq!((stats.limit, stats.probing), (Some(40), false));
    assert_eq!(stats.baseline_latency, Some(ms(20)));
    // Ten minutes idle: no window closes, the limit stays.
    tokio::time::sleep(Duration::from_secs(600)).await;
    let stats = layer.stats();
    assert_eq!(
        (stats.limit, stats.global_in_flight, stats.probing),
        (Some(40), 0, false)
    );
}

async fn load_every_2ms<S>(
    svc: &S,
    layer: &ConcurrencyLayer,
    run: Duration,
) -> (usize, usize, usize)
where
    S: Service<
            Request<Full<Bytes>>,
            Response = Response<tower_admission::concurrency::PermitBody<Full<Bytes>>>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let mut tasks = Vec::new();
    let mut highest = 0;
    let start = tokio::time::Instant::now();
    for n in 0..run.as_millis() as u64 / 2 {
        tokio::time::sleep_until(start + ms(2 * n)).await;
        let stats = layer.stats();
        if !stats.probing {
            highest = highest.max(stats.limit.unwrap());
        }
        let svc = svc.clone();
        tasks.push(tokio::spawn(async move {
            let response = svc.oneshot(Request::new(Full::default())).await.unwrap();
            response.extensions().get::<OverloadReason>().is_none()
        }));
    }
    let mut admitted = 0;
    let mut refused = 0;
    for task in tasks {
        if task.await.unwrap() {
            admitted += 1;
        } else {
            refused += 1;
        }
    }
    (admitted, refused, highest)
}

/// A limit below the load grows, because it is used, until the load fits,
/// and then stops: 20 in flight against an initial limit of 5.
#[tokio::test(start_paused = true)]
async fn a_used_limit_grows_until_the_load_fits_and_stops() {
    let layer = ConcurrencyLayer::builder()
        .global_adaptive(AdaptiveLimit::default().initial(5), 0, Duration::ZERO)
        .build()
        .unwrap();
    let svc = layer.layer(fixed_latency(Arc::new(AtomicU64::new(20))));
    let (admitted, refused, _) = load(&svc, &layer, 1, Duration::from_secs(2)).await;
    assert_eq!((admitted, refused), (1462, 538));
    let (admitted, refused, highest) = load(&svc, &layer, 1, Duration::from_secs(30)).await;
    assert_eq!((admitted, refused), (30_000, 0));
    assert_eq!((highest, layer.stats().limit), (29, Some(29)));
}

/// Callers that give up after 1 ms while the limit is full: their dropped
/// futures free their slots and give no sample, so the limit and the
/// baseline stay where they were (reading a drop as an answer at the time
/// of the drop would see 1 ms against a 20 ms baseline and raise the limit
/// to its ceiling). Callers that give up after 100 ms on a dependency
/// slowed to 200 ms count as slow, and the limit falls.
#[tokio::test(start_paused = true)]
async fn dropped_requests_are_not_fast_successes() {
    let latency = Arc::new(AtomicU64::new(20));
    let limit = AdaptiveLimitLayer::<Request<Full<Bytes>>>::builder(
        AdaptiveLimit::default().initial(20).bounds(2, 1000),
    )
    .build()
    .unwrap();
    let svc = limit.layer(fixed_latency(Arc::clone(&latency)));
    // The first probe: 25 answers at 3 in flight.
    for _ in 0..9 {
        let calls: Vec<_> = (0..3)
            .map(|_| svc.clone().oneshot(Request::new(Full::default())))
            .collect();
        for call in calls {
            call.await.unwrap();
        }
    }
    let stats = limit.stats();
    assert_eq!(
        (stats.limit, stats.baseline_latency, stats.probing),
        (Some(20), Some(ms(20)), false)
    );

    // 5 s of callers that drop their request after 1 ms, 20 new each ms.
    let mut refused = 0;
    for _ in 0..5_000 {
        let calls: Vec<_> = (0..20)
            .map(|_| {
                let call = svc.clone().oneshot(Request::new(Full::default()));
                tokio::spawn(async move {
                    match tokio::time::timeout(ms(1), call).await {
                        Ok(Err(LimitError::Overloaded { .. })) => 1,
                        Ok(_) => panic!("answered within 1 ms"),
                        Err(_) => 0,
                    }
                })
            })
            .collect();
        for call in calls {
            refused += call.await.unwrap();
        }
    }
    let stats = limit.stats();
    assert_eq!(refused, 0);
    assert_eq!(
        (
            stats.limit,
            stats.baseline_latency,
            stats.latency,
            stats.global_in_flight
        ),
        (Some(20), Some(ms(20)), None, 0)
    );

    // The dependency slows to 200 ms; callers give up after 100 ms.
    latency.store(200, Ordering::Relaxed);
    for _ in 0..50 {
        let calls: Vec<_> = (0..20)
            .map(|_| {
                let call = svc.clone().oneshot(Request::new(Full::default()));
                tokio::spawn(tokio::time::timeout(ms(100), call))
            })
            .collect();
        for call in calls {
            match call.await.unwrap() {
                Err(_gave_up) => {}
                Ok(Err(LimitError::Overloaded { .. })) => {}
                Ok(_) => panic!("answered within 100 ms"),
            }
        }
    }
    let stats = limit.stats();
    assert_eq!(
        (stats.limit, stats.latency, stats.global_in_flight),
        (Some(2), Some(ms(100)), 0)
    );
}

/// A refusal of the adaptive global limit keeps the crate's contract: 503
/// with `Retry-After` and the `RateLimit` fields of the limit in force, an
/// [`OverloadReason`], and `UNAVAILABLE` for gRPC.
#[tokio::test(start_paused = true)]
async fn refusals_are_503_with_retry_after_and_ratelimit_fields() {
    let layer = ConcurrencyLayer::builder()
        .global_adaptive(AdaptiveLimit::default(), 0, Duration::ZERO)
        .build()
        .unwrap();
    let svc = layer.layer(fixed_latency(Arc::new(AtomicU64::new(20))));
    // The first probe holds the limit at 3.
    let held: Vec<_> = (0..3)
        .map(|_| svc.clone().oneshot(Request::new(Full::default())))
        .map(tokio::spawn)
        .collect();
    tokio::task::yield_now().await;
    assert_eq!(layer.in_flight(), 3);
    let refused = svc
        .clone()
        .oneshot(Request::new(Full::default()))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(
        refused.headers()["ratelimit-policy"],
        r#""global-concurrency";q=3;qu="concurrent-requests""#
    );
    assert_eq!(
        refused.headers()["ratelimit"],
        r#""global-concurrency";r=0;t=1"#
    );
    assert_eq!(
        refused.extensions().get::<OverloadReason>(),
        Some(&OverloadReason::QueueFull)
    );
    let grpc = Request::builder()
        .header("content-type", "application/grpc")
        .body(Full::default())
        .unwrap();
    let refused = svc.clone().oneshot(grpc).await.unwrap();
    assert_eq!(refused.headers()["grpc-status"], "14");
    for call in held {
        call.await.unwrap().unwrap();
    }
    let stats = layer.stats();
    assert_eq!(
        (stats.refused_global_queue_full, stats.global_in_flight),
        (2, 0)
    );
}

/// A tenant at its share of the queue is refused with
/// [`OverloadReason::TenantQueueFull`], while another tenant still queues;
/// one under its share that finds the queue full pushes out the newest
/// waiter of the tenant with the most.
#[tokio::test(start_paused = true)]
async fn a_tenant_over_its_share_of_the_queue_is_refused() {
    let layer = ConcurrencyLayer::builder()
        .global(1, 4, Duration::from_secs(1))
        .fair_by(|parts| {
            parts
                .extensions
                .get::<Identity>()
                .map(|id| Arc::clone(id.tenant_arc()))
        })
        .build()
        .unwrap();
    let svc = layer.layer(fixed_latency(Arc::new(AtomicU64::new(100))));
    let of = |tenant: &str| {
        let mut req = Request::new(Full::default());
        req.extensions_mut().insert(Identity::new(
            "u".to_owned(),
            tenant.to_owned(),
            "pro".to_owned(),
        ));
        req
    };
    // Each call's reason, its response (and permit) dropped at once.
    let call = |tenant: &str| {
        let call = svc.clone().oneshot(of(tenant));
        tokio::spawn(async move {
            let response = call.await.unwrap();
            response.extensions().get::<OverloadReason>().copied()
        })
    };
    let running = call("a");
    tokio::task::yield_now().await;
    // Tenant a alone may hold the whole queue of 4.
    let a: Vec<_> = (0..4).map(|_| call("a")).collect();
    tokio::task::yield_now().await;
    assert_eq!(layer.queued(), 4);
    // Tenant b under its share (4 / 2): a's newest waiter is pushed out.
    let b = call("b");
    tokio::task::yield_now().await;
    assert_eq!(layer.queued(), 4);
    // a holds 3 places, over its share of 2: refused at once.
    let refused = svc.clone().oneshot(of("a")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.extensions().get::<OverloadReason>(),
        Some(&OverloadReason::TenantQueueFull)
    );
    assert_eq!(running.await.unwrap(), None);
    let mut reasons = Vec::new();
    for call in a {
        reasons.push(call.await.unwrap());
    }
    // Served round-robin: a, b, a, a; the newest of a was pushed out.
    assert_eq!(
        reasons,
        [None, None, None, Some(OverloadReason::TenantQueueFull)]
    );
    assert_eq!(b.await.unwrap(), None);
    assert_eq!(layer.stats().refused_global_queue_full, 2);
}

#[test]
fn bad_configurations_name_their_field() {
    let field =
        |b: tower_admission::concurrency::ConcurrencyLayerBuilder| b.build().unwrap_err().field();
    let adaptive = AdaptiveLimit::default();
    assert_eq!(
        field(
            ConcurrencyLayer::builder()
                .global(8, 0, Duration::ZERO)
                .global_adaptive(adaptive, 0, Duration::ZERO)
        ),
        "global_adaptive"
    );
    assert_eq!(
        field(ConcurrencyLayer::builder().criticality(|_| Criticality::Critical)),
        "criticality"
    );
    assert_eq!(
        field(
            ConcurrencyLayer::builder()
                .global(8, 0, Duration::ZERO)
                .class_shares(0.9, 0.5)
        ),
        "class_shares.sheddable"
    );
    assert_eq!(
        field(ConcurrencyLayer::builder().global_adaptive(
            adaptive.bounds(0, 10),
            0,
            Duration::ZERO
        )),
        "adaptive.floor"
    );
    assert_eq!(
        field(ConcurrencyLayer::builder().global_adaptive(
            adaptive.bounds(5, 10).initial(20),
            0,
            Duration::ZERO
        )),
        "adaptive.initial"
    );
    assert_eq!(
        field(ConcurrencyLayer::builder().global_adaptive(adaptive, 8, Duration::ZERO)),
        "queue.deadline"
    );
    let standalone =
        AdaptiveLimitLayer::<()>::builder(adaptive.probe(Duration::from_secs(1), 2000, 5))
            .build()
            .unwrap_err();
    assert_eq!(standalone.field(), "adaptive.probe_limit");
}

/// The limit, the baseline and the per-class counts reach the `metrics`
/// facade under the layer's scope.
#[cfg(feature = "metrics")]
#[test]
fn the_limit_and_the_classes_are_metrics() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(async {
                let limit = AdaptiveLimitLayer::<u8>::builder(AdaptiveLimit::default().initial(10))
                    .classify(|n: &u8| {
                        if *n == 0 {
                            Criticality::Critical
                        } else {
                            Criticality::Sheddable
                        }
                    })
                    .scope("billing")
                    .build()
                    .unwrap();
                let svc = limit.layer(service_fn(|_n: u8| async {
                    tokio::time::sleep(ms(20)).await;
                    Ok::<_, Infallible>(())
                }));
                // The probe: 25 answers at 3 in flight, then one sheddable
                // refused over its share (2 of the probe's 3).
                for _ in 0..9 {
                    let calls: Vec<_> = (0..3).map(|_| svc.clone().oneshot(0)).collect();
                    for call in calls {
                        call.await.unwrap();
                    }
                }
                let held: Vec<_> = (0..10)
                    .map(|_| tokio::spawn(svc.clone().oneshot(0)))
                    .collect();
                tokio::task::yield_now().await;
                assert!(matches!(
                    svc.clone().oneshot(1).await,
                    Err(LimitError::Overloaded { .. })
                ));
                for call in held {
                    call.await.unwrap().unwrap();
                }
            });
    });
    let mut seen = std::collections::BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let labels: Vec<String> = key
            .key()
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let value = match value {
            DebugValue::Gauge(v) => v.into_inner(),
            DebugValue::Counter(n) => n as f64,
            DebugValue::Histogram(_) => continue,
        };
        seen.insert(
            format!("{}{{{}}}", key.key().name(), labels.join(",")),
            value,
        );
    }
    let get = |k: &str| seen.get(k).copied();
    assert_eq!(
        get("tower_admission_concurrency_limit{scope=billing}"),
        Some(10.0)
    );
    assert_eq!(
        get("tower_admission_concurrency_baseline_latency_seconds{scope=billing}"),
        Some(0.02)
    );
    assert_eq!(
        get("tower_admission_concurrency_in_flight{scope=billing}"),
        Some(0.0)
    );
    assert_eq!(
        get("tower_admission_concurrency_class_in_flight{scope=billing,class=critical}"),
        Some(0.0)
    );
    assert_eq!(
        get("tower_admission_concurrency_shed_total{scope=billing,class=sheddable,reason=queue-full}"),
        Some(1.0)
    );
}

/// Every series of a gate is on a scrape before any traffic: each class's
/// gauges and refusal counters at 0, the limit, and the baseline and
/// latency at 0 until measured.
#[cfg(feature = "metrics")]
#[test]
fn every_series_is_at_zero_before_any_traffic() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _layer = metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(async {
                AdaptiveLimitLayer::<u8>::builder(AdaptiveLimit::default())
                    .classify(|_: &u8| Criticality::Default)
                    .scope("reports")
                    .build()
                    .unwrap()
            })
    });
    let seen: std::collections::BTreeMap<String, f64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            let value = match value {
                DebugValue::Gauge(v) => v.into_inner(),
                DebugValue::Counter(n) => n as f64,
                DebugValue::Histogram(_) => f64::NAN,
            };
            (
                format!("{}{{{}}}", key.key().name(), labels.join(",")),
                value,
            )
        })
        .collect();
    let mut expected = vec![
        (
            "tower_admission_concurrency_limit{scope=reports}".to_owned(),
            3.0,
        ),
        (
            "tower_admission_concurrency_baseline_latency_seconds{scope=reports}".to_owned(),
            0.0,
        ),
        (
            "tower_admission_concurrency_latency_seconds{scope=reports}".to_owned(),
            0.0,
        ),
        (
            "tower_admission_concurrency_in_flight{scope=reports}".to_owned(),
            0.0,
        ),
        (
            "tower_admission_concurrency_queued{scope=reports}".to_owned(),
            0.0,
        ),
    ];
    for class in ["sheddable", "default", "critical"] {
        for gauge in ["class_in_flight", "class_queued"] {
            expected.push((
                format!("tower_admission_concurrency_{gauge}{{scope=reports,class={class}}}"),
                0.0,
            ));
        }
        for reason in ["queue-full", "tenant-queue-full", "deadline-passed"] {
            expected.push((
                format!(
                    "tower_admission_concurrency_shed_total{{scope=reports,class={class},reason={reason}}}"
                ),
                0.0,
            ));
        }
    }
    let expected: std::collections::BTreeMap<String, f64> = expected.into_iter().collect();
    assert_eq!(seen, expected);
}

/// `AdaptiveLimitLayer::fixed`: the same classes, queues and refusals under
/// a cap that never moves, however the calls answer.
#[tokio::test(start_paused = true)]
async fn a_fixed_cap_never_moves() {
    let cap = AdaptiveLimitLayer::<u8>::fixed(2)
        .classify(|n: &u8| {
            if *n == 0 {
                Criticality::Critical
            } else {
                Criticality::Sheddable
            }
        })
        .build()
        .unwrap();
    let svc = cap.layer(service_fn(|_n: u8| async {
        tokio::time::sleep(ms(20)).await;
        Ok::<_, Infallible>(())
    }));
    for _ in 0..50 {
        let calls: Vec<_> = (0..2).map(|_| svc.clone().oneshot(0)).collect();
        for call in futures_util::future::join_all(calls).await {
            call.unwrap();
        }
    }
    let stats = cap.stats();
    assert_eq!(
        (stats.limit, stats.probing, stats.baseline_latency),
        (Some(2), false, None)
    );
    // A sheddable call may fill 80 % of 2 (1); a critical one the whole cap.
    let held = tokio::spawn(svc.clone().oneshot(0));
    tokio::task::yield_now().await;
    match svc.clone().oneshot(1).await {
        Err(LimitError::Overloaded {
            limit,
            class,
            reason,
            ..
        }) => {
            assert_eq!(limit, 2);
            assert_eq!(class, Criticality::Sheddable);
            assert_eq!(reason, OverloadReason::QueueFull);
        }
        other => panic!("{other:?}"),
    }
    svc.clone().oneshot(0).await.unwrap();
    held.await.unwrap().unwrap();
    let stats = cap.stats();
    assert_eq!(stats.class_shed(Criticality::Sheddable), 1);
    assert_eq!(stats.class_shed(Criticality::Critical), 0);
    // The refusal is counted as the global cap's, a full queue.
    assert_eq!(
        (
            stats.refused_global_queue_full,
            stats.refused_global_deadline
        ),
        (1, 0)
    );
    assert_eq!(
        AdaptiveLimitLayer::<u8>::fixed(0)
            .build()
            .unwrap_err()
            .field(),
        "limit"
    );
}

/// A refusal by the limit under the budget is not retried by
/// `RetryAttempts`: nothing was sent, and a retry would charge the retry
/// share to add to the overload. An error of the dependency still is.
#[tokio::test(start_paused = true)]
async fn retry_attempts_do_not_retry_a_refusal_of_the_limit() {
    use tower::ServiceBuilder;
    use tower_admission::outbound::{
        BudgetError, DependencyBudget, DependencyBudgetLayer, RetryAttempts,
    };
    use tower_admission::quota::{MemoryStore, Policy};

    let second = Duration::from_secs(1);
    let budget = DependencyBudget::builder(MemoryStore::new(), "dependency")
        .normal(Policy::token_bucket("normal", 100, 100, second).unwrap())
        .retry(Policy::token_bucket("retry", 100, 100, second).unwrap())
        .build()
        .unwrap();
    let sent = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&sent);
    let client = ServiceBuilder::new()
        .retry(RetryAttempts::new(3).backoff(Duration::ZERO, Duration::ZERO))
        .layer(DependencyBudgetLayer::new(budget.clone()))
        .layer(
            AdaptiveLimitLayer::<Request<String>>::fixed(1)
                .build()
                .unwrap(),
        )
        .service(service_fn(move |req: Request<String>| {
            counted.fetch_add(1, Ordering::Relaxed);
            async move {
                tokio::time::sleep(ms(20)).await;
                if req.uri().path() == "/fails" {
                    return Err(std::io::Error::other("connection reset"));
                }
                Ok(Response::new(String::new()))
            }
        }));
    let request = |path: &str| {
        let mut req = Request::new(String::new());
        *req.uri_mut() = path.parse().unwrap();
        req
    };
    let held = tokio::spawn(client.clone().oneshot(request("/slow")));
    tokio::task::yield_now().await;
    match client.clone().oneshot(request("/refused")).await {
        Err(BudgetError::Inner(LimitError::Overloaded { reason, .. })) => {
            assert_eq!(reason, OverloadReason::QueueFull);
        }
        other => panic!("{other:?}"),
    }
    held.await.unwrap().unwrap();
    let stats = budget.stats();
    assert_eq!((stats.normal, stats.retry), (2, 0));
    assert_eq!(sent.load(Ordering::Relaxed), 1);
    // The dependency's own error is retried: 3 attempts, 2 of them retries.
    assert!(matches!(
        client.clone().oneshot(request("/fails")).await,
        Err(BudgetError::Inner(LimitError::Inner(_)))
    ));
    let stats = budget.stats();
    assert_eq!((stats.normal, stats.retry), (3, 2));
    assert_eq!(sent.load(Ordering::Relaxed), 4);
}
