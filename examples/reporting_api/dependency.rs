//! The shared external service that batch items call, and the budget every
//! call attempt passes through:
//!
//! ```text
//! AdaptiveLimitLayer (calls in flight, by class and tenant: crate::overload)
//!   -> tower::retry (RetryAttempts: 429 and 5xx, backoff with jitter, obeying Retry-After)
//!   -> DependencyBudgetLayer (normal share for first attempts, retry share for retries)
//!   -> PushbackLayer (with `--pushback`: 429, or 503 with Retry-After, lowers the fleet's budget)
//!   -> HTTP client
//! ```
//!
//! The limit is outside the budget: an attempt the budget admits is sent at
//! once, so the budget's bound on send starts holds at the dependency.
//!
//! The budget is 240/s in all, 200/s for first attempts and 40/s for
//! retries: in memory for one instance, or one rate lease on Redis shared by
//! the whole fleet (`--redis`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{Request, Response, StatusCode};
use serde::Serialize;
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceBuilder, ServiceExt};
use tower_admission::concurrency::LimitError;
use tower_admission::outbound::{
    Attempt, AttemptBudget, BudgetError, DependencyBudget, DependencyBudgetLayer, PushbackLayer,
    RetryAttempts,
};
use tower_admission::quota::MemoryStore;
use tower_admission::reject::Rejection;
use tower_admission::ConfigError;

use crate::config;
use crate::overload::Caller;

type Client =
    BoxCloneSyncService<Request<String>, Response<Bytes>, LimitError<BudgetError<reqwest::Error>>>;

/// The dependency's client: retries, budget, HTTP. Clones share the budget
/// and the connection pool.
#[derive(Clone)]
pub(crate) struct Dependency {
    client: Client,
    base: Arc<str>,
    active_items: usize,
}

/// The attempts one API request made, retries included: only attempts that
/// were sent (the budget admitted them) are counted.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    attempts: AtomicU64,
    retries: AtomicU64,
}

/// A snapshot of a [`Tally`], as batch answers report it.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub(crate) struct Attempts {
    pub(crate) attempts: u64,
    pub(crate) retries: u64,
}

impl Tally {
    pub(crate) fn snapshot(&self) -> Attempts {
        Attempts {
            attempts: self.attempts.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
        }
    }
}

/// Why a call gave no answer.
#[derive(Debug)]
pub(crate) enum CallError {
    /// The budget refused an attempt; it may pass after the wait.
    Budget(Option<Duration>),
    /// The limit on calls in flight refused an attempt (not retried): its
    /// wait and why.
    Shed(Duration, String),
    /// The dependency's last answer was not 200; it may have asked for a
    /// wait.
    Answered(StatusCode, Option<Duration>),
    /// The dependency could not be reached.
    Failed(String),
}

impl CallError {
    /// The wait to advertise in `Retry-After`: the budget's, or the
    /// dependency's own (at least 1 s).
    pub(crate) fn retry_after(&self) -> Duration {
        match self {
            CallError::Budget(Some(wait)) => *wait,
            CallError::Shed(wait, _) => *wait,
            CallError::Answered(_, Some(wait)) => (*wait).max(Duration::from_secs(1)),
            _ => Duration::from_secs(1),
        }
    }
}

impl CallError {
    /// The 503 it is answered with: the limit's refusal is the crate's
    /// overload refusal, any other the dependency being unavailable.
    pub(crate) fn rejection(&self) -> Rejection {
        let retry_after = self.retry_after();
        match self {
            CallError::Shed(..) => Rejection::Overloaded {
                retry_after,
                cap: None,
            },
            _ => Rejection::DependencyUnavailable { retry_after },
        }
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Budget(_) => f.write_str("the dependency budget is exhausted"),
            CallError::Shed(_, why) => write!(f, "the dependency is overloaded: {why}"),
            CallError::Answered(status, _) => write!(f, "the dependency answered {status}"),
            CallError::Failed(why) => write!(f, "the dependency failed: {why}"),
        }
    }
}

/// The budget for one instance, in memory: with the defaults 200/s + 40/s,
/// each with a burst of 25 ms of its rate, so at most 246 attempts start in
/// any second.
pub(crate) fn memory_budget(
    settings: &config::Dependency,
) -> Result<DependencyBudget<MemoryStore>, ConfigError> {
    DependencyBudget::builder(MemoryStore::new(), "dependency")
        .normal(config::Dependency::share_policy(
            "normal",
            settings.normal_per_second,
        )?)
        .retry(config::Dependency::share_policy(
            "retry",
            settings.retry_per_second,
        )?)
        .build()
}

impl Dependency {
    /// Calls the service at `base_url` through `budget` and the limit on
    /// calls in flight, as `settings` say, at most `active_items` items of a
    /// batch at once.
    pub(crate) fn new<Bu: AttemptBudget>(
        base_url: &str,
        budget: Bu,
        settings: &config::Dependency,
        active_items: usize,
    ) -> Result<Self, ConfigError> {
        Self::new_with(base_url, budget, settings, active_items, false)
    }

