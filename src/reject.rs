//! The one place that turns a refusal into a response.
//!
//! Every layer in this crate refuses by returning `Ok(response)` built here,
//! never an error, so stacks keep axum's `Infallible` bound. The typed
//! [`Rejection`] is inserted into the response extensions for logging and
//! tests.
//!
//! | status | variant | gRPC code |
//! |---|---|---|
//! | 400 | [`Rejection::InvalidParameters`] | `INVALID_ARGUMENT` |
//! | 401 | [`Rejection::Unauthenticated`] | `UNAUTHENTICATED` |
//! | 413 | [`Rejection::PayloadTooLarge`], [`Rejection::CostExceedsCapacity`] | `RESOURCE_EXHAUSTED` |
//! | 415 | [`Rejection::UnsupportedEncoding`] | `INVALID_ARGUMENT` |
//! | 429 | [`Rejection::QuotaExceeded`], [`Rejection::Overloaded`] with [`OverloadScope::Identity`] | `RESOURCE_EXHAUSTED` |
//! | 503 | [`Rejection::Overloaded`] with [`OverloadScope::Global`], [`Rejection::LimiterUnavailable`], [`Rejection::DependencyUnavailable`] | `UNAVAILABLE` |
//!
//! # HTTP: problem details
//!
//! HTTP bodies are `application/problem+json` problem details (RFC 9457)
//! with the members `type`, `title`, `status` and `detail`, and these
//! extension members:
//!
//! | variant | `type` | extension members |
//! |---|---|---|
//! | [`Rejection::QuotaExceeded`] | [`QUOTA_EXCEEDED_TYPE`] | `violated-policies`, `policies` (the same names), `retry_after` |
//! | [`Rejection::LimiterUnavailable`], [`Rejection::DependencyUnavailable`] | [`TEMPORARY_REDUCED_CAPACITY_TYPE`] | `retry_after` |
//! | [`Rejection::CostExceedsCapacity`] | own | `policies`, `cost` |
//! | [`Rejection::PayloadTooLarge`] | own | `cap`, `limit` |
//! | [`Rejection::InvalidParameters`] | own | `errors`: `name` and `reason` of each |
//! | [`Rejection::Overloaded`] | own | `retry_after` |
//! | [`Rejection::Unauthenticated`], [`Rejection::UnsupportedEncoding`] | own | |
//!
//! "Own" is [`PROBLEM_TYPE_BASE`] followed by `#` and [`Rejection::kind`],
//! for example `…/reject/#payload-too-large`.
//!
//! The two registered rate-limit problem types are used where they fit: a
//! quota refusal is `quota-exceeded`, whose `violated-policies` member lists
//! the refusing policies by name, and a limiter that cannot decide while its
//! policies fail closed, or a dependency that cannot be called, is
//! `temporary-reduced-capacity` (the server cannot serve the request now; the
//! client did nothing wrong). The other refusals
//! have no registered type and use this crate's own.
//!
//! Every refusal a wait can cure carries `Retry-After` and the `retry_after`
//! member: the exact wait rounded **up** to whole seconds, and at least 1.
//! [`QuotaLayer`](crate::quota::QuotaLayer) adds the `RateLimit-Policy` and
//! `RateLimit` fields to its 429 and 503 refusals.
//!
//! # gRPC: statuses with details
//!
//! Requests whose `content-type` starts with `application/grpc` in any case
//! ([`is_grpc`]: the `+proto` and other `+codec` forms, and gRPC-Web's
//! `application/grpc-web` and `application/grpc-web-text`) get a gRPC status
//! instead, with the code in the table above and the problem `detail` as
//! `grpc-message`. It is a trailers-only response: the status in the
//! headers, HTTP status 200 and an empty body. [`Protocol::of`] is the one
//! place that tells the flavours apart, and the `content-type` follows it:
//!
//! | request `content-type` (any case) | refusal `content-type` |
//! |---|---|
//! | `application/grpc`, `application/grpc+codec` | `application/grpc` |
//! | `application/grpc-web`, `application/grpc-web+codec` | the request's media type, in lower case |
//! | `application/grpc-web-text`, `application/grpc-web-text+codec` | the request's media type, in lower case |
//!
//! Every gRPC refusal carries
//! `grpc-retry-pushback-ms`, which gRPC clients with a retry policy obey: the
//! same wait as `Retry-After` in milliseconds when a wait can cure the
//! refusal, and `-1` (do not retry) when none can. A browser reads these
//! headers only when CORS exposes them: put the CORS layer outside this
//! crate's layers, exposing `grpc-status`, `grpc-message`,
//! `grpc-status-details-bin` and `grpc-retry-pushback-ms`.
//!
//! A layer that answers gRPC-Web must name the request with
//! [`Protocol::of`]; a `bool` from [`is_grpc`] answers plain gRPC.
//!
//! What the layers count in a gRPC call:
//!
//! * **Quotas and concurrency caps decide once per call**, not per message:
//!   a client-, server- or bidirectional-streaming call is one request,
//!   charged its cost once, and it holds its concurrency permits until its
//!   response stream ends. Served by tonic's server, a call waiting in a
//!   concurrency queue also ends at its own `grpc-timeout` (`CANCELLED`,
//!   from tonic, which enforces it around the layers) and leaves the queue.
//! * **Body caps count the request stream's bytes**, every message of a
//!   streaming call together, with their 5-byte gRPC frame prefixes. Only
//!   the HTTP `content-encoding` is decoded; messages compressed with
//!   `grpc-encoding` pass through coded, so the decoded cap counts their
//!   compressed bytes. Bound the decoded size of each message with tonic's
//!   `max_decoding_message_size` on the service. A cap tripped before the
//!   handler answers (a unary or client-streaming call) is answered as the
//!   cap's refusal. One tripped after it answered (a streaming response has
//!   begun) cannot replace the response headers or the messages already
//!   sent: the handler's next read of its request stream fails, and the
//!   call's status in the trailers becomes the cap's refusal
//!   (`RESOURCE_EXHAUSTED` naming the cap, `grpc-retry-pushback-ms: -1`),
//!   whatever status the handler ended with. For gRPC-Web the trailers are
//!   the body's trailer frame (base64 for `-text`), which the refusal's
//!   replaces ([`StatusBody`](crate::bounds::StatusBody)).
//!
//! With the `tonic` feature the status also carries `google.rpc` details in
//! `grpc-status-details-bin`:
//!
//! | variant | details |
//! |---|---|
//! | [`Rejection::QuotaExceeded`] | `RetryInfo` (the wait) and `QuotaFailure`, one violation per refusing policy (its name as `subject` and `quota_id`) |
//! | [`Rejection::CostExceedsCapacity`] | `QuotaFailure`, one violation per policy whose capacity is below the cost |
//! | [`Rejection::Overloaded`], [`Rejection::LimiterUnavailable`], [`Rejection::DependencyUnavailable`] | `RetryInfo` (the wait) |
//! | [`Rejection::InvalidParameters`] | `BadRequest`, one field violation per parameter |
//!
//! ```
//! use std::time::Duration;
//! use tower_admission::reject::{Rejection, QUOTA_EXCEEDED_TYPE};
//!
//! let refusal = Rejection::QuotaExceeded {
//!     policies: vec!["per-minute".into()],
//!     retry_after: Duration::from_millis(1500),
//! };
//! let doc = refusal.problem();
//! assert_eq!(doc["type"], QUOTA_EXCEEDED_TYPE);
//! assert_eq!(doc["violated-policies"], serde_json::json!(["per-minute"]));
//! assert_eq!(doc["retry_after"], 2);
//!
//! let grpc = refusal.into_response(true);
//! assert_eq!(grpc.headers()["grpc-status"], "8");
//! assert_eq!(grpc.headers()["grpc-retry-pushback-ms"], "2000");
//! assert_eq!(grpc.headers()["retry-after"], "2");
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use http_body_util::{Either, Full};
use serde_json::json;

