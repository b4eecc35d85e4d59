//! gRPC-Web callers (`application/grpc-web*`, binary or `-text`, in any
//! case): refusals answer with the caller's gRPC-Web content type and the
//! status in the headers (trailers-only), and a body cap that trips after a
//! streaming answer began ends the call with a gRPC-Web trailer frame in the
//! body (base64 for `-text`), never with HTTP trailers a browser cannot read.

use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{stream, Stream, StreamExt};
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_admission::bounds::{BatchItemsLayer, BodyLimitsLayer, CappedBody};
use tower_admission::concurrency::ConcurrencyLayer;
use tower_admission::identity::{ApiKeys, AuthenticateLayer, Identity};
use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer};
use tower_admission::reject::Rejection;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Frames = Pin<Box<dyn Stream<Item = Result<Frame<Bytes>, BoxError>> + Send>>;
type WebBody = StreamBody<Frames>;
/// A request stream of chunks.
type ReqBody = StreamBody<stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

/// Request content types and the content type their refusals must carry.
const FLAVOURS: [(&str, &str); 7] = [
    ("application/grpc-web", "application/grpc-web"),
    ("application/grpc-web+proto", "application/grpc-web+proto"),
    ("application/grpc-web+json", "application/grpc-web+json"),
    ("application/grpc-web-text", "application/grpc-web-text"),
    (
        "application/grpc-web-text+proto",
        "application/grpc-web-text+proto",
    ),
    (
        "Application/GRPC-Web-Text+Proto",
        "application/grpc-web-text+proto",
    ),
    (
        "APPLICATION/GRPC-WEB+PROTO; charset=utf-8",
        "application/grpc-web+proto",
    ),
];

/// The `grpc-message` of a refusal as this build writes it: tonic's
/// percent-encoding with the `tonic` feature, the crate's own without.
fn message(detail: &str) -> String {
    if cfg!(feature = "tonic") {
        detail.replace(' ', "%20")
    } else {
        detail.to_owned()
    }
}

fn headers(content_type: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_str(content_type).unwrap());
    headers
}

fn assert_trailers_only(response: &Response<impl Sized>, content_type: &str, code: &str) {
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()[CONTENT_TYPE], content_type);
    assert_eq!(response.headers()["grpc-status"], code);
}

/// Every refusal, for every gRPC-Web flavour: trailers-only with the
/// caller's content type, and the same status headers as plain gRPC.
#[test]
fn every_refusal_answers_grpc_web_with_its_own_content_type() {
    let quota = Rejection::QuotaExceeded {
        policies: vec!["per-minute".into()],
        retry_after: std::time::Duration::from_millis(1500),
    };
    for (content_type, expected) in FLAVOURS {
        let response = quota.clone().into_response(&headers(content_type));
        assert_trailers_only(&response, expected, "8");
        let plain = quota.clone().into_response(&headers("application/grpc"));
        assert_eq!(plain.headers()[CONTENT_TYPE], "application/grpc");
        for name in [
            "grpc-status",
            "grpc-message",
            "grpc-retry-pushback-ms",
            "retry-after",
        ] {
            assert_eq!(response.headers()[name], plain.headers()[name], "{name}");
        }
        assert_eq!(response.headers()["grpc-retry-pushback-ms"], "2000");
        #[cfg(feature = "tonic")]
        assert_eq!(
            response.headers()["grpc-status-details-bin"],
            plain.headers()["grpc-status-details-bin"]
        );
    }
}

/// A wire cap refused before the call runs (its `content-length` is over
/// the cap): RESOURCE_EXHAUSTED in the caller's content type.
#[tokio::test]
async fn an_early_cap_refusal_answers_grpc_web_with_its_content_type() {
    for (content_type, expected) in FLAVOURS {
        let service = ServiceBuilder::new()
            .layer(BodyLimitsLayer::new(4, 4))
            .service(service_fn(|_: Request<CappedBody<Full<Bytes>>>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }));
        let request = Request::builder()
            .method("POST")
            .header(CONTENT_TYPE, content_type)
            .header("content-length", "16")
            .body(Full::new(Bytes::from_static(&[0; 16])))
            .unwrap();
        let response = service.oneshot(request).await.unwrap();
        assert_trailers_only(&response, expected, "8");
        assert_eq!(
            response.headers()["grpc-message"],
            message("the wire-bytes cap of 4 was exceeded").as_str()
        );
        assert_eq!(response.headers()["grpc-retry-pushback-ms"], "-1");
        let body = response.into_body().collect().await.unwrap();
        assert!(body.trailers().is_none());
        assert_eq!(body.to_bytes(), Bytes::new());
    }
}

