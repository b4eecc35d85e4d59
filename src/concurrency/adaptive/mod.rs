//! Adaptive limits, criticality classes and fair queues.
//!
//! A fixed cap is a guess: when a dependency slows, a cap set for its fast
//! days lets latency pile up, and one set for its slow days leaves capacity
//! idle. An adaptive limit follows the latency instead. It is used in two
//! places:
//!
//! * as the global cap of a [`ConcurrencyLayer`](crate::concurrency::ConcurrencyLayer),
//!   with [`ConcurrencyLayerBuilder::global_adaptive`](crate::concurrency::ConcurrencyLayerBuilder::global_adaptive)
//!   (the fixed [`global`](crate::concurrency::ConcurrencyLayerBuilder::global) cap stays a choice);
//! * on its own, on a client calling one dependency, with
//!   [`AdaptiveLimitLayer`] (a fixed cap with the same classes and queues
//!   stays a choice there too: [`AdaptiveLimitLayer::fixed`]).
//!
//! # The algorithm
//!
//! The limit is a gradient controller on latency against a measured
//! no-load baseline, with a multiplicative back-off on errors. Parameters
//! are in [`AdaptiveLimit`], with their defaults.
//!
//! * **Baseline.** At start, and then every `probe_interval` (60 s), the
//!   limit drops to `probe_limit` (3) in flight: its own level, not the
//!   floor. The probe ends once `probe_samples` (25) requests *admitted
//!   during it* have answered; the baseline is their latency (at
//!   `percentile`, 0.9), and the limit goes back to where it was.
//! * **Windows.** Answers are gathered in windows of `window` (100 ms)
//!   with at least `min_samples` (10); a window with fewer goes on. Its
//!   latency is the `percentile` of its samples.
//! * **Gradient.** At the end of a window, with `goal = baseline × (1 +
//!   tolerance)` (tolerance 0.25), the target is `limit × clamp(goal /
//!   latency, 0.5, 2)`, plus `√limit` of headroom while the latency is in
//!   the lower half of the band (at most `baseline × (1 + tolerance / 2)`),
//!   and the limit moves `smoothing` (0.5) of the way to it. `limit` here is
//!   the whole number in force, which admitted the window's requests. Past
//!   its capacity a dependency's latency grows with the requests in flight,
//!   so the limit settles where the latency is about the goal. Near the
//!   goal only the gradient moves it, so at a small capacity (2, where one
//!   request more costs half the baseline) it stays on the last whole limit
//!   within the goal instead of stepping past it.
//! * **Back-off (AIMD).** A window with an [`Outcome::Overload`] (an error
//!   or timeout) multiplies the limit by `backoff` (0.9) instead; growth
//!   comes back through the gradient's √limit headroom.
//! * **Bounds.** The limit stays within `[floor, ceiling]` (1 and 1000),
//!   except during a probe.
//!
//! **Below capacity** the limit neither drifts up nor collapses. It grows
//! only after a window in which the requests in flight reached
//! `utilisation` (0.8) of it, or a request found no slot it could take (its
//! class's share was full, or it queued): a limit that was not used gives no
//! evidence that more would be served as fast. The window right after a probe never
//! grows it either (the requests the probe held back crowd in at once, which
//! says nothing of demand). An idle service closes no window, so its limit
//! stays where it was, and no probe starts until requests come back.
//!
//! **A probe costs** about `probe_samples / probe_limit` answers' time
//! (25 / 3 × the baseline, some 170 ms for a 20 ms dependency) at the probe
//! level, once a minute and at start, for every class. Give the queue room
//! and a deadline for the requests of that time, or they are refused.
//!
//! **A dropped request is not a fast success.** A request whose future is
//! dropped before it answered (the caller gave up) gives no sample, unless
//! it had already waited longer than the goal: then its wait is a sample,
//! a lower bound of its real latency. It never counts in the baseline.
//! Counting a cancelled request as an answer at the moment it was dropped
//! would read early cancellations as a fast dependency and raise the limit.
//!
//! # Criticality classes
//!
//! A function of the request gives its [`Criticality`]: the plan of the
//! authenticated [`Identity`](crate::identity::Identity), or the route, as
//! the operator configures it. Each class may fill only its share of the
//! limit: a sheddable request is admitted only while fewer than
//! `sheddable × limit` requests (of every class) are in flight, a default
//! one below `default × limit`, a critical one below the limit (defaults
//! 0.8 and 0.9). So sheddable
//! work is refused first, and `1 - default` of the limit is reserved for
//! critical work. Waiters are served most critical class first, each within
//! its share. Without a classifier every request is
//! [`Criticality::Default`] with a share of the whole limit.
//!
//! # Fair queues
//!
//! Each class has a queue of `queue` places and a deadline. Within a class,
//! each tenant (a function of the request, such as the
//! [`Identity`](crate::identity::Identity)'s tenant) has its own
//! sub-queue; sub-queues are served round-robin, one request each in turn,
//! and a tenant holds at most `queue / tenants waiting` places (at least 1).
//! A tenant under its share that finds the queue full pushes out the newest
//! waiter of the tenant holding the most places. So a flooding tenant gets
//! at most its fair share of the queue and of the admissions from it, while
//! the others keep theirs. Fairness needs a queue: with `queue == 0`
//! requests are admitted or refused in arrival order.
//!
//! # Refusals and metrics
//!
//! A refusal of the [`ConcurrencyLayer`](crate::concurrency::ConcurrencyLayer)'s
//! global limit is a 503 (gRPC `UNAVAILABLE`) with `Retry-After` and the
//! `RateLimit` fields of a `"global-concurrency"` quota of the current
//! limit, with an [`OverloadReason`](crate::concurrency::OverloadReason); an
//! [`AdaptiveLimitLayer`] answers [`LimitError::Overloaded`].
//!
//! With the `metrics` feature, labelled `scope` (`global` for the layer,
//! [`scope`](AdaptiveLimitLayerBuilder::scope) on its own):
//!
//! | series | kind | what |
//! |---|---|---|
//! | `tower_admission_concurrency_limit` | gauge | the limit in force |
//! | `tower_admission_concurrency_baseline_latency_seconds` | gauge | the measured no-load latency |
//! | `tower_admission_concurrency_latency_seconds` | gauge | the last window's latency |
//! | `tower_admission_concurrency_in_flight`, `…_queued` | gauge | every class |
//! | `tower_admission_concurrency_class_in_flight`, `…_class_queued` | gauge | per `class` |
//! | `tower_admission_concurrency_shed_total` | counter | refusals per `class` and `reason` |
//!
//! Every series is registered when the layer is built, with the recorder
//! installed then: a scrape before any traffic shows each class's gauges
//! and its refusal counters (`queue-full`, `tenant-queue-full`,
//! `deadline-passed`) at 0, and the baseline and latency at 0 until they
//! are measured. The same figures are in [`LimitStats`].
//!
//! # Example
//!
//! Inbound, the plan decides the class and the tenant is queued fairly;
//! outbound, one dependency's calls go through their own adaptive limit:
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tower::{service_fn, Layer, ServiceExt};
//! use tower_admission::concurrency::{
//!     AdaptiveLimit, AdaptiveLimitLayer, ConcurrencyLayer, Criticality,
//! };
//! use tower_admission::identity::Identity;
//!
//! let plan_class = |parts: &http::request::Parts| {
//!     match parts.extensions.get::<Identity>().map(Identity::plan) {
//!         Some("enterprise") => Criticality::Critical,
//!         Some("free") | None => Criticality::Sheddable,
//!         Some(_) => Criticality::Default,
//!     }
//! };
//! let inbound = ConcurrencyLayer::builder()
//!     .global_adaptive(AdaptiveLimit::default().bounds(8, 512), 256, Duration::from_millis(200))
//!     .criticality(plan_class)
//!     .fair_by(|parts| parts.extensions.get::<Identity>().map(|id| Arc::clone(id.tenant_arc())))
//!     .build()
//!     .unwrap();
//! let app: axum::Router = axum::Router::new()
//!     .route("/reports", axum::routing::get(|| async { "ok" }))
//!     .layer(inbound);
//! # let _ = app;
//!
//! // The dependency client: an error or timeout is an overload outcome.
//! let outbound = AdaptiveLimitLayer::<http::Request<String>>::builder(
//!     AdaptiveLimit::default().bounds(2, 64),
//! )
//! .queue(16, Duration::from_millis(100))
//! .scope("billing")
//! .build()
//! .unwrap();
//! let client = outbound.layer(service_fn(|_req: http::Request<String>| async {
//!     Ok::<_, std::io::Error>(http::Response::new(String::from("{}")))
//! }));
//! # let _ = client;
//! ```

mod class;
mod config;
mod controller;
mod fair;
pub(crate) mod gate;
mod limit_layer;
mod stats;
mod telemetry;

pub use class::Criticality;
pub use config::AdaptiveLimit;
pub use controller::Outcome;
pub use limit_layer::{
    AdaptiveLimitLayer, AdaptiveLimitLayerBuilder, ClassifyOutcome, ErrorIsOverload, LimitError,
    Overloaded,
};
pub use stats::{ClassStats, LimitStats};

pub(crate) use limit_layer::{check_queue, gate_shares};