use crate::quota::Outcome;

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
/// use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer, Scope};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let quota = Quota::new("api", [Policy::fixed_window("per-second", 1, std::time::Duration::from_secs(1))?])?;
/// let handler = tower::service_fn(|_: Request<()>| async {
///     Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
/// });
/// let service = ServiceBuilder::new()
///     .layer(QuotaLayer::builder(MemoryStore::new()).quota(quota).scope(Scope::Aggregate).build()?)
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

/// Base of this crate's own problem `type` URIs, for the refusals that have
/// no registered problem type. The fragment is [`Rejection::kind`].
pub const PROBLEM_TYPE_BASE: &str =
    "https://docs.rs/tower-admission/latest/tower_admission/reject/";

/// The registered problem type of a quota refusal (429). Its extension member
/// `violated-policies` is an array with the names of the refusing policies.
pub const QUOTA_EXCEEDED_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// The registered problem type of a request the server cannot serve now
/// because its capacity is temporarily reduced (503): here, a limiter that
/// could not decide while its policies fail closed, or a dependency that
/// cannot be called.
pub const TEMPORARY_REDUCED_CAPACITY_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// The gRPC response header (in a trailers-only response, the trailer) that
/// tells a gRPC client with a retry policy how many milliseconds to wait
/// before its next attempt; a negative value tells it not to retry.
pub const GRPC_RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// No credential, or one that is not known. 401.
    Unauthenticated {
        /// What was wrong, for the `detail` member. Never echoes the credential.
        reason: &'static str,
    },
    /// One or more query parameters or body fields are invalid. 400.
    InvalidParameters(Vec<InvalidParameter>),
    /// A size cap was exceeded. 413.
    PayloadTooLarge {
        /// Which cap.
        cap: SizeCap,
        /// The configured cap.
        limit: u64,
    },
    /// The body's `content-encoding` is not supported. 415.
    UnsupportedEncoding {
        /// The encoding that was sent.
        encoding: String,
    },
    /// One or more quota policies refused. 429.
    QuotaExceeded {
        /// Names of the refusing policies.
        policies: Vec<Arc<str>>,
        /// Exact wait until a retry can succeed.
        retry_after: Duration,
    },
    /// The request costs more than a policy can ever admit. 413; retrying
    /// cannot help, so there is no `Retry-After`.
    CostExceedsCapacity {
        /// Names of the policies whose capacity is below the cost.
        policies: Vec<Arc<str>>,
        /// The cost of the request.
        cost: u64,
    },
    /// A concurrency cap and its queue are full, or the queue deadline passed.
    Overloaded {
        /// Which cap.
        scope: OverloadScope,
        /// Suggested wait.
        retry_after: Duration,
    },
    /// The limiter store could not decide in time and the policy fails closed. 503.
    LimiterUnavailable {
        /// Suggested wait.
        retry_after: Duration,
    },
    /// A dependency the request's work needs cannot be called now: its
    /// outbound budget is spent, or its calls failed. 503.
    DependencyUnavailable {
        /// Suggested wait: the budget's wait when it refused.
        retry_after: Duration,
    },
}