/// A batch that is not a JSON object, refused by `BatchItemsLayer`.
#[tokio::test]
async fn a_batch_refusal_answers_grpc_web_with_its_content_type() {
    let service = ServiceBuilder::new()
        .layer(BatchItemsLayer::new(NonZeroUsize::new(10).unwrap()))
        .service(service_fn(|_: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        }));
    let request = Request::builder()
        .method("POST")
        .header(CONTENT_TYPE, "application/grpc-web-text")
        .body(Full::new(Bytes::from_static(b"AAAAAAA=")))
        .unwrap();
    let response = service.oneshot(request).await.unwrap();
    assert_trailers_only(&response, "application/grpc-web-text", "3");
}

/// UNAUTHENTICATED from `AuthenticateLayer`. Needs `src/identity` to name
/// the request's protocol from its headers, not a plain gRPC flag.
#[tokio::test]
async fn an_unauthenticated_grpc_web_call_gets_its_content_type() {
    let service = ServiceBuilder::new()
        .layer(AuthenticateLayer::new(
            ApiKeys::new().with_key("k", Identity::new("alice", "acme", "free")),
        ))
        .service(service_fn(|_: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        }));
    let request = Request::builder()
        .method("POST")
        .header(CONTENT_TYPE, "application/grpc-web+proto")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = service.oneshot(request).await.unwrap();
    assert_trailers_only(&response, "application/grpc-web+proto", "16");
    assert_eq!(response.headers()["grpc-retry-pushback-ms"], "-1");
}

#[tokio::test]
async fn a_quota_refusal_answers_grpc_web_with_its_content_type() {
    let quota = Quota::new(
        "api",
        [Policy::fixed_window("per-minute", 1, Duration::from_secs(60)).unwrap()],
    )
    .unwrap();
    let layer = QuotaLayer::builder(MemoryStore::new())
        .quota(quota)
        .aggregate()
        .build()
        .unwrap();
    let service =
        ServiceBuilder::new()
            .layer(layer)
            .service(service_fn(|_: Request<Full<Bytes>>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }));
    for (sent, answered) in FLAVOURS {
        let request = || {
            Request::post("/")
                .header(CONTENT_TYPE, sent)
                .body(Full::new(Bytes::new()))
                .unwrap()
        };
        // The one admission of the minute goes to the first flavour.
        if sent == FLAVOURS[0].0 {
            let admitted = service.clone().oneshot(request()).await.unwrap();
            assert!(admitted.headers().get("grpc-status").is_none(), "{sent}");
        }
        let response = service.clone().oneshot(request()).await.unwrap();
        assert_trailers_only(&response, answered, "8");
        let pushback: u64 = response.headers()["grpc-retry-pushback-ms"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=60_000).contains(&pushback), "{sent}: {pushback}");
    }
}

#[tokio::test]
async fn a_concurrency_refusal_answers_grpc_web_with_its_content_type() {
    // One in flight, no queue: a second call while the first runs is refused.
    let layer = ConcurrencyLayer::builder()
        .global(1, 0, Duration::from_secs(1))
        .build()
        .unwrap();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let released = std::sync::Arc::new(tokio::sync::Mutex::new(Some(released)));
    let service =
        ServiceBuilder::new()
            .layer(layer)
            .service(service_fn(move |_: Request<Full<Bytes>>| {
                let released = released.clone();
                async move {
                    if let Some(released) = released.lock().await.take() {
                        let _ = released.await;
                    }
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                }
            }));
    let request = |content_type: &str| {
        Request::post("/")
            .header(CONTENT_TYPE, content_type)
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let first = tokio::spawn(service.clone().oneshot(request("application/grpc-web")));
    tokio::task::yield_now().await;
    for (sent, answered) in FLAVOURS {
        let response = service.clone().oneshot(request(sent)).await.unwrap();
        assert_trailers_only(&response, answered, "14");
    }
    release.send(()).unwrap();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert!(first.headers().get("grpc-status").is_none());
}

// ------------------------------------------------ a cap tripped mid-stream

/// One gRPC message frame: flag 0, big-endian length, payload.
fn message_frame(payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![0];
    frame.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// A gRPC-Web trailer frame: flag 0x80, big-endian length, the trailers as
/// an HTTP/1 header block.
fn trailer_frame(block: &str) -> Vec<u8> {
    let mut frame = vec![0x80];
    frame.extend_from_slice(&u32::try_from(block.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(block.as_bytes());
    frame
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as gRPC-Web-text writes each chunk.
fn base64(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize]);
            } else {
                out.push(b'=');
            }
        }
    }
    out
}

