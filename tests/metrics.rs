//! With the `metrics` feature, decisions, failure modes and unknown outcomes
//! are counted through the `metrics` facade.
#![cfg(feature = "metrics")]

#[cfg(feature = "tonic")]
#[path = "../examples/grpc_reports/client.rs"]
mod client;
#[cfg(feature = "tonic")]
#[path = "../examples/grpc_reports/config.rs"]
#[allow(
    dead_code,
    reason = "the command line's default address is not used here"
)]
mod config;
#[cfg(feature = "tonic")]
#[path = "../examples/grpc_reports/proto.rs"]
mod proto;
#[cfg(feature = "tonic")]
#[path = "../examples/grpc_reports/server.rs"]
mod server;

use std::sync::Arc;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use tower_admission::quota::{
    Limiter, MemoryStore, Policy, Quota, QuotaDecision, Store, StoreError,
};

/// A store whose every call was sent and timed out: the outcome is unknown.
#[derive(Clone)]
struct TimingOut;

impl Store for TimingOut {
    type DecideFuture = std::future::Ready<Result<QuotaDecision, StoreError>>;
    type SettleFuture = std::future::Ready<Result<QuotaDecision, StoreError>>;

    fn decide(&self, _: &Quota, _: &Arc<str>, _: u64) -> Self::DecideFuture {
        std::future::ready(Err(StoreError::Timeout))
    }
    fn peek(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        self.decide(quota, key, cost)
    }
    fn settle(&self, _: &Quota, _: &Arc<str>, _: &QuotaDecision, _: i64) -> Self::SettleFuture {
        std::future::ready(Err(StoreError::Timeout))
    }
}

/// Runs `test` on a current-thread runtime with a fresh debugging recorder
/// installed for this thread: what it returned, and what it recorded.
fn recorded<T>(test: impl std::future::Future<Output = T>) -> (T, Snapshotter) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let out = metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(test)
    });
    (out, snapshotter)
}

fn counter(
    snapshot: &[(
        CompositeKey,
        Option<metrics::Unit>,
        Option<metrics::SharedString>,
        DebugValue,
    )],
    name: &str,
    label: (&str, &str),
) -> u64 {
    snapshot
        .iter()
        .filter(|(key, ..)| key.kind() == MetricKind::Counter && key.key().name() == name)
        .filter(|(key, ..)| {
            key.key()
                .labels()
                .any(|l| l.key() == label.0 && l.value() == label.1)
        })
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum()
}

#[test]
fn decisions_failure_modes_and_unknown_outcomes_are_counted() {
    let ((), snapshotter) = recorded(async {
        let limiter = Limiter::new(TimingOut);
        let minute = Duration::from_secs(60);
        let closed =
            Quota::new("closed", [Policy::fixed_window("m", 10, minute).unwrap()]).unwrap();
        let open = Quota::new(
            "open",
            [Policy::fixed_window("m", 10, minute).unwrap().fail_open()],
        )
        .unwrap();
        let key: Arc<str> = "alice".into();
        for _ in 0..3 {
            assert!(!limiter.check(&closed, &key, 1).await.is_admitted());
        }
        for _ in 0..2 {
            assert!(limiter.check(&open, &key, 1).await.is_admitted());
        }
        let stats = limiter.stats();
        assert_eq!(
            (
                stats.failed_closed,
                stats.failed_open,
                stats.unknown_outcomes
            ),
            (3, 2, 5)
        );
    });
    let snapshot = snapshotter.snapshot().into_vec();
    assert_eq!(
        counter(
            &snapshot,
            "tower_admission_quota_decisions_total",
            ("result", "refused")
        ),
        3
    );
    assert_eq!(
        counter(
            &snapshot,
            "tower_admission_quota_decisions_total",
            ("result", "admitted")
        ),
        2
    );
    assert_eq!(
        counter(
            &snapshot,
            "tower_admission_failure_mode_total",
            ("mode", "closed")
        ),
        3
    );
    assert_eq!(
        counter(
            &snapshot,
            "tower_admission_failure_mode_total",
            ("mode", "open")
        ),
        2
    );
    assert_eq!(
        counter(
            &snapshot,
            "tower_admission_unknown_outcomes_total",
            ("quota", "closed")
        ),
        3
    );
    assert_eq!(
        counter(
            &snapshot,
            "tower_admission_unknown_outcomes_total",
            ("quota", "open")
        ),
        2
    );
}