/// Which size cap a [`Rejection::PayloadTooLarge`] hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SizeCap {
    /// Bytes on the wire.
    WireBytes,
    /// Bytes after decompression.
    DecodedBytes,
    /// Items in a batch.
    Items,
}

/// Which concurrency cap a [`Rejection::Overloaded`] hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OverloadScope {
    /// The service-wide cap: 503.
    Global,
    /// The caller's own cap: 429, since the caller can fix it by waiting.
    Identity,
}

/// One invalid parameter and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidParameter {
    /// Parameter or field name.
    pub name: String,
    /// Why it is invalid.
    pub reason: String,
}

impl InvalidParameter {
    /// A new invalid-parameter entry.
    pub fn new(name: impl Into<String>, reason: impl Into<String>) -> Self {
        InvalidParameter {
            name: name.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for SizeCap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SizeCap::WireBytes => "wire-bytes",
            SizeCap::DecodedBytes => "decoded-bytes",
            SizeCap::Items => "items",
        })
    }
}

/// `ceil(wait)` in whole seconds, at least 1 and saturating at `u64::MAX`
/// (a wait of `Duration::MAX`): the value of `Retry-After`.
pub fn retry_after_secs(wait: Duration) -> u64 {
    ceil_secs(wait).max(1)
}

/// `ceil(d)` in whole seconds, saturating at `u64::MAX`: `Retry-After` and
/// the `RateLimit` fields' `t` and `w`.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0))
}

/// True when the request is gRPC: its `content-type` starts with
/// `application/grpc` in any case, since media types are case-insensitive.
/// gRPC-Web requests are gRPC too; [`Protocol::of`] tells them apart.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| starts_with_ignore_case(v.as_bytes(), b"application/grpc"))
}

fn starts_with_ignore_case(bytes: &[u8], prefix: &[u8]) -> bool {
    bytes
        .get(..prefix.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
}

/// The protocol a request speaks, which decides how its refusals are
/// written: problem details for HTTP, a trailers-only gRPC status for gRPC
/// (`content-type: application/grpc`), and the same status with the
/// caller's own content type for gRPC-Web.
///
/// ```
/// use http::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
/// use tower_admission::reject::{Protocol, Rejection};
///
/// let mut headers = HeaderMap::new();
/// headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc-web-text"));
/// let protocol = Protocol::of(&headers);
/// assert!(protocol.is_grpc_web());
/// let refusal = Rejection::Unauthenticated { reason: "missing credential" };
/// let response = refusal.into_response(protocol);
/// assert_eq!(response.headers()["content-type"], "application/grpc-web-text");
/// assert_eq!(response.headers()["grpc-status"], "16");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protocol(Wire);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Wire {
    Http,
    Grpc,
    /// The request's `content-type`, answered back as its media type in
    /// lower case; `text` for `application/grpc-web-text*` (base64 bodies).
    GrpcWeb {
        content_type: HeaderValue,
        text: bool,
    },
}

impl Protocol {
    /// HTTP: refusals are problem details.
    pub const HTTP: Protocol = Protocol(Wire::Http);
    /// Plain gRPC: refusals are trailers-only with `content-type: application/grpc`.
    pub const GRPC: Protocol = Protocol(Wire::Grpc);

    /// The protocol of a request with these headers. Its `content-type`,
    /// in any case, names it:
    ///
    /// * `application/grpc-web` or `application/grpc-web-text`, alone or
    ///   with a `+codec` suffix or parameters: gRPC-Web, its refusals
    ///   answered with that media type in lower case (parameters dropped);
    /// * any other that starts with `application/grpc` ([`is_grpc`]): gRPC;
    /// * anything else, or none: HTTP.
    pub fn of(headers: &HeaderMap) -> Protocol {
        let Some(value) = headers.get(CONTENT_TYPE) else {
            return Protocol::HTTP;
        };
        let bytes = value.as_bytes();
        if !starts_with_ignore_case(bytes, b"application/grpc") {
            return Protocol::HTTP;
        }
        let rest = &bytes[b"application/grpc".len()..];
        let (text, rest) = if starts_with_ignore_case(rest, b"-web-text") {
            (true, &rest[b"-web-text".len()..])
        } else if starts_with_ignore_case(rest, b"-web") {
            (false, &rest[b"-web".len()..])
        } else {
            return Protocol::GRPC;
        };
        match rest.first() {
            None | Some(b'+' | b';' | b' ' | b'\t') => Protocol(Wire::GrpcWeb {
                content_type: value.clone(),
                text,
            }),
            Some(_) => Protocol::GRPC,
        }
    }

    /// True for gRPC and gRPC-Web: refusals are gRPC statuses.
    pub fn is_grpc(&self) -> bool {
        !matches!(self.0, Wire::Http)
    }