/// Decodes base64 that may carry padding in the middle (chunks encoded one
/// by one), as a gRPC-Web-text client must.
fn unbase64(text: &[u8]) -> Vec<u8> {
    assert_eq!(text.len() % 4, 0, "{:?}", String::from_utf8_lossy(text));
    let mut out = Vec::new();
    for group in text.chunks(4) {
        let mut n = 0u32;
        let mut len = 0;
        for &c in group {
            n <<= 6;
            if c != b'=' {
                n |= B64.iter().position(|&b| b == c).unwrap() as u32;
                len += 1;
            }
        }
        out.extend_from_slice(&n.to_be_bytes()[1..][..len - 1]);
    }
    out
}

/// The trailer frame of the decoded-bytes cap's refusal: the status of
/// `BodyLimits` before an answer, in the body.
fn refusal_block(cap: usize) -> String {
    format!(
        "grpc-status:8\r\ngrpc-message:{}\r\ngrpc-retry-pushback-ms:-1\r\n",
        message(&format!("the decoded-bytes cap of {cap} was exceeded"))
    )
}

/// A gRPC-Web handler (what a service behind tonic-web's translation
/// answers): it answers at once with one message, then reads its request
/// stream to the end, and ends with `grpc-status: 0` in a trailer frame
/// whatever the read gave, its `chunks` written as they are.
fn web_handler(
    content_type: &'static str,
    chunks: impl Fn() -> (Vec<Vec<u8>>, Vec<Vec<u8>>) + Clone + Send + 'static,
) -> impl tower::Service<
    Request<CappedBody<ReqBody>>,
    Response = Response<WebBody>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    service_fn(move |request: Request<CappedBody<_>>| {
        let chunks = chunks.clone();
        async move {
            let (before, after) = chunks();
            let mut body = request.into_body();
            let before = stream::iter(before.into_iter().map(|c| Ok(Frame::data(Bytes::from(c)))));
            let after = stream::once(async move {
                while let Some(frame) = body.frame().await {
                    if frame.is_err() {
                        break;
                    }
                }
                stream::iter(after.into_iter().map(|c| Ok(Frame::data(Bytes::from(c)))))
            })
            .flatten();
            let frames: Frames = Box::pin(before.chain(after));
            let mut response = Response::new(StreamBody::new(frames));
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
            Ok::<_, Infallible>(response)
        }
    })
}

/// A request stream of 16 bytes in two chunks, no `content-length`.
fn streaming_request(content_type: &str) -> Request<ReqBody> {
    let chunks = vec![
        Ok(Frame::data(Bytes::from_static(&[1; 8]))),
        Ok(Frame::data(Bytes::from_static(&[2; 8]))),
    ];
    Request::builder()
        .method("POST")
        .header(CONTENT_TYPE, content_type)
        .body(StreamBody::new(stream::iter(chunks)))
        .unwrap()
}

async fn call(
    content_type: &'static str,
    request_type: &str,
    chunks: impl Fn() -> (Vec<Vec<u8>>, Vec<Vec<u8>>) + Clone + Send + 'static,
) -> (Response<()>, Bytes, Option<HeaderMap>) {
    let service = ServiceBuilder::new()
        .layer(BodyLimitsLayer::new(1024, 8))
        .service(web_handler(content_type, chunks));
    let response = service
        .oneshot(streaming_request(request_type))
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap();
    let trailers = body.trailers().cloned();
    (Response::from_parts(parts, ()), body.to_bytes(), trailers)
}

