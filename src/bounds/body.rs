//! Wire-byte and decoded-byte caps, composed from tower-http's
//! [`RequestBodyLimit`] and [`RequestDecompression`].

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::{HeaderValue, ACCEPT_ENCODING, CONTENT_ENCODING, CONTENT_LENGTH};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Full, LengthLimitError};
use pin_project_lite::pin_project;
use tower::{Layer, Service};
use tower_http::decompression::{RequestDecompression, RequestDecompressionLayer};
use tower_http::limit::{RequestBodyLimit, RequestBodyLimitLayer};

use crate::reject::{is_grpc, Rejection, SizeCap};

type BoxError = Box<dyn StdError + Send + Sync>;

/// The composed stack inside [`BodyLimits`], outermost first.
type Stack<S> = RequestBodyLimit<LimitProbe<RequestDecompression<RequestBodyLimit<LimitProbe<S>>>>>;

/// Caps the bytes of a request body on the wire and after decompression.
///
/// Builds [`BodyLimits`]. The stack, outermost first:
///
/// 1. tower-http [`RequestBodyLimit`] with the wire cap (early 413 when
///    `content-length` is over it, a length error while streaming otherwise);
/// 2. a probe that records a wire-cap trip;
/// 3. tower-http [`RequestDecompression`] (gzip, deflate, br, zstd; 415 for
///    any other `content-encoding`);
/// 4. tower-http [`RequestBodyLimit`] with the decoded cap;
/// 5. a probe that records a decoded-cap trip.
///
/// [`BodyLimits`] turns every over-cap outcome into
/// [`Rejection::PayloadTooLarge`] naming the cap, whatever the handler answered
/// when its body read failed.
#[derive(Debug, Clone)]
pub struct BodyLimitsLayer {
    wire_bytes: usize,
    decoded_bytes: usize,
    decompression: RequestDecompressionLayer,
}

impl BodyLimitsLayer {
    /// Caps the body at `wire_bytes` as sent and `decoded_bytes` after
    /// decompression. A cap of 0 admits only empty bodies.
    ///
    /// For an uncompressed body both caps apply to the same bytes, so the
    /// smaller one wins.
    pub fn new(wire_bytes: usize, decoded_bytes: usize) -> Self {
        BodyLimitsLayer {
            wire_bytes,
            decoded_bytes,
            decompression: RequestDecompressionLayer::new(),
        }
    }

    /// Uses this tower-http decompression layer, for example one with some
    /// encodings turned off (`RequestDecompressionLayer::new().no_br()`).
    /// An encoding that is turned off is answered with 415.
    pub fn decompression(mut self, layer: RequestDecompressionLayer) -> Self {
        self.decompression = layer;
        self
    }

    /// The wire cap in bytes.
    pub fn wire_bytes(&self) -> usize {
        self.wire_bytes
    }

    /// The decoded cap in bytes.
    pub fn decoded_bytes(&self) -> usize {
        self.decoded_bytes
    }
}

impl<S> Layer<S> for BodyLimitsLayer {
    type Service = BodyLimits<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let decoded = LimitProbe {
            inner,
            stage: Stage::Decoded,
        };
        let decoded = RequestBodyLimitLayer::new(self.decoded_bytes).layer(decoded);
        let decompress = self.decompression.clone().layer(decoded);
        let wire = LimitProbe {
            inner: decompress,
            stage: Stage::Wire,
        };
        BodyLimits {
            inner: RequestBodyLimitLayer::new(self.wire_bytes).layer(wire),
            wire_bytes: self.wire_bytes,
            decoded_bytes: self.decoded_bytes,
        }
    }
}

/// Service built by [`BodyLimitsLayer`].
///
/// Clones share nothing but configuration: each request that can trip a cap
/// carries its own probe.
///
/// With the `axum` feature it also disables axum's `DefaultBodyLimit` (2 MB)
/// for the requests it passes on with a body: the decoded cap replaces it. A
/// `DefaultBodyLimit` layer placed inside this one still applies.
#[derive(Clone)]
pub struct BodyLimits<S> {
    inner: Stack<S>,
    wire_bytes: usize,
    decoded_bytes: usize,
}

impl<S: fmt::Debug> fmt::Debug for BodyLimits<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BodyLimits")
            .field("inner", self.get_ref())
            .field("wire_bytes", &self.wire_bytes)
            .field("decoded_bytes", &self.decoded_bytes)
            .finish()
    }
}

