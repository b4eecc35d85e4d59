use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, StatusCode};
use http_body_util::{BodyExt, Either, Full};
use serde_json::json;

use super::grpc::grpc_message;
use super::*;

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
            retry_after: Duration::from_millis(1500),
            cap: None,
        };
        let response = rejection.respond::<B>(grpc);
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

/// A wait of `Duration::MAX` (a budget that never admits again) saturates
/// instead of overflowing (moved from tests/reject.rs, which still checks the
/// headers).
#[test]
fn an_endless_wait_saturates_retry_after_secs() {
    assert_eq!(retry_after_secs(Duration::MAX), u64::MAX);
}

#[test]
fn quota_refusal_is_problem_json_with_retry_after() {
    let r = Rejection::QuotaExceeded {
        policies: vec!["per-minute".into()],
        retry_after: Duration::from_millis(1500),
    };
    let response = r.clone().respond::<Full<Bytes>>(false);
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
    let response = r.clone().respond::<Full<Bytes>>(false);
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
    let response = r.clone().respond::<Full<Bytes>>(false);
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
    let grpc = r.respond::<Full<Bytes>>(true);
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
        retry_after: Duration::from_secs(2),
        cap: None,
    };
    assert_eq!(
        r.problem()["type"],
        format!("{PROBLEM_TYPE_BASE}#overloaded")
    );
    assert_eq!(r.respond::<Full<Bytes>>(false).headers()[RETRY_AFTER], "2");
}

/// A refusal of concurrent work advertises its cap over HTTP only, and
/// names it in its text; without a cap, neither.
#[test]
fn a_concurrency_cap_is_advertised_over_http_only() {
    let busy = Rejection::CallerBusy {
        retry_after: Duration::from_millis(1500),
        cap: Some(("jobs-per-owner", 2)),
    };
    let http = busy.clone().respond::<Full<Bytes>>(false);
    assert_eq!(
        http.headers()["ratelimit-policy"],
        "\"jobs-per-owner\";q=2;qu=\"concurrent-requests\""
    );
    assert_eq!(http.headers()["ratelimit"], "\"jobs-per-owner\";r=0;t=2");
    let grpc = busy.clone().respond::<Full<Bytes>>(true);
    assert_eq!(grpc.headers().get("ratelimit"), None);
    assert_eq!(
        busy.to_string(),
        "429 Too Many Requests: you are at your concurrency limit (jobs-per-owner: 2)"
    );
    let shut = Rejection::Overloaded {
        retry_after: Duration::from_secs(1),
        cap: None,
    };
    assert_eq!(
        shut.clone()
            .respond::<Full<Bytes>>(false)
            .headers()
            .get("ratelimit"),
        None
    );
    assert_eq!(
        shut.to_string(),
        "503 Service Unavailable: the service is at its concurrency limit"
    );
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
            Rejection::CallerBusy {
                retry_after: Duration::from_secs(1),
                cap: None,
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
        let response = r.clone().respond::<Full<Bytes>>(true);
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
    let response = r.respond::<Full<Bytes>>(true);
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
    let status = tonic::Status::from_header_map(r.respond::<Full<Bytes>>(true).headers()).unwrap();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let bad = status.get_details_bad_request().unwrap();
    assert_eq!(bad.field_violations[0].field, "page_size");
    assert_eq!(bad.field_violations[0].description, "too big");

    let r = Rejection::Unauthenticated { reason: "missing" };
    let response = r.respond::<Full<Bytes>>(true);
    assert!(!response.headers().contains_key("grpc-status-details-bin"));
}

#[test]
fn grpc_rejections_use_grpc_status() {
    let mut h = HeaderMap::new();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/grpc+proto"),
    );
    assert!(Protocol::of(&h).is_grpc());
    let r = Rejection::Unauthenticated { reason: "missing" };
    let response = r.respond::<Full<Bytes>>(true);
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["grpc-status"], "16");
}

/// The one place that names a request's flavour: every `application/grpc*`
/// request is gRPC, and gRPC-Web is told apart in any case (moved from the
/// gRPC-Web integration tests when `Protocol` became crate-private).
#[test]
fn the_protocol_of_a_request_tells_grpc_web_from_grpc() {
    fn headers(content_type: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_str(content_type).unwrap());
        headers
    }
    for content_type in [
        "application/grpc-web",
        "application/grpc-web+proto",
        "application/grpc-web+json",
        "application/grpc-web-text",
        "application/grpc-web-text+proto",
        "Application/GRPC-Web-Text+Proto",
        "APPLICATION/GRPC-WEB+PROTO; charset=utf-8",
    ] {
        let protocol = Protocol::of(&headers(content_type));
        assert!(protocol.is_grpc(), "{content_type}");
        assert!(protocol.is_grpc_web(), "{content_type}");
        assert!(
            Protocol::of(&headers(content_type)).is_grpc(),
            "{content_type}"
        );
    }
    for content_type in [
        "application/grpc",
        "application/grpc+proto",
        "APPLICATION/GRPC+json",
        "application/grpc-webby",
    ] {
        let protocol = Protocol::of(&headers(content_type));
        assert_eq!(protocol, Protocol::GRPC, "{content_type}");
        assert!(!protocol.is_grpc_web(), "{content_type}");
    }
    for content_type in ["application/json", "text/plain", ""] {
        assert_eq!(Protocol::of(&headers(content_type)), Protocol::HTTP);
    }
    assert_eq!(Protocol::of(&HeaderMap::new()), Protocol::HTTP);
    assert_eq!(Protocol::from(true), Protocol::GRPC);
    assert_eq!(Protocol::from(false), Protocol::HTTP);
}
