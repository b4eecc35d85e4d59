//! [`CappedBody`]: the request body the inner service reads.

use std::error::Error as StdError;
use std::fmt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::stack::Decoded;
use super::BoxError;

pin_project! {
    /// The request body that [`BodyLimits`] passes to its inner service.
    ///
    /// A request that could trip a cap gets its body through the caps and
    /// the decompressor: frames are decoded bytes, and an exceeded cap is a
    /// [`LengthLimitError`] (boxed). A request that could not gets its body
    /// as it came, already at its end; should such a body yield data anyway,
    /// that is an error, never bytes past the caps.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tower_admission::bounds::{BodyLimitsLayer, CappedBody};
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// // The inner service reads the body through caps of 16 bytes.
    /// let service = ServiceBuilder::new()
    ///     .layer(BodyLimitsLayer::new(16, 16))
    ///     .service_fn(|req: Request<CappedBody<Full<Bytes>>>| async move {
    ///         let read = req.into_body().collect().await.map(|b| b.to_bytes().len());
    ///         Ok::<_, std::convert::Infallible>(Response::new(format!("{read:?}")))
    ///     });
    /// let send = |body: &'static [u8]| {
    ///     let request = Request::new(Full::new(Bytes::from_static(body)));
    ///     service.clone().oneshot(request)
    /// };
    /// let read = send(b"hello").await.unwrap().into_body().collect().await.unwrap();
    /// assert_eq!(read.to_bytes(), "Ok(5)");
    /// let refused = send(&[b'a'; 32]).await.unwrap();
    /// assert_eq!(refused.status(), StatusCode::PAYLOAD_TOO_LARGE);
    /// # });
    /// ```
    pub struct CappedBody<B>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        #[pin]
        pub(super) kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    pub(super) enum Kind<B>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        Plain {
            #[pin]
            body: B,
        },
        // Boxed: the plain body, the common case, stays small to move.
        Decoded {
            body: Pin<Box<Decoded<B>>>,
        },
    }
}

impl<B> fmt::Debug for CappedBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Plain { .. } => "plain",
            Kind::Decoded { .. } => "decoded",
        };
        f.debug_struct("CappedBody")
            .field("kind", &kind)
            .finish_non_exhaustive()
    }
}

/// A body that reported its end and then yielded data.
#[derive(Debug)]
struct DataAfterEnd;

impl fmt::Display for DataAfterEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the request body yielded data after reporting its end")
    }
}

impl StdError for DataAfterEnd {}

impl<B> Body for CappedBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Plain { body } => match ready!(body.poll_frame(cx)) {
                Some(Ok(frame)) if frame.data_ref().is_some_and(|d| !d.is_empty()) => {
                    Poll::Ready(Some(Err(DataAfterEnd.into())))
                }
                Some(Ok(frame)) => Poll::Ready(Some(Ok(frame))),
                Some(Err(err)) => Poll::Ready(Some(Err(err.into()))),
                None => Poll::Ready(None),
            },
            KindProj::Decoded { body } => body.as_mut().poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Plain { body } => body.is_end_stream(),
            Kind::Decoded { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Plain { body } => body.size_hint(),
            Kind::Decoded { body } => body.size_hint(),
        }
    }
}