fn gauge(
    snapshot: &[(
        CompositeKey,
        Option<metrics::Unit>,
        Option<metrics::SharedString>,
        DebugValue,
    )],
    name: &str,
    labels: &[(&str, &str)],
) -> f64 {
    snapshot
        .iter()
        .filter(|(key, ..)| key.kind() == MetricKind::Gauge && key.key().name() == name)
        .filter(|(key, ..)| {
            let have: Vec<(&str, &str)> =
                key.key().labels().map(|l| (l.key(), l.value())).collect();
            have == labels
        })
        .map(|(.., value)| match value {
            DebugValue::Gauge(n) => n.into_inner(),
            _ => 0.0,
        })
        .sum()
}

#[test]
fn refusals_are_counted_per_policy_and_shadow_refusals_apart() {
    let (stats, snapshotter) = recorded(async {
        let hour = Duration::from_secs(3_600);
        let limiter = Limiter::new(MemoryStore::new());
        let quota = Quota::new(
            "reports",
            [
                Policy::token_bucket("burst", 2, 2, hour).unwrap(),
                Policy::fixed_window("watch", 1, hour).unwrap().shadow(),
            ],
        )
        .unwrap();
        let key: Arc<str> = "alice".into();
        let admitted: Vec<bool> = [1, 1, 1, 1, 5]
            .iter()
            .map(|&cost| limiter.check(&quota, &key, cost))
            .collect::<futures_util::future::JoinAll<_>>()
            .await
            .iter()
            .map(|v| v.is_admitted())
            .collect();
        assert_eq!(admitted, [true, true, false, false, false]);
        limiter.stats()
    });
    let snapshot = snapshotter.snapshot().into_vec();
    let name = "tower_admission_policy_refused_total";
    assert_eq!(
        counter(&snapshot, name, ("reason", "exhausted")),
        2,
        "the 3rd and 4th requests, by burst"
    );
    assert_eq!(
        counter(&snapshot, name, ("reason", "cost-exceeds-capacity")),
        1,
        "cost 5 is over burst's 2"
    );
    assert_eq!(counter(&snapshot, name, ("policy", "watch")), 0);
    assert_eq!(counter(&snapshot, name, ("policy", "burst")), 3);
    let shadow = counter(
        &snapshot,
        "tower_admission_shadow_refusals_total",
        ("policy", "watch"),
    );
    assert_eq!(shadow, stats.shadow_refusals);
    assert_eq!(shadow, 4, "every request after the first");
}

