//! Concurrency caps: bound the requests in flight, globally and per
//! identity, with a bounded wait queue and a queue deadline.
//!
//! A rate limit bounds how many requests *start* per unit of time; it does not
//! bound how many are *active* at once. A slow dependency makes each request
//! live longer, so the same admitted rate piles up more active work. This
//! layer bounds the active work directly.
//!
//! # Caps
//!
//! [`ConcurrencyLayer::builder`] configures one or both caps:
//!
//! * **global** `(limit, queue, deadline)`: at most `limit` requests of the
//!   whole service in flight.
//! * **per identity** `(limit, queue, deadline)`: at most `limit` requests in
//!   flight per authenticated subject
//!   ([`Identity::subject`](crate::identity::Identity::subject), read from the
//!   request extensions). Requests **without** an
//!   [`Identity`](crate::identity::Identity) are counted by the global cap
//!   only; put the authentication layer outside this one so every request
//!   carries an identity, or configure a global cap as the backstop.
//!
//! Each cap has two forms:
//!
//! * **load shedding**, `queue == 0`: a request that finds every permit taken
//!   is refused at once.
//! * **queueing with a deadline**, `queue > 0`: up to `queue` requests wait,
//!   in arrival order, for at most `deadline` each. A request that finds the
//!   queue full is refused at once; one that waits the whole deadline is
//!   refused then.
//!
//! A request takes its identity permit first and the global permit second, so
//! a caller over its own cap is refused without taking a place in the global
//! queue. The two are one step: a request that gets its identity permit
//! takes the global permit, or a place in the global queue, at the same
//! moment, and a request that leaves gives both back at once. When it hands
//! its identity permit to its subject's next waiter, that waiter takes the
//! global step in the same moment: the freed global permit goes to the first
//! request of the global queue if one waits, and otherwise to that waiter;
//! in the first case the waiter takes the freed place at the back of the
//! global queue. So a leaving request's global permit never goes to a
//! newcomer while a request waits in the global queue or for that request's
//! identity permit, and a request handed its identity permit is never refused
//! by a full global queue. The worst-case queueing time is the sum of both
//! deadlines.
//!
//! # Adaptive limits, classes and fair queues
//!
//! The global cap may instead follow the latency, with
//! [`global_adaptive`](ConcurrencyLayerBuilder::global_adaptive); and a
//! global cap, fixed or adaptive, may give each
//! [`criticality`](ConcurrencyLayerBuilder::criticality) class its share of
//! the limit and queue each tenant fairly
//! ([`fair_by`](ConcurrencyLayerBuilder::fair_by)). The same limit guards a
//! client on its own as an [`AdaptiveLimitLayer`]. See
//! [below](#adaptive-limits-criticality-classes-and-fair-queues-in-detail)
//! for the algorithm, its parameters and its guarantees. A plain fixed cap (no
//! classes, no tenants) keeps the path described here.
//!
//! # Refusals
//!
//! | cap | status | `RateLimit` fields | why |
//! |---|---|---|---|
//! | global | 503 + `Retry-After` | `"global-concurrency"` | the *service* is full; nothing the caller did caused it |
//! | per identity | 429 + `Retry-After` | `"concurrency"` | the *caller* has too much in flight; it can fix that by waiting for its own requests |
//! | identity map full | 503 + `Retry-After` of 1 s, as for a cap with no queue | none: the map counts callers, not requests | the service cannot track another caller |
//! | tenant's share of a fair queue full | 503 + `Retry-After` | `"global-concurrency"` | the tenant holds its share of the queue ([`OverloadReason::TenantQueueFull`]) |
//!
//! They are [`Rejection::Overloaded`](crate::reject::Rejection::Overloaded)
//! (503) or [`Rejection::CallerBusy`](crate::reject::Rejection::CallerBusy)
//! (429) (gRPC: `UNAVAILABLE` or `RESOURCE_EXHAUSTED`), whose `cap`, the
//! name above and the limit in force, the `RateLimit` fields advertise
//! (HTTP only). The response extensions also hold an [`OverloadReason`]
//! (queue full, deadline passed, too many identities). Each refusal is logged at `debug` level through `tracing` and
//! counted in [`ConcurrencyStats`] (and, with the `metrics` feature, in the
//! `tower_admission_concurrency_refused_total` counter labelled by scope and
//! reason).
//!
//! # Gauges
//!
//! With the `metrics` feature the layer also keeps three gauges, moved as
//! permits and queue places are taken and given back:
//!
//! | gauge | labels | what |
//! |---|---|---|
//! | `tower_admission_concurrency_in_flight` | `scope` = `global` or `identity` | requests holding a permit of that cap; `identity` sums over every subject |
//! | `tower_admission_concurrency_queued` | `scope` | requests waiting in that cap's queue |
//! | `tower_admission_concurrency_tracked_identities` | | subjects with a request queued or in flight |
//!
//! A request waiting for a global permit already holds its identity permit,
//! so it counts in `in_flight{scope="identity"}` and `queued{scope="global"}`
//! at once. Several concurrency layers in one process add into the same
//! series.
//!
//! **`Retry-After`** is the refusing cap's queue deadline, rounded up to
//! whole seconds and at least 1 s (so 1 s for the load-shedding form). The
//! reasoning: a request that could not get a permit within the deadline is
//! unlikely to get one sooner. [`ConcurrencyLayerBuilder::retry_after`]
//! overrides it.
//!
//! # Permits live until the body is sent
//!
//! Permits are held by the response body, a [`PermitBody`], and released
//! when the body reaches its end, fails, or is dropped (client gone). A
//! streaming response therefore counts as in flight for as long as it
//! streams. If the inner service returns an error, the permits are released
//! at once.
//!
//! # Backpressure
//!
//! axum does not use `poll_ready` for backpressure, so permits are taken in
//! `call`, and the service's `poll_ready` only delegates to the inner
//! service. A refused request never reaches the inner service.
//!
//! A request admitted at once is handed to the inner service that
//! `poll_ready` made ready. A request that must queue holds nothing of the
//! inner service while it waits: the ready inner service is dropped, giving
//! back what its readiness reserved (a `tower::buffer::Buffer` slot, a
//! `tower::limit::ConcurrencyLimit` permit), and once the request holds its
//! permits it polls a clone of the inner service ready and calls it. So a
//! buffer or limit inside this layer is never filled by queued requests,
//! and waiting for it counts as in flight. An error of that `poll_ready` is
//! the request's answer, and its permits go back at once.
//!
//! # Bounded memory
//!
//! The per-identity map holds one entry per subject that has a request
//! queued, running or sending its body; the last such request removes the
//! entry, so an idle service tracks nothing. The map holds at most
//! [`max_identities`](ConcurrencyLayerBuilder::max_identities) entries
//! (default 10 000). When it is full, a request of a *new*
//! subject is refused at once with 503 ([`OverloadReason::TooManyIdentities`])
//! while subjects already tracked continue as normal.
//!
//! With a global cap configured, a subject has an entry only while one of its
//! requests holds a global permit or a place in the global queue (both steps
//! above are one), so the map never holds more than `global.limit +
//! global.queue` entries. A new subject that finds the global cap full is
//! refused by the global cap (503, [`OverloadReason::QueueFull`]) before the
//! map is looked at. Hence with `max_identities >= global.limit +
//! global.queue`, [`OverloadReason::TooManyIdentities`] never happens.
//!
//! The map and the global cap's permits sit behind one mutex, taken once
//! when a request enters and once when it leaves, identified or not (a
//! request no cap counts takes it never).
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower::{service_fn, Layer, ServiceExt};
//! use tower_admission::concurrency::ConcurrencyLayer;
//! use tower_admission::identity::Identity;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = ConcurrencyLayer::builder()
//!     // 64 in flight service-wide, 128 more may wait up to 250 ms: then 503.
//!     .global(64, 128, Duration::from_millis(250))
//!     // 4 in flight per subject, no queue: the 5th is refused with 429.
//!     .per_identity(4, 0, Duration::ZERO)
//!     .build()?;
//!
//! let svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
//!     Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from("report"))))
//! }));
//!
//! let mut req = Request::new(Full::default());
//! req.extensions_mut().insert(Identity::new("alice", "acme", "free"));
//! let response = svc.oneshot(req).await?;
//! assert_eq!(response.status(), StatusCode::OK);
//! // The permit is held by the body until it is sent or dropped.
//! assert_eq!(layer.in_flight(), 1);
//! drop(response);
//! assert_eq!(layer.in_flight(), 0);
//! assert_eq!(layer.tracked_identities(), 0);
//! # Ok(())
//! # }
//! ```
//!
//! With axum, apply it with `Router::layer`; all routes share the caps:
//!
//! ```
//! # use std::time::Duration;
//! # use tower_admission::concurrency::ConcurrencyLayer;
//! let caps = ConcurrencyLayer::builder()
//!     .global(64, 0, Duration::ZERO) // shed load: 503 at once past 64
//!     .build()
//!     .unwrap();
//! let app: axum::Router = axum::Router::new()
//!     .route("/reports", axum::routing::get(|| async { "ok" }))
//!     .layer(caps.clone());
//! # let _ = app;
//! ```
#![doc = include_str!("../../docs/adaptive.md")]

pub(crate) mod adaptive;
mod body;
mod future;
mod gauges;
mod layer;
mod permits;
mod reason;
mod service;
mod state;

pub(crate) use adaptive::Overloaded;
pub use adaptive::{
    AdaptiveLimit, AdaptiveLimitLayer, AdaptiveLimitLayerBuilder, Criticality, LimitError, Outcome,
};
pub use body::PermitBody;
pub use layer::{ConcurrencyLayer, ConcurrencyLayerBuilder};
pub use reason::{ConcurrencyStats, OverloadReason};
