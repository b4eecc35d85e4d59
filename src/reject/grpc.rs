//! gRPC refusals: trailers-only statuses, with `google.rpc` details under
//! the `tonic` feature.

#[cfg(feature = "tonic")]
use std::sync::Arc;
#[cfg(feature = "tonic")]
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderValue;
#[cfg(not(feature = "tonic"))]
use http::header::CONTENT_TYPE;
use http::{HeaderMap, Response};

use super::{retry_after_secs, Rejection};

/// The gRPC response header (in a trailers-only response, the trailer) that
/// tells a gRPC client with a retry policy how many milliseconds to wait
/// before its next attempt; a negative value tells it not to retry.
pub(crate) const GRPC_RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";

impl Rejection {
    /// The gRPC status code number of this rejection.
    pub fn grpc_code(&self) -> i32 {
        match self {
            Rejection::Unauthenticated { .. } => 16,
            Rejection::InvalidParameters(_) | Rejection::UnsupportedEncoding { .. } => 3,
            Rejection::BodyTooLarge { .. }
            | Rejection::DecodedTooLarge { .. }
            | Rejection::TooManyItems { .. }
            | Rejection::CostExceedsCapacity { .. }
            | Rejection::QuotaExceeded { .. }
            | Rejection::CallerBusy { .. } => 8,
            Rejection::Overloaded { .. }
            | Rejection::LimiterUnavailable { .. }
            | Rejection::DependencyUnavailable { .. } => 14,
        }
    }

    /// The value of `grpc-retry-pushback-ms`: the `Retry-After` wait in
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
    pub(super) fn grpc_response(&self) -> Response<Bytes> {
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
    pub(super) fn grpc_response(&self) -> Response<Bytes> {
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

/// `detail` as a `grpc-message`: its UTF-8 bytes, each outside the visible
/// ASCII range (and `%`) percent-encoded, as the gRPC wire format asks.
#[cfg(any(test, not(feature = "tonic")))]
pub(super) fn grpc_message(detail: &str) -> String {
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