    /// True for gRPC-Web, binary or text.
    pub fn is_grpc_web(&self) -> bool {
        matches!(self.0, Wire::GrpcWeb { .. })
    }

    /// True for gRPC-Web-text, whose bodies are base64.
    pub(crate) fn is_grpc_web_text(&self) -> bool {
        matches!(self.0, Wire::GrpcWeb { text: true, .. })
    }

    /// The `content-type` of a gRPC refusal.
    fn grpc_content_type(&self) -> HeaderValue {
        match &self.0 {
            Wire::GrpcWeb { content_type, .. } => {
                let media = content_type.as_bytes();
                let end = media.iter().position(|&b| b == b';').unwrap_or(media.len());
                let media = media[..end].trim_ascii_end().to_ascii_lowercase();
                HeaderValue::from_bytes(&media)
                    .unwrap_or_else(|_| HeaderValue::from_static("application/grpc-web+proto"))
            }
            _ => HeaderValue::from_static("application/grpc"),
        }
    }
}

/// `true` is [`Protocol::GRPC`] and `false` [`Protocol::HTTP`], as
/// [`is_grpc`] answers; use [`Protocol::of`] to answer gRPC-Web callers in
/// their own content type.
impl From<bool> for Protocol {
    fn from(grpc: bool) -> Self {
        if grpc {
            Protocol::GRPC
        } else {
            Protocol::HTTP
        }
    }
}

/// The gRPC-Web trailer frame that carries `trailers` in a response body:
/// flag byte `0x80`, the 4-byte big-endian length, then each trailer as
/// `name:value\r\n`; base64 when `text`.
pub(crate) fn grpc_web_trailer_frame(trailers: &HeaderMap, text: bool) -> Bytes {
    let mut block = Vec::new();
    for (name, value) in trailers {
        block.extend_from_slice(name.as_str().as_bytes());
        block.push(b':');
        block.extend_from_slice(value.as_bytes());
        block.extend_from_slice(b"\r\n");
    }
    let mut frame = Vec::with_capacity(block.len() + 5);
    frame.push(0x80);
    frame.extend_from_slice(&u32::try_from(block.len()).unwrap_or(u32::MAX).to_be_bytes());
    frame.extend_from_slice(&block);
    if text {
        Bytes::from(base64(&frame))
    } else {
        Bytes::from(frame)
    }
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as gRPC-Web-text writes its bodies.
pub(crate) fn base64(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            out.push(if i <= chunk.len() {
                BASE64[(n >> (18 - 6 * i) & 63) as usize]
            } else {
                b'='
            });
        }
    }
    out
}

/// The bytes of one group of four base64 characters (one to three; fewer
/// when padded), or `None` when it is not base64.
pub(crate) fn unbase64_group(group: [u8; 4]) -> Option<([u8; 3], usize)> {
    let mut n = 0u32;
    let mut chars = 0;
    for (i, &c) in group.iter().enumerate() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            // Padding only at the end, after at least two characters.
            b'=' if i >= 2 && group[i..].iter().all(|&p| p == b'=') => break,
            _ => return None,
        };
        n |= u32::from(v) << (18 - 6 * i);
        chars += 1;
    }
    let [_, a, b, c] = n.to_be_bytes();
    Some(([a, b, c], chars - 1))
}

impl Rejection {
    /// The refusal for a quota engine outcome of a request of `cost`;
    /// `None` when the outcome admits.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::quota::Outcome;
    /// use tower_admission::reject::Rejection;
    ///
    /// let outcome = Outcome::Unavailable { wait: Duration::from_secs(1) };
    /// let rejection = Rejection::from_outcome(&outcome, 1).unwrap();
    /// assert_eq!(rejection.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    /// assert_eq!(Rejection::from_outcome(&Outcome::Admitted, 1), None);
    /// ```
    pub fn from_outcome(outcome: &Outcome, cost: u64) -> Option<Rejection> {
        Some(match outcome {
            Outcome::Admitted => return None,
            Outcome::Refused { policies, wait } => Rejection::QuotaExceeded {
                policies: policies.clone(),
                retry_after: *wait,
            },
            Outcome::CostExceedsCapacity { policies } => Rejection::CostExceedsCapacity {
                policies: policies.clone(),
                cost,
            },
            Outcome::Unavailable { wait } => Rejection::LimiterUnavailable { retry_after: *wait },
        })
    }

