use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};

use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use tower::Service;

use crate::quota::layer::{Config, Planned, Resolved};
use crate::quota::settle::Charge;
use crate::quota::{headers, Settlement, Store, Verdict};
use crate::reject::{Protocol, RefusalBody, Rejection};

/// A charge to give back when the request is refused further in.
type Refund = Option<Arc<Charge>>;

/// The service built by [`QuotaLayer`](crate::quota::QuotaLayer).
pub struct QuotaService<S, St> {
    inner: S,
    config: Arc<Config<St>>,
}

impl<S, St> QuotaService<S, St> {
    pub(crate) fn new(inner: S, config: Arc<Config<St>>) -> Self {
        QuotaService { inner, config }
    }

    crate::macros::inner_accessors!(inner: S);
}

impl<S: Clone, St> Clone for QuotaService<S, St> {
    fn clone(&self) -> Self {
        QuotaService {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: std::fmt::Debug, St> std::fmt::Debug for QuotaService<S, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

type Boxed<B, E> = Pin<Box<dyn Future<Output = Result<Response<B>, E>> + Send>>;

pin_project! {
    /// Response future of [`QuotaService`].
    ///
    /// A store whose decision is ready at once (the memory store) costs no
    /// allocation: the decision is made in `call` and the inner future is
    /// polled in place. A store that awaits (Redis) runs in one boxed future.
    pub struct ResponseFuture<F, B, E> {
        // The inner service's future, when the decision was made in `call`:
        // outside any enum, so that it is written once, in place.
        #[pin]
        inner: Option<F>,
        rest: Rest<B, E>,
    }
}

enum Rest<B, E> {
    /// Admitted in `call`: the RateLimit values to add to the inner
    /// response, when configured, and the charge to give back if it is a
    /// refusal.
    Admitted {
        headers: Option<[HeaderValue; 2]>,
        refund: Refund,
    },
    Refused {
        response: Option<Response<B>>,
    },
    Waiting {
        future: Boxed<B, E>,
    },
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Some(future) = this.inner.as_pin_mut() {
            let mut response = ready!(future.poll(cx))?;
            if let Rest::Admitted { headers, refund } = this.rest {
                if refund.is_some() {
                    refund_if_refused(&response, refund.take());
                }
                if headers.is_some() {
                    headers::append(response.headers_mut(), headers.take());
                }
            }
            return Poll::Ready(Ok(response));
        }
        match this.rest {
            Rest::Refused { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
            Rest::Waiting { future } => future.as_mut().poll(cx),
            Rest::Admitted { .. } => unreachable!("an admission has an inner future"),
        }
    }
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for QuotaService<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    St: Store,
    ReqBody: Send + 'static,
    ResBody: RefusalBody + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        // The request is split only for a key or cost function, which reads
        // its head: moving a request costs a copy of it.
        // The quotas in force now decide this request whole, also when a
        // reload replaces them meanwhile.
        let quotas = self.config.quotas.load();
        let resolved = if self.config.reads_parts() {
            let (parts, body) = req.into_parts();
            let resolved = self
                .config
                .resolve(&quotas, &parts.extensions, Some(&parts));
            req = Request::from_parts(parts, body);
            resolved
        } else {
            self.config.resolve(&quotas, req.extensions(), None)
        };
        let (planned, key, cost) = match resolved {
            Resolved::Apply { planned, key, cost } => (planned, key, cost),
            Resolved::Skip => {
                return ResponseFuture {
                    inner: Some(self.inner.call(req)),
                    rest: Rest::Admitted {
                        headers: None,
                        refund: None,
                    },
                }
            }
            Resolved::NoIdentity => {
                let rejection = Rejection::Unauthenticated {
                    reason: "no authenticated identity",
                };
                return refused(rejection.respond(Protocol::of(req.headers())));
            }
        };
        let limiter = &self.config.limiter;
        let quota = &planned.quota;
        let mut decide = limiter.store().decide(quota, &key, cost);
        // A decision that is ready at once is applied here, in place. A
        // pending one is polled again, with the caller's waker, below.
        let mut noop = Context::from_waker(Waker::noop());
        if let Poll::Ready(result) = Pin::new(&mut decide).poll(&mut noop) {
            let mut verdict = limiter.resolve(quota, &key, cost, result);
            let (headers, refund) =
                match admit(&self.config, planned, key, cost, &mut verdict, &mut req) {
                    Admission::Admitted(headers, refund) => (headers, refund),
                    Admission::Refused(response) => return refused(response),
                };
            drop(verdict);
            // Built in place: the inner future is written once, not moved.
            return ResponseFuture {
                inner: Some(self.inner.call(req)),
                rest: Rest::Admitted { headers, refund },
            };
        }
        // Sent: dropped from here on before the store answers, it is counted
        // as abandoned.
        let pending = limiter.pending(quota).into_owned();
        let planned = planned.clone();
        let ready = self.inner.clone();
        let mut service = std::mem::replace(&mut self.inner, ready);
        let config = self.config.clone();
        ResponseFuture {
            inner: None,
            rest: Rest::Waiting {
                future: Box::pin(async move {
                    let result = decide.await;
                    pending.answered();
                    let mut verdict = config.limiter.resolve(&planned.quota, &key, cost, result);
                    match admit(&config, &planned, key, cost, &mut verdict, &mut req) {
                        Admission::Admitted(headers, refund) => {
                            let mut response = service.call(req).await?;
                            refund_if_refused(&response, refund);
                            headers::append(response.headers_mut(), headers);
                            Ok(response)
                        }
                        Admission::Refused(response) => Ok(response),
                    }
                }),
            },
        }
    }
}

/// Gives `refund` back when `response` is a refusal made before any work
/// (see [`refund_inner_refusals`](crate::quota::QuotaLayerBuilder::refund_inner_refusals)).
/// A store that answers at once settles here; one that awaits settles in a
/// task of its own, so the refusal is not held up.
fn refund_if_refused<B>(response: &Response<B>, refund: Refund) {
    let Some(charge) = refund else { return };
    let before_work = matches!(
        response.extensions().get::<Rejection>(),
        Some(
            Rejection::QuotaExceeded { .. }
                | Rejection::CostExceedsCapacity { .. }
                | Rejection::Overloaded { .. }
                | Rejection::CallerBusy { .. }
                | Rejection::LimiterUnavailable { .. }
        )
    );
    if !before_work {
        return;
    }
    let mut settle = Box::pin(async move {
        if let Err(error) = charge.settle_to(0).await {
            tracing::warn!(%error, "could not refund a charge refused further in");
        }
    });
    let mut noop = Context::from_waker(Waker::noop());
    if settle.as_mut().poll(&mut noop).is_pending() {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(settle)),
            Err(_) => tracing::warn!("no Tokio runtime to refund a charge refused further in"),
        }
    }
}

