//! The response future of [`BodyLimits`](super::BodyLimits), which turns a tripped cap into
//! its refusal.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{ready, Context, Poll};

use http::header::{HeaderValue, ACCEPT_ENCODING};
use http::{Response, StatusCode};
use http_body_util::Either;
use pin_project_lite::pin_project;

use super::probe::{Trip, PASSED_DECODED, PASSED_WIRE};
use super::status::StatusBody;
use super::{limit, LimitedResponse};
use crate::bounds::grpc_web::WebEnd;
use crate::reject::{Protocol, Rejection};

/// What the response future of a request that can trip a cap needs.
#[derive(Debug)]
pub(super) struct Watch {
    pub(super) trip: Trip,
    pub(super) protocol: Protocol,
    /// The `content-encoding` as sent, for a 415 to name.
    pub(super) encoding: Option<HeaderValue>,
}

impl Watch {
    /// The response to a request that went through the caps: the inner one,
    /// or the refusal of the cap that tripped.
    fn answer<RB, SB>(&mut self, response: Response<SB>) -> LimitedResponse<RB, SB> {
        let trip = &self.trip;
        let passed = trip.probe.0.passed.load(Ordering::Acquire);
        let status = response.status();
        let rejection = match trip.rejection() {
            Some(rejection) => Some(rejection),
            // A layer answered before the probe below it ran: tower-http's
            // early `content-length` 413, or the decompressor's 415.
            None if passed & PASSED_WIRE == 0 && status == StatusCode::PAYLOAD_TOO_LARGE => {
                Some(Rejection::BodyTooLarge {
                    limit: limit(trip.wire_bytes),
                })
            }
            None if passed & PASSED_DECODED == 0 && status == StatusCode::PAYLOAD_TOO_LARGE => {
                Some(Rejection::DecodedTooLarge {
                    limit: limit(trip.decoded_bytes),
                })
            }
            None if passed & PASSED_DECODED == 0
                && status == StatusCode::UNSUPPORTED_MEDIA_TYPE =>
            {
                let encoding = self
                    .encoding
                    .take()
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                    .unwrap_or_default();
                let accept = response.headers().get(ACCEPT_ENCODING).cloned();
                let mut rejected =
                    Rejection::UnsupportedEncoding { encoding }.respond(self.protocol.clone());
                if let Some(accept) = accept {
                    rejected.headers_mut().insert(ACCEPT_ENCODING, accept);
                }
                return rejected;
            }
            None => None,
        };
        match rejection {
            Some(rejection) => rejection.respond(self.protocol.clone()),
            None => {
                let trip = self.protocol.is_grpc().then(|| self.trip.clone());
                // A gRPC-Web answer carries its trailers in the body, in the
                // encoding of the response (binary or base64).
                let answer = Protocol::of(response.headers());
                let web = (self.protocol.is_grpc_web() && answer.is_grpc_web())
                    .then(|| Box::new(WebEnd::new(answer.is_grpc_web_text())));
                response.map(|inner| {
                    Either::Left(Either::Right(StatusBody {
                        inner,
                        trip,
                        web,
                        ended: false,
                    }))
                })
            }
        }
    }
}

pin_project! {
    /// Response future of [`BodyLimits`].
    pub struct ResponseFuture<F, C> {
        #[pin]
        pub(super) state: State<F, C>,
    }
}

pin_project! {
    #[project = StateProj]
    pub(super) enum State<F, C> {
        // The request could not trip a cap: the inner future, its response
        // passed unchanged.
        Plain {
            #[pin]
            future: F,
        },
        // Boxed, so that the plain future stays small to move.
        Capped {
            capped: Pin<Box<Capped<C>>>,
        },
    }
}

pin_project! {
    pub(super) struct Capped<C> {
        #[pin]
        pub(super) future: C,
        pub(super) watch: Watch,
    }
}

impl<F, C> fmt::Debug for ResponseFuture<F, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let watch = match &self.state {
            State::Plain { .. } => None,
            State::Capped { capped } => Some(&capped.watch),
        };
        f.debug_struct("ResponseFuture")
            .field("watch", &watch)
            .finish_non_exhaustive()
    }
}

impl<F, C, RB, SB, E> Future for ResponseFuture<F, C>
where
    F: Future<Output = Result<Response<RB>, E>>,
    C: Future<Output = Result<Response<SB>, E>>,
{
    type Output = Result<LimitedResponse<RB, SB>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Plain { future } => {
                let response = ready!(future.poll(cx))?;
                Poll::Ready(Ok(response.map(|body| Either::Left(Either::Left(body)))))
            }
            StateProj::Capped { capped } => {
                let capped = capped.as_mut().project();
                let response = ready!(capped.future.poll(cx))?;
                Poll::Ready(Ok(capped.watch.answer(response)))
            }
        }
    }
}
