use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use super::adaptive::gate::GateBegin;
use super::adaptive::Criticality;
use super::body::PermitBody;
use super::future::{CallInner, ResponseFuture};
use super::layer::ConcurrencyLayer;
use super::reason::ConcurrencyStats;
use super::state::{Begin, Shared};
use crate::identity::Identity;
use crate::reject::{Protocol, RefusalBody};

/// Middleware that bounds requests in flight; built by
/// [`ConcurrencyLayer`].
///
/// Clones share the caps (see [`ConcurrencyLayer`]).
#[derive(Clone)]
pub struct Concurrency<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> Concurrency<S> {
    pub(crate) fn from_shared(inner: S, shared: Arc<Shared>) -> Self {
        Concurrency { inner, shared }
    }

    /// Wraps `inner` with the caps of `layer` (shared with it).
    pub fn new(inner: S, layer: &ConcurrencyLayer) -> Self {
        Concurrency::from_shared(inner, Arc::clone(&layer.shared))
    }

    crate::macros::inner_accessors!(inner: S);

    /// A snapshot of the shared counters.
    pub fn stats(&self) -> ConcurrencyStats {
        self.shared.stats()
    }
}

impl<S: fmt::Debug> fmt::Debug for Concurrency<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Concurrency")
            .field("inner", &self.inner)
            .field("stats", &self.shared.stats())
            .finish()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Concurrency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    ReqBody: Send + 'static,
    ResBody: RefusalBody,
{
    type Response = Response<PermitBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    /// Delegates to the inner service. Permits are not taken here: axum
    /// does not drive `poll_ready` for backpressure, so admission happens in
    /// `call`.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    #[inline]
    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        if self.shared.gate.is_some() {
            return self.call_gated(req);
        }
        let subject = req
            .extensions()
            .get::<Identity>()
            .map(Identity::subject_arc);
        match self.shared.begin(subject) {
            Begin::Ready(guard) => ResponseFuture::calling(self.inner.call(req), guard),
            Begin::Refused(refusal) => {
                ResponseFuture::refused(refusal, Protocol::of(req.headers()))
            }
            Begin::Wait(acquire) => {
                let protocol = Protocol::of(req.headers());
                let call = self.deferred(req);
                ResponseFuture::waiting(acquire, call, protocol)
            }
        }
    }
}

impl<S> Concurrency<S> {
    /// The call of a request that must wait: a clone, polled ready once it
    /// holds its permits. The service `poll_ready` made ready is replaced by
    /// a fresh clone and dropped, giving up whatever its readiness reserved
    /// (a `Buffer` slot, a `ConcurrencyLimit` permit): a request waiting in
    /// the queue holds nothing of the inner service.
    fn deferred<ReqBody, ResBody>(&mut self, req: Request<ReqBody>) -> CallInner<S::Future>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
        ReqBody: Send + 'static,
    {
        let mut inner = self.inner.clone();
        self.inner = self.inner.clone();
        let mut req = Some(req);
        Box::new(move |cx: &mut Context<'_>| match inner.poll_ready(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(Err(e))),
            Poll::Ready(Ok(())) => {
                let req = req.take().expect("called after completion");
                Poll::Ready(Ok(inner.call(req)))
            }
        })
    }

    /// Admission when the global cap is a gate: the identity step first,
    /// then the gate's, one after the other.
    fn call_gated<ReqBody, ResBody>(&mut self, req: Request<ReqBody>) -> ResponseFuture<S::Future>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
        ReqBody: Send + 'static,
    {
        let Some(global) = &self.shared.gate else {
            unreachable!("called without a gate");
        };
        let (parts, body) = req.into_parts();
        let class = global
            .class
            .as_ref()
            .map_or(Criticality::Default, |f| f(&parts));
        let tenant = global.tenant.as_ref().and_then(|f| f(&parts));
        let req = Request::from_parts(parts, body);
        let gate = Arc::clone(&global.gate);
        let protocol = Protocol::of(req.headers());
        let subject = req
            .extensions()
            .get::<Identity>()
            .map(Identity::subject_arc);
        let shared = Arc::clone(&self.shared);
        match self.shared.begin(subject) {
            Begin::Refused(refusal) => ResponseFuture::refused(refusal, protocol),
            Begin::Ready(mut guard) => match gate.begin(class, tenant.as_ref()) {
                GateBegin::Ready(ticket) => {
                    guard.ticket = Some(Box::new(ticket));
                    ResponseFuture::calling(self.inner.call(req), guard)
                }
                GateBegin::Refused(refusal) => {
                    drop(guard);
                    ResponseFuture::refused(shared.gate_refusal(refusal), protocol)
                }
                GateBegin::Wait(waiter) => {
                    let acquire = Box::pin(async move {
                        match waiter.wait().await {
                            Ok(ticket) => {
                                guard.ticket = Some(Box::new(ticket));
                                Ok(guard)
                            }
                            Err(refusal) => Err(shared.gate_refusal(refusal)),
                        }
                    });
                    let call = self.deferred(req);
                    ResponseFuture::waiting(acquire, call, protocol)
                }
            },
            Begin::Wait(identity) => {
                let acquire = Box::pin(async move {
                    let mut guard = identity.await?;
                    let ticket = match gate.begin(class, tenant.as_ref()) {
                        GateBegin::Ready(ticket) => Ok(ticket),
                        GateBegin::Refused(refusal) => Err(refusal),
                        GateBegin::Wait(waiter) => waiter.wait().await,
                    };
                    match ticket {
                        Ok(ticket) => {
                            guard.ticket = Some(Box::new(ticket));
                            Ok(guard)
                        }
                        Err(refusal) => Err(shared.gate_refusal(refusal)),
                    }
                });
                let call = self.deferred(req);
                ResponseFuture::waiting(acquire, call, protocol)
            }
        }
    }
}