#[test]
fn concurrency_gauges_follow_in_flight_and_queued_requests() {
    use tower::{Layer, Service};
    use tower_admission::concurrency::ConcurrencyLayer;
    use tower_admission::identity::Identity;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let gauges = |snapshot: &[_]| {
        [
            ("tower_admission_concurrency_in_flight", "global"),
            ("tower_admission_concurrency_in_flight", "identity"),
            ("tower_admission_concurrency_queued", "global"),
            ("tower_admission_concurrency_queued", "identity"),
        ]
        .map(|(name, scope)| gauge(snapshot, name, &[("scope", scope)]))
    };
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let layer = ConcurrencyLayer::builder()
                .global(2, 1, Duration::from_secs(1))
                .per_identity(1, 1, Duration::from_secs(1))
                .build()
                .unwrap();
            // Never answers: the permits stay held while the futures live.
            let inner = tower::service_fn(|_: http::Request<()>| {
                std::future::pending::<Result<http::Response<String>, std::convert::Infallible>>()
            });
            let mut service = layer.layer(inner);
            let request = |subject: &str| {
                let mut req = http::Request::new(());
                req.extensions_mut()
                    .insert(Identity::new(subject.to_owned(), "acme", "free"));
                req
            };
            // Permits are taken in `call`, before any poll.
            let alice = service.call(request("alice"));
            let alice_queued = service.call(request("alice"));
            let alice_refused = service.call(request("alice"));
            let bob = service.call(request("bob"));
            // Carol holds her own permit and waits for a global one.
            let carol = service.call(request("carol"));
            let dave_refused = service.call(request("dave"));
            let snapshot = snapshotter.snapshot().into_vec();
            assert_eq!(gauges(&snapshot), [2.0, 3.0, 1.0, 1.0]);
            assert_eq!(
                gauge(
                    &snapshot,
                    "tower_admission_concurrency_tracked_identities",
                    &[]
                ),
                3.0
            );
            let refused = "tower_admission_concurrency_refused_total";
            assert_eq!(counter(&snapshot, refused, ("scope", "identity")), 1);
            assert_eq!(counter(&snapshot, refused, ("scope", "global")), 1);
            drop((alice, alice_queued, alice_refused, bob, carol, dave_refused));
        });
    });
    // A debugging snapshot resets what it read, so this one holds the moves
    // since the last: dropping the requests took every gauge back to 0.
    let snapshot = snapshotter.snapshot().into_vec();
    assert_eq!(gauges(&snapshot), [-2.0, -3.0, -1.0, -1.0]);
    assert_eq!(
        gauge(
            &snapshot,
            "tower_admission_concurrency_tracked_identities",
            &[]
        ),
        -3.0
    );
}