    /// The HTTP status of this rejection.
    pub fn status(&self) -> StatusCode {
        match self {
            Rejection::Unauthenticated { .. } => StatusCode::UNAUTHORIZED,
            Rejection::InvalidParameters(_) => StatusCode::BAD_REQUEST,
            Rejection::PayloadTooLarge { .. } | Rejection::CostExceedsCapacity { .. } => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            Rejection::UnsupportedEncoding { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Rejection::QuotaExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Rejection::Overloaded { scope, .. } => match scope {
                OverloadScope::Global => StatusCode::SERVICE_UNAVAILABLE,
                OverloadScope::Identity => StatusCode::TOO_MANY_REQUESTS,
            },
            Rejection::LimiterUnavailable { .. } | Rejection::DependencyUnavailable { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// The wait to advertise in `Retry-After`, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Rejection::QuotaExceeded { retry_after, .. }
            | Rejection::Overloaded { retry_after, .. }
            | Rejection::LimiterUnavailable { retry_after }
            | Rejection::DependencyUnavailable { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// Short kebab-case name of the reason, for logs and metrics. For the
    /// refusals without a registered problem type it is also the fragment
    /// of their `type` after [`PROBLEM_TYPE_BASE`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::reject::Rejection;
    ///
    /// let outage = Rejection::LimiterUnavailable { retry_after: Duration::from_secs(1) };
    /// assert_eq!(outage.kind(), "limiter-unavailable");
    /// ```
    pub fn kind(&self) -> &'static str {
        match self {
            Rejection::Unauthenticated { .. } => "unauthenticated",
            Rejection::InvalidParameters(_) => "invalid-parameters",
            Rejection::PayloadTooLarge { .. } => "payload-too-large",
            Rejection::UnsupportedEncoding { .. } => "unsupported-encoding",
            Rejection::QuotaExceeded { .. } => "quota-exceeded",
            Rejection::CostExceedsCapacity { .. } => "cost-exceeds-capacity",
            Rejection::Overloaded { .. } => "overloaded",
            Rejection::LimiterUnavailable { .. } => "limiter-unavailable",
            Rejection::DependencyUnavailable { .. } => "dependency-unavailable",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Rejection::Unauthenticated { .. } => "Authentication required",
            Rejection::InvalidParameters(_) => "Invalid request parameters",
            Rejection::PayloadTooLarge { .. } => "Payload too large",
            Rejection::UnsupportedEncoding { .. } => "Unsupported content encoding",
            Rejection::QuotaExceeded { .. } => "Quota Exceeded",
            Rejection::CostExceedsCapacity { .. } => "Request cost exceeds quota capacity",
            Rejection::Overloaded { .. } => "Too many requests in progress",
            Rejection::LimiterUnavailable { .. } | Rejection::DependencyUnavailable { .. } => {
                "Temporary Reduced Capacity"
            }
        }
    }

    fn detail(&self) -> String {
        match self {
            Rejection::Unauthenticated { reason } => (*reason).to_owned(),
            Rejection::InvalidParameters(errors) => {
                let names: Vec<&str> = errors.iter().map(|e| e.name.as_str()).collect();
                format!("invalid parameters: {}", names.join(", "))
            }
            Rejection::PayloadTooLarge { cap, limit } => {
                format!("the {cap} cap of {limit} was exceeded")
            }
            Rejection::UnsupportedEncoding { encoding } => {
                format!("content-encoding {encoding:?} is not supported")
            }
            Rejection::QuotaExceeded {
                policies,
                retry_after,
            } => format!(
                "quota policy {} refused; retry after {} s",
                join(policies),
                retry_after_secs(*retry_after)
            ),
            Rejection::CostExceedsCapacity { policies, cost } => format!(
                "cost {cost} is more than policy {} can ever admit",
                join(policies)
            ),
            Rejection::Overloaded { scope, .. } => match scope {
                OverloadScope::Global => "the service is at its concurrency limit".to_owned(),
                OverloadScope::Identity => "you are at your concurrency limit".to_owned(),
            },
            Rejection::LimiterUnavailable { .. } => {
                "the rate limiter could not decide in time".to_owned()
            }
            Rejection::DependencyUnavailable { .. } => {
                "a dependency this request needs cannot be called now".to_owned()
            }
        }
    }

    /// The problem `type` URI: [`QUOTA_EXCEEDED_TYPE`],
    /// [`TEMPORARY_REDUCED_CAPACITY_TYPE`], or this crate's own under
    /// [`PROBLEM_TYPE_BASE`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::reject::{Rejection, TEMPORARY_REDUCED_CAPACITY_TYPE};
    ///
    /// let outage = Rejection::LimiterUnavailable { retry_after: Duration::from_secs(1) };
    /// assert_eq!(outage.problem_type(), TEMPORARY_REDUCED_CAPACITY_TYPE);
    /// let anonymous = Rejection::Unauthenticated { reason: "missing credential" };
    /// assert!(anonymous.problem_type().ends_with("/reject/#unauthenticated"));
    /// ```
    pub fn problem_type(&self) -> std::borrow::Cow<'static, str> {
        match self {
            Rejection::QuotaExceeded { .. } => QUOTA_EXCEEDED_TYPE.into(),
            Rejection::LimiterUnavailable { .. } | Rejection::DependencyUnavailable { .. } => {
                TEMPORARY_REDUCED_CAPACITY_TYPE.into()
            }
            _ => format!("{PROBLEM_TYPE_BASE}#{}", self.kind()).into(),
        }
    }

    /// The problem details document (RFC 9457): `type`, `title`, `status`,
    /// `detail` and the extension members in the [module table](self).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::reject::Rejection;
    ///
    /// let outage = Rejection::LimiterUnavailable { retry_after: Duration::from_millis(200) };
    /// let doc = outage.problem();
    /// assert_eq!(doc["status"], 503);
    /// assert_eq!(doc["title"], "Temporary Reduced Capacity");
    /// assert_eq!(doc["retry_after"], 1);
    /// ```
    pub fn problem(&self) -> serde_json::Value {
        let status = self.status();
        let mut doc = json!({
            "type": self.problem_type(),
            "title": self.title(),
            "status": status.as_u16(),
            "detail": self.detail(),
        });
        let extra = match self {
            Rejection::InvalidParameters(errors) => json!({
                "errors": errors.iter().map(|e| json!({"name": e.name, "reason": e.reason})).collect::<Vec<_>>()
            }),
            Rejection::PayloadTooLarge { cap, limit } => {
                json!({"cap": cap.to_string(), "limit": limit})
            }
            Rejection::QuotaExceeded { policies, .. } => json!({
                "violated-policies": names(policies),
                "policies": names(policies),
            }),
            Rejection::CostExceedsCapacity { policies, cost } => {
                json!({"policies": names(policies), "cost": cost})
            }
            _ => json!({}),
        };
        if let (Some(doc), serde_json::Value::Object(extra)) = (doc.as_object_mut(), extra) {
            doc.extend(extra);
        }
        if let Some(wait) = self.retry_after() {
            doc["retry_after"] = json!(retry_after_secs(wait));
        }
        doc
    }

    /// The response for this rejection in the request's [`Protocol`]:
    /// problem details for HTTP, a gRPC status for gRPC and gRPC-Web. A
    /// `bool` is [`is_grpc`]'s answer (`true` is plain gRPC).
    pub fn into_response(self, protocol: impl Into<Protocol>) -> Response<Full<Bytes>> {
        self.into_layer_response(protocol)
    }

    /// The rejection as a response of any layer of this crate, in the inner
    /// service's body type; see [`into_response`](Self::into_response).
    pub fn into_layer_response<B: RefusalBody>(self, protocol: impl Into<Protocol>) -> Response<B> {
        let protocol = protocol.into();
        let mut response = if protocol.is_grpc() {
            let mut response = self.grpc_response();
            response
                .headers_mut()
                .insert(CONTENT_TYPE, protocol.grpc_content_type());
            response
        } else {
            let body = serde_json::to_vec(&self.problem()).unwrap_or_default();
            let mut response = Response::new(Bytes::from(body));
            *response.status_mut() = self.status();
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            );
            if let Rejection::Unauthenticated { .. } = self {
                response.headers_mut().insert(
                    http::header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer"),
                );
            }
            response
        };
        if let Some(wait) = self.retry_after() {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(wait)));
        }
        response.extensions_mut().insert(self);
        response.map(B::from_refusal)
    }

