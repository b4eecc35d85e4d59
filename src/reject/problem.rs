//! HTTP refusals: problem details (RFC 9457).

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::Response;
use serde_json::json;

use super::{names, retry_after_secs, Rejection};

/// Base of this crate's own problem `type` URIs, for the refusals that have
/// no registered problem type. The fragment is [`Rejection::kind`].
pub(crate) const PROBLEM_TYPE_BASE: &str =
    "https://docs.rs/tower-admission/latest/tower_admission/reject/";

/// The registered problem type of a quota refusal (429). Its extension member
/// `violated-policies` is an array with the names of the refusing policies.
pub(crate) const QUOTA_EXCEEDED_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// The registered problem type of a request the server cannot serve now
/// because its capacity is temporarily reduced (503): here, a limiter that
/// could not decide while its policies fail closed, or a dependency that
/// cannot be called.
pub(crate) const TEMPORARY_REDUCED_CAPACITY_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

impl Rejection {
    /// The problem `type` URI: the registered
    /// `https://iana.org/assignments/http-problem-types#quota-exceeded` and
    /// `…#temporary-reduced-capacity`, or this crate's own,
    /// `https://docs.rs/tower-admission/latest/tower_admission/reject/`
    /// followed by `#` and [`kind`](Self::kind).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::reject::Rejection;
    ///
    /// let outage = Rejection::LimiterUnavailable { retry_after: Duration::from_secs(1) };
    /// assert_eq!(
    ///     outage.problem_type(),
    ///     "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
    /// );
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
    /// `detail` and the extension members in the [module table](super).
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
            Rejection::BodyTooLarge { limit }
            | Rejection::DecodedTooLarge { limit }
            | Rejection::TooManyItems { limit } => {
                json!({"cap": self.size_cap(), "limit": limit})
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

    /// The problem details response, before the `Retry-After` every
    /// refusal a wait can cure carries.
    pub(super) fn problem_response(&self) -> Response<Bytes> {
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
    }
}
