//! axum extractors for [`Identity`] and [`ClientIp`].

use std::convert::Infallible;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::StatusCode;

use super::{ClientIp, Identity};
use crate::reject::Rejection;

/// Reads the [`Identity`] inserted by
/// [`AuthenticateLayer`](super::AuthenticateLayer).
///
/// Without one (the route is not behind the layer) the answer is a 401, the
/// same response the layer gives, so a missing layer fails closed. Use
/// `Option<Identity>` on routes where authentication is optional.
impl<S: Send + Sync> FromRequestParts<S> for Identity {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Identity>().cloned().ok_or_else(|| {
            let rejection = Rejection::Unauthenticated {
                reason: "no authenticated identity",
            };
            rejection
                .into_response(&parts.headers)
                .map(axum::body::Body::new)
        })
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for Identity {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Identity>().cloned())
    }
}

/// Reads the [`ClientIp`] inserted by [`ClientIpLayer`](super::ClientIpLayer).
///
/// Without one (no layer, or no peer address because the server was not
/// started with `into_make_service_with_connect_info::<SocketAddr>()`) the
/// answer is `500 Internal Server Error`: a set-up error, not the caller's.
impl<S: Send + Sync> FromRequestParts<S> for ClientIp {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<ClientIp>().copied().ok_or_else(|| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "client address unavailable: ClientIpLayer or ConnectInfo is missing",
            )
                .into_response()
        })
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for ClientIp {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<ClientIp>().copied())
    }
}
