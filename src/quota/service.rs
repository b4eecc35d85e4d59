use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body_util::Either;
use tower::Service;

use crate::quota::layer::{Config, Resolved};
use crate::quota::{headers, Settlement, Store};
use crate::reject::{is_grpc, Rejection, ResponseBody};

/// The service built by [`QuotaLayer`](crate::quota::QuotaLayer).
pub struct QuotaService<S, St> {
    inner: S,
    config: Arc<Config<St>>,
}

impl<S, St> QuotaService<S, St> {
    pub(crate) fn new(inner: S, config: Arc<Config<St>>) -> Self {
        QuotaService { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes this service, returning the inner one.
    pub fn into_inner(self) -> S {
        self.inner
    }
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

/// Response future of [`QuotaService`].
pub type ResponseFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for QuotaService<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    St: Store,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        let grpc = is_grpc(&parts.headers);
        let (quota, key, cost) = match self.config.resolve(&parts) {
            Resolved::Apply { quota, key, cost } => (quota.clone(), key, cost),
            Resolved::Skip => {
                let future = self.inner.call(Request::from_parts(parts, body));
                return Box::pin(async move { Ok(future.await?.map(Either::Left)) });
            }
            Resolved::NoIdentity => {
                let rejection = Rejection::Unauthenticated {
                    reason: "no authenticated identity",
                };
                return Box::pin(std::future::ready(Ok(rejection.into_layer_response(grpc))));
            }
        };
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        let config = self.config.clone();
        Box::pin(async move {
            let verdict = config.limiter.check(&quota, &key, cost).await;
            let Some(rejection) = verdict.rejection else {
                if config.cost.is_some() {
                    let mut settlement =
                        parts.extensions.remove::<Settlement>().unwrap_or_default();
                    settlement.push(config.limiter.clone(), quota.clone(), key, cost);
                    parts.extensions.insert(settlement);
                }
                let mut response = inner.call(Request::from_parts(parts, body)).await?;
                if config.headers_on_success {
                    headers::insert(response.headers_mut(), &quota, &verdict.decisions);
                }
                return Ok(response.map(Either::Left));
            };
            tracing::debug!(quota = quota.name(), key = &*key, cost, %rejection, "quota refused");
            let mut response = rejection.into_layer_response(grpc);
            headers::insert(response.headers_mut(), &quota, &verdict.decisions);
            Ok(response)
        })
    }
}
