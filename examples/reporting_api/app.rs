//! The router: every layer, in the order a request meets them.
//!
//! ```text
//! authenticate -> cap wire bytes -> decompress -> cap decoded bytes -> validate query
//!   -> per-user request quota -> aggregate quota -> concurrency caps -> handler
//! ```
//!
//! `GET /v1/reports` also charges the per-user work quota its page size and
//! settles it to the rows actually returned; a cursor past the range's end
//! gives an empty last page, and one this API never gave out is refused
//! (400) with its work charge given back. `POST /v1/reports/batch` counts
//! its items ([`BatchItemsLayer`]) and charges the work quota one unit per
//! item before any item runs; then every item makes two calls to the
//! dependency, through its budget ([`crate::dependency`]) and its limit on
//! calls in flight, by the class of the caller's plan ([`crate::overload`]),
//! at most five items at once. A batch
//! refused after that charge, for an invalid item (400) or a full job queue
//! (503), gives the whole charge back; one whose dependency calls fail (503)
//! keeps it, since its items ran.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;
use time::OffsetDateTime;
use tower::ServiceBuilder;
use tower_admission::bounds::{
    BatchItemsLayer, BodyLimitsLayer, QueryRules, ValidateQueryLayer, ValidatedQuery,
};
use tower_admission::identity::{AuthenticateLayer, Identity};
use tower_admission::jobs::{JobId, JobQueue, JobStatus};
use tower_admission::quota::{Quota, QuotaLayer, Quotas, Settlement, Store};
use tower_admission::reject::{InvalidParameter, Rejection};
use tower_admission::ConfigError;

use crate::config::Config;
use crate::data;
use crate::dependency::{CallError, Dependency, Tally};
use crate::overload::{Caller, Classes};
use crate::reload::Handles;

/// One item of a batch request.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct BatchItem {
    pub(crate) metric: String,
    pub(crate) from: String,
    pub(crate) to: String,
}

/// An item whose range was checked: what a batch runs.
#[derive(Debug, Clone)]
pub(crate) struct CheckedItem {
    metric: String,
    from: OffsetDateTime,
    to: OffsetDateTime,
}

/// One item's answer.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct ItemResult {
    pub(crate) metric: String,
    pub(crate) rows: usize,
}

/// A batch job: its caller and its items.
type Jobs = JobQueue<(Caller, Vec<CheckedItem>), Vec<ItemResult>, String>;

#[derive(Clone)]
struct AppState {
    dependency: Dependency,
    classes: Classes,
    limits: Arc<Limits>,
    jobs: Jobs,
}

/// What the handlers check themselves.
#[derive(Debug)]
struct Limits {
    sync_items: usize,
    max_items: usize,
    max_span: Duration,
    max_page_size: u32,
}

/// The API's router and what a graceful shutdown waits for.
pub(crate) struct Api {
    pub(crate) router: Router,
    /// The batch jobs; [`Api::drain`] waits for the accepted ones.
    jobs: Jobs,
    /// What a reload of the file changes while the API runs; taken by the
    /// reloader.
    pub(crate) reload: Option<Handles>,
    /// Runs once the jobs have drained: gives the fleet's rate lease back,
    /// so this instance's share returns at once instead of when its grants
    /// expire (Redis builds).
    pub(crate) release: Option<futures_util::future::BoxFuture<'static, ()>>,
}

impl Api {
    /// Stops taking jobs and waits until every accepted job has finished.
    pub(crate) async fn drain(&self) {
        self.jobs.shutdown().await;
    }
}

