//! The response body a refusal is written into.

use bytes::Bytes;
use http_body_util::{Either, Full};

/// A response body that can also carry a refusal, so that every layer of this
/// crate answers with the inner service's own body type: a stack of layers
/// adds no wrapper around the body, and axum has no body to box again.
///
/// Implemented for axum's and tonic's bodies (with the `axum` and `tonic`
/// features), [`Full<Bytes>`], `String`, the boxed bodies of `http_body_util`, and
/// [`Either<B, Full<Bytes>>`] for any `B`. An inner service with another body
/// type maps its responses into that `Either` first:
///
/// ```
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::{Either, Empty, Full};
/// use std::convert::Infallible;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let quota = Quota::new("api", [Policy::fixed_window("per-second", 1, std::time::Duration::from_secs(1))?])?;
/// let handler = tower::service_fn(|_: Request<()>| async {
///     Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
/// });
/// let service = ServiceBuilder::new()
///     .layer(QuotaLayer::builder(MemoryStore::new()).quota(quota).aggregate().build()?)
///     .map_response(|r: Response<Empty<Bytes>>| r.map(Either::<_, Full<Bytes>>::Left))
///     .service(handler);
/// let admitted = service.clone().oneshot(Request::new(())).await?;
/// assert_eq!(admitted.status(), 200);
/// let refused = service.oneshot(Request::new(())).await?;
/// assert_eq!(refused.status(), 429);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
pub trait RefusalBody {
    /// The body of a refusal: a problem details document, or nothing for gRPC.
    fn from_refusal(body: Bytes) -> Self;
}

impl RefusalBody for Full<Bytes> {
    fn from_refusal(body: Bytes) -> Self {
        Full::new(body)
    }
}

impl<B> RefusalBody for Either<B, Full<Bytes>> {
    fn from_refusal(body: Bytes) -> Self {
        Either::Right(Full::new(body))
    }
}

/// The body is UTF-8: JSON, or empty.
impl RefusalBody for String {
    fn from_refusal(body: Bytes) -> Self {
        String::from_utf8_lossy(&body).into_owned()
    }
}

impl<E: 'static> RefusalBody for http_body_util::combinators::BoxBody<Bytes, E> {
    fn from_refusal(body: Bytes) -> Self {
        use http_body_util::BodyExt;
        Full::new(body).map_err(|never| match never {}).boxed()
    }
}

impl<E: 'static> RefusalBody for http_body_util::combinators::UnsyncBoxBody<Bytes, E> {
    fn from_refusal(body: Bytes) -> Self {
        use http_body_util::BodyExt;
        Full::new(body)
            .map_err(|never| match never {})
            .boxed_unsync()
    }
}

#[cfg(feature = "axum")]
impl RefusalBody for axum::body::Body {
    fn from_refusal(body: Bytes) -> Self {
        axum::body::Body::from(body)
    }
}

#[cfg(feature = "tonic")]
impl RefusalBody for tonic::body::Body {
    fn from_refusal(body: Bytes) -> Self {
        tonic::body::Body::new(Full::new(body))
    }
}
