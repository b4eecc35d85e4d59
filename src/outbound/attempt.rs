use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Request, Response, StatusCode};

use crate::concurrency::Overloaded;
use crate::outbound::BudgetError;

/// The attempt number of an outbound request, in its extensions: 1 for the
/// first attempt, 2 and up for retries. Set by [`RetryAttempts`]; the
/// [`DependencyBudgetLayer`](crate::outbound::DependencyBudgetLayer) reads it
/// to pick the share. A request without it is a first attempt.
///
/// A retry policy of your own, or a hedge (a second copy of a request sent
/// while the first is still out), marks its extra sends with
/// [`next`](Self::next) so that they draw on the retry share:
///
/// ```
/// use tower_admission::outbound::Attempt;
///
/// let mut hedge = http::Request::new(());
/// hedge.extensions_mut().insert(Attempt::FIRST.next());
/// assert!(hedge.extensions().get::<Attempt>().unwrap().is_retry());
/// ```
///
/// There is no attempt 0; the number stops at `u32::MAX` instead of
/// wrapping back to a first attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Attempt(u32);

impl Attempt {
    /// The first attempt.
    pub const FIRST: Attempt = Attempt(1);

    /// The attempt's number, from 1.
    pub fn number(self) -> u32 {
        self.0
    }

    /// True from the second attempt on.
    pub fn is_retry(self) -> bool {
        self.0 > 1
    }

    /// The attempt after this one (saturating at `u32::MAX`).
    pub fn next(self) -> Attempt {
        Attempt(self.0.saturating_add(1))
    }
}

/// A `tower::retry` policy that marks every attempt's number in the request
/// extensions ([`Attempt`]) and retries, with exponential backoff and full
/// jitter, up to a total of `max_attempts`:
///
/// - responses with status 429 or 5xx;
/// - gRPC responses that end in their headers (trailers-only) with
///   `grpc-status` `RESOURCE_EXHAUSTED` (8) or `UNAVAILABLE` (14);
/// - errors of the inner service ([`BudgetError::Inner`]).
///
/// **The dependency's wait is obeyed.** A failed response that asks for a
/// wait (`Retry-After` in seconds or as an HTTP date, or gRPC's
/// `grpc-retry-pushback-ms`) is retried no sooner than that: the delay is
/// the longer of the jittered backoff and the wait asked for. A wait longer
/// than [`max_server_wait`](Self::max_server_wait) (default 1 s), and a
/// gRPC pushback that is negative or not a number (gRPC's "do not retry"),
/// end the retries: the response goes back to the caller as it is. A
/// `Retry-After` that does not parse is ignored.
///
/// A refusal by the budget itself ([`BudgetError::is_refusal`]) is not retried:
/// it already waited as long as it was allowed to. Nor is a refusal by a
/// concurrency limit under the budget (an error whose chain of
/// [`source`](std::error::Error::source)s holds an
/// [`AdaptiveLimitLayer`](crate::concurrency::AdaptiveLimitLayer)'s
/// [`LimitError::Overloaded`](crate::concurrency::LimitError::Overloaded)):
/// nothing was sent, and a retry would only add to the overload it reports.
/// So the client's error type implements `std::error::Error`. Requests are
/// cloned for retries, so the body type must be `Clone` (`String`, `Bytes`,
/// `Full<Bytes>`).
///
/// Each attempt of one request has its own clone of the policy.
#[derive(Debug, Clone)]
pub struct RetryAttempts {
    max_attempts: u32,
    base: Duration,
    cap: Duration,
    max_server_wait: Duration,
}

impl RetryAttempts {
    /// The wait a dependency's answer asks for before the next attempt:
    /// `grpc-retry-pushback-ms`, else `Retry-After` in seconds or as an HTTP
    /// date. `None` when it asks for none, or for one that does not parse. The
    /// rule a retry policy of this type obeys; a handler can pass the wait on to its own
    /// caller.
    ///
    /// ```
    /// use std::time::Duration;
    /// use http::HeaderMap;
    /// use tower_admission::outbound::RetryAttempts;
    ///
    /// let mut headers = HeaderMap::new();
    /// headers.insert("retry-after", "30".parse().unwrap());
    /// assert_eq!(RetryAttempts::requested_wait(&headers), Some(Duration::from_secs(30)));
    /// headers.insert("grpc-retry-pushback-ms", "250".parse().unwrap());
    /// assert_eq!(RetryAttempts::requested_wait(&headers), Some(Duration::from_millis(250)));
    /// ```
    pub fn requested_wait(headers: &HeaderMap) -> Option<Duration> {
        match asked_wait(headers, SystemTime::now()) {
            Asked::Wait(wait) => Some(wait),
            Asked::Nothing | Asked::NoRetry => None,
        }
    }

    /// At most `max_attempts` attempts in all (at least 1), with backoff from
    /// 10 ms doubling up to 1 s.
    pub fn new(max_attempts: u32) -> Self {
        RetryAttempts {
            max_attempts: max_attempts.max(1),
            base: Duration::from_millis(10),
            cap: Duration::from_secs(1),
            max_server_wait: Duration::from_secs(1),
        }
    }

    /// The longest wait a failed response may ask for and still be retried
    /// (after that wait). Default 1 s; with `Duration::ZERO` only responses
    /// that ask for no wait at all are retried.
    pub fn max_server_wait(mut self, max: Duration) -> Self {
        self.max_server_wait = max;
        self
    }

