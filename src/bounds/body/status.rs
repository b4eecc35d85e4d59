//! [`StatusBody`]: a gRPC status that a cap tripped after the answer.

use std::fmt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::probe::Trip;
use crate::bounds::grpc_web::WebEnd;
use crate::reject::Rejection;

pin_project! {
    /// The response body of a request that [`BodyLimits`] passed through
    /// its caps. For a gRPC call, a cap that trips after the handler
    /// answered (a streaming response has begun), or a coded body found
    /// malformed then, replaces the call's status with the refusal it gets
    /// before an answer: its `grpc-status`, `grpc-message`, details and
    /// `grpc-retry-pushback-ms`, and keeps the handler's other trailers.
    /// Plain gRPC carries them in the HTTP trailers. gRPC-Web (a gRPC-Web
    /// request answered in gRPC-Web) carries them in the body's trailer
    /// frame (flag byte `0x80`, 4-byte big-endian length, `name:value\r\n`
    /// lines; base64 for `-text`), which replaces the handler's; the frames
    /// before it pass on as they come (for `-text`, in whole base64 groups).
    /// Otherwise the inner body, unchanged.
    pub struct StatusBody<B> {
        #[pin]
        pub(super) inner: B,
        // Until the trailers are sent, for a gRPC call only.
        pub(super) trip: Option<Trip>,
        // How a gRPC-Web body ends.
        pub(super) web: Option<Box<WebEnd>>,
        // gRPC-Web: the inner body ended and the end of this one was sent.
        pub(super) ended: bool,
    }
}

impl<B: fmt::Debug> fmt::Debug for StatusBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatusBody")
            .field("inner", &self.inner)
            .field("grpc", &self.trip.is_some())
            .field("grpc_web", &self.web.is_some())
            .finish()
    }
}

impl<B: Body<Data = Bytes>> Body for StatusBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        if let Some(web) = this.web {
            return poll_web(this.inner, this.trip, web, this.ended, cx);
        }
        if this.trip.is_none() {
            return this.inner.poll_frame(cx);
        }
        let (trailers, ended) = match ready!(this.inner.poll_frame(cx)) {
            Some(Ok(frame)) => match frame.into_trailers() {
                Ok(trailers) => (trailers, false),
                Err(frame) => return Poll::Ready(Some(Ok(frame))),
            },
            Some(Err(err)) => return Poll::Ready(Some(Err(err))),
            // A stream that ends without trailers gets them if it tripped.
            None => (HeaderMap::new(), true),
        };
        match this.trip.take().and_then(|trip| trip.rejection()) {
            Some(rejection) => Poll::Ready(Some(Ok(Frame::trailers(refused_trailers(
                trailers, rejection,
            ))))),
            None if ended => Poll::Ready(None),
            None => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        let web_done = self.web.as_ref().is_none_or(|web| web.is_empty());
        (self.ended || (self.inner.is_end_stream() && web_done))
            && self.trip.as_ref().is_none_or(|trip| !trip.tripped())
    }

    fn size_hint(&self) -> SizeHint {
        if self.web.is_some() {
            // The trailer frame may be replaced by one of another length.
            return SizeHint::default();
        }
        self.inner.size_hint()
    }
}

/// [`StatusBody::poll_frame`] for gRPC-Web: data passes through `web` until
/// the inner body ends, then the held trailer frame is sent as it was, or
/// replaced by the refusal's.
fn poll_web<B: Body<Data = Bytes>>(
    mut inner: Pin<&mut B>,
    trip: &mut Option<Trip>,
    web: &mut WebEnd,
    ended: &mut bool,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
    loop {
        if let Some(trailers) = web.deferred.take() {
            *ended = true;
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        if *ended {
            return Poll::Ready(None);
        }
        let http_trailers = match ready!(inner.as_mut().poll_frame(cx)) {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    let data = web.data(data);
                    if data.is_empty() {
                        continue;
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) => Some(trailers),
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
            },
            Some(Err(err)) => return Poll::Ready(Some(Err(err))),
            None => None,
        };
        let refuse = trip
            .take()
            .and_then(|trip| trip.rejection())
            .map(|rejection| move |trailers| refused_trailers(trailers, rejection));
        let (data, http_trailers) = web.finish(http_trailers, refuse);
        // HTTP trailers the inner body sent, and no refusal replaced: after
        // the held data.
        *ended = http_trailers.is_none();
        web.deferred = http_trailers;
        if !data.is_empty() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
    }
}

/// `trailers` with their gRPC status replaced by the one of `rejection`, as
/// [`Rejection::into_response`] writes it, in that order.
fn refused_trailers(mut trailers: HeaderMap, rejection: Rejection) -> HeaderMap {
    let (refusal, _) = rejection
        .respond::<http_body_util::Full<Bytes>>(true)
        .into_parts();
    for name in ["grpc-status", "grpc-message", "grpc-status-details-bin"] {
        trailers.remove(name);
    }
    for (name, value) in &refusal.headers {
        if name != CONTENT_TYPE {
            trailers.insert(name, value.clone());
        }
    }
    trailers
}
