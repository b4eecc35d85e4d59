//! [`BodyLimits`]: the caps around the inner service, built per call.

use std::fmt;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_ENCODING, CONTENT_LENGTH};
use http::{HeaderMap, Request, Response};
use http_body::Body;
#[cfg(feature = "axum")]
use tower::Layer;
use tower::Service;
use tower_http::limit::RequestBodyLimit;

use super::capped::{CappedBody, Kind};
use super::future::{Capped, ResponseFuture, State, Watch};
use super::layer::BodyLimitsLayer;
use super::probe::{Probe, Trip};
use super::stack::{DecodedProbe, Decompress, StackBody, StackFuture};
use super::{BoxError, LimitedResponse};
use crate::reject::Protocol;

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
    pub(super) inner: S,
    pub(super) caps: BodyLimitsLayer,
}

impl<S: fmt::Debug> fmt::Debug for BodyLimits<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BodyLimits")
            .field("inner", &self.inner)
            .field("caps", &self.caps.caps)
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
        let layer = &self.caps;
        let caps = **layer.caps.load();
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
            codings: &layer.codings,
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