    /// The backoff: before retry `n` (n = 1 for the second attempt) a random
    /// wait in `[0, min(cap, base * 2^(n-1))]`.
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.base = base;
        self.cap = cap.max(base);
        self
    }

    fn delay(&self, retry: u32) -> Duration {
        let exp = self
            .base
            .saturating_mul(1u32 << retry.saturating_sub(1).min(20));
        let top = exp.min(self.cap);
        let micros = u64::try_from(top.as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(rand::random_range(0..=micros))
    }
}

impl<B, R, E> tower::retry::Policy<Request<B>, Response<R>, BudgetError<E>> for RetryAttempts
where
    B: Clone,
    E: std::error::Error + 'static,
{
    type Future = Pin<Box<dyn Future<Output = ()> + Send>>;

    fn retry(
        &mut self,
        req: &mut Request<B>,
        result: &mut Result<Response<R>, BudgetError<E>>,
    ) -> Option<Self::Future> {
        let asked = match result {
            Ok(response) if is_failure(response) => {
                match asked_wait(response.headers(), SystemTime::now()) {
                    Asked::Nothing => Duration::ZERO,
                    Asked::Wait(wait) if wait <= self.max_server_wait => wait,
                    Asked::Wait(_) | Asked::NoRetry => return None,
                }
            }
            Ok(_) => return None,
            Err(BudgetError::Inner(e)) if !refused_by_a_limit(e) => Duration::ZERO,
            Err(_) => return None,
        };
        let attempt = req
            .extensions()
            .get::<Attempt>()
            .copied()
            .unwrap_or(Attempt::FIRST);
        if attempt.number() >= self.max_attempts {
            return None;
        }
        let next = attempt.next();
        req.extensions_mut().insert(next);
        let delay = self.delay(attempt.number()).max(asked);
        Some(Box::pin(tokio::time::sleep(delay)))
    }

    fn clone_request(&mut self, req: &Request<B>) -> Option<Request<B>> {
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.version_mut() = req.version();
        *clone.headers_mut() = req.headers().clone();
        *clone.extensions_mut() = req.extensions().clone();
        if req.extensions().get::<Attempt>().is_none() {
            clone.extensions_mut().insert(Attempt::FIRST);
        }
        Some(clone)
    }
}

/// True when `error`, or an error in its chain of sources, is a concurrency
/// limit's refusal: the attempt was never sent.
fn refused_by_a_limit(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<Overloaded>() {
            return true;
        }
        next = e.source();
    }
    false
}

/// gRPC status codes retried when a response ends in its headers.
const RESOURCE_EXHAUSTED: &[u8] = b"8";
const UNAVAILABLE: &[u8] = b"14";

/// A response worth retrying: 429, 5xx, or a trailers-only gRPC
/// `RESOURCE_EXHAUSTED` or `UNAVAILABLE`.
fn is_failure<R>(response: &Response<R>) -> bool {
    let status = response.status();
    if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
        return true;
    }
    matches!(
        response.headers().get("grpc-status").map(|v| v.as_bytes()),
        Some(RESOURCE_EXHAUSTED | UNAVAILABLE)
    )
}

/// What a failed response asks of the next attempt.
#[derive(Debug, PartialEq, Eq)]
enum Asked {
    /// No wait, or none that parses.
    Nothing,
    /// No sooner than this.
    Wait(Duration),
    /// Not at all: a gRPC pushback that is negative or not a number.
    NoRetry,
}

/// The wait in `grpc-retry-pushback-ms`, else in `Retry-After` (seconds or
/// an HTTP date, counted from `now`).
fn asked_wait(headers: &HeaderMap, now: SystemTime) -> Asked {
    if let Some(pushback) = headers.get("grpc-retry-pushback-ms") {
        return match pushback.to_str().ok().map(|v| v.trim().parse::<u64>()) {
            Some(Ok(ms)) => Asked::Wait(Duration::from_millis(ms)),
            _ => Asked::NoRetry,
        };
    }
    let Some(value) = headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
    else {
        return Asked::Nothing;
    };
    if let Ok(seconds) = value.parse::<u64>() {
        return Asked::Wait(Duration::from_secs(seconds));
    }
    match httpdate::parse_http_date(value) {
        Ok(at) => Asked::Wait(at.duration_since(now).unwrap_or_default()),
        Err(_) => Asked::Nothing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn asked_waits_are_read_from_either_header() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let asked = |pairs: &[(&'static str, &str)]| asked_wait(&headers(pairs), now);
        let secs = |s| Asked::Wait(Duration::from_secs(s));
        assert_eq!(asked(&[]), Asked::Nothing);
        assert_eq!(asked(&[("retry-after", "3")]), secs(3));
        assert_eq!(asked(&[("retry-after", " 0 ")]), secs(0));
        assert_eq!(asked(&[("retry-after", "soon")]), Asked::Nothing);
        assert_eq!(asked(&[("retry-after", "-1")]), Asked::Nothing);
        // A date is counted from now; one in the past asks for no wait.
        let in_30s = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(asked(&[("retry-after", &in_30s)]), secs(30));
        assert_eq!(
            asked(&[("retry-after", "Sun, 06 Nov 1994 08:49:37 GMT")]),
            secs(0)
        );
        // gRPC's pushback wins over Retry-After; a bad one forbids the retry.
        let both = [("grpc-retry-pushback-ms", "250"), ("retry-after", "9")];
        assert_eq!(asked(&both), Asked::Wait(Duration::from_millis(250)));
        for bad in ["-1", "abc", "1.5", ""] {
            assert_eq!(
                asked(&[("grpc-retry-pushback-ms", bad)]),
                Asked::NoRetry,
                "{bad:?}"
            );
        }
    }
}
