//! The request-body decoder of [`BodyLimits`](super::BodyLimits): streaming,
//! bounded in memory, and exact about where the coded data ends.
//!
//! A gzip body may be several members one after the other (RFC 1952 §2.2,
//! what `cat a.gz b.gz` makes) and a zstd body several frames (RFC 8878 §3);
//! each is decoded in turn. A deflate or br body is one stream. Bytes after
//! the coded data that do not start another member or frame are refused as a
//! malformed body, never dropped: the decoder works on the body's own frames
//! and always knows how many input bytes a codec consumed.

use std::error::Error as StdError;
use std::fmt;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use compression_codecs::core::util::{PartialBuffer, WriteBuffer};
use compression_codecs::{BrotliDecoder, DecodeV2, GzipDecoder, ZlibDecoder, ZstdDecoder};
use http::header::CONTENT_ENCODING;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Empty;
use pin_project_lite::pin_project;
use tower::{Layer, Service};
use tower_http::decompression::{DecompressionBody, RequestDecompressionLayer};

use super::body::Probe;

type BoxError = Box<dyn StdError + Send + Sync>;

/// Decoded bytes per frame at most. A frame is yielded when it is full, when
/// the coded body has nothing more ready, or at the end.
const CHUNK: usize = 4096;

/// A content coding the decoder knows, as `content-encoding` names it in
/// lowercase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Coding {
    Zstd,
    Gzip,
    Deflate,
    Br,
}

impl Coding {
    /// In the order `Accept-Encoding` lists them.
    const ALL: [Coding; 4] = [Coding::Zstd, Coding::Gzip, Coding::Deflate, Coding::Br];

    fn name(self) -> &'static str {
        match self {
            Coding::Zstd => "zstd",
            Coding::Gzip => "gzip",
            Coding::Deflate => "deflate",
            Coding::Br => "br",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// The coding that a one-line, lowercase `content-encoding` names.
    pub(super) fn from_header(value: &[u8]) -> Option<Coding> {
        Coding::ALL
            .into_iter()
            .find(|coding| coding.name().as_bytes() == value)
    }

    fn codec(self) -> Codec {
        match self {
            Coding::Zstd => Codec::Zstd(ZstdDecoder::new()),
            Coding::Gzip => Codec::Gzip(GzipDecoder::new()),
            // HTTP's `deflate` is the zlib format (RFC 9110 §8.4.1.2).
            Coding::Deflate => Codec::Zlib(ZlibDecoder::new()),
            Coding::Br => Codec::Br(BrotliDecoder::new()),
        }
    }

    /// What one unit of coded data is called when the coding allows several
    /// in a row, or `None` when the coded data is one stream.
    fn unit(self) -> Option<&'static str> {
        match self {
            Coding::Gzip => Some("member"),
            Coding::Zstd => Some("frame"),
            Coding::Deflate | Coding::Br => None,
        }
    }

    /// Whether `bytes`, the start of what follows a complete unit (possibly
    /// only its first byte so far), can start another one: the gzip magic
    /// `1f 8b`, or a zstd frame (`28 b5 2f fd`) or skippable frame
    /// (`5? 2a 4d 18`). The codec checks the rest of the header.
    fn may_start_unit(self, bytes: &[u8]) -> bool {
        let starts = |magic: &[u8]| bytes.iter().zip(magic).all(|(b, m)| b == m);
        match self {
            Coding::Gzip => starts(&[0x1f, 0x8b]),
            Coding::Zstd => {
                starts(&[0x28, 0xb5, 0x2f, 0xfd])
                    || (bytes.first().is_some_and(|b| b & 0xf0 == 0x50)
                        && bytes
                            .iter()
                            .skip(1)
                            .zip([0x2a, 0x4d, 0x18])
                            .all(|(b, m)| *b == m))
            }
            Coding::Deflate | Coding::Br => false,
        }
    }
}

/// Which codings a [`RequestDecompressionLayer`] decodes, and what it does
/// with the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Codings {
    accepted: [bool; 4],
    pass_through: bool,
    accept_encoding: HeaderValue,
}

/// What `RequestDecompressionLayer::new()` does, without asking it (a test
/// checks that they agree): every coding decoded, any other one refused.
impl Default for Codings {
    fn default() -> Self {
        Codings {
            accepted: [true; 4],
            pass_through: false,
            accept_encoding: HeaderValue::from_static("zstd,gzip,deflate,br"),
        }
    }
}

