//! The whole inbound stack of the sample reporting API, defined once for the
//! in-process benches (`benches/common/stacks.rs`) and for the over-the-socket
//! server (`examples/bench_server.rs`, modes `stack` and `stack-redis`, which
//! includes this file by `#[path]`).
//!
//! In the order a request meets the layers:
//!
//! 1. authentication: [`ApiKeys`], key [`API_KEY`];
//! 2. wire and decoded byte caps: [`BodyLimitsLayer`], 1 MiB and 8 MiB;
//! 3. query validation: [`ValidateQueryLayer`], page size 20 by default and
//!    at most 100, a `from..to` span of at most 31 days, unknown parameters
//!    refused; every request carries [`QUERY`], which passes;
//! 4. a per-user quota of two policies decided together, a sliding log
//!    **and** a token bucket (the shape of the sample API's free plan), with
//!    `RateLimit` headers on admitted responses as the sample API sends them;
//! 5. an aggregate quota (one token bucket, one key for everyone);
//! 6. global and per-identity concurrency caps: [`ConcurrencyLayer`].
//!
//! Every limit is far above what one machine can offer, so every request is
//! admitted: this measures the admitted path, which every served request
//! pays.
//!
//! [`first_layers`] builds the stack cut after its first `n` layers, for the
//! cost of each layer (variants `stack_1` to `stack_5` of
//! `benches/instructions.sh`, modes `stack-1` to `stack-5` of the server).
//! [`whole_stack_without_fields`] is the whole stack whose per-user quota
//! adds no `RateLimit` fields to admitted responses (server mode
//! `stack-no-fields`), for what those fields cost.

use std::num::NonZeroU32;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use tower::ServiceBuilder;
use tower_admission::bounds::{BodyLimitsLayer, QueryRules, ValidateQueryLayer};
use tower_admission::concurrency::ConcurrencyLayer;
use tower_admission::identity::{ApiKeys, AuthenticateLayer, Identity};
use tower_admission::quota::{Policy, Quota, QuotaLayer, Store};
use tower_admission::ConfigError;

/// The API key every request presents, as `Authorization: Bearer bench`.
pub(crate) const API_KEY: &str = "bench";

/// The `Authorization` header value of every request.
pub(crate) const AUTHORIZATION: &str = "Bearer bench";

macro_rules! query {
    () => {
        "from=2026-11-01T00:00:00Z&to=2026-11-02T00:00:00Z&page_size=20"
    };
}

/// The query string every request carries: a one-day range and a page size,
/// all three validated.
pub(crate) const QUERY: &str = query!();

/// The path and query of every request to the stack.
pub(crate) const PATH_AND_QUERY: &str = concat!("/?", query!());

/// The route every stack serves: `GET /` answers `ok`.
pub(crate) fn base() -> Router {
    Router::new().route("/", get(|| async { "ok" }))
}

/// A token bucket that never runs dry at any load one machine can offer:
/// a burst of 10^9 refilled at 10^6 per second.
pub(crate) fn huge_bucket(name: &str) -> Result<Policy, ConfigError> {
    Policy::token_bucket(name, 1_000_000_000, 1_000_000, Duration::from_secs(1))
}

/// The per-user quota: a sliding log of 10^6 per second (the most a log
/// takes) **and** a huge
/// bucket, like the sample API's free plan (a sliding log of 100 per minute
/// and a bucket of 20 at 100 per minute) but never refusing. The log's
/// window is 1 s, so it holds about one second of admissions.
pub(crate) fn per_user_quota() -> Result<Quota, ConfigError> {
    Quota::new(
        "bench-user",
        [
            Policy::sliding_log("per-second", 1_000_000, Duration::from_secs(1))?,
            huge_bucket("burst")?,
        ],
    )
}

/// The aggregate quota: one huge bucket.
pub(crate) fn aggregate_quota() -> Result<Quota, ConfigError> {
    Quota::new("bench-all", [huge_bucket("per-second")?])
}