    /// The gRPC status code number of this rejection.
    pub fn grpc_code(&self) -> i32 {
        match self {
            Rejection::Unauthenticated { .. } => 16,
            Rejection::InvalidParameters(_) | Rejection::UnsupportedEncoding { .. } => 3,
            Rejection::PayloadTooLarge { .. }
            | Rejection::CostExceedsCapacity { .. }
            | Rejection::QuotaExceeded { .. } => 8,
            Rejection::Overloaded { scope, .. } => match scope {
                OverloadScope::Identity => 8,
                OverloadScope::Global => 14,
            },
            Rejection::LimiterUnavailable { .. } | Rejection::DependencyUnavailable { .. } => 14,
        }
    }

    /// The value of [`GRPC_RETRY_PUSHBACK_MS`]: the `Retry-After` wait in
    /// milliseconds, or `-1` (do not retry) when no wait can cure the refusal.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::reject::Rejection;
    ///
    /// let outage = Rejection::LimiterUnavailable { retry_after: Duration::from_millis(200) };
    /// assert_eq!(outage.grpc_retry_pushback_ms(), 1000);
    /// let too_big = Rejection::CostExceedsCapacity { policies: vec!["burst".into()], cost: 50 };
    /// assert_eq!(too_big.grpc_retry_pushback_ms(), -1);
    /// ```
    pub fn grpc_retry_pushback_ms(&self) -> i64 {
        match self.retry_after() {
            Some(wait) => {
                i64::try_from(retry_after_secs(wait).saturating_mul(1000)).unwrap_or(i64::MAX)
            }
            None => -1,
        }
    }

    #[cfg(feature = "tonic")]
    fn grpc_response(&self) -> Response<Bytes> {
        use tonic_types::{ErrorDetails, FieldViolation, QuotaViolation, StatusExt};
        let code = tonic::Code::from_i32(self.grpc_code());
        let mut details = ErrorDetails::new();
        if let Some(wait) = self.retry_after() {
            // The same whole seconds as `Retry-After`, so every signal agrees.
            details.set_retry_info(Some(Duration::from_secs(retry_after_secs(wait))));
        }
        match self {
            Rejection::QuotaExceeded { policies, .. } => {
                details.set_quota_failure(quota_violations(policies, |name| {
                    format!("quota policy {name} refused")
                }));
            }
            Rejection::CostExceedsCapacity { policies, cost } => {
                details.set_quota_failure(quota_violations(policies, |name| {
                    format!("cost {cost} is more than policy {name} can ever admit")
                }));
            }
            Rejection::InvalidParameters(errors) => {
                details.set_bad_request(
                    errors
                        .iter()
                        .map(|e| FieldViolation::new(e.name.clone(), e.reason.clone()))
                        .collect::<Vec<_>>(),
                );
            }
            _ => {}
        }
        fn quota_violations(
            policies: &[Arc<str>],
            description: impl Fn(&str) -> String,
        ) -> Vec<QuotaViolation> {
            policies
                .iter()
                .map(|name| QuotaViolation {
                    quota_id: name.to_string(),
                    ..QuotaViolation::new(name.to_string(), description(name))
                })
                .collect()
        }
        let has_details = self.retry_after().is_some()
            || matches!(
                self,
                Rejection::QuotaExceeded { .. }
                    | Rejection::CostExceedsCapacity { .. }
                    | Rejection::InvalidParameters(_)
            );
        let status = if !has_details {
            tonic::Status::new(code, self.detail())
        } else {
            tonic::Status::with_error_details(code, self.detail(), details)
        };
        let mut response: Response<Bytes> = status.into_http();
        response.extensions_mut().remove::<tonic::Status>();
        self.insert_pushback(response.headers_mut());
        response
    }

