//! With the `metrics` feature, decisions, failure modes and unknown outcomes
//! are counted through the `metrics` facade.
#![cfg(feature = "metrics")]

use std::sync::Arc;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::{CompositeKey, MetricKind};
use tower_admission::quota::{
    FailureMode, Holds, Limiter, Policy, Quota, QuotaDecision, Store, StoreError,
};

/// A store whose every call was sent and timed out: the outcome is unknown.
#[derive(Clone)]
struct TimingOut;

impl Store for TimingOut {
    type DecideFuture = std::future::Ready<Result<QuotaDecision, StoreError>>;
    type SettleFuture = std::future::Ready<Result<Holds, StoreError>>;

    fn decide(&self, _: &Quota, _: &Arc<str>, _: u64) -> Self::DecideFuture {
        std::future::ready(Err(StoreError::Timeout))
    }
    fn settle(&self, _: &Quota, _: &Arc<str>, _: &Holds, _: i64) -> Self::SettleFuture {
        std::future::ready(Err(StoreError::Timeout))
    }
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
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let limiter = Limiter::new(TimingOut);
            let minute = Duration::from_secs(60);
            let closed =
                Quota::new("closed", [Policy::fixed_window("m", 10, minute).unwrap()]).unwrap();
            let open = Quota::new(
                "open",
                [Policy::fixed_window("m", 10, minute)
                    .unwrap()
                    .on_failure(FailureMode::Open)],
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