/// The layers of the stack, in the order a request meets them.
pub(crate) const LAYERS: [&str; 6] = [
    "authentication",
    "body caps",
    "query validation",
    "per-user quota",
    "aggregate quota",
    "concurrency caps",
];

/// The whole inbound stack over `store` (both quotas live in it), serving
/// [`base`].
pub(crate) fn whole_stack<St: Store + Clone>(store: St) -> Result<Router, ConfigError> {
    first_layers(store, LAYERS.len())
}

/// [`whole_stack`] with no `RateLimit` fields on admitted responses (a
/// refusal still carries them): the same work less writing the two values
/// and sending their 138 bytes.
#[allow(dead_code)] // used by the server only
pub(crate) fn whole_stack_without_fields<St: Store + Clone>(
    store: St,
) -> Result<Router, ConfigError> {
    cut(store, LAYERS.len(), false)
}

/// The stack's first `n` layers of [`LAYERS`] over `store`, serving
/// [`base`]; `n` of 6 or more is the whole stack.
pub(crate) fn first_layers<St: Store + Clone>(store: St, n: usize) -> Result<Router, ConfigError> {
    cut(store, n, true)
}

/// [`first_layers`], the per-user quota adding the `RateLimit` fields to
/// admitted responses when `fields` is true.
fn cut<St: Store + Clone>(store: St, n: usize, fields: bool) -> Result<Router, ConfigError> {
    let (auth, body, query, per_user, aggregate, concurrency) = layers(store, fields)?;
    let first = ServiceBuilder::new().layer(auth);
    Ok(match n {
        0 => base(),
        1 => base().layer(first),
        2 => base().layer(first.layer(body)),
        3 => base().layer(first.layer(body).layer(query)),
        4 => base().layer(first.layer(body).layer(query).layer(per_user)),
        5 => base().layer(
            first
                .layer(body)
                .layer(query)
                .layer(per_user)
                .layer(aggregate),
        ),
        _ => base().layer(
            first
                .layer(body)
                .layer(query)
                .layer(per_user)
                .layer(aggregate)
                .layer(concurrency),
        ),
    })
}

/// The six layers of [`LAYERS`], in that order.
type Layers<St> = (
    AuthenticateLayer<ApiKeys>,
    BodyLimitsLayer,
    ValidateQueryLayer,
    QuotaLayer<St>,
    QuotaLayer<St>,
    ConcurrencyLayer,
);

/// The six layers, each built once here; `fields`: the per-user quota adds
/// the `RateLimit` fields to admitted responses, as the sample API does.
fn layers<St: Store + Clone>(store: St, fields: bool) -> Result<Layers<St>, ConfigError> {
    let keys = ApiKeys::new().with_key(API_KEY, Identity::new("alice", "acme", "free"));
    let per_user = QuotaLayer::builder(store.clone())
        .quota(per_user_quota()?)
        .headers_on_success(fields)
        .build()?;
    let aggregate = QuotaLayer::builder(store)
        .quota(aggregate_quota()?)
        .aggregate()
        .build()?;
    let rules = QueryRules::new()
        .page_size(
            NonZeroU32::new(20).unwrap_or(NonZeroU32::MIN),
            NonZeroU32::new(100).unwrap_or(NonZeroU32::MIN),
        )?
        .max_span(Duration::from_secs(31 * 24 * 3600))?
        .ignore_unknown_params(false);
    let concurrency = ConcurrencyLayer::builder()
        .global(1024, 1024, Duration::from_secs(1))
        .per_identity(1024, 0, Duration::from_secs(1))
        .build()?;
    Ok((
        AuthenticateLayer::new(keys),
        BodyLimitsLayer::new(1 << 20, 8 << 20),
        ValidateQueryLayer::new(rules),
        per_user,
        aggregate,
        concurrency,
    ))
}
