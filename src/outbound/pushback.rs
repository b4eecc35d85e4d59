//! Pushback from the dependency: which answers say "send less", and the
//! layer that tells the budget.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{HeaderMap, Request, Response, StatusCode};
use tower::{Layer, Service};

use crate::outbound::AttemptBudget;

/// gRPC's `RESOURCE_EXHAUSTED`.
const GRPC_RESOURCE_EXHAUSTED: &str = "8";
/// gRPC's `UNAVAILABLE`.
const GRPC_UNAVAILABLE: &str = "14";

/// Whether a dependency's answer pushes back (the rule is on
/// [`PushbackLayer`]).
fn is_pushback<B>(response: &Response<B>) -> bool {
    let headers = response.headers();
    match response.status() {
        StatusCode::TOO_MANY_REQUESTS => return true,
        StatusCode::SERVICE_UNAVAILABLE if headers.contains_key(http::header::RETRY_AFTER) => {
            return true
        }
        _ => {}
    }
    nothing_remaining(headers) || grpc_pushback(headers)
}

/// A `RateLimit` field with a remaining quota of 0, or
/// `RateLimit-Remaining: 0`.
fn nothing_remaining(headers: &HeaderMap) -> bool {
    let zero = |v: &str| v.trim().parse::<u64>() == Ok(0);
    let field = headers
        .get_all("ratelimit")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split([',', ';']))
        .filter_map(|param| param.split_once('='))
        .any(|(name, value)| matches!(name.trim(), "r" | "remaining") && zero(value));
    field
        || headers
            .get_all("ratelimit-remaining")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(zero)
}

/// gRPC `RESOURCE_EXHAUSTED`, or `UNAVAILABLE` with a pushback wait.
fn grpc_pushback(headers: &HeaderMap) -> bool {
    match headers.get("grpc-status").and_then(|v| v.to_str().ok()) {
        Some(GRPC_RESOURCE_EXHAUSTED) => true,
        Some(GRPC_UNAVAILABLE) => headers.contains_key("grpc-retry-pushback-ms"),
        _ => false,
    }
}

/// Tells an [`AttemptBudget`] when the dependency pushes back, so that the
/// budget can lower what it spends ([`AttemptBudget::record_pushback`]: a
/// `LeasedBudget` lowers the whole fleet's, feature `redis`).
///
/// An answer pushes back when it asks the fleet to send less, not merely to
/// retry this one attempt later:
///
/// - `429 Too Many Requests`;
/// - `503 Service Unavailable` with `Retry-After` (a 503 without it is an
///   outage or a failure, which the retry policy handles);
/// - a `RateLimit` field with nothing remaining (`r=0`, or `remaining=0`
///   in the older form), or `RateLimit-Remaining: 0`, on any status: the
///   dependency says the next attempt would be refused;
/// - gRPC `RESOURCE_EXHAUSTED`, or `UNAVAILABLE` with
///   `grpc-retry-pushback-ms`, in the headers (a trailers-only answer).
///
/// Put it **inside** the budget layer, right on the client, so that it sees
/// the answer to every attempt, retries included:
///
/// ```text
/// tower::retry (RetryAttempts) -> DependencyBudgetLayer -> PushbackLayer -> client
/// ```
///
/// It changes no answer and adds no wait: the retry policy still obeys the
/// dependency's `Retry-After`.
///
/// ```
/// use std::time::Duration;
/// use tower::ServiceBuilder;
/// use tower_admission::outbound::{DependencyBudget, DependencyBudgetLayer, PushbackLayer, RetryAttempts};
/// use tower_admission::quota::{MemoryStore, Policy};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let budget = DependencyBudget::builder(MemoryStore::new(), "reports-db")
///     .normal(Policy::token_bucket("normal", 20, 200, Duration::from_secs(1))?)
///     .retry(Policy::token_bucket("retry", 4, 40, Duration::from_secs(1))?)
///     .build()?;
/// let client = tower::service_fn(|_req: http::Request<String>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
/// });
/// let _client = ServiceBuilder::new()
///     .retry(RetryAttempts::new(3))
///     .layer(DependencyBudgetLayer::<_, String>::new(budget.clone()))
///     .layer(PushbackLayer::new(budget))
///     .service(client);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PushbackLayer<Bu> {
    budget: Bu,
}

