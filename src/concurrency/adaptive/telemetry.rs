//! The gate's gauges and counters through the `metrics` facade (feature
//! `metrics`; no-ops without it).

use std::time::Duration;

use super::class::Criticality;
use crate::concurrency::OverloadReason;

#[cfg(feature = "metrics")]
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// The keys of one gate's series, built once with its `scope` label.
#[derive(Debug)]
pub(super) struct Telemetry {
    #[cfg(feature = "metrics")]
    keys: Keys,
}

#[cfg(feature = "metrics")]
#[derive(Debug)]
struct Keys {
    scope: metrics::SharedString,
    limit: metrics::Key,
    baseline: metrics::Key,
    latency: metrics::Key,
    in_flight: metrics::Key,
    queued: metrics::Key,
    /// Per class, by [`Criticality::index`].
    class_in_flight: [metrics::Key; 3],
    class_queued: [metrics::Key; 3],
    /// `shed_total` per class and per [`SHED_REASONS`] entry.
    shed: [[metrics::Key; SHED_REASONS.len()]; 3],
}

/// The reasons a gate refuses for, in the order of [`Keys::shed`].
#[cfg(feature = "metrics")]
const SHED_REASONS: [OverloadReason; 3] = [
    OverloadReason::QueueFull,
    OverloadReason::TenantQueueFull,
    OverloadReason::DeadlinePassed,
];

#[cfg(feature = "metrics")]
const CLASSES: [Criticality; 3] = [
    Criticality::Sheddable,
    Criticality::Default,
    Criticality::Critical,
];

impl Telemetry {
    pub(super) fn new(scope: &str) -> Self {
        #[cfg(feature = "metrics")]
        {
            use metrics::{Key, Label, SharedString};
            let scope = SharedString::from(scope.to_owned());
            let key = |name: &'static str| {
                Key::from_parts(name, vec![Label::new("scope", scope.clone())])
            };
            let class_key = |name: &'static str| {
                CLASSES.map(|class| {
                    Key::from_parts(
                        name,
                        vec![
                            Label::new("scope", scope.clone()),
                            Label::from_static_parts("class", class.as_str()),
                        ],
                    )
                })
            };
            let shed = CLASSES.map(|class| {
                SHED_REASONS.map(|reason| {
                    Key::from_parts(
                        "tower_admission_concurrency_shed_total",
                        vec![
                            Label::new("scope", scope.clone()),
                            Label::from_static_parts("class", class.as_str()),
                            Label::from_static_parts("reason", reason.as_str()),
                        ],
                    )
                })
            });
            Telemetry {
                keys: Keys {
                    limit: key("tower_admission_concurrency_limit"),
                    baseline: key("tower_admission_concurrency_baseline_latency_seconds"),
                    latency: key("tower_admission_concurrency_latency_seconds"),
                    in_flight: key("tower_admission_concurrency_in_flight"),
                    queued: key("tower_admission_concurrency_queued"),
                    class_in_flight: class_key("tower_admission_concurrency_class_in_flight"),
                    class_queued: class_key("tower_admission_concurrency_class_queued"),
                    shed,
                    scope,
                },
            }
        }
        #[cfg(not(feature = "metrics"))]
        {
            let _ = scope;
            Telemetry {}
        }
    }

    /// Moves the in-flight and queued gauges of `class` (and of the scope).
    pub(super) fn moved(&self, class: Criticality, in_flight: isize, queued: isize) {
        #[cfg(feature = "metrics")]
        metrics::with_recorder(|r| {
            let k = &self.keys;
            let i = class.index();
            if in_flight != 0 {
                r.register_gauge(&k.in_flight, &METADATA)
                    .increment(in_flight as f64);
                r.register_gauge(&k.class_in_flight[i], &METADATA)
                    .increment(in_flight as f64);
            }
            if queued != 0 {
                r.register_gauge(&k.queued, &METADATA)
                    .increment(queued as f64);
                r.register_gauge(&k.class_queued[i], &METADATA)
                    .increment(queued as f64);
            }
        });
        #[cfg(not(feature = "metrics"))]
        let _ = (class, in_flight, queued);
    }

    /// Registers every series of the gate, so that a scrape shows each
    /// class's gauges and refusal counters at 0 before any traffic: the
    /// gauges at 0, the limit at `limit`, and with `adaptive` the baseline
    /// and latency at 0 until they are measured.
    pub(super) fn start(&self, limit: usize, adaptive: bool) {
        #[cfg(feature = "metrics")]
        metrics::with_recorder(|r| {
            let k = &self.keys;
            r.register_gauge(&k.limit, &METADATA).set(limit as f64);
            if adaptive {
                r.register_gauge(&k.baseline, &METADATA).set(0.0);
                r.register_gauge(&k.latency, &METADATA).set(0.0);
            }
            let gauges = [&k.in_flight, &k.queued]
                .into_iter()
                .chain(&k.class_in_flight)
                .chain(&k.class_queued);
            for key in gauges {
                r.register_gauge(key, &METADATA).set(0.0);
            }
            for key in k.shed.iter().flatten() {
                r.register_counter(key, &METADATA).increment(0);
            }
        });
        #[cfg(not(feature = "metrics"))]
        let _ = (limit, adaptive);
    }

    /// Counts a refusal of `class` in `tower_admission_concurrency_shed_total`.
    pub(super) fn shed(&self, class: Criticality, reason: OverloadReason) {
        #[cfg(feature = "metrics")]
        {
            let k = &self.keys;
            match SHED_REASONS.iter().position(|r| *r == reason) {
                Some(at) => metrics::with_recorder(|r| {
                    r.register_counter(&k.shed[class.index()][at], &METADATA)
                        .increment(1);
                }),
                // A reason no gate gives today: its series is made now.
                None => metrics::counter!(
                    "tower_admission_concurrency_shed_total",
                    "scope" => k.scope.clone(),
                    "class" => class.as_str(),
                    "reason" => reason.as_str()
                )
                .increment(1),
            }
        }
        #[cfg(not(feature = "metrics"))]
        let _ = (class, reason);
    }

    /// Sets the limit and latency gauges.
    pub(super) fn limit(
        &self,
        limit: usize,
        baseline: Option<Duration>,
        latency: Option<Duration>,
    ) {
        #[cfg(feature = "metrics")]
        metrics::with_recorder(|r| {
            let k = &self.keys;
            r.register_gauge(&k.limit, &METADATA).set(limit as f64);
            if let Some(b) = baseline {
                r.register_gauge(&k.baseline, &METADATA)
                    .set(b.as_secs_f64());
            }
            if let Some(l) = latency {
                r.register_gauge(&k.latency, &METADATA).set(l.as_secs_f64());
            }
        });
        #[cfg(not(feature = "metrics"))]
        let _ = (limit, baseline, latency);
    }
}
