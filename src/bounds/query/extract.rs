//! The [`ValidatedQuery`] extractor.

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::StatusCode;

use super::ValidatedQuery;

/// Rejection of the [`ValidatedQuery`] extractor: the route has no
/// [`ValidateQueryLayer`](super::ValidateQueryLayer). A server bug, so 500.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingValidatedQuery;

impl IntoResponse for MissingValidatedQuery {
    fn into_response(self) -> Response {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "ValidatedQuery extractor used on a route without ValidateQueryLayer",
        )
            .into_response()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for ValidatedQuery {
    type Rejection = MissingValidatedQuery;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<ValidatedQuery>()
            .cloned()
            .ok_or(MissingValidatedQuery)
    }
}
