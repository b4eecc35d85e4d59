//! Wire-byte and decoded-byte caps, composed from tower-http's
//! [`RequestBodyLimit`] around this crate's streaming decoder, which follows
//! the coding settings of a tower-http [`RequestDecompressionLayer`].

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use futures_util::TryFutureExt;
use http::header::{HeaderValue, ACCEPT_ENCODING, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Empty, Full, LengthLimitError};
use pin_project_lite::pin_project;
use tower::{Layer, Service};
use tower_http::body::Limited;
use tower_http::decompression::RequestDecompressionLayer;
use tower_http::limit::{RequestBodyLimit, ResponseBody, ResponseFuture as LimitFuture};

use super::decode::{Coding, Codings, DecodeBody};
use super::grpc_web::WebEnd;
use crate::reject::{InvalidParameter, Protocol, Rejection, SizeCap};

type BoxError = Box<dyn StdError + Send + Sync>;

/// A request body after the caps and the decompressor, outermost first:
/// decoded probe, decoded cap, decompressor, wire probe, wire cap.
type Decoded<B> = ProbedBody<Limited<DecodeBody<ProbedBody<Limited<B>>>>>;

/// The response body of the stack: the inner one under both caps, or the
/// decompressor's bodiless 415, which [`Watch`] replaces.
type StackBody<RB> = ResponseBody<Either<ResponseBody<RB>, Empty<Bytes>>>;

/// A response of [`BodyLimits`]: the inner one as it was when the request
/// could not trip a cap, the one through the caps (`SB`), or a refusal.
type LimitedResponse<RB, SB> = Response<Either<Either<RB, StatusBody<SB>>, Full<Bytes>>>;

/// Caps the bytes of a request body on the wire and after decompression.
///
/// Builds [`BodyLimits`]. A request that can trip a cap passes this stack,
/// outermost first:
///
/// 1. tower-http [`RequestBodyLimit`] with the wire cap (early 413 when
///    `content-length` is over it, a length error while streaming otherwise;
///    a body longer than its `content-length` is refused with 400 naming
///    `body`, since the cap was never reached);
/// 2. a probe that records a wire-cap trip;
/// 3. a streaming decoder (gzip, deflate, br, zstd, named in any case; 415
///    for any other `content-encoding`, `x-gzip` included, and for several
///    codings, on several lines or as a list, since it decodes one; a
///    `content-encoding` of empty list elements only names no coding);
/// 4. tower-http [`RequestBodyLimit`] with the decoded cap;
/// 5. a probe that records a decoded-cap trip.
///
/// A request that cannot trip one (no body, no `content-encoding`, and a
/// `content-length`, if any, within both caps) goes straight to the inner
/// service.
///
/// [`BodyLimits`] turns every over-cap outcome into
/// [`Rejection::PayloadTooLarge`] naming the cap, whatever the handler answered
/// when its body read failed. A gRPC call whose cap trips after the handler
/// answered (a streaming response has begun) keeps the response headers and
/// the messages sent so far, and ends with the refusal's status in its
/// trailers (see [`StatusBody`]).
///
/// # Where the coded data ends
///
/// The decoder reads the whole body, never only its first unit of coded
/// data:
///
/// * A gzip body may be several members one after the other (RFC 1952
///   §2.2; `cat a.gz b.gz` makes one), and a zstd body several frames
///   (RFC 8878 §3): the inner service gets all of them decoded, in order.
///   The decoded cap counts the output of every member together, so a bomb
///   split into members is cut off at the cap like a single one.
/// * A deflate or br body is one stream.
/// * Any bytes after the coded data that do not start another gzip member
///   or zstd frame (trailing garbage, zero padding, a second deflate
///   stream), coded data that ends before it is complete, and corrupt coded
///   data are a malformed body: the body read fails, and [`BodyLimits`]
///   answers 400 with [`Rejection::InvalidParameters`] naming `body`, whatever
///   the handler answered. Nothing is silently dropped. An empty body is
///   empty whatever its `content-encoding`.
///
/// Decoding streams: frames of at most 4 KiB of decoded bytes, the codec's
/// state and one frame of the sent body are all it holds, whatever the body
/// inflates to. A handler that reads the body as a stream may therefore get
/// the frames decoded before a malformed part (the last partial one is
/// dropped with it), then the error; one that buffers the whole body first
/// (axum's `Bytes`, `Json`) never runs.
#[derive(Debug, Clone)]
pub struct BodyLimitsLayer {
    wire_bytes: usize,
    decoded_bytes: usize,
    codings: Codings,
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
            codings: Codings::default(),
        }
    }

    /// Takes the coding settings of this tower-http decompression layer, for
    /// example one with some encodings turned off
    /// (`RequestDecompressionLayer::new().no_br()`). An encoding that is
    /// turned off is answered with 415. A layer set to
    /// `pass_through_unaccepted(true)` passes such requests on undecoded
    /// instead, several codings with their `content-encoding` in one line.
    ///
    /// Only the settings are taken: the decoding itself is this crate's,
    /// with the behaviour [above](Self#where-the-coded-data-ends).
    pub fn decompression(mut self, layer: RequestDecompressionLayer) -> Self {
        self.codings = Codings::learn(&layer);
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
        BodyLimits {
            inner,
            caps: self.clone(),
        }
    }
}