    /// [`new`](Self::new), and with `pushback` the budget hears the
    /// dependency's pushback (`PushbackLayer`, inside the budget layer).
    pub(crate) fn new_with<Bu: AttemptBudget>(
        base_url: &str,
        budget: Bu,
        settings: &config::Dependency,
        active_items: usize,
        pushback: bool,
    ) -> Result<Self, ConfigError> {
        let http = reqwest::Client::builder()
            .timeout(settings.timeout.0)
            .build()
            .unwrap_or_default();
        let send = tower::service_fn(move |req: Request<String>| {
            let http = http.clone();
            async move {
                if let Some(tally) = req.extensions().get::<Arc<Tally>>() {
                    tally.attempts.fetch_add(1, Ordering::Relaxed);
                    if req
                        .extensions()
                        .get::<Attempt>()
                        .is_some_and(|a| a.is_retry())
                    {
                        tally.retries.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let (parts, body) = req.into_parts();
                let response = http
                    .request(parts.method, parts.uri.to_string())
                    .body(body)
                    .send()
                    .await?;
                // The status and headers (a `Retry-After` the retries obey).
                let status = response.status();
                let headers = response.headers().clone();
                let bytes = response.bytes().await?;
                let mut answer = Response::new(bytes);
                *answer.status_mut() = status;
                *answer.headers_mut() = headers;
                Ok::<_, reqwest::Error>(answer)
            }
        });
        let limit = settings.concurrency.limit().map_err(|e| {
            ConfigError::new(
                "dependency.concurrency",
                format!("{}: {}", e.field(), e.reason()),
            )
        })?;
        // Nothing may hold an attempt between the budget and the client:
        // what waits there starts later than the budget admitted it, and
        // the bound on send starts is the budget's only if each admitted
        // attempt is sent at once. So the limit holds a slot for the whole
        // call, its retries included, outside them.
        let attempts = ServiceBuilder::new()
            .retry(RetryAttempts::new(settings.attempts))
            .layer(DependencyBudgetLayer::new(budget.clone()).wait_up_to(settings.budget_wait.0))
            .option_layer(pushback.then(|| PushbackLayer::new(budget)))
            .service(send);
        let client = match limit {
            Some(limit) => BoxCloneSyncService::new(limit.layer(attempts)),
            None => BoxCloneSyncService::new(attempts.map_err(LimitError::Inner)),
        };
        Ok(Dependency {
            client,
            base: base_url.trim_end_matches('/').into(),
            active_items: active_items.max(1),
        })
    }

    /// One call for `caller`: `GET base + path`, every attempt counted in
    /// `tally`.
    pub(crate) async fn get(
        &self,
        path: &str,
        caller: &Caller,
        tally: &Arc<Tally>,
    ) -> Result<Bytes, CallError> {
        let mut req = Request::new(String::new());
        *req.uri_mut() = format!("{}{path}", self.base)
            .parse()
            .map_err(|e| CallError::Failed(format!("bad URL: {e}")))?;
        req.extensions_mut().insert(tally.clone());
        req.extensions_mut().insert(caller.clone());
        match self.client.clone().oneshot(req).await {
            Ok(response) if response.status() == StatusCode::OK => Ok(response.into_body()),
            Ok(response) => Err(CallError::Answered(
                response.status(),
                RetryAttempts::requested_wait(response.headers()),
            )),
            Err(LimitError::Inner(refusal)) if refusal.is_refusal() => {
                Err(CallError::Budget(refusal.wait()))
            }
            Err(refused @ LimitError::Overloaded { retry_after, .. }) => {
                Err(CallError::Shed(retry_after, refused.to_string()))
            }
            Err(e) => Err(CallError::Failed(e.to_string())),
        }
    }

    /// The calls of a batch: for every item, exactly two calls one after
    /// the other, at most `active_items` items at once. After the
    /// first failure no item starts another call; the calls in flight
    /// finish, so every attempt sent is counted.
    pub(crate) async fn call_for_items(
        &self,
        metrics: &[&str],
        caller: &Caller,
        tally: &Arc<Tally>,
    ) -> Result<(), CallError> {
        let stop = AtomicBool::new(false);
        let items: Vec<_> = metrics
            .iter()
            .map(|metric| self.item_calls(metric, caller, tally, &stop))
            .collect();
        let results: Vec<Result<(), Option<CallError>>> = futures_util::stream::iter(items)
            .buffered(self.active_items)
            .collect()
            .await;
        // The first error is the cause; items stopped after it carry none.
        match results.into_iter().find_map(|r| r.err().flatten()) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// One item's two calls; `Err(None)` when it stopped because another
    /// item failed.
    async fn item_calls(
        &self,
        metric: &str,
        caller: &Caller,
        tally: &Arc<Tally>,
        stop: &AtomicBool,
    ) -> Result<(), Option<CallError>> {
        let query: String = form_urlencoded::Serializer::new(String::new())
            .append_pair("metric", metric)
            .finish();
        for path in ["/v1/series", "/v1/points"] {
            if stop.load(Ordering::Relaxed) {
                return Err(None);
            }
            if let Err(e) = self.get(&format!("{path}?{query}"), caller, tally).await {
                stop.store(true, Ordering::Relaxed);
                return Err(Some(e));
            }
        }
        Ok(())
    }
}