impl Codings {
    /// Learns the settings of `layer`, whose fields are private, by what it
    /// does with one bodiless request per coding: it removes the
    /// `content-encoding` of a coding it decodes, keeps that of one it passes
    /// through, and answers 415 without calling its inner service otherwise.
    /// Runs once per configuration, never per request.
    pub(super) fn learn(layer: &RequestDecompressionLayer) -> Codings {
        let mut probe = layer.layer(Record::default());
        let mut outcome = |name: &'static str| {
            probe.get_mut().decoded = None;
            let mut req = Request::new(Empty::<Bytes>::new());
            req.headers_mut()
                .insert(CONTENT_ENCODING, HeaderValue::from_static(name));
            // Always ready: `Record` is.
            let mut cx = Context::from_waker(std::task::Waker::noop());
            let _ = Service::<Request<Empty<Bytes>>>::poll_ready(&mut probe, &mut cx);
            // The future is dropped unpolled: the decision is made in `call`.
            drop(probe.call(req));
            probe.get_ref().decoded
        };
        let accepted = Coding::ALL.map(|coding| outcome(coding.name()) == Some(true));
        let pass_through = outcome("x-tower-admission-unknown").is_some();
        let names: Vec<&str> = Coding::ALL
            .into_iter()
            .filter(|coding| accepted[coding.index()])
            .map(Coding::name)
            .collect();
        // As tower-http lists them; `identity` when it accepts none.
        let accept_encoding = if names.is_empty() {
            HeaderValue::from_static("identity")
        } else {
            HeaderValue::from_str(&names.join(",")).unwrap_or(HeaderValue::from_static("identity"))
        };
        Codings {
            accepted,
            pass_through,
            accept_encoding,
        }
    }

    /// Whether bodies in `coding` are decoded.
    pub(super) fn accepts(&self, coding: Coding) -> bool {
        self.accepted[coding.index()]
    }

    /// Whether a coding that is not decoded passes through undecoded rather
    /// than being refused with 415.
    pub(super) fn pass_through(&self) -> bool {
        self.pass_through
    }

    /// The `Accept-Encoding` of a 415.
    pub(super) fn accept_encoding(&self) -> &HeaderValue {
        &self.accept_encoding
    }
}

/// The inner service of [`Codings::learn`]: records whether the request it
/// got still had its `content-encoding`.
#[derive(Debug, Default)]
struct Record {
    /// `None`: not called; `Some(true)`: called with the coding removed.
    decoded: Option<bool>,
}

impl<B: Body> Service<Request<DecompressionBody<B>>> for Record {
    type Response = Response<Empty<Bytes>>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<DecompressionBody<B>>) -> Self::Future {
        self.decoded = Some(!req.headers().contains_key(CONTENT_ENCODING));
        std::future::ready(Ok(Response::new(Empty::new())))
    }
}

/// The error a decoded body yields when its coded data is malformed,
/// truncated or followed by other bytes.
#[derive(Debug)]
pub(super) struct MalformedBody {
    reason: String,
}

impl fmt::Display for MalformedBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed request body: {}", self.reason)
    }
}

impl StdError for MalformedBody {}

pin_project! {
    /// A request body after content-coding negotiation: as it came, or
    /// decoded.
    #[project = DecodeBodyProj]
    pub(super) enum DecodeBody<B> {
        Identity {
            #[pin]
            body: B,
        },
        Decoding {
            #[pin]
            body: B,
            decoder: Decoder,
        },
    }
}

impl<B> DecodeBody<B> {
    pub(super) fn identity(body: B) -> Self {
        DecodeBody::Identity { body }
    }

    /// `body` decoded from `coding`; a malformed body is recorded in `probe`.
    pub(super) fn decoding(body: B, coding: Coding, probe: Option<Probe>) -> Self {
        DecodeBody::Decoding {
            body,
            decoder: Decoder {
                coding,
                codec: coding.codec(),
                probe,
                input: Bytes::new(),
                out: BytesMut::new(),
                written: 0,
                phase: Phase::Decoding,
                complete: false,
                maybe_pending: false,
                body_ended: false,
                coded_bytes: false,
                trailers: None,
            },
        }
    }
}

impl<B: fmt::Debug> fmt::Debug for DecodeBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeBody::Identity { body } => f.debug_tuple("Identity").field(body).finish(),
            DecodeBody::Decoding { body, decoder } => f
                .debug_struct("Decoding")
                .field("body", body)
                .field("coding", &decoder.coding)
                .finish_non_exhaustive(),
        }
    }
}

impl<B> Body for DecodeBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project() {
            DecodeBodyProj::Identity { body } => match ready!(body.poll_frame(cx)) {
                Some(Ok(frame)) => Poll::Ready(Some(Ok(
                    frame.map_data(|mut data| data.copy_to_bytes(data.remaining()))
                ))),
                Some(Err(err)) => Poll::Ready(Some(Err(err.into()))),
                None => Poll::Ready(None),
            },
            DecodeBodyProj::Decoding { body, decoder } => decoder.poll(body, cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            DecodeBody::Identity { body } => body.is_end_stream(),
            DecodeBody::Decoding { decoder, .. } => {
                matches!(decoder.phase, Phase::Done)
                    && decoder.written == 0
                    && decoder.trailers.is_none()
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            DecodeBody::Identity { body } => body.size_hint(),
            DecodeBody::Decoding { .. } => SizeHint::default(),
        }
    }
}