/// Service built by [`BodyLimitsLayer`].
///
/// The inner service receives a [`CappedBody`]. Clones share nothing but
/// configuration: each request that can trip a cap carries its own probe.
///
/// With the `axum` feature it also disables axum's `DefaultBodyLimit` (2 MB)
/// for the requests it passes on with a body: the decoded cap replaces it. A
/// `DefaultBodyLimit` layer placed inside this one still applies.
#[derive(Clone)]
pub struct BodyLimits<S> {
    inner: S,
    caps: BodyLimitsLayer,
}

impl<S: fmt::Debug> fmt::Debug for BodyLimits<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BodyLimits")
            .field("inner", &self.inner)
            .field("wire_bytes", &self.caps.wire_bytes)
            .field("decoded_bytes", &self.caps.decoded_bytes)
            .finish()
    }
}

impl<S> BodyLimits<S> {
    crate::macros::inner_accessors!(inner: S);
}

impl<S, B, RB> Service<Request<B>> for BodyLimits<S>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    S: Service<Request<CappedBody<B>>, Response = Response<RB>>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = LimitedResponse<RB, StackBody<RB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, StackFuture<S::Future, RB, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let caps = &self.caps;
        if !may_trip(&req, caps.wire_bytes.min(caps.decoded_bytes)) {
            let req = req.map(|body| CappedBody {
                kind: Kind::Plain { body },
            });
            return ResponseFuture {
                state: State::Plain {
                    future: self.inner.call(req),
                },
            };
        }
        let probe = Probe::default();
        req.extensions_mut().insert(probe.clone());
        let watch = Watch {
            trip: Trip {
                probe,
                declared_length: declared_length(req.headers()),
                wire_bytes: caps.wire_bytes,
                decoded_bytes: caps.decoded_bytes,
            },
            protocol: Protocol::of(req.headers()),
            encoding: combine_content_encoding(req.headers_mut()),
        };
        // The stack is built around the inner service for this call: its
        // layers hold no state of their own, and the inner service was made
        // ready by `poll_ready`.
        let decoded = RequestBodyLimit::new(
            DecodedProbe {
                inner: &mut self.inner,
            },
            caps.decoded_bytes,
        );
        let wire = Decompress {
            inner: decoded,
            codings: &caps.codings,
        };
        let mut stack = RequestBodyLimit::new(wire, caps.wire_bytes);
        // axum's `DefaultBodyLimit::disable()` layered over the stack for this
        // call: it inserts one `Copy` marker, whose type is private to axum.
        #[cfg(feature = "axum")]
        let future = axum::extract::DefaultBodyLimit::disable()
            .layer(&mut stack)
            .call(req);
        #[cfg(not(feature = "axum"))]
        let future = stack.call(req);
        ResponseFuture {
            state: State::Capped {
                capped: Box::pin(Capped { future, watch }),
            },
        }
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
        // One that tower-http cannot parse stays watched.
        Some(_) => declared_length(headers).is_none_or(|len| len > caps),
    }
}