impl<S> BodyLimits<S> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner.get_ref().inner.get_ref().get_ref().inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner.get_mut().inner.get_mut().get_mut().inner
    }

    /// Consumes this service, returning the wrapped one.
    pub fn into_inner(self) -> S {
        self.inner
            .into_inner()
            .inner
            .into_inner()
            .into_inner()
            .inner
    }
}

impl<S, B, RB> Service<Request<B>> for BodyLimits<S>
where
    B: Body,
    Stack<S>: Service<Request<B>, Response = Response<RB>>,
{
    type Response = Response<Either<RB, Full<Bytes>>>;
    type Error = <Stack<S> as Service<Request<B>>>::Error;
    type Future = ResponseFuture<<Stack<S> as Service<Request<B>>>::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let watch = may_trip(&req, self.wire_bytes.min(self.decoded_bytes)).then(|| {
            let probe = Probe::default();
            req.extensions_mut().insert(probe.clone());
            Watch {
                probe,
                grpc: is_grpc(req.headers()),
                encoding: req.headers().get(CONTENT_ENCODING).cloned(),
                wire_bytes: self.wire_bytes,
                decoded_bytes: self.decoded_bytes,
            }
        });
        // axum's `DefaultBodyLimit::disable()` layered over the stack for this
        // call: it inserts one `Copy` marker, whose type is private to axum.
        // An empty body (all `may_trip` lets through) cannot trip axum's
        // limit, so it goes without.
        #[cfg(feature = "axum")]
        let inner = if watch.is_some() {
            axum::extract::DefaultBodyLimit::disable()
                .layer(&mut self.inner)
                .call(req)
        } else {
            self.inner.call(req)
        };
        #[cfg(not(feature = "axum"))]
        let inner = self.inner.call(req);
        ResponseFuture { inner, watch }
    }
}

/// Whether a cap or the decompressor can refuse `req`, `caps` being the
/// smaller cap. Not when the body is already at its end, no
/// `content-encoding` asks for decoding, and the `content-length` that
/// tower-http checks before reading is absent or within both caps.
fn may_trip<B: Body>(req: &Request<B>, caps: usize) -> bool {
    let body = req.body();
    if !body.is_end_stream() && body.size_hint().upper() != Some(0) {
        return true;
    }
    let headers = req.headers();
    if headers.contains_key(CONTENT_ENCODING) {
        return true;
    }
    match headers.get(CONTENT_LENGTH) {
        None => false,
        // Parsed as tower-http parses it; one it cannot parse stays watched.
        Some(len) => len
            .to_str()
            .ok()
            .and_then(|len| len.parse::<usize>().ok())
            .is_none_or(|len| len > caps),
    }
}

/// What the response future of a request that can trip a cap needs.
#[derive(Debug)]
struct Watch {
    probe: Probe,
    grpc: bool,
    encoding: Option<HeaderValue>,
    wire_bytes: usize,
    decoded_bytes: usize,
}

pin_project! {
    /// Response future of [`BodyLimits`].
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        // `None` when the request cannot trip a cap: the response passes
        // unchanged.
        watch: Option<Watch>,
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("watch", &self.watch)
            .finish_non_exhaustive()
    }
}

impl<F, RB, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<RB>, E>>,
{
    type Output = Result<Response<Either<RB, Full<Bytes>>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = ready!(this.inner.poll(cx))?;
        let Some(watch) = this.watch else {
            return Poll::Ready(Ok(response.map(Either::Left)));
        };
        let state = &watch.probe.0;
        let passed = state.passed.load(Ordering::Acquire);
        let status = response.status();
        let rejection = match state.tripped.load(Ordering::Acquire) {
            TRIPPED_WIRE => Some(too_large(SizeCap::WireBytes, watch.wire_bytes)),
            TRIPPED_DECODED => Some(too_large(SizeCap::DecodedBytes, watch.decoded_bytes)),
            // tower-http answered before the probe below it ran: its early
            // `content-length` 413, or the decompressor's 415.
            _ if passed & PASSED_WIRE == 0 && status == StatusCode::PAYLOAD_TOO_LARGE => {
                Some(too_large(SizeCap::WireBytes, watch.wire_bytes))
            }
            _ if passed & PASSED_DECODED == 0 && status == StatusCode::PAYLOAD_TOO_LARGE => {
                Some(too_large(SizeCap::DecodedBytes, watch.decoded_bytes))
            }
            _ if passed & PASSED_DECODED == 0 && status == StatusCode::UNSUPPORTED_MEDIA_TYPE => {
                let encoding = watch
                    .encoding
                    .take()
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                    .unwrap_or_default();
                let accept = response.headers().get(ACCEPT_ENCODING).cloned();
                let mut rejected =
                    Rejection::UnsupportedEncoding { encoding }.into_layer_response(watch.grpc);
                if let Some(accept) = accept {
                    rejected.headers_mut().insert(ACCEPT_ENCODING, accept);
                }
                return Poll::Ready(Ok(rejected));
            }
            _ => None,
        };
        Poll::Ready(Ok(match rejection {
            Some(rejection) => rejection.into_layer_response(watch.grpc),
            None => response.map(Either::Left),
        }))
    }
}

