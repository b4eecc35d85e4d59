//! The tower-http stack [`BodyLimits`](super::BodyLimits) builds around the inner service for
//! a request that can trip a cap: caps, probes and the decoder.

use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::TryFutureExt;
use http::header::{ACCEPT_ENCODING, CONTENT_ENCODING, CONTENT_LENGTH};
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{Either, Empty};
use tower::Service;
use tower_http::body::Limited;
use tower_http::limit::{ResponseBody, ResponseFuture as LimitFuture};

use super::capped::{CappedBody, Kind};
use super::probe::{Probe, ProbedBody, Stage};
use super::BoxError;
use crate::bounds::decode::{Coding, Codings, DecodeBody};

/// A request body after the caps and the decompressor, outermost first:
/// decoded probe, decoded cap, decompressor, wire probe, wire cap.
pub(super) type Decoded<B> = ProbedBody<Limited<DecodeBody<ProbedBody<Limited<B>>>>>;

/// The response body of the stack: the inner one under both caps, or the
/// decompressor's bodiless 415, which [`Watch`](super::future::Watch) replaces.
pub(super) type StackBody<RB> = ResponseBody<Either<ResponseBody<RB>, Empty<Bytes>>>;

/// The response future of the stack.
pub(super) type StackFuture<F, RB, E> =
    LimitFuture<DecompressFuture<LimitFuture<F>, ResponseBody<RB>, E>>;

/// The decoded cap's probe, innermost in the stack: it marks the decoded
/// stage and hands the body to the inner service as a [`CappedBody`].
pub(super) struct DecodedProbe<'a, S> {
    pub(super) inner: &'a mut S,
}

impl<S, B> Service<Request<Limited<DecodeBody<ProbedBody<Limited<B>>>>>> for DecodedProbe<'_, S>
where
    B: Body,
    B::Error: Into<BoxError>,
    S: Service<Request<CappedBody<B>>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Limited<DecodeBody<ProbedBody<Limited<B>>>>>) -> S::Future {
        let req = probed(req, Stage::Decoded);
        self.inner.call(req.map(|body| CappedBody {
            kind: Kind::Decoded {
                body: Box::pin(body),
            },
        }))
    }
}

/// Between the wire cap and the decoded cap: marks that the request got past
/// the wire cap, then decodes its body per its (combined) `content-encoding`,
/// passes it on as it is, or answers a bodiless 415 with `Accept-Encoding`,
/// which [`Watch`](super::future::Watch) turns into the refusal. The same choices as tower-http's
/// decompressor with the same settings.
pub(super) struct Decompress<'a, S> {
    pub(super) inner: S,
    pub(super) codings: &'a Codings,
}

impl<S, B, RB> Service<Request<B>> for Decompress<'_, S>
where
    S: Service<Request<DecodeBody<ProbedBody<B>>>, Response = Response<RB>>,
{
    type Response = DecompressResponse<RB>;
    type Error = S::Error;
    type Future = DecompressFuture<S::Future, RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let mut req = probed(req, Stage::Wire);
        let coding = match req.headers().get(CONTENT_ENCODING) {
            None => None,
            Some(value) => match Coding::from_header(value.as_bytes()) {
                Some(coding) if self.codings.accepts(coding) => Some(coding),
                _ if value == "identity" || self.codings.pass_through() => None,
                _ => {
                    let mut refused = Response::new(Either::Right(Empty::new()));
                    *refused.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
                    refused
                        .headers_mut()
                        .insert(ACCEPT_ENCODING, self.codings.accept_encoding().clone());
                    return futures_util::future::Either::Right(std::future::ready(Ok(refused)));
                }
            },
        };
        let req = match coding {
            Some(coding) => {
                let headers = req.headers_mut();
                headers.remove(CONTENT_ENCODING);
                headers.remove(CONTENT_LENGTH);
                let probe = req.extensions().get::<Probe>().cloned();
                req.map(|body| DecodeBody::decoding(body, coding, probe))
            }
            None => req.map(DecodeBody::identity),
        };
        let map: fn(Response<RB>) -> DecompressResponse<RB> = decompressed;
        futures_util::future::Either::Left(self.inner.call(req).map_ok(map))
    }
}

/// The response of [`Decompress`].
pub(super) type DecompressResponse<RB> = Response<Either<RB, Empty<Bytes>>>;

/// Response future of [`Decompress`], from public parts only, as it is part
/// of [`BodyLimits`](super::BodyLimits)' future type: the inner future, its response mapped, or
/// the ready 415.
pub(super) type DecompressFuture<F, RB, E> = futures_util::future::Either<
    futures_util::future::MapOk<F, fn(Response<RB>) -> DecompressResponse<RB>>,
    std::future::Ready<Result<DecompressResponse<RB>, E>>,
>;

fn decompressed<RB>(response: Response<RB>) -> DecompressResponse<RB> {
    response.map(Either::Left)
}

/// Marks that `req` got past the cap of `stage` and wraps its body in a
/// [`ProbedBody`] for that stage.
fn probed<B>(req: Request<B>, stage: Stage) -> Request<ProbedBody<B>> {
    let probe = req.extensions().get::<Probe>().cloned();
    if let Some(probe) = &probe {
        probe
            .0
            .passed
            .fetch_or(stage.passed_bit(), Ordering::AcqRel);
    }
    req.map(|inner| ProbedBody {
        inner,
        probe,
        stage,
    })
}
