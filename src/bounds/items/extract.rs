//! The [`Batch`] extractor.

use std::ops::Deref;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::parse::parse_batch;
use crate::reject::Rejection;

/// Axum extractor of a JSON batch `{"items": [...]}` of at most `MAX`
/// items, read as [`BatchItemsLayer::parse`](super::BatchItemsLayer::parse) reads them.
///
/// The cap is a const generic so that it sits in the handler signature,
/// checked at compile time to be at least 1:
///
/// ```
/// use tower_admission::bounds::Batch;
///
/// #[derive(serde::Deserialize)]
/// struct Report { id: u64 }
///
/// async fn ingest(batch: Batch<Report, 1000>) -> String {
///     // `batch.len()` is what a quota can charge.
///     format!("{}", batch.len())
/// }
/// let _app: axum::Router = axum::Router::new().route("/reports", axum::routing::post(ingest));
/// ```
///
/// Over the cap: 413 with cap `items`, before the handler runs. Bad JSON:
/// 400 naming `body` or `items[i]`. The body itself is read with axum's
/// `Bytes` extractor, so the byte caps of [`BodyLimitsLayer`](super::super::BodyLimitsLayer)
/// apply first. The content type is not checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch<T, const MAX: usize>(pub Vec<T>);

impl<T, const MAX: usize> Batch<T, MAX> {
    /// The cap.
    pub const MAX: usize = MAX;

    /// The items.
    pub fn into_inner(self) -> Vec<T> {
        self.0
    }
}

impl<T, const MAX: usize> Deref for Batch<T, MAX> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.0
    }
}

/// Rejection of [`Batch`].
#[derive(Debug)]
#[non_exhaustive]
pub enum BatchRejection {
    /// Too many items (413, cap `items`) or malformed JSON (400).
    Batch(Rejection),
    /// The body could not be read (for example a byte cap tripped).
    Body(BytesRejection),
}

impl IntoResponse for BatchRejection {
    fn into_response(self) -> Response {
        match self {
            BatchRejection::Batch(err) => err.respond(false),
            BatchRejection::Body(err) => err.into_response(),
        }
    }
}

impl<S, T, const MAX: usize> FromRequest<S> for Batch<T, MAX>
where
    S: Send + Sync,
    T: for<'de> Deserialize<'de>,
{
    type Rejection = BatchRejection;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        const { assert!(MAX > 0, "Batch<T, MAX> needs MAX >= 1") };
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(BatchRejection::Body)?;
        parse_batch(&bytes, MAX)
            .map(Batch)
            .map_err(BatchRejection::Batch)
    }
}
