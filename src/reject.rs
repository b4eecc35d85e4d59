//! The one place that turns a refusal into a response.
//!
//! Every layer in this crate refuses by returning `Ok(response)` built here,
//! never an error, so stacks keep axum's `Infallible` bound. The typed
//! [`Rejection`] is inserted into the response extensions for logging and
//! tests.
//!
//! | status | variant |
//! |---|---|
//! | 400 | [`Rejection::InvalidParameters`] |
//! | 401 | [`Rejection::Unauthenticated`] |
//! | 413 | [`Rejection::PayloadTooLarge`], [`Rejection::CostExceedsCapacity`] |
//! | 415 | [`Rejection::UnsupportedEncoding`] |
//! | 429 | [`Rejection::QuotaExceeded`], [`Rejection::Overloaded`] with [`OverloadScope::Identity`] |
//! | 503 | [`Rejection::Overloaded`] with [`OverloadScope::Global`], [`Rejection::LimiterUnavailable`] |
//!
//! HTTP bodies are `application/problem+json` (RFC 9457). Requests whose
//! `content-type` starts with `application/grpc` get a trailers-only gRPC
//! response instead: `RESOURCE_EXHAUSTED`, `UNAUTHENTICATED`,
//! `INVALID_ARGUMENT`, `UNAVAILABLE`. With the `tonic` feature a
//! `RESOURCE_EXHAUSTED` or `UNAVAILABLE` status carries a `google.rpc.RetryInfo`
//! detail.
//!
//! `Retry-After` is always the exact wait rounded **up** to whole seconds, and
//! at least 1.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use http_body_util::{Either, Full};
use serde_json::json;

use crate::quota::Outcome;

/// Response body of every layer in this crate: the inner service's body, or a
/// rejection's.
pub type ResponseBody<B> = Either<B, Full<Bytes>>;

/// Base of the problem `type` URIs.
pub const PROBLEM_TYPE_BASE: &str =
    "https://docs.rs/tower-admission/latest/tower_admission/reject/";

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

/// `ceil(wait)` in whole seconds, at least 1: the value of `Retry-After`.
pub fn retry_after_secs(wait: Duration) -> u64 {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.max(1)
}

/// True when the request is gRPC (`content-type: application/grpc*`).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
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
            Rejection::LimiterUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The wait to advertise in `Retry-After`, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Rejection::QuotaExceeded { retry_after, .. }
            | Rejection::Overloaded { retry_after, .. }
            | Rejection::LimiterUnavailable { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// Short kebab-case name, the last segment of the problem `type`.
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
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Rejection::Unauthenticated { .. } => "Authentication required",
            Rejection::InvalidParameters(_) => "Invalid request parameters",
            Rejection::PayloadTooLarge { .. } => "Payload too large",
            Rejection::UnsupportedEncoding { .. } => "Unsupported content encoding",
            Rejection::QuotaExceeded { .. } => "Quota exceeded",
            Rejection::CostExceedsCapacity { .. } => "Request cost exceeds quota capacity",
            Rejection::Overloaded { .. } => "Too many requests in progress",
            Rejection::LimiterUnavailable { .. } => "Rate limiter unavailable",
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
        }
    }

    /// The RFC 9457 problem document.
    pub fn problem(&self) -> serde_json::Value {
        let status = self.status();
        let mut doc = json!({
            "type": format!("{PROBLEM_TYPE_BASE}#{}", self.kind()),
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
            Rejection::QuotaExceeded { policies, .. } => json!({"policies": names(policies)}),
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

    /// The HTTP response for this rejection, or its gRPC form when `grpc`.
    pub fn into_response(self, grpc: bool) -> Response<Full<Bytes>> {
        let mut response = if grpc {
            self.grpc_response()
        } else {
            let body = serde_json::to_vec(&self.problem()).unwrap_or_default();
            let mut response = Response::new(Full::new(Bytes::from(body)));
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
        response
    }

    /// The rejection as a response body of any layer of this crate.
    pub fn into_layer_response<B>(self, grpc: bool) -> Response<ResponseBody<B>> {
        self.into_response(grpc).map(Either::Right)
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
            Rejection::LimiterUnavailable { .. } => 14,
        }
    }

    #[cfg(feature = "tonic")]
    fn grpc_response(&self) -> Response<Full<Bytes>> {
        use tonic_types::{ErrorDetails, StatusExt};
        let code = tonic::Code::from_i32(self.grpc_code());
        let status = match self.retry_after() {
            Some(wait) => tonic::Status::with_error_details(
                code,
                self.detail(),
                ErrorDetails::with_retry_info(Some(Duration::from_secs(retry_after_secs(wait)))),
            ),
            None => tonic::Status::new(code, self.detail()),
        };
        let mut response: Response<Full<Bytes>> = status.into_http();
        response.extensions_mut().remove::<tonic::Status>();
        response
    }

    #[cfg(not(feature = "tonic"))]
    fn grpc_response(&self) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::default());
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert("grpc-status", HeaderValue::from(self.grpc_code()));
        // The detail is ASCII without control characters; percent-encode the rest.
        let message: String = self
            .detail()
            .chars()
            .map(|c| match c {
                ' '..='~' if c != '%' => c.to_string(),
                _ => format!("%{:02X}", c as u32 & 0xff),
            })
            .collect();
        if let Ok(v) = HeaderValue::from_str(&message) {
            headers.insert("grpc-message", v);
        }
        response
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(doc["status"], 429);
        assert_eq!(doc["policies"][0], "per-minute");
        assert_eq!(doc["retry_after"], 2);
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