impl<Bu> fmt::Debug for PushbackLayer<Bu> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PushbackLayer").finish_non_exhaustive()
    }
}

impl<Bu: AttemptBudget> PushbackLayer<Bu> {
    /// Reports the dependency's pushback to `budget`.
    pub fn new(budget: Bu) -> Self {
        PushbackLayer { budget }
    }
}

impl<S, Bu: Clone> Layer<S> for PushbackLayer<Bu> {
    type Service = Pushback<S, Bu>;

    fn layer(&self, inner: S) -> Self::Service {
        Pushback {
            inner,
            budget: self.budget.clone(),
        }
    }
}

/// The service of a [`PushbackLayer`].
#[derive(Clone)]
pub struct Pushback<S, Bu> {
    inner: S,
    budget: Bu,
}

impl<S: fmt::Debug, Bu> fmt::Debug for Pushback<S, Bu> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pushback")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, Bu> Pushback<S, Bu> {
    crate::macros::inner_accessors!(inner: S);
}

impl<S, Bu, B, R> Service<Request<B>> for Pushback<S, Bu>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Future: Send + 'static,
    Bu: AttemptBudget,
{
    type Response = Response<R>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, Bu>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        ResponseFuture {
            inner: Box::pin(self.inner.call(req)),
            budget: Some(self.budget.clone()),
        }
    }
}

/// The response future of [`Pushback`].
pub struct ResponseFuture<F, Bu> {
    inner: Pin<Box<F>>,
    budget: Option<Bu>,
}

impl<F, Bu> fmt::Debug for ResponseFuture<F, Bu> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

// The inner future is boxed and the budget never pinned.
impl<F, Bu> Unpin for ResponseFuture<F, Bu> {}

impl<F, Bu, R, E> Future for ResponseFuture<F, Bu>
where
    F: Future<Output = Result<Response<R>, E>>,
    Bu: AttemptBudget,
{
    type Output = Result<Response<R>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let out = std::task::ready!(this.inner.as_mut().poll(cx));
        if let Ok(response) = &out {
            if is_pushback(response) {
                if let Some(budget) = this.budget.take() {
                    budget.record_pushback();
                }
            }
        }
        Poll::Ready(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, headers: &[(&'static str, &str)]) -> Response<()> {
        let mut response = Response::new(());
        *response.status_mut() = StatusCode::from_u16(status).unwrap();
        for (name, value) in headers {
            response.headers_mut().append(*name, value.parse().unwrap());
        }
        response
    }

    /// A status, its headers, and whether the answer pushes back.
    type Case = (u16, &'static [(&'static str, &'static str)], bool);

    #[test]
    fn pushback_is_read_from_status_and_fields() {
        let cases: [Case; 14] = [
            (429, &[], true),
            (503, &[("retry-after", "1")], true),
            (503, &[], false),
            (500, &[("retry-after", "1")], false),
            (200, &[], false),
            (200, &[("ratelimit", r#""default";r=0;t=3"#)], true),
            (200, &[("ratelimit", r#""default";r=10;t=3"#)], false),
            (
                200,
                &[("ratelimit", "limit=100, remaining=0, reset=5")],
                true,
            ),
            (
                200,
                &[("ratelimit", "limit=100, remaining=7, reset=5")],
                false,
            ),
            (200, &[("ratelimit-remaining", "0")], true),
            (200, &[("ratelimit-remaining", "3")], false),
            (200, &[("grpc-status", "8")], true),
            (200, &[("grpc-status", "14")], false),
            (
                200,
                &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "100")],
                true,
            ),
        ];
        for (status, headers, expected) in cases {
            assert_eq!(
                is_pushback(&answer(status, headers)),
                expected,
                "{status} {headers:?}"
            );
        }
    }
}
