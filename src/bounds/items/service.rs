//! [`BatchItems`]: the count before the inner service.

use std::error::Error as StdError;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::Service;

use super::future::{ResponseFuture, State};
use crate::reject::RefusalBody;

/// Service built by [`BatchItemsLayer`](crate::bounds::BatchItemsLayer). Clones share nothing but the cap.
#[derive(Debug, Clone)]
pub struct BatchItems<S> {
    pub(super) inner: S,
    /// The cap in force, shared with the layer and its reload handle.
    pub(super) max: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl<S> BatchItems<S> {
    crate::macros::inner_accessors!(inner: S);
}

impl<S, B, RB> Service<Request<B>> for BatchItems<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>> + Clone,
    B: Body,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
    RB: RefusalBody,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The body is read before the inner service is called: take the
        // service that was polled ready, leave a clone.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (parts, body) = req.into_parts();
        ResponseFuture {
            state: State::Reading {
                collect: body.collect(),
                parts: Some(parts),
                inner: Some(inner),
                max: self.max.load(std::sync::atomic::Ordering::Relaxed),
            },
        }
    }
}