/// Builds the API of `config` over `store`, which holds every quota; batch
/// items call `dependency`.
pub(crate) fn app<St: Store>(
    config: &Config,
    store: St,
    dependency: Dependency,
) -> Result<Api, ConfigError> {
    let quotas = LayerQuotas::of(config)?;
    // Every quota gives its charge back when a layer further in (or the
    // job queue) refuses the request: a refused request costs nothing.
    let per_user = QuotaLayer::builder(store.clone())
        .quotas(quotas.per_user)
        .headers_on_success(true)
        .refund_inner_refusals(true)
        .build()?;
    let aggregate = QuotaLayer::builder(store.clone())
        .quotas(quotas.aggregate)
        .aggregate()
        .refund_inner_refusals(true)
        .build()?;
    let rows = QuotaLayer::builder(store.clone())
        .quotas(quotas.work.clone())
        .cost(ValidatedQuery::page_cost)
        .refund_inner_refusals(true)
        .build()?;
    // The same work quotas, charged one unit per batch item: the handler
    // settles a refused batch's charge back to zero.
    let items = QuotaLayer::builder(store.clone())
        .quotas(quotas.work)
        .cost(BatchItemsLayer::item_cost)
        .refund_inner_refusals(true)
        .build()?;
    let max_items = std::num::NonZeroUsize::new(config.batch.max_items)
        .ok_or_else(|| ConfigError::new("batch.max_items", "must be at least 1"))?;
    let (default_page, max_page) = config.page_sizes();
    let rules = QueryRules::new()
        .page_size(default_page, max_page)?
        .max_span(config.query.max_span.0)?
        .ignore_unknown_params(false);
    let limits = Arc::new(Limits {
        sync_items: config.batch.sync_items,
        max_items: config.batch.max_items,
        max_span: config.query.max_span.0,
        max_page_size: config.query.max_page_size,
    });

    let for_jobs = (dependency.clone(), limits.clone());
    let jobs = config
        .job_queue()
        .build(move |(caller, items): (Caller, Vec<CheckedItem>)| {
            let (dependency, limits) = for_jobs.clone();
            async move {
                let tally = Arc::new(Tally::default());
                run_batch(&dependency, &limits, &caller, &items, &tally)
                    .await
                    .map_err(|e| e.to_string())
            }
        })?;
    let concurrency = config.concurrency_layer()?;
    let body = BodyLimitsLayer::new(config.body.max_wire_bytes, config.body.max_decoded_bytes);
    let reload = Handles {
        per_user: per_user.reload_handle(),
        aggregate: aggregate.reload_handle(),
        rows: rows.reload_handle(),
        items: items.reload_handle(),
        concurrency: concurrency.reload_handle(),
        body: body.reload_handle(),
        budget: None,
    };
    let state = AppState {
        dependency,
        classes: Classes::new(config),
        limits,
        jobs: jobs.clone(),
    };

    let protected = Router::new()
        .route("/v1/reports", get(list_reports).route_layer(rows))
        .route(
            "/v1/reports/batch",
            post(batch).route_layer(
                ServiceBuilder::new()
                    .layer(axum::middleware::from_fn(require_json))
                    .layer(BatchItemsLayer::new(max_items))
                    .layer(items),
            ),
        )
        .route("/v1/jobs/{id}", get(job_status))
        .with_state(state)
        .route_layer(
            ServiceBuilder::new()
                .layer(AuthenticateLayer::new(config.api_keys()))
                .layer(body)
                .layer(ValidateQueryLayer::new(rules))
                .layer(per_user)
                .layer(aggregate)
                .layer(concurrency),
        );
    let router = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .merge(protected)
        .fallback(|| async { problem(StatusCode::NOT_FOUND, "no such route", json!({})) })
        .method_not_allowed_fallback(|| async {
            problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "this route does not take that method",
                json!({}),
            )
        });
    Ok(Api {
        router,
        jobs,
        reload: Some(reload),
        release: None,
    })
}

/// The quotas of each quota layer, as a config gives them.
pub(crate) struct LayerQuotas {
    /// Requests per user, by plan.
    pub(crate) per_user: Quotas,
    /// Every caller together.
    pub(crate) aggregate: Quotas,
    /// Work per user (rows read, batch items), by plan.
    pub(crate) work: Quotas,
}