/// The `content-length` as tower-http's [`RequestBodyLimit`] reads it: the
/// first line, parsed as a whole number. Within the wire cap it, not the
/// cap, is the limit tower-http reads the body to.
fn declared_length(headers: &HeaderMap) -> Option<usize> {
    headers
        .get(CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse::<usize>()
        .ok()
}

/// Puts the `content-encoding` lines of `headers` into the one line that
/// [`Decompress`] reads (it matches exact lowercase names, as tower-http's
/// decompressor does): the lines combined with `, ` (RFC 9110 §5.3), or,
/// when they name exactly one coding, its name in lowercase (names are
/// case-insensitive, RFC 9110 §8.4.1). A list of several codings matches no
/// name, so the decompressor refuses it instead of decoding only the first.
/// Lines that name no coding at all (empty, or only commas) are removed:
/// the body is as sent.
///
/// Returns the lines as sent, combined, for a 415 to name.
fn combine_content_encoding(headers: &mut HeaderMap) -> Option<HeaderValue> {
    let mut lines = headers.get_all(CONTENT_ENCODING).iter();
    let first = lines.next()?;
    let sent = match lines.next() {
        None => first.clone(),
        Some(_) => {
            let combined: Vec<&[u8]> = headers
                .get_all(CONTENT_ENCODING)
                .iter()
                .map(HeaderValue::as_bytes)
                .collect();
            // Cannot fail, as lines and `, ` are valid value bytes; were it
            // to, `,` names no coding and is refused all the same.
            HeaderValue::from_bytes(&combined.join(&b", "[..]))
                .unwrap_or(HeaderValue::from_static(","))
        }
    };
    // Empty list elements do not count (RFC 9110 §5.6.1).
    let mut codings = sent
        .as_bytes()
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|coding| !coding.is_empty());
    let lone_coding = match (codings.next(), codings.next()) {
        (None, _) => {
            headers.remove(CONTENT_ENCODING);
            return Some(sent);
        }
        (Some(one), None) => HeaderValue::from_bytes(&one.to_ascii_lowercase()).ok(),
        _ => None,
    };
    headers.insert(
        CONTENT_ENCODING,
        lone_coding.unwrap_or_else(|| sent.clone()),
    );
    Some(sent)
}

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
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B>
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

/// The response future of the stack.
type StackFuture<F, RB, E> = LimitFuture<DecompressFuture<LimitFuture<F>, ResponseBody<RB>, E>>;

/// The decoded cap's probe, innermost in the stack: it marks the decoded
/// stage and hands the body to the inner service as a [`CappedBody`].
struct DecodedProbe<'a, S> {
    inner: &'a mut S,
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
/// which [`Watch`] turns into the refusal. The same choices as tower-http's
/// decompressor with the same settings.
struct Decompress<'a, S> {
    inner: S,
    codings: &'a Codings,
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
type DecompressResponse<RB> = Response<Either<RB, Empty<Bytes>>>;

/// Response future of [`Decompress`], from public parts only, as it is part
/// of [`BodyLimits`]' future type: the inner future, its response mapped, or
/// the ready 415.
type DecompressFuture<F, RB, E> = futures_util::future::Either<
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

/// What the response future of a request that can trip a cap needs.
#[derive(Debug)]
struct Watch {
    trip: Trip,
    protocol: Protocol,
    /// The `content-encoding` as sent, for a 415 to name.
    encoding: Option<HeaderValue>,
}