#[inline(always)]
fn refused<F, B, E>(response: Response<B>) -> ResponseFuture<F, B, E> {
    ResponseFuture {
        inner: None,
        rest: Rest::Refused {
            response: Some(response),
        },
    }
}

/// Applies a verdict: on admission records the settlement and returns the
/// headers for the response (if configured); on refusal, the response.
fn admit<St: Store, ReqB, B: RefusalBody>(
    config: &Config<St>,
    planned: &Planned,
    key: Cow<'static, Arc<str>>,
    cost: u64,
    verdict: &mut Verdict,
    req: &mut Request<ReqB>,
) -> Admission<B> {
    let quota = &planned.quota;
    if verdict.is_admitted() {
        let headers = if config.headers_on_success {
            headers::values(quota, verdict, planned.policy_field.as_ref())
        } else {
            None
        };
        let mut refund = None;
        if config.cost.is_some() || config.refund_inner_refusals {
            let recorded = std::mem::take(&mut verdict.recorded);
            let charge = Charge::new(
                &config.limiter,
                quota,
                key.into_owned(),
                cost,
                recorded,
                verdict.decisions(),
            );
            if config.cost.is_some() {
                let extensions = req.extensions_mut();
                let mut settlement = extensions.remove::<Settlement>().unwrap_or_default();
                settlement.push(charge.clone());
                extensions.insert(settlement);
            }
            refund = config.refund_inner_refusals.then_some(charge);
        }
        return Admission::Admitted(headers, refund);
    }
    let Some(rejection) = verdict.rejection() else {
        unreachable!("only an admission maps to no rejection");
    };
    tracing::debug!(quota = quota.name(), key = &**key, cost, %rejection, "quota refused");
    let mut response = rejection.respond(Protocol::of(req.headers()));
    let values = headers::values(quota, verdict, planned.policy_field.as_ref());
    headers::append(response.headers_mut(), values);
    Admission::Refused(response)
}

/// What [`admit`] decided.
enum Admission<B> {
    /// Go on, adding these `RateLimit-Policy` and `RateLimit` values to the
    /// response, and giving this charge back if the request is refused
    /// further in.
    Admitted(Option<[HeaderValue; 2]>, Refund),
    /// Answer with this refusal.
    Refused(Response<B>),
}
