//! [`ValidateQuery`]: the check before the inner service.

use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use crate::reject::{Protocol, RefusalBody, Rejection};

use super::future::{Kind, ResponseFuture};
use super::rules::QueryRules;

/// Service built by [`ValidateQueryLayer`](super::ValidateQueryLayer): refuses a bad query with 400
/// ([`Rejection::InvalidParameters`]) and otherwise inserts the
/// [`ValidatedQuery`](super::ValidatedQuery) into the request extensions.
///
/// Clones share the rules.
#[derive(Debug, Clone)]
pub struct ValidateQuery<S> {
    pub(super) inner: S,
    pub(super) rules: std::sync::Arc<crate::reload::Live<QueryRules>>,
}

impl<S> ValidateQuery<S> {
    crate::macros::inner_accessors!(inner: S);
}

impl<S, B, RB> Service<Request<B>> for ValidateQuery<S>
where
    S: Service<Request<B>, Response = Response<RB>>,
    RB: RefusalBody,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, RB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        match self.rules.load().validate(req.uri().query()) {
            Ok(validated) => {
                req.extensions_mut().insert(validated);
                ResponseFuture {
                    kind: Kind::Inner {
                        future: self.inner.call(req),
                    },
                }
            }
            Err(errors) => ResponseFuture {
                kind: Kind::Rejected {
                    response: Some(
                        Rejection::InvalidParameters(errors).respond(Protocol::of(req.headers())),
                    ),
                },
            },
        }
    }
}
