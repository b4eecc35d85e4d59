//! Which protocol a request speaks: HTTP, gRPC or gRPC-Web.

use http::header::{HeaderValue, CONTENT_TYPE};
use http::HeaderMap;

fn starts_with_ignore_case(bytes: &[u8], prefix: &[u8]) -> bool {
    bytes
        .get(..prefix.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
}

/// The protocol a request speaks, which decides how its refusals are
/// written: problem details for HTTP, a trailers-only gRPC status for gRPC
/// (`content-type: application/grpc`), and the same status with the
/// caller's own content type for gRPC-Web.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Protocol(Wire);

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
    pub(crate) const HTTP: Protocol = Protocol(Wire::Http);
    /// Plain gRPC: refusals are trailers-only with `content-type: application/grpc`.
    pub(crate) const GRPC: Protocol = Protocol(Wire::Grpc);

    /// The protocol of a request with these headers. Its `content-type`,
    /// in any case, names it:
    ///
    /// * `application/grpc-web` or `application/grpc-web-text`, alone or
    ///   with a `+codec` suffix or parameters: gRPC-Web, its refusals
    ///   answered with that media type in lower case (parameters dropped);
    /// * any other that starts with `application/grpc`: gRPC;
    /// * anything else, or none: HTTP.
    pub(crate) fn of(headers: &HeaderMap) -> Protocol {
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
    pub(crate) fn is_grpc(&self) -> bool {
        !matches!(self.0, Wire::Http)
    }

    /// True for gRPC-Web, binary or text.
    pub(crate) fn is_grpc_web(&self) -> bool {
        matches!(self.0, Wire::GrpcWeb { .. })
    }

    /// True for gRPC-Web-text, whose bodies are base64.
    pub(crate) fn is_grpc_web_text(&self) -> bool {
        matches!(self.0, Wire::GrpcWeb { text: true, .. })
    }

    /// The `content-type` of a gRPC refusal.
    pub(super) fn grpc_content_type(&self) -> HeaderValue {
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

/// `true` is [`Protocol::GRPC`] and `false` [`Protocol::HTTP`].
impl From<bool> for Protocol {
    fn from(grpc: bool) -> Self {
        if grpc {
            Protocol::GRPC
        } else {
            Protocol::HTTP
        }
    }
}
