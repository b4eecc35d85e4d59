use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use http::{Request, Response};

use crate::outbound::BudgetError;

/// The attempt number of an outbound request, in its extensions: 1 for the
/// first attempt, 2 and up for retries. Set by [`RetryAttempts`]; the
/// [`DependencyBudgetLayer`](crate::outbound::DependencyBudgetLayer) reads it
/// to pick the share.
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

    fn next(self) -> Attempt {
        Attempt(self.0.saturating_add(1))
    }
}

/// A `tower::retry` policy that marks every attempt's number in the request
/// extensions ([`Attempt`]) and retries, with exponential backoff and full
/// jitter, up to a total of `max_attempts`:
///
/// - responses with status 429 or 5xx;
/// - errors of the inner service ([`BudgetError::Inner`]).
///
/// A refusal by the budget itself ([`BudgetError::Refused`]) is not retried:
/// it already waited as long as it was allowed to. Requests are cloned for
/// retries, so the body type must be `Clone` (`String`, `Bytes`,
/// `Full<Bytes>`).
///
/// Each attempt of one request has its own clone of the policy.
#[derive(Debug, Clone)]
pub struct RetryAttempts {
    max_attempts: u32,
    base: Duration,
    cap: Duration,
}

impl RetryAttempts {
    /// At most `max_attempts` attempts in all (at least 1), with backoff from
    /// 10 ms doubling up to 1 s.
    pub fn new(max_attempts: u32) -> Self {
        RetryAttempts {
            max_attempts: max_attempts.max(1),
            base: Duration::from_millis(10),
            cap: Duration::from_secs(1),
        }
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

impl<B: Clone, R, E> tower::retry::Policy<Request<B>, Response<R>, BudgetError<E>>
    for RetryAttempts
{
    type Future = Pin<Box<dyn Future<Output = ()> + Send>>;

    fn retry(
        &mut self,
        req: &mut Request<B>,
        result: &mut Result<Response<R>, BudgetError<E>>,
    ) -> Option<Self::Future> {
        let failed = match result {
            Ok(response) => {
                let status = response.status();
                status == http::StatusCode::TOO_MANY_REQUESTS || status.is_server_error()
            }
            Err(BudgetError::Inner(_)) => true,
            Err(_) => false,
        };
        let attempt = req
            .extensions()
            .get::<Attempt>()
            .copied()
            .unwrap_or(Attempt::FIRST);
        if !failed || attempt.number() >= self.max_attempts {
            return None;
        }
        let next = attempt.next();
        req.extensions_mut().insert(next);
        let delay = self.delay(attempt.number());
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