impl LayerQuotas {
    /// The quotas of `config`; the default plan's are the default quotas.
    pub(crate) fn of(config: &Config) -> Result<LayerQuotas, ConfigError> {
        let quotas = config
            .quotas()
            .map_err(|e| ConfigError::new("config", e.to_string()))?;
        let by_plan = |by_plan: &BTreeMap<String, Quota>| {
            by_plan.iter().fold(Quotas::new(), |quotas, (plan, quota)| {
                if *plan == config.default_plan {
                    quotas.quota(quota.clone())
                } else {
                    quotas.plan(plan, quota.clone())
                }
            })
        };
        Ok(LayerQuotas {
            per_user: by_plan(&quotas.requests),
            aggregate: Quotas::new().quota(quotas.aggregate),
            work: by_plan(&quotas.work),
        })
    }
}

async fn list_reports(
    who: Identity,
    query: ValidatedQuery,
    Extension(settlement): Extension<Settlement>,
    headers: HeaderMap,
) -> Response {
    let now = OffsetDateTime::now_utc();
    let to = query.to.unwrap_or(now);
    let from = query
        .from
        .unwrap_or_else(|| to.checked_sub(time::Duration::days(1)).unwrap_or(to));
    let cursor = match query.cursor.as_deref().map(parse_cursor).transpose() {
        Ok(cursor) => cursor.unwrap_or(0),
        Err(reason) => {
            let refused =
                Rejection::InvalidParameters(vec![InvalidParameter::new("cursor", reason)])
                    .into_response(&headers)
                    .into_response();
            return refund(&settlement, refused).await;
        }
    };
    // A cursor past the range's end, however large, is an empty last page.
    let (rows, next) = data::page("requests", from, to, query.page_size, cursor);
    // Charged the page size up front; settle to the rows actually read.
    if let Err(e) = settlement.settle(rows.len() as u64).await {
        tracing::warn!(%e, "could not settle work quota");
    }
    Json(json!({
        "subject": who.subject(),
        "page_size": query.page_size,
        "rows": rows,
        "next_cursor": next.map(|n| n.to_string()),
    }))
    .into_response()
}

/// A cursor of `GET /v1/reports`: the index of the next row, in decimal
/// digits. Digits beyond `u64::MAX` are past the end of any range.
fn parse_cursor(cursor: &str) -> Result<u64, &'static str> {
    if cursor.is_empty() || !cursor.bytes().all(|b| b.is_ascii_digit()) {
        return Err("not a cursor of this API: send a next_cursor back as it was given");
    }
    Ok(cursor.parse().unwrap_or(u64::MAX))
}

/// Refuses a batch that is not JSON with 415, before its body is read or
/// anything is charged.
async fn require_json(req: Request, next: Next) -> Response {
    let json = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return problem(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "a batch is a JSON body: send content-type: application/json",
            json!({}),
        );
    }
    next.run(req).await
}

/// Runs a batch whose items were counted and charged to the work quota.
/// A batch refused from here on (an invalid item, a full job queue) gives
/// the charge back.
async fn batch(
    who: Identity,
    State(state): State<AppState>,
    Extension(settlement): Extension<Settlement>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    // The count passed; an item can still be malformed or out of range.
    let items = match BatchItemsLayer::parse::<BatchItem>(&body, state.limits.max_items) {
        Ok(items) => check_items(&state.limits, items),
        Err(e) => {
            let refused = e.into_response(&headers).into_response();
            return refund(&settlement, refused).await;
        }
    };
    let items = match items {
        Ok(items) => items,
        Err(invalid) => {
            let refused = Rejection::InvalidParameters(vec![invalid])
                .into_response(&headers)
                .into_response();
            return refund(&settlement, refused).await;
        }
    };
    let caller = Caller::new(&state.classes, &who);
    if items.len() <= state.limits.sync_items {
        let tally = Arc::new(Tally::default());
        let result = run_batch(&state.dependency, &state.limits, &caller, &items, &tally).await;
        let dependency = tally.snapshot();
        return match result {
            Ok(results) => {
                Json(json!({ "items": results, "dependency": dependency })).into_response()
            }
            Err(e) => {
                // The crate's 503, with what was called before it gave up.
                // The items ran, so their charge stays.
                let rejection = e.rejection();
                let mut doc = rejection.problem();
                doc["detail"] = json!(e.to_string());
                doc["dependency"] = json!(dependency);
                let mut response = rejection.into_response(&headers);
                *response.body_mut() = doc.to_string().into();
                response.into_response()
            }
        };
    }
    match state
        .jobs
        .submit(who.subject_arc().clone(), (caller, items))
    {
        Ok(id) => match id.accepted_response(&format!("/v1/jobs/{id}")) {
            Ok(response) => response.into_response(),
            Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
        },
        // No room, in the service or for this user: nothing ran, so nothing
        // stays charged.
        Err(refused) => refund(&settlement, refused.into_response(&headers).into_response()).await,
    }
}