fn too_large(cap: SizeCap, limit: usize) -> Rejection {
    Rejection::PayloadTooLarge {
        cap,
        limit: u64::try_from(limit).unwrap_or(u64::MAX),
    }
}

const PASSED_WIRE: u8 = 1;
const PASSED_DECODED: u8 = 2;
const TRIPPED_WIRE: u8 = 1;
const TRIPPED_DECODED: u8 = 2;

#[derive(Debug, Default)]
struct ProbeState {
    /// Bit set of the probes the request reached.
    passed: AtomicU8,
    /// The first cap whose length error was seen, or 0.
    tripped: AtomicU8,
}

/// Per-request record shared by [`BodyLimits`], its probes and their bodies,
/// carried in the request extensions.
#[derive(Debug, Clone, Default)]
struct Probe(Arc<ProbeState>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Wire,
    Decoded,
}

impl Stage {
    fn passed_bit(self) -> u8 {
        match self {
            Stage::Wire => PASSED_WIRE,
            Stage::Decoded => PASSED_DECODED,
        }
    }

    fn trip_code(self) -> u8 {
        match self {
            Stage::Wire => TRIPPED_WIRE,
            Stage::Decoded => TRIPPED_DECODED,
        }
    }
}

/// One probe inside [`BodyLimits`]: marks that the request got past the cap
/// above it and wraps the body in a [`ProbedBody`].
///
/// Only [`BodyLimitsLayer`] builds it; it appears in the request body type a
/// handler receives.
#[derive(Clone)]
pub struct LimitProbe<S> {
    inner: S,
    stage: Stage,
}

impl<S: fmt::Debug> fmt::Debug for LimitProbe<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitProbe")
            .field("inner", &self.inner)
            .field("stage", &self.stage)
            .finish()
    }
}

impl<S> LimitProbe<S> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the probe, returning the wrapped service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B> Service<Request<B>> for LimitProbe<S>
where
    S: Service<Request<ProbedBody<B>>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let probe = req.extensions().get::<Probe>().cloned();
        if let Some(probe) = &probe {
            probe
                .0
                .passed
                .fetch_or(self.stage.passed_bit(), Ordering::AcqRel);
        }
        let stage = self.stage;
        self.inner.call(req.map(|inner| ProbedBody {
            inner,
            probe,
            stage,
        }))
    }
}

pin_project! {
    /// A request body inside [`BodyLimits`] that records when the cap
    /// directly around it is exceeded. Frames and errors pass through
    /// unchanged.
    pub struct ProbedBody<B> {
        #[pin]
        inner: B,
        probe: Option<Probe>,
        stage: Stage,
    }
}

impl<B: fmt::Debug> fmt::Debug for ProbedBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProbedBody")
            .field("inner", &self.inner)
            .field("stage", &self.stage)
            .finish()
    }
}

/// True when `err` or one of its sources is a [`LengthLimitError`].
fn is_length_limit(err: &(dyn StdError + 'static)) -> bool {
    let mut current = Some(err);
    while let Some(e) = current {
        if e.is::<LengthLimitError>() {
            return true;
        }
        current = e.source();
    }
    false
}

impl<B> Body for ProbedBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        match ready!(this.inner.poll_frame(cx)) {
            Some(Ok(frame)) => Poll::Ready(Some(Ok(frame))),
            Some(Err(err)) => {
                let err: BoxError = err.into();
                if let Some(probe) = this.probe {
                    if is_length_limit(&*err) {
                        // The first cap to trip wins: an error from the wire
                        // cap passes this probe before the decoded one.
                        let _ = probe.0.tripped.compare_exchange(
                            0,
                            this.stage.trip_code(),
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        );
                    }
                }
                Poll::Ready(Some(Err(err)))
            }
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