/// A request's probe and caps: which refusal a trip of its body stands for.
#[derive(Debug, Clone)]
struct Trip {
    probe: Probe,
    /// The `content-length` the wire stage reads the body to, if sent.
    declared_length: Option<usize>,
    wire_bytes: usize,
    decoded_bytes: usize,
}

impl Trip {
    /// Whether a cap tripped or the coded body was found malformed.
    fn tripped(&self) -> bool {
        self.probe.0.tripped.load(Ordering::Acquire) != 0
    }

    /// The refusal for what the request body tripped, if anything.
    fn rejection(&self) -> Option<Rejection> {
        let state = &self.probe.0;
        match state.tripped.load(Ordering::Acquire) {
            TRIPPED_WIRE => Some(match self.declared_length {
                // The length the body broke is the one it declared.
                Some(declared) if declared <= self.wire_bytes => {
                    Rejection::InvalidParameters(vec![InvalidParameter::new(
                        "body",
                        format!("the body is longer than its content-length of {declared} bytes"),
                    )])
                }
                _ => too_large(SizeCap::WireBytes, self.wire_bytes),
            }),
            TRIPPED_DECODED => Some(too_large(SizeCap::DecodedBytes, self.decoded_bytes)),
            TRIPPED_MALFORMED => {
                let reason = state
                    .malformed
                    .get()
                    .cloned()
                    .unwrap_or_else(|| "the coded data is malformed".to_owned());
                Some(Rejection::InvalidParameters(vec![InvalidParameter::new(
                    "body", reason,
                )]))
            }
            _ => None,
        }
    }
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
                Some(too_large(SizeCap::WireBytes, trip.wire_bytes))
            }
            None if passed & PASSED_DECODED == 0 && status == StatusCode::PAYLOAD_TOO_LARGE => {
                Some(too_large(SizeCap::DecodedBytes, trip.decoded_bytes))
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
                let mut rejected = Rejection::UnsupportedEncoding { encoding }
                    .into_layer_response(self.protocol.clone());
                if let Some(accept) = accept {
                    rejected.headers_mut().insert(ACCEPT_ENCODING, accept);
                }
                return rejected;
            }
            None => None,
        };
        match rejection {
            Some(rejection) => rejection.into_layer_response(self.protocol.clone()),
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
        inner: B,
        // Until the trailers are sent, for a gRPC call only.
        trip: Option<Trip>,
        // How a gRPC-Web body ends.
        web: Option<Box<WebEnd>>,
        // gRPC-Web: the inner body ended and the end of this one was sent.
        ended: bool,
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
    let (refusal, _) = rejection.into_response(true).into_parts();
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

pin_project! {
    /// Response future of [`BodyLimits`].
    pub struct ResponseFuture<F, C> {
        #[pin]
        state: State<F, C>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, C> {
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
    struct Capped<C> {
        #[pin]
        future: C,
        watch: Watch,
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
const TRIPPED_MALFORMED: u8 = 3;

#[derive(Debug, Default)]
struct ProbeState {
    /// Bit set of the probes the request reached.
    passed: AtomicU8,
    /// The first cap whose length error was seen, or a malformed coded
    /// body, whichever came first; or 0.
    tripped: AtomicU8,
    /// Why the coded body is malformed, once `tripped` says it is.
    malformed: OnceLock<String>,
}

/// Per-request record shared by [`BodyLimits`], its probes and their bodies,
/// carried in the request extensions.
#[derive(Debug, Clone, Default)]
pub(super) struct Probe(Arc<ProbeState>);

impl Probe {
    /// Records that the decoder found the coded body malformed, unless a cap
    /// tripped first.
    pub(super) fn trip_malformed(&self, reason: &str) {
        let first = self
            .0
            .tripped
            .compare_exchange(0, TRIPPED_MALFORMED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if first {
            let _ = self.0.malformed.set(reason.to_owned());
        }
    }
}

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

pin_project! {
    /// A request body inside [`BodyLimits`] that records when the cap
    /// directly around it is exceeded. Frames and errors pass through
    /// unchanged.
    struct ProbedBody<B> {
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