/// Gives a refused batch's work charge back, then answers `refused`.
async fn refund(settlement: &Settlement, refused: Response) -> Response {
    if let Err(e) = settlement.settle(0).await {
        tracing::warn!(%e, "could not refund the work quota of a refused batch");
    }
    refused
}

async fn job_status(
    who: Identity,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Response {
    let status = id
        .parse::<JobId>()
        .ok()
        .and_then(|id| state.jobs.status(who.subject(), id));
    let Some(status) = status else {
        return problem(StatusCode::NOT_FOUND, "no such job", json!({}));
    };
    let body = match status {
        JobStatus::Succeeded(items) => json!({"status": "succeeded", "items": items}),
        JobStatus::Failed(error) => json!({"status": "failed", "error": error}),
        other => json!({"status": other.as_str()}),
    };
    Json(body).into_response()
}

/// An RFC 9457 problem: `application/problem+json`, with `extra` members.
fn problem(status: StatusCode, detail: &str, extra: serde_json::Value) -> Response {
    let mut body = json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    if let (Some(body), serde_json::Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
    let mut response = (status, Json(body)).into_response();
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// Checks every item's range: `from < to`, within the longest span. The
/// first bad one is named by its index and field, e.g. `items[3].from`.
fn check_items(
    limits: &Limits,
    items: Vec<BatchItem>,
) -> Result<Vec<CheckedItem>, InvalidParameter> {
    use time::format_description::well_known::Rfc3339;
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let invalid = |field: &str, reason: String| {
                InvalidParameter::new(format!("items[{i}].{field}"), reason)
            };
            let from = OffsetDateTime::parse(&item.from, &Rfc3339)
                .map_err(|e| invalid("from", format!("not an RFC 3339 time: {e}")))?;
            let to = OffsetDateTime::parse(&item.to, &Rfc3339)
                .map_err(|e| invalid("to", format!("not an RFC 3339 time: {e}")))?;
            if to <= from || (to - from) > limits.max_span {
                return Err(invalid(
                    "to",
                    format!(
                        "must be after from, by at most {} s",
                        limits.max_span.as_secs()
                    ),
                ));
            }
            Ok(CheckedItem {
                metric: item.metric,
                from,
                to,
            })
        })
        .collect()
}

/// Makes each item's dependency calls, then reads its rows.
async fn run_batch(
    dependency: &Dependency,
    limits: &Limits,
    caller: &Caller,
    items: &[CheckedItem],
    tally: &Arc<Tally>,
) -> Result<Vec<ItemResult>, CallError> {
    let metrics: Vec<&str> = items.iter().map(|item| item.metric.as_str()).collect();
    dependency.call_for_items(&metrics, caller, tally).await?;
    Ok(items
        .iter()
        .map(|item| {
            let (rows, _) = data::page(&item.metric, item.from, item.to, limits.max_page_size, 0);
            ItemResult {
                metric: item.metric.clone(),
                rows: rows.len(),
            }
        })
        .collect())
}