/// Binary gRPC-Web: the handler's trailer frame (`grpc-status:0`) is
/// replaced in the body by the cap's refusal; no HTTP trailers.
#[tokio::test]
async fn a_cap_tripped_mid_stream_ends_a_grpc_web_call_with_a_refusal_trailer_frame() {
    let (response, body, trailers) = call(
        "application/grpc-web+proto",
        "application/grpc-web+proto",
        || {
            (
                vec![message_frame(b"hi")],
                vec![trailer_frame("grpc-status:0\r\n")],
            )
        },
    )
    .await;
    assert_eq!(
        response.headers()[CONTENT_TYPE],
        "application/grpc-web+proto"
    );
    let mut expected = message_frame(b"hi");
    expected.extend(trailer_frame(&refusal_block(8)));
    assert_eq!(body, expected, "{:?}", String::from_utf8_lossy(&body));
    assert_eq!(trailers, None);
}

/// The trailer frame may share a chunk with the end of a message, and a
/// message may span chunks: the frames are found wherever they start, and
/// other trailer metadata of the handler is kept.
#[tokio::test]
async fn the_trailer_frame_is_found_inside_a_chunk() {
    let (_, body, trailers) = call("application/grpc-web", "application/grpc-web", || {
        let message = message_frame(b"hello");
        let mut last = message[3..].to_vec();
        last.extend(trailer_frame("grpc-status:0\r\nx-served-by:a\r\n"));
        (vec![message[..3].to_vec()], vec![last])
    })
    .await;
    let mut expected = message_frame(b"hello");
    expected.extend(trailer_frame(&format!(
        "x-served-by:a\r\n{}",
        refusal_block(8)
    )));
    assert_eq!(body, expected, "{:?}", String::from_utf8_lossy(&body));
    assert_eq!(trailers, None);
}

/// gRPC-Web-text: the refusal trailer frame is base64, like the rest.
#[tokio::test]
async fn a_cap_tripped_mid_stream_ends_a_grpc_web_text_call_with_a_base64_trailer_frame() {
    let (response, body, trailers) = call(
        "application/grpc-web-text+proto",
        "application/grpc-web-text+proto",
        || {
            (
                vec![base64(&message_frame(b"hi"))],
                vec![base64(&trailer_frame("grpc-status:0\r\n"))],
            )
        },
    )
    .await;
    assert_eq!(
        response.headers()[CONTENT_TYPE],
        "application/grpc-web-text+proto"
    );
    let mut expected = base64(&message_frame(b"hi"));
    expected.extend(base64(&trailer_frame(&refusal_block(8))));
    assert_eq!(body, expected, "{:?}", String::from_utf8_lossy(&body));
    assert_eq!(trailers, None);
}

/// gRPC-Web-text whose trailer frame starts inside a base64 group (the
/// message and the trailers encoded together, and split across chunks):
/// the message bytes are kept and the refusal replaces the trailers.
#[tokio::test]
async fn a_text_trailer_frame_inside_a_base64_group_is_replaced() {
    let (_, body, trailers) = call(
        "application/grpc-web-text",
        "application/grpc-web-text",
        || {
            let mut all = message_frame(b"hi");
            all.extend(trailer_frame("grpc-status:0\r\n"));
            let text = base64(&all);
            (vec![text[..6].to_vec()], vec![text[6..].to_vec()])
        },
    )
    .await;
    let mut expected = message_frame(b"hi");
    expected.extend(trailer_frame(&refusal_block(8)));
    assert_eq!(
        unbase64(&body),
        expected,
        "{:?}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(trailers, None);
}

/// A gRPC-Web call whose cap never trips passes byte for byte.
#[tokio::test]
async fn an_untripped_grpc_web_stream_passes_unchanged() {
    let service = ServiceBuilder::new()
        .layer(BodyLimitsLayer::new(1024, 1024))
        .service(web_handler("application/grpc-web-text", || {
            let mut all = message_frame(b"hi");
            all.extend(trailer_frame("grpc-status:0\r\n"));
            let text = base64(&all);
            (vec![text[..6].to_vec()], vec![text[6..].to_vec()])
        }));
    let response = service
        .oneshot(streaming_request("application/grpc-web-text"))
        .await
        .unwrap();
    let body = response.into_body().collect().await.unwrap();
    assert!(body.trailers().is_none());
    let mut all = message_frame(b"hi");
    all.extend(trailer_frame("grpc-status:0\r\n"));
    assert_eq!(body.to_bytes(), base64(&all));
}
