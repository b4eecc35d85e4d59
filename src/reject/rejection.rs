//! Why a request was refused, and its response in either protocol.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use http_body_util::Full;

use super::{retry_after_secs, Protocol, RefusalBody};

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
    /// The body's bytes on the wire exceed the cap. 413.
    BodyTooLarge {
        /// The configured cap.
        limit: u64,
    },
    /// The body's bytes after decompression exceed the cap. 413.
    DecodedTooLarge {
        /// The configured cap.
        limit: u64,
    },
    /// A batch has more items than the cap. 413.
    TooManyItems {
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
    /// The service is at its concurrency limit: a cap and its queue are
    /// full, or the queue deadline passed. 503.
    Overloaded {
        /// Suggested wait.
        retry_after: Duration,
        /// The cap of concurrent work that refused, as its name and limit.
        /// Over HTTP the response advertises it as a quota of concurrent
        /// requests, used up: `RateLimit-Policy: "NAME";q=LIMIT;
        /// qu="concurrent-requests"` and `RateLimit: "NAME";r=0;t=WAIT`.
        /// `None` when no count of work refused: a full identity map of a
        /// [`ConcurrencyLayer`](crate::concurrency::ConcurrencyLayer), a
        /// [`JobQueue`](crate::jobs::JobQueue) that was shut down.
        cap: Option<(&'static str, usize)>,
    },
    /// The caller is at its own concurrency limit; it can fix that by
    /// waiting for its own requests. 429.
    CallerBusy {
        /// Suggested wait.
        retry_after: Duration,
        /// The caller's cap that refused, as its name and limit, advertised
        /// over HTTP as [`Overloaded`](Self::Overloaded)'s is.
        cap: Option<(&'static str, usize)>,
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

impl Rejection {
    /// The HTTP status of this rejection.
    pub fn status(&self) -> StatusCode {
        match self {
            Rejection::Unauthenticated { .. } => StatusCode::UNAUTHORIZED,
            Rejection::InvalidParameters(_) => StatusCode::BAD_REQUEST,
            Rejection::BodyTooLarge { .. }
            | Rejection::DecodedTooLarge { .. }
            | Rejection::TooManyItems { .. }
            | Rejection::CostExceedsCapacity { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Rejection::UnsupportedEncoding { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Rejection::QuotaExceeded { .. } | Rejection::CallerBusy { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Rejection::Overloaded { .. }
            | Rejection::LimiterUnavailable { .. }
            | Rejection::DependencyUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The wait to advertise in `Retry-After`, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Rejection::QuotaExceeded { retry_after, .. }
            | Rejection::Overloaded { retry_after, .. }
            | Rejection::CallerBusy { retry_after, .. }
            | Rejection::LimiterUnavailable { retry_after }
            | Rejection::DependencyUnavailable { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// Short kebab-case name of the reason, for logs and metrics. For the
    /// refusals without a registered problem type it is also the fragment
    /// of their `type` after this crate's base URI (see [`problem_type`](Self::problem_type)).
    /// The three size refusals share `payload-too-large`, whose problem's
    /// `cap` member tells them apart, and the two concurrency refusals
    /// `overloaded`.
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
            Rejection::BodyTooLarge { .. }
            | Rejection::DecodedTooLarge { .. }
            | Rejection::TooManyItems { .. } => "payload-too-large",
            Rejection::UnsupportedEncoding { .. } => "unsupported-encoding",
            Rejection::QuotaExceeded { .. } => "quota-exceeded",
            Rejection::CostExceedsCapacity { .. } => "cost-exceeds-capacity",
            Rejection::Overloaded { .. } | Rejection::CallerBusy { .. } => "overloaded",
            Rejection::LimiterUnavailable { .. } => "limiter-unavailable",
            Rejection::DependencyUnavailable { .. } => "dependency-unavailable",
        }
    }

    /// The cap of concurrent work that refused, by name and limit.
    fn cap(&self) -> Option<(&'static str, usize)> {
        match *self {
            Rejection::Overloaded { cap, .. } | Rejection::CallerBusy { cap, .. } => cap,
            _ => None,
        }
    }

    /// The name of the size cap a 413 for size exceeded, for the problem's
    /// `cap` member and the `detail`.
    pub(super) fn size_cap(&self) -> Option<&'static str> {
        match self {
            Rejection::BodyTooLarge { .. } => Some("wire-bytes"),
            Rejection::DecodedTooLarge { .. } => Some("decoded-bytes"),
            Rejection::TooManyItems { .. } => Some("items"),
            _ => None,
        }
    }

    pub(super) fn title(&self) -> &'static str {
        match self {
            Rejection::Unauthenticated { .. } => "Authentication required",
            Rejection::InvalidParameters(_) => "Invalid request parameters",
            Rejection::BodyTooLarge { .. }
            | Rejection::DecodedTooLarge { .. }
            | Rejection::TooManyItems { .. } => "Payload too large",
            Rejection::UnsupportedEncoding { .. } => "Unsupported content encoding",
            Rejection::QuotaExceeded { .. } => "Quota Exceeded",
            Rejection::CostExceedsCapacity { .. } => "Request cost exceeds quota capacity",
            Rejection::Overloaded { .. } | Rejection::CallerBusy { .. } => {
                "Too many requests in progress"
            }
            Rejection::LimiterUnavailable { .. } | Rejection::DependencyUnavailable { .. } => {
                "Temporary Reduced Capacity"
            }
        }
    }

    pub(super) fn detail(&self) -> String {
        match self {
            Rejection::Unauthenticated { reason } => (*reason).to_owned(),
            Rejection::InvalidParameters(errors) => {
                let names: Vec<&str> = errors.iter().map(|e| e.name.as_str()).collect();
                format!("invalid parameters: {}", names.join(", "))
            }
            Rejection::BodyTooLarge { limit }
            | Rejection::DecodedTooLarge { limit }
            | Rejection::TooManyItems { limit } => {
                let cap = self.size_cap().unwrap_or_default();
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
            Rejection::Overloaded { .. } => "the service is at its concurrency limit".to_owned(),
            Rejection::CallerBusy { .. } => "you are at your concurrency limit".to_owned(),
            Rejection::LimiterUnavailable { .. } => {
                "the rate limiter could not decide in time".to_owned()
            }
            Rejection::DependencyUnavailable { .. } => {
                "a dependency this request needs cannot be called now".to_owned()
            }
        }
    }

    /// The response to a request with `request_headers`, in the protocol
    /// the request speaks, named by its `content-type`: problem details for
    /// HTTP, a gRPC status for gRPC (`application/grpc*`) and for gRPC-Web
    /// (`application/grpc-web*`, answered with the caller's own media type);
    /// see [gRPC](crate::reject#grpc-statuses-with-details).
    ///
    /// ```
    /// use http::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
    /// use tower_admission::reject::Rejection;
    ///
    /// let refusal = Rejection::Unauthenticated { reason: "missing credential" };
    /// let http = refusal.clone().into_response(&HeaderMap::new());
    /// assert_eq!(http.status(), 401);
    /// let mut headers = HeaderMap::new();
    /// headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc-web-text"));
    /// let web = refusal.into_response(&headers);
    /// assert_eq!(web.headers()["content-type"], "application/grpc-web-text");
    /// assert_eq!(web.headers()["grpc-status"], "16");
    /// ```
    pub fn into_response(self, request_headers: &HeaderMap) -> Response<Full<Bytes>> {
        self.respond(Protocol::of(request_headers))
    }

    /// The rejection as a response of any layer of this crate, in the inner
    /// service's body type; see [`into_response`](Self::into_response).
    pub fn into_layer_response<B: RefusalBody>(self, request_headers: &HeaderMap) -> Response<B> {
        self.respond(Protocol::of(request_headers))
    }

    /// The response in `protocol`, of a request already read.
    pub(crate) fn respond<B: RefusalBody>(self, protocol: impl Into<Protocol>) -> Response<B> {
        let protocol = protocol.into();
        let mut response = if protocol.is_grpc() {
            let mut response = self.grpc_response();
            response
                .headers_mut()
                .insert(CONTENT_TYPE, protocol.grpc_content_type());
            response
        } else {
            self.problem_response()
        };
        if let Some(wait) = self.retry_after() {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(wait)));
        }
        if let (Some((name, limit)), Some(wait), false) =
            (self.cap(), self.retry_after(), protocol.is_grpc())
        {
            crate::quota::headers::insert_concurrency(response.headers_mut(), name, limit, wait);
        }
        response.extensions_mut().insert(self);
        response.map(B::from_refusal)
    }
}

/// The status and the `detail`, then the cap of concurrent work that
/// refused, if any: `503 Service Unavailable: the service is at its
/// concurrency limit (job-queue: 100)`.
impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status(), self.detail())?;
        match self.cap() {
            Some((name, limit)) => write!(f, " ({name}: {limit})"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for Rejection {}

pub(super) fn names(policies: &[Arc<str>]) -> Vec<&str> {
    policies.iter().map(|p| &**p).collect()
}

fn join(policies: &[Arc<str>]) -> String {
    names(policies).join(", ")
}