enum Codec {
    Zstd(ZstdDecoder),
    Gzip(GzipDecoder),
    Zlib(ZlibDecoder),
    Br(BrotliDecoder),
}

impl Codec {
    fn get(&mut self) -> &mut dyn DecodeV2 {
        match self {
            Codec::Zstd(codec) => codec,
            Codec::Gzip(codec) => codec,
            Codec::Zlib(codec) => codec,
            Codec::Br(codec) => codec,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Feeding input to the codec.
    Decoding,
    /// Draining the codec: after it reported the end of a unit
    /// (`complete`), or when the body ended before it did.
    Finishing,
    /// A unit is complete: another one, the body's end, or other bytes
    /// follow.
    Between,
    /// Nothing more to decode: pending output, then trailers, then the end.
    Done,
}

/// The state of a body being decoded. Its memory is the codec's state, one
/// frame of the coded body and at most [`CHUNK`] decoded bytes, whatever the
/// body inflates to.
pub(super) struct Decoder {
    coding: Coding,
    codec: Codec,
    probe: Option<Probe>,
    /// The unconsumed rest of the coded body's current frame.
    input: Bytes,
    /// Decoded bytes not yet yielded: the first `written` of `out`, which
    /// is [`CHUNK`] long when in use and empty otherwise.
    out: BytesMut,
    written: usize,
    phase: Phase,
    /// The codec reported the end of the current unit.
    complete: bool,
    /// The last call filled the output, so the codec may hold more back.
    maybe_pending: bool,
    /// The coded body has no more data.
    body_ended: bool,
    /// The coded body had at least one byte.
    coded_bytes: bool,
    trailers: Option<HeaderMap>,
}

impl Decoder {
    fn poll<B>(
        &mut self,
        mut body: Pin<&mut B>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        loop {
            if self.written == CHUNK {
                return Poll::Ready(Some(Ok(self.take_output())));
            }
            match self.phase {
                Phase::Decoding if !self.input.is_empty() || self.maybe_pending => {
                    // Without input, a call only drains what the codec holds
                    // back from a call that filled the output.
                    let flushing = self.input.is_empty();
                    let (consumed, produced, result) = self.run(false);
                    match result {
                        Ok(true) => {
                            self.complete = true;
                            self.phase = Phase::Finishing;
                        }
                        // With input left and room for output, a codec that
                        // moves nothing would be called forever.
                        Ok(false) if !flushing && consumed == 0 && produced == 0 => {
                            return self.malformed(format!(
                                "the {} decoder stopped making progress",
                                self.coding.name()
                            ));
                        }
                        Ok(false) => {}
                        // flate2 reports a drain with nothing held back as
                        // an error; a real one recurs on the next input.
                        Err(_) if flushing => {}
                        Err(err) => {
                            return self
                                .malformed(format!("not valid {} data: {err}", self.coding.name()))
                        }
                    }
                }
                Phase::Decoding if self.body_ended => {
                    // An empty body is empty whatever its coding.
                    self.phase = if self.coded_bytes {
                        Phase::Finishing
                    } else {
                        Phase::Done
                    };
                }
                Phase::Decoding => {
                    if let Some(poll) = self.poll_input(body.as_mut(), cx) {
                        return poll;
                    }
                }
                Phase::Finishing => {
                    let (_, produced, result) = self.run(true);
                    match result {
                        Ok(true) => self.phase = Phase::Between,
                        Ok(false) if produced > 0 => {}
                        Ok(false) | Err(_) if !self.complete => {
                            return self.malformed(format!(
                                "the {} data ends before it is complete",
                                self.coding.name()
                            ));
                        }
                        Ok(false) => {
                            return self.malformed(format!(
                                "the {} decoder stopped making progress",
                                self.coding.name()
                            ));
                        }
                        Err(err) => {
                            return self
                                .malformed(format!("not valid {} data: {err}", self.coding.name()))
                        }
                    }
                }
                Phase::Between if !self.input.is_empty() => {
                    let coding = self.coding.name();
                    let Some(unit) = self.coding.unit() else {
                        return self
                            .malformed(format!("bytes follow the end of the {coding} data"));
                    };
                    if !self.coding.may_start_unit(&self.input) {
                        return self.malformed(format!(
                            "bytes that are not another {coding} {unit} follow the end of the \
                             {coding} data"
                        ));
                    }
                    if let Err(err) = self.codec.get().reinit() {
                        return self.malformed(format!("not valid {coding} data: {err}"));
                    }
                    self.complete = false;
                    self.maybe_pending = false;
                    self.phase = Phase::Decoding;
                }
                Phase::Between if self.body_ended => self.phase = Phase::Done,
                Phase::Between => {
                    if let Some(poll) = self.poll_input(body.as_mut(), cx) {
                        return poll;
                    }
                }
                Phase::Done => {
                    if self.written > 0 {
                        return Poll::Ready(Some(Ok(self.take_output())));
                    }
                    return Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))));
                }
            }
        }
    }

    /// Takes the coded body's next frame as input, or marks its end. Returns
    /// what to yield when there is nothing to continue with: decoded bytes
    /// while the body is not ready, `Pending`, or the body's own error.
    #[allow(clippy::type_complexity)]
    fn poll_input<B>(
        &mut self,
        body: Pin<&mut B>,
        cx: &mut Context<'_>,
    ) -> Option<Poll<Option<Result<Frame<Bytes>, BoxError>>>>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        match body.poll_frame(cx) {
            Poll::Pending if self.written > 0 => Some(Poll::Ready(Some(Ok(self.take_output())))),
            Poll::Pending => Some(Poll::Pending),
            Poll::Ready(None) => {
                self.body_ended = true;
                None
            }
            Poll::Ready(Some(Err(err))) => {
                // Not the coded data's fault: a cap or the connection.
                // Passed on as it is.
                self.stop();
                Some(Poll::Ready(Some(Err(err.into()))))
            }
            Poll::Ready(Some(Ok(frame))) => {
                match frame.into_data() {
                    Ok(mut data) => {
                        if data.has_remaining() {
                            self.input = data.copy_to_bytes(data.remaining());
                            self.coded_bytes = true;
                        }
                    }
                    Err(frame) => {
                        // Trailers end the data.
                        self.trailers = frame.into_trailers().ok();
                        self.body_ended = true;
                    }
                }
                None
            }
        }
    }

    /// One call of the codec, decoding the current input or, with `finish`,
    /// draining it. Returns the bytes consumed and produced, and whether the
    /// codec reached the end of a unit.
    fn run(&mut self, finish: bool) -> (usize, usize, io::Result<bool>) {
        if self.out.is_empty() {
            self.out = BytesMut::zeroed(CHUNK);
        }
        let mut input = PartialBuffer::new(&self.input[..]);
        let mut output = WriteBuffer::new_initialized(&mut self.out[self.written..]);
        let codec = self.codec.get();
        let result = if finish {
            codec.finish(&mut output)
        } else {
            codec.decode(&mut input, &mut output)
        };
        let (consumed, produced) = (input.written_len(), output.written_len());
        self.input.advance(consumed);
        self.written += produced;
        self.maybe_pending = self.written == CHUNK;
        (consumed, produced, result)
    }

    fn take_output(&mut self) -> Frame<Bytes> {
        let mut out = std::mem::take(&mut self.out);
        out.truncate(self.written);
        self.written = 0;
        Frame::data(out.freeze())
    }

    /// Drops everything pending: the body ends after the error at hand.
    fn stop(&mut self) {
        self.phase = Phase::Done;
        self.input = Bytes::new();
        self.out = BytesMut::new();
        self.written = 0;
        self.trailers = None;
    }

    /// Records the body as malformed for `reason` and yields the error.
    fn malformed<T>(&mut self, reason: String) -> Poll<Option<Result<T, BoxError>>> {
        self.stop();
        if let Some(probe) = &self.probe {
            probe.trip_malformed(&reason);
        }
        Poll::Ready(Some(Err(Box::new(MalformedBody { reason }))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_codings_are_those_of_a_default_tower_http_layer() {
        assert_eq!(
            Codings::learn(&RequestDecompressionLayer::new()),
            Codings::default()
        );
    }

    #[test]
    fn codings_are_learnt_from_the_layer_settings() {
        let codings = Codings::learn(&RequestDecompressionLayer::new().no_br().no_zstd());
        assert_eq!(
            Coding::ALL.map(|coding| codings.accepts(coding)),
            [false, true, true, false]
        );
        assert!(!codings.pass_through());
        assert_eq!(codings.accept_encoding(), "gzip,deflate");

        let none = RequestDecompressionLayer::new()
            .no_gzip()
            .no_deflate()
            .no_br()
            .no_zstd()
            .pass_through_unaccepted(true);
        let codings = Codings::learn(&none);
        assert_eq!(
            Coding::ALL.map(|coding| codings.accepts(coding)),
            [false; 4]
        );
        assert!(codings.pass_through());
        assert_eq!(codings.accept_encoding(), "identity");
    }

    /// A decoded body can go wherever the body it decodes can.
    #[test]
    fn a_decoded_body_is_send_and_sync() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<DecodeBody<http_body_util::Full<Bytes>>>();
    }
}