#[test]
fn dependency_attempts_refusals_and_waits_are_counted_per_budget() {
    use tower_admission::outbound::{Attempt, AttemptBudget, DependencyBudget};

    let ((), snapshotter) = recorded(async {
        let hour = Duration::from_secs(3_600);
        let budget = DependencyBudget::builder(MemoryStore::new(), "reports-db")
            .normal(Policy::token_bucket("normal", 2, 2, hour).unwrap())
            .retry(Policy::token_bucket("retry", 1, 1, hour).unwrap())
            .build()
            .unwrap();
        for _ in 0..3 {
            let _ = budget.try_acquire(Attempt::FIRST, 1).await;
        }
        assert_eq!(budget.try_acquire(Attempt::FIRST.next(), 1).await, Ok(()));
        budget.record_wait(Duration::from_millis(250));
        budget.record_wait(Duration::ZERO);
        let stats = budget.stats();
        assert_eq!((stats.normal, stats.retry, stats.refused), (2, 1, 1));
    });
    let snapshot = snapshotter.snapshot().into_vec();
    let attempts = |share: &str| -> u64 {
        snapshot
            .iter()
            .filter(|(key, ..)| {
                key.key().name() == "tower_admission_dependency_attempts_total"
                    && key
                        .key()
                        .labels()
                        .map(|l| (l.key(), l.value()))
                        .eq([("budget", "reports-db"), ("share", share)])
            })
            .map(|(.., value)| match value {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    };
    assert_eq!((attempts("normal"), attempts("retry")), (2, 1));
    assert_eq!(
        counter(
            &snapshot,
            "tower_admission_dependency_refused_total",
            ("budget", "reports-db")
        ),
        1
    );
    let waits: Vec<f64> = snapshot
        .iter()
        .filter(|(key, ..)| {
            key.kind() == MetricKind::Histogram
                && key.key().name() == "tower_admission_dependency_wait_seconds"
        })
        .flat_map(|(.., value)| match value {
            DebugValue::Histogram(values) => values.iter().map(|v| v.into_inner()).collect(),
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(waits, [0.25, 0.0]);
}

/// Every series the gRPC example records for 25 calls of one free key (the
/// burst of 20, then 5 refusals) and 2 calls without a known key: each
/// refusal counted once, and no label carries what a caller sent or who it
/// is.
#[cfg(feature = "tonic")]
#[test]
fn grpc_refusals_are_counted_once_with_labels_from_configuration_only() {
    use tower_admission::clock::ManualClock;

    let ((), snapshotter) = recorded(async {
        let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
        let store = MemoryStore::with_clock(clock);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(server::serve(store, listener, async {
            let _ = stopped.await;
        }));
        let request = || proto::ListReportsRequest {
            page_size: 1,
            metric: "caller-chosen-metric".into(),
        };
        let mut alice = client::ReportsClient::connect(url.clone())
            .await
            .unwrap()
            .with_key("demo-free")
            .unwrap();
        let mut codes = Vec::new();
        for _ in 0..25 {
            codes.push(
                alice
                    .list_reports(request())
                    .await
                    .map(|_| ())
                    .map_err(|s| s.code()),
            );
        }
        for key in [None, Some("demo-nope")] {
            let mut anonymous = client::ReportsClient::connect(url.clone()).await.unwrap();
            if let Some(key) = key {
                anonymous = anonymous.with_key(key).unwrap();
            }
            codes.push(
                anonymous
                    .list_reports(request())
                    .await
                    .map(|_| ())
                    .map_err(|s| s.code()),
            );
        }
        let refused = |code| codes.iter().filter(|c| **c == Err(code)).count();
        assert_eq!(codes.iter().filter(|c| c.is_ok()).count(), 20);
        assert_eq!(refused(tonic::Code::ResourceExhausted), 5);
        assert_eq!(refused(tonic::Code::Unauthenticated), 2);
        drop(stop);
        server.await.unwrap().unwrap();
    });
    let snapshot = snapshotter.snapshot().into_vec();
    let decisions = "tower_admission_quota_decisions_total";
    assert_eq!(counter(&snapshot, decisions, ("result", "admitted")), 20);
    assert_eq!(counter(&snapshot, decisions, ("result", "refused")), 5);
    let refused = "tower_admission_policy_refused_total";
    assert_eq!(counter(&snapshot, refused, ("policy", "burst")), 5);
    assert_eq!(counter(&snapshot, refused, ("policy", "per-minute")), 0);
    let refused_series: u64 = snapshot
        .iter()
        .filter(|(key, ..)| key.kind() == MetricKind::Counter)
        .filter(|(key, ..)| key.key().name().ends_with("refused_total"))
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum();
    assert_eq!(refused_series, 5, "each refusal in one refusal series only");
    let caller_values = [
        "alice",
        "acme",
        "demo-free",
        "demo-nope",
        "caller-chosen-metric",
    ];
    for (key, ..) in &snapshot {
        assert!(key.key().name().starts_with("tower_admission_"), "{key:?}");
        for label in key.key().labels() {
            assert!(
                !caller_values.iter().any(|v| label.value().contains(v)),
                "{key:?} carries a caller's value"
            );
        }
    }
}

/// A queued request that waits out its deadline is one refusal, counted as
/// `deadline-passed`; one dropped while queued (its caller gave up) is none.
#[test]
fn a_passed_queue_deadline_is_counted_once_and_a_dropped_wait_not_at_all() {
    use tower::{Layer, Service};
    use tower_admission::concurrency::ConcurrencyLayer;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let layer = ConcurrencyLayer::builder()
                .global(1, 2, Duration::from_secs(1))
                .build()
                .unwrap();
            let inner = tower::service_fn(|_: http::Request<()>| {
                std::future::pending::<Result<http::Response<String>, std::convert::Infallible>>()
            });
            let mut service = layer.layer(inner);
            let held = service.call(http::Request::new(()));
            let gave_up = service.call(http::Request::new(()));
            let waited = service.call(http::Request::new(()));
            assert_eq!(layer.queued(), 2);
            drop(gave_up);
            assert_eq!(layer.queued(), 1);
            let refused = waited.await.unwrap();
            assert_eq!(refused.status(), http::StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(layer.queued(), 0);
            drop(held);
        });
    });
    let snapshot = snapshotter.snapshot().into_vec();
    let refused = "tower_admission_concurrency_refused_total";
    assert_eq!(
        counter(&snapshot, refused, ("reason", "deadline-passed")),
        1
    );
    assert_eq!(counter(&snapshot, refused, ("reason", "queue-full")), 0);
    assert_eq!(counter(&snapshot, refused, ("scope", "global")), 1);
}

/// Every series a quota can emit exists at 0 once its layer is built,
/// before any request: decisions, refusals per policy and reason, its
/// failure mode, unknown outcomes and the shadow policy's refusals.
#[test]
fn a_built_quota_layer_exports_its_series_at_zero() {
    let ((), snapshotter) = recorded(async {
        let minute = Duration::from_secs(60);
        let quota = Quota::new(
            "free",
            [
                Policy::sliding_log("per-minute", 100, minute).unwrap(),
                Policy::token_bucket("trial", 5, 5, minute)
                    .unwrap()
                    .shadow(),
            ],
        )
        .unwrap();
        let layer = tower_admission::quota::QuotaLayer::builder(MemoryStore::new())
            .quota(quota)
            .build()
            .unwrap();
        drop(layer);
    });
    let snapshot = snapshotter.snapshot().into_vec();
    let mut series: Vec<String> = snapshot
        .iter()
        .map(|(key, _, _, value)| {
            assert_eq!(*value, DebugValue::Counter(0), "{key:?}");
            let mut labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            format!("{}{{{}}}", key.key().name(), labels.join(","))
        })
        .collect();
    series.sort();
    assert_eq!(
        series,
        [
            "tower_admission_failure_mode_total{mode=closed,quota=free}",
            "tower_admission_policy_refused_total{policy=per-minute,quota=free,reason=cost-exceeds-capacity}",
            "tower_admission_policy_refused_total{policy=per-minute,quota=free,reason=exhausted}",
            "tower_admission_quota_decisions_total{quota=free,result=admitted}",
            "tower_admission_quota_decisions_total{quota=free,result=refused}",
            "tower_admission_shadow_refusals_total{policy=trial,quota=free}",
            "tower_admission_unknown_outcomes_total{quota=free}",
        ]
    );
}

/// A budget's attempt series exist for both shares, and its refusals, at 0
/// once it is built: an alert on the rate of retries has a series to read
/// before the first retry.
#[test]
fn a_built_budget_exports_both_shares_at_zero() {
    use tower_admission::outbound::DependencyBudget;

    let ((), snapshotter) = recorded(async {
        let second = Duration::from_secs(1);
        DependencyBudget::builder(MemoryStore::new(), "reports-db")
            .normal(Policy::token_bucket("normal", 20, 200, second).unwrap())
            .retry(Policy::token_bucket("retry", 4, 40, second).unwrap())
            .build()
            .unwrap();
    });
    let snapshot: Vec<_> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name().starts_with("tower_admission_dependency_"))
        .collect();
    assert_eq!(snapshot.len(), 3);
    for share in ["normal", "retry"] {
        let series = snapshot.iter().find(|(key, ..)| {
            key.key().name() == "tower_admission_dependency_attempts_total"
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == "share" && l.value() == share)
        });
        assert_eq!(
            series.map(|s| &s.3),
            Some(&DebugValue::Counter(0)),
            "{share}"
        );
    }
    assert!(snapshot.iter().any(|(key, _, _, value)| key.key().name()
        == "tower_admission_dependency_refused_total"
        && *value == DebugValue::Counter(0)));
}
