use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use super::body::PermitBody;
use super::future::ResponseFuture;
use super::layer::ConcurrencyLayer;
use super::state::{Begin, ConcurrencyStats, Shared};
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

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the middleware, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }

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
                // The waiter gets a clone, polled ready once it holds its
                // permits. The service `poll_ready` made ready is replaced by
                // a fresh clone and dropped, giving up whatever its readiness
                // reserved (a `Buffer` slot, a `ConcurrencyLimit` permit): a
                // request waiting in the queue holds nothing of the inner
                // service.
                let mut inner = self.inner.clone();
                self.inner = self.inner.clone();
                let mut req = Some(req);
                let call = move |cx: &mut Context<'_>| match inner.poll_ready(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(Err(e)) => Poll::Ready(Err(Err(e))),
                    Poll::Ready(Ok(())) => {
                        let req = req.take().expect("called after completion");
                        Poll::Ready(Ok(inner.call(req)))
                    }
                };
                ResponseFuture::waiting(acquire, Box::new(call), protocol)
            }
        }
    }
}