    #[cfg(not(feature = "tonic"))]
    fn grpc_response(&self) -> Response<Bytes> {
        let mut response = Response::new(Bytes::new());
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert("grpc-status", HeaderValue::from(self.grpc_code()));
        if let Ok(v) = HeaderValue::from_str(&grpc_message(&self.detail())) {
            headers.insert("grpc-message", v);
        }
        self.insert_pushback(headers);
        response
    }

    fn insert_pushback(&self, headers: &mut HeaderMap) {
        headers.insert(
            GRPC_RETRY_PUSHBACK_MS,
            HeaderValue::from(self.grpc_retry_pushback_ms()),
        );
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status(), self.detail())
    }
}

impl std::error::Error for Rejection {}

fn names(policies: &[Arc<str>]) -> Vec<&str> {
    policies.iter().map(|p| &**p).collect()
}

fn join(policies: &[Arc<str>]) -> String {
    names(policies).join(", ")
}

/// `detail` as a `grpc-message`: its UTF-8 bytes, each outside the visible
/// ASCII range (and `%`) percent-encoded, as the gRPC wire format asks.
#[cfg(any(test, not(feature = "tonic")))]
fn grpc_message(detail: &str) -> String {
    use std::fmt::Write as _;
    let mut message = String::with_capacity(detail.len());
    for b in detail.bytes() {
        match b {
            b' '..=b'~' if b != b'%' => message.push(char::from(b)),
            _ => {
                let _ = write!(message, "%{b:02X}");
            }
        }
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// Every byte of a non-ASCII character is encoded (`é` is C3 A9), not
    /// the character's low byte, and `%` itself.
    #[test]
    fn grpc_messages_percent_encode_utf8_bytes() {
        assert_eq!(
            grpc_message("page_size é 100%…"),
            "page_size %C3%A9 100%25%E2%80%A6"
        );
        assert_eq!(grpc_message("plain ~ text"), "plain ~ text");
    }

    /// Every body type carries the same refusal: status, headers and bytes.
    #[tokio::test]
    async fn every_refusal_body_carries_the_same_bytes() {
        async fn bytes<B>(grpc: bool) -> (StatusCode, Option<HeaderValue>, Bytes)
        where
            B: RefusalBody + http_body::Body,
            B::Error: fmt::Debug,
        {
            let rejection = Rejection::Overloaded {
                scope: OverloadScope::Global,
                retry_after: Duration::from_millis(1500),
            };
            let response = rejection.into_layer_response::<B>(grpc);
            let status = response.status();
            let retry_after = response.headers().get(RETRY_AFTER).cloned();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, retry_after, body)
        }
        for grpc in [false, true] {
            let full = bytes::<Full<Bytes>>(grpc).await;
            assert_eq!(
                full.0,
                if grpc {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            );
            assert_eq!(full.1.as_ref().map(|v| v.as_bytes()), Some(&b"2"[..]));
            assert_eq!(
                full.2.is_empty(),
                grpc,
                "a problem document, or nothing for gRPC"
            );
            type Boxed = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;
            type Unsync = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;
            assert_eq!(bytes::<String>(grpc).await, full);
            assert_eq!(bytes::<Boxed>(grpc).await, full);
            assert_eq!(bytes::<Unsync>(grpc).await, full);
            assert_eq!(bytes::<Either<String, Full<Bytes>>>(grpc).await, full);
            #[cfg(feature = "axum")]
            assert_eq!(bytes::<axum::body::Body>(grpc).await, full);
            #[cfg(feature = "tonic")]
            assert_eq!(bytes::<tonic::body::Body>(grpc).await, full);
        }
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_micros(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_millis(59_400)), 60);
    }

    #[test]
    fn quota_refusal_is_problem_json_with_retry_after() {
        let r = Rejection::QuotaExceeded {
            policies: vec!["per-minute".into()],
            retry_after: Duration::from_millis(1500),
        };
        let response = r.clone().into_response(false);
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[RETRY_AFTER], "2");
        assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(response.extensions().get::<Rejection>(), Some(&r));
        let doc = r.problem();
        assert_eq!(doc["type"], QUOTA_EXCEEDED_TYPE);
        assert_eq!(doc["title"], "Quota Exceeded");
        assert_eq!(doc["status"], 429);
        assert_eq!(doc["violated-policies"], json!(["per-minute"]));
        assert_eq!(doc["policies"], json!(["per-minute"]));
        assert_eq!(doc["retry_after"], 2);
        assert_eq!(
            doc["detail"],
            "quota policy per-minute refused; retry after 2 s"
        );
    }

    #[test]
    fn limiter_outage_is_temporary_reduced_capacity_with_retry_after() {
        let r = Rejection::LimiterUnavailable {
            retry_after: Duration::from_millis(100),
        };
        let response = r.clone().into_response(false);
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[RETRY_AFTER], "1");
        let doc = r.problem();
        assert_eq!(
            doc,
            json!({
                "type": TEMPORARY_REDUCED_CAPACITY_TYPE,
                "title": "Temporary Reduced Capacity",
                "status": 503,
                "detail": "the rate limiter could not decide in time",
                "retry_after": 1,
            })
        );
    }

    #[test]
    fn an_uncallable_dependency_is_temporary_reduced_capacity_with_retry_after() {
        let r = Rejection::DependencyUnavailable {
            retry_after: Duration::from_millis(2_500),
        };
        let response = r.clone().into_response(false);
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[RETRY_AFTER], "3");
        assert_eq!(r.kind(), "dependency-unavailable");
        assert_eq!(
            r.problem(),
            json!({
                "type": TEMPORARY_REDUCED_CAPACITY_TYPE,
                "title": "Temporary Reduced Capacity",
                "status": 503,
                "detail": "a dependency this request needs cannot be called now",
                "retry_after": 3,
            })
        );
        let grpc = r.into_response(true);
        assert_eq!(grpc.headers()["grpc-status"], "14");
        assert_eq!(grpc.headers()[GRPC_RETRY_PUSHBACK_MS], "3000");
    }

    #[test]
    fn unregistered_refusals_keep_the_crate_types() {
        let r = Rejection::CostExceedsCapacity {
            policies: vec!["burst".into()],
            cost: 50,
        };
        assert_eq!(
            r.problem()["type"],
            format!("{PROBLEM_TYPE_BASE}#cost-exceeds-capacity")
        );
        assert_eq!(r.problem().get("violated-policies"), None);
        let r = Rejection::Overloaded {
            scope: OverloadScope::Global,
            retry_after: Duration::from_secs(2),
        };
        assert_eq!(
            r.problem()["type"],
            format!("{PROBLEM_TYPE_BASE}#overloaded")
        );
        assert_eq!(r.into_response(false).headers()[RETRY_AFTER], "2");
    }

    #[test]
    fn grpc_pushback_is_the_retry_after_in_ms_or_minus_one() {
        let cases = [
            (
                Rejection::QuotaExceeded {
                    policies: vec!["burst".into()],
                    retry_after: Duration::from_millis(600),
                },
                "8",
                "1000",
            ),
            (
                Rejection::LimiterUnavailable {
                    retry_after: Duration::from_millis(2500),
                },
                "14",
                "3000",
            ),
            (
                Rejection::Overloaded {
                    scope: OverloadScope::Identity,
                    retry_after: Duration::from_secs(1),
                },
                "8",
                "1000",
            ),
            (
                Rejection::CostExceedsCapacity {
                    policies: vec!["burst".into()],
                    cost: 50,
                },
                "8",
                "-1",
            ),
            (Rejection::Unauthenticated { reason: "missing" }, "16", "-1"),
        ];
        for (r, code, pushback) in cases {
            let response = r.clone().into_response(true);
            assert_eq!(response.status(), StatusCode::OK, "{r:?}");
            assert_eq!(response.headers()["grpc-status"], code, "{r:?}");
            assert_eq!(
                response.headers()[GRPC_RETRY_PUSHBACK_MS],
                pushback,
                "{r:?}"
            );
            match r.retry_after() {
                Some(_) => assert_eq!(
                    response.headers()[RETRY_AFTER],
                    (pushback.parse::<u64>().unwrap() / 1000).to_string()
                ),
                None => assert!(!response.headers().contains_key(RETRY_AFTER)),
            }
        }
    }

    #[cfg(feature = "tonic")]
    #[test]
    fn grpc_details_carry_retry_info_and_quota_failure() {
        use tonic_types::StatusExt;
        let r = Rejection::QuotaExceeded {
            policies: vec!["per-minute".into(), "burst".into()],
            retry_after: Duration::from_millis(600),
        };
        let response = r.into_response(true);
        let status = tonic::Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        let details = status.get_error_details();
        assert_eq!(
            details.retry_info().unwrap().retry_delay,
            Some(Duration::from_secs(1))
        );
        let violations = &details.quota_failure().unwrap().violations;
        let names: Vec<(&str, &str)> = violations
            .iter()
            .map(|v| (v.subject.as_str(), v.quota_id.as_str()))
            .collect();
        assert_eq!(names, [("per-minute", "per-minute"), ("burst", "burst")]);

        let r = Rejection::InvalidParameters(vec![InvalidParameter::new("page_size", "too big")]);
        let status = tonic::Status::from_header_map(r.into_response(true).headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        let bad = status.get_details_bad_request().unwrap();
        assert_eq!(bad.field_violations[0].field, "page_size");
        assert_eq!(bad.field_violations[0].description, "too big");

        let r = Rejection::Unauthenticated { reason: "missing" };
        let response = r.into_response(true);
        assert!(!response.headers().contains_key("grpc-status-details-bin"));
    }

    #[test]
    fn grpc_rejections_use_grpc_status() {
        let mut h = HeaderMap::new();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/grpc+proto"),
        );
        assert!(is_grpc(&h));
        let r = Rejection::Unauthenticated { reason: "missing" };
        let response = r.into_response(true);
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["grpc-status"], "16");
    }
}
