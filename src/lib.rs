//! Composable Tower layers for admission control.
//!
//! A request meets the layers in this order; each refuses with a response
//! built in [`reject`], never an error, so stacks keep axum's `Infallible`
//! bound:
//!
//! ```text
//! authenticate -> cap wire bytes -> decompress -> cap decoded bytes -> validate page/range/items
//!    -> per-user quotas -> aggregate quotas -> bound concurrency (queue with deadline) -> handler
//! ```
//!
//! | module | layer | refuses with |
//! |---|---|---|
//! | [`identity`] | [`AuthenticateLayer`](identity::AuthenticateLayer), [`ClientIpLayer`](identity::ClientIpLayer) | 401 |
//! | [`bounds`] | [`BodyLimitsLayer`](bounds::BodyLimitsLayer), [`ValidateQueryLayer`](bounds::ValidateQueryLayer) | 413, 415, 400 |
//! | [`quota`] | [`QuotaLayer`](quota::QuotaLayer) over a [`Store`](quota::Store) | 429 + `Retry-After`, 413, 503 |
//! | [`concurrency`] | [`ConcurrencyLayer`](concurrency::ConcurrencyLayer): fixed or adaptive global limit, criticality classes, fair per-tenant queues; [`AdaptiveLimitLayer`](concurrency::AdaptiveLimitLayer) on a client | 503 / 429 + `Retry-After` |
//! | [`jobs`] | [`JobQueue`](jobs::JobQueue) for `202 Accepted` | 503 |
//! | [`outbound`] | [`DependencyBudgetLayer`](outbound::DependencyBudgetLayer) on a client | [`BudgetError`](outbound::BudgetError) with the wait |
//!
//! The numbers of every layer above (quotas and plans, caps, rules, budgets)
//! can change while it runs, checked whole and applied atomically per
//! request: see [`reload`].
//!
//! # Quick start
//!
//! ```
//! use std::time::Duration;
//! use axum::{routing::get, Router};
//! use tower::ServiceBuilder;
//! use tower_admission::identity::{ApiKeys, AuthenticateLayer, Identity};
//! use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer};
//!
//! let free = Quota::new("free", [
//!     Policy::sliding_log("per-minute", 100, Duration::from_secs(60))?,
//!     Policy::token_bucket("burst", 20, 100, Duration::from_secs(60))?,
//! ])?;
//! let keys = ApiKeys::new().with_key("demo-free", Identity::new("alice", "acme", "free"));
//! let app: Router = Router::new()
//!     .route("/v1/reports", get(|| async { "ok" }))
//!     .layer(
//!         ServiceBuilder::new()
//!             .layer(AuthenticateLayer::new(keys))
//!             .layer(QuotaLayer::builder(MemoryStore::new()).quota(free).build()?),
//!     );
//! # Ok::<(), tower_admission::ConfigError>(())
//! ```
//!
//! More in [`recipes`]: limits per route, an allow-list, identity from a
//! JWT, client IP behind a proxy, tonic, an outbound client with retries
//! under a budget, Redis Cluster. [`Limiter::peek`](quota::Limiter::peek)
//! tells whether a request would be admitted without spending anything.
//!
//! # Guarantees
//!
//! | algorithm | guarantee |
//! |---|---|
//! | [`Policy::fixed_window`](quota::Policy::fixed_window) | ≤ L per clock-aligned window; 2L can pass across a boundary |
//! | [`Policy::sliding_log`](quota::Policy::sliding_log) | ≤ L in every interval `(t − W, t]` (exact) |
//! | [`Policy::token_bucket`](quota::Policy::token_bucket) | ≤ `floor(B + r·T)` in any interval T (GCRA, equal to governor) |
//! | [`Policy::sliding_window`](quota::Policy::sliding_window) | approximation: `prev·(1 − elapsed/W) + current ≤ L` |
//!
//! Every decision is one atomic step per key; a refusal consumes nothing;
//! `Retry-After` is the exact wait rounded up, never 0.
//!
//! # Features
//!
//! | feature | default | adds |
//! |---|---|---|
//! | `axum` | yes | extractors for `Identity`, `ClientIp`, `ValidatedQuery` |
//! | `redis` | no | the Redis and Redis Cluster store |
//! | `tonic` | no | gRPC rejections with `google.rpc.RetryInfo`, `QuotaFailure` and `BadRequest` details |
//! | `metrics` | yes | counters, gauges and a histogram through the `metrics` facade: quota decisions, refusals per policy, failure modes, unknown outcomes, in-flight and queued requests per concurrency scope, dependency attempts per share, refusals and waits. On by default because without an installed recorder every emission is a no-op (one key built per event); the sample API serves them on `GET /metrics` |
//! | `test-hooks` | no | this crate's own tests, benches and examples only: a test clock for the Redis scripts, the quota script's source, arguments and keys |
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod bounds;
pub mod clock;
pub mod concurrency;
mod error;
pub mod identity;
pub mod jobs;
mod macros;
pub mod outbound;
pub mod quota;
#[doc = include_str!("../docs/recipes.md")]
pub mod recipes {}
#[cfg(feature = "redis")]
mod redis;
pub mod reject;
pub mod reload;

pub use error::ConfigError;

/// Lets the tests that reach crate-private parts, kept in `tests/internal/`
/// and compiled as unit tests, name the crate as an integration test does.
#[cfg(test)]
extern crate self as tower_admission;

/// The README's Rust example, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
