//! Body caps, query validation and batch item caps through an axum `Router`.

use std::io::Write;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::stream;
use http_body_util::BodyExt;
use proptest::prelude::*;
use serde_json::{json, Value};
use tower::ServiceExt;
use tower_admission::bounds::{
    BatchItemsLayer, BodyLimitsLayer, QueryRules, ValidateQueryLayer, ValidatedQuery,
};
use tower_admission::reject::{InvalidParameter, Rejection};

/// The item count as `BatchItemsLayer` takes it: `BatchItemsLayer::parse` into
/// zero-sized `IgnoredAny` items.
fn count_batch_items(json: &[u8], max: usize) -> Result<usize, Rejection> {
    BatchItemsLayer::parse::<serde::de::IgnoredAny>(json, max).map(|items| items.len())
}

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

// ---------------------------------------------------------------- helpers

/// Counts every body byte the handler is given.
async fn count_body(State(seen): State<Arc<AtomicU64>>, body: Body) -> Response {
    let mut body = body;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                if let Some(data) = frame.data_ref() {
                    seen.fetch_add(data.len() as u64, Ordering::SeqCst);
                }
            }
            // What a careless handler would answer: not 413, not ours.
            Err(_) => return (StatusCode::BAD_REQUEST, "body read failed").into_response(),
        }
    }
    (StatusCode::OK, seen.load(Ordering::SeqCst).to_string()).into_response()
}

/// axum's own `Bytes` extractor, which answers 413 text/plain on a length error.
async fn bytes_handler(State(seen): State<Arc<AtomicU64>>, body: Bytes) -> String {
    seen.fetch_add(body.len() as u64, Ordering::SeqCst);
    body.len().to_string()
}

fn body_app(wire: usize, decoded: usize, seen: Arc<AtomicU64>) -> Router {
    Router::new()
        .route("/stream", post(count_body))
        .route("/bytes", post(bytes_handler))
        .with_state(seen)
        .layer(BodyLimitsLayer::new(wire, decoded))
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, Response<Body>) {
    let response = app.clone().oneshot(req).await.unwrap();
    (response.status(), response)
}

async fn problem(response: Response<Body>) -> Value {
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

async fn text(response: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// `len` bytes as a chunked stream of 64 KiB frames, no content-length.
fn chunked(len: usize, byte: u8) -> Body {
    let chunks = (0..len.div_ceil(64 * KIB)).map(move |i| {
        let n = (len - i * 64 * KIB).min(64 * KIB);
        Ok::<_, std::io::Error>(Bytes::from(vec![byte; n]))
    });
    Body::from_stream(stream::iter(chunks))
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

/// A gzip stream of `decoded` zero bytes, compressed in 1 MiB steps so that
/// the decoded data is never held in memory.
fn gzip_zeros(decoded: usize) -> Vec<u8> {
    let zeros = vec![0u8; MIB];
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut left = decoded;
    while left > 0 {
        let n = left.min(MIB);
        enc.write_all(&zeros[..n]).unwrap();
        left -= n;
    }
    enc.finish().unwrap()
}

// ---------------------------------------------------------------- wire and decoded bytes

#[tokio::test]
async fn wire_cap_with_content_length_is_413_wire_bytes_before_the_handler() {
    let seen = Arc::new(AtomicU64::new(0));
    let app = body_app(MIB, 8 * MIB, seen.clone());
    let req = Request::post("/stream")
        .header(header::CONTENT_LENGTH, 2 * MIB)
        .body(Body::from(vec![b'a'; 2 * MIB]))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        response.extensions().get::<Rejection>(),
        Some(&Rejection::BodyTooLarge { limit: MIB as u64 })
    );
    let doc = problem(response).await;
    assert_eq!(doc["status"], 413);
    assert_eq!(doc["cap"], "wire-bytes");
    assert_eq!(doc["limit"], MIB);
    assert_eq!(seen.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn wire_cap_on_a_chunked_body_is_413_wire_bytes_whatever_the_handler_answers() {
    let seen = Arc::new(AtomicU64::new(0));
    let app = body_app(MIB, 8 * MIB, seen.clone());
    let req = Request::post("/stream")
        .body(chunked(2 * MIB, b'a'))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let doc = problem(response).await;
    assert_eq!(doc["cap"], "wire-bytes");
    assert_eq!(doc["limit"], MIB);
    // 16 frames of 64 KiB fit exactly; the 17th is refused.
    assert_eq!(seen.load(Ordering::SeqCst), MIB as u64);
}

#[tokio::test]
async fn grpc_requests_get_a_grpc_status_instead_of_problem_json() {
    let seen = Arc::new(AtomicU64::new(0));
    let app = body_app(MIB, 8 * MIB, seen.clone());
    let req = Request::post("/stream")
        .header(header::CONTENT_TYPE, "application/grpc")
        .body(chunked(2 * MIB, b'a'))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(response.headers()["grpc-status"], "8");
    assert_eq!(
        response.extensions().get::<Rejection>(),
        Some(&Rejection::BodyTooLarge { limit: MIB as u64 })
    );
}

#[tokio::test]
async fn wire_cap_replaces_axum_bytes_extractor_response() {
    let seen = Arc::new(AtomicU64::new(0));
    let app = body_app(MIB, 8 * MIB, seen.clone());
    let req = Request::post("/bytes")
        .body(chunked(2 * MIB, b'a'))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(problem(response).await["cap"], "wire-bytes");
    assert_eq!(seen.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn bodies_under_both_caps_pass_and_axum_default_limit_is_lifted() {
    let seen = Arc::new(AtomicU64::new(0));
    // 3 MiB is over axum's 2 MB default; the decoded cap replaces it.
    let app = body_app(4 * MIB, 4 * MIB, seen.clone());
    let req = Request::post("/bytes")
        .header(header::CONTENT_LENGTH, 3 * MIB)
        .body(Body::from(vec![b'a'; 3 * MIB]))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(text(response).await, (3 * MIB).to_string());

    let seen = Arc::new(AtomicU64::new(0));
    let app = body_app(MIB, 8 * MIB, seen.clone());
    let req = Request::post("/stream")
        .header(header::CONTENT_ENCODING, "gzip")
        .body(Body::from(gzip(&vec![b'z'; 5 * MIB])))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(text(response).await, (5 * MIB).to_string());
    assert_eq!(seen.load(Ordering::SeqCst), 5 * MIB as u64);
}

#[tokio::test]
async fn an_axum_default_body_limit_inside_ours_still_applies() {
    let seen = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/bytes", post(bytes_handler))
        .layer(axum::extract::DefaultBodyLimit::max(KIB))
        .with_state(seen.clone())
        .layer(BodyLimitsLayer::new(MIB, 8 * MIB));
    let req = Request::post("/bytes")
        .body(Body::from(vec![b'a'; KIB]))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(text(response).await, KIB.to_string());

    // axum's own 413, untouched: its limit is not one of our caps.
    let req = Request::post("/bytes")
        .body(Body::from(vec![b'a'; KIB + 1]))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(response.extensions().get::<Rejection>(), None);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "text/plain; charset=utf-8"
    );
    assert_eq!(
        text(response).await,
        "Failed to buffer the request body: length limit exceeded"
    );
    assert_eq!(seen.load(Ordering::SeqCst), KIB as u64);
}

#[tokio::test]
async fn gzip_bomb_is_413_decoded_bytes_and_the_handler_sees_at_most_the_cap() {
    let bomb = gzip_zeros(1024 * MIB);
    // About 1 MiB on the wire for 1 GiB decoded.
    assert!(bomb.len() < 2 * MIB, "bomb is {} bytes", bomb.len());
    let wire_len = bomb.len();

    for path in ["/stream", "/bytes"] {
        let seen = Arc::new(AtomicU64::new(0));
        let app = body_app(2 * MIB, 8 * MIB, seen.clone());
        let bomb = Bytes::from(bomb.clone());
        let chunks = (0..wire_len.div_ceil(16 * KIB)).map(move |i| {
            Ok::<_, std::io::Error>(bomb.slice(i * 16 * KIB..((i + 1) * 16 * KIB).min(wire_len)))
        });
        let req = Request::post(path)
            .header(header::CONTENT_ENCODING, "gzip")
            .body(Body::from_stream(stream::iter(chunks)))
            .unwrap();
        let (status, response) = send(&app, req).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{path}");
        let doc = problem(response).await;
        assert_eq!(doc["cap"], "decoded-bytes", "{path}");
        assert_eq!(doc["limit"], 8 * MIB, "{path}");
        let seen = seen.load(Ordering::SeqCst);
        assert!(seen <= 8 * MIB as u64, "{path}: handler saw {seen} bytes");
        // The streaming handler got exactly the cap (tower-http decodes in
        // 4 KiB chunks, which divide 8 MiB); `Bytes` refused, so its handler
        // never ran.
        let expected = if path == "/stream" { 8 * MIB as u64 } else { 0 };
        assert_eq!(seen, expected, "{path}");
    }
}

#[tokio::test]
async fn identity_body_over_the_decoded_cap_with_content_length_is_413_decoded_bytes() {
    let seen = Arc::new(AtomicU64::new(0));
    let app = body_app(8 * MIB, MIB, seen.clone());
    let req = Request::post("/stream")
        .header(header::CONTENT_LENGTH, 2 * MIB)
        .body(Body::from(vec![b'a'; 2 * MIB]))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(problem(response).await["cap"], "decoded-bytes");
    assert_eq!(seen.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn unsupported_content_encoding_is_415_problem_json() {
    for encoding in ["compress", "x-unknown"] {
        let seen = Arc::new(AtomicU64::new(0));
        let app = body_app(MIB, 8 * MIB, seen.clone());
        let req = Request::post("/stream")
            .header(header::CONTENT_ENCODING, encoding)
            .body(Body::from("hello"))
            .unwrap();
        let (status, response) = send(&app, req).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{encoding}");
        assert_eq!(
            response.extensions().get::<Rejection>(),
            Some(&Rejection::UnsupportedEncoding {
                encoding: encoding.to_owned()
            })
        );
        assert_eq!(
            response.headers()[header::ACCEPT_ENCODING],
            "zstd,gzip,deflate,br"
        );
        let doc = problem(response).await;
        assert_eq!(doc["status"], 415);
        assert_eq!(
            doc["type"],
            "https://docs.rs/tower-admission/latest/tower_admission/reject/#unsupported-encoding"
        );
        assert_eq!(seen.load(Ordering::SeqCst), 0);
    }
}

/// A handler that answers 413 or 415 itself, whatever the request.
async fn own_status(axum::extract::Path(code): axum::extract::Path<u16>) -> Response {
    let status = StatusCode::from_u16(code).unwrap();
    (status, "the handler's own").into_response()
}

fn own_status_app() -> Router {
    Router::new()
        .route("/own/{code}", get(own_status).post(own_status))
        .layer(BodyLimitsLayer::new(MIB, 8 * MIB))
}

#[tokio::test]
async fn a_handlers_own_413_and_415_pass_unchanged_with_or_without_a_body() {
    let app = own_status_app();
    for code in [413, 415] {
        let bodiless = Request::get(format!("/own/{code}"))
            .body(Body::empty())
            .unwrap();
        let zero_length = Request::post(format!("/own/{code}"))
            .header(header::CONTENT_LENGTH, 0)
            .body(Body::empty())
            .unwrap();
        let with_body = Request::post(format!("/own/{code}"))
            .header(header::CONTENT_LENGTH, 5)
            .body(Body::from("hello"))
            .unwrap();
        let empty_stream = Request::post(format!("/own/{code}"))
            .body(Body::from_stream(stream::iter(Vec::<
                Result<Bytes, std::io::Error>,
            >::new())))
            .unwrap();
        for req in [bodiless, zero_length, with_body, empty_stream] {
            let what = format!("{} {}", req.method(), code);
            let (status, response) = send(&app, req).await;
            assert_eq!(status.as_u16(), code, "{what}");
            assert_eq!(response.extensions().get::<Rejection>(), None, "{what}");
            assert_eq!(
                response.headers()[header::CONTENT_TYPE],
                "text/plain; charset=utf-8",
                "{what}"
            );
            assert_eq!(text(response).await, "the handler's own", "{what}");
        }
    }
}

#[tokio::test]
async fn a_bodiless_request_with_an_unsupported_encoding_is_still_415() {
    let app = own_status_app();
    for method in ["GET", "POST"] {
        let req = Request::builder()
            .method(method)
            .uri("/own/200")
            .header(header::CONTENT_ENCODING, "compress")
            .body(Body::empty())
            .unwrap();
        let (status, response) = send(&app, req).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{method}");
        assert_eq!(
            response.extensions().get::<Rejection>(),
            Some(&Rejection::UnsupportedEncoding {
                encoding: "compress".to_owned()
            }),
            "{method}"
        );
        assert_eq!(
            response.headers()[header::ACCEPT_ENCODING],
            "zstd,gzip,deflate,br"
        );
        assert_eq!(problem(response).await["status"], 415, "{method}");
    }
}

#[tokio::test]
async fn a_bodiless_request_whose_content_length_is_over_a_cap_is_413_naming_it() {
    // The handler answers 413 too: only our problem+json names the cap.
    let app = Router::new()
        .route("/own/{code}", post(own_status))
        .layer(BodyLimitsLayer::new(2 * MIB, MIB));
    let cases = [
        (2 * MIB + 1, "wire-bytes", 2 * MIB),
        (2 * MIB, "decoded-bytes", MIB),
        (MIB + 1, "decoded-bytes", MIB),
    ];
    for (length, cap, limit) in cases {
        let req = Request::post("/own/413")
            .header(header::CONTENT_LENGTH, length)
            .body(Body::empty())
            .unwrap();
        let (status, response) = send(&app, req).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{length}");
        let doc = problem(response).await;
        assert_eq!(doc["cap"], cap, "{length}");
        assert_eq!(doc["limit"], limit, "{length}");
    }
    // Exactly at the caps the request is not refused, and the handler's own
    // 413 passes.
    let req = Request::post("/own/413")
        .header(header::CONTENT_LENGTH, MIB)
        .body(Body::empty())
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(text(response).await, "the handler's own");
}

#[tokio::test]
async fn a_body_over_the_cap_to_a_handler_answering_413_gets_the_cap_named() {
    let app = Router::new()
        .route("/own/{code}", post(own_status))
        .layer(BodyLimitsLayer::new(KIB, 8 * MIB));
    let req = Request::post("/own/413")
        .header(header::CONTENT_LENGTH, KIB + 1)
        .body(Body::from(vec![b'a'; KIB + 1]))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let doc = problem(response).await;
    assert_eq!(doc["cap"], "wire-bytes");
    assert_eq!(doc["limit"], KIB);
}

/// A body that says it is at its end, then yields `data` once.
struct EndedButNot {
    data: Option<Bytes>,
}

impl http_body::Body for EndedButNot {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(
            self.data
                .take()
                .map(|data| Ok(http_body::Frame::data(data))),
        )
    }

    fn is_end_stream(&self) -> bool {
        true
    }
}

/// A service that reads the whole body and answers with its length, or
/// with the read error.
fn reading() -> impl tower::Service<
    Request<tower_admission::bounds::CappedBody<EndedButNot>>,
    Response = Response<String>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone {
    tower::service_fn(
        |req: Request<tower_admission::bounds::CappedBody<EndedButNot>>| async move {
            Ok(match req.into_body().collect().await {
                Ok(body) => Response::new(format!("read {}", body.to_bytes().len())),
                Err(err) => Response::new(format!("error: {err}")),
            })
        },
    )
}

#[tokio::test]
async fn a_request_that_cannot_trip_a_cap_gets_the_inner_response_as_it_was() {
    // No body, no encoding, no length: nothing to cap, so nothing wraps the
    // body or boxes the response.
    let service = tower::ServiceBuilder::new()
        .layer(BodyLimitsLayer::new(KIB, KIB))
        .service(reading());
    let req = Request::get("/").body(EndedButNot { data: None }).unwrap();
    let response = service.oneshot(req).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    match response.into_body() {
        http_body_util::Either::Left(http_body_util::Either::Left(body)) => {
            assert_eq!(body, "read 0")
        }
        _ => panic!("the inner response was wrapped"),
    }
}

#[tokio::test]
async fn a_body_that_yields_data_after_reporting_its_end_is_an_error_not_bytes_past_the_caps() {
    // It looks empty, so it skips the caps: the data it yields anyway is
    // refused as it comes, here 2 KiB past a 1 KiB cap.
    let service = tower::ServiceBuilder::new()
        .layer(BodyLimitsLayer::new(KIB, KIB))
        .service(reading());
    let data = Bytes::from(vec![b'a'; 2 * KIB]);
    let req = Request::post("/")
        .body(EndedButNot { data: Some(data) })
        .unwrap();
    let response = service.oneshot(req).await.unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        body,
        "error: the request body yielded data after reporting its end"
    );
}

/// A gRPC-like handler that answers at once, reads the request as its
/// response streams, and ends with `grpc-status` 2 (tonic's for a failed
/// read) or 0 in its trailers, or with no trailers when `trailers` is false.
fn answering_first(
    trailers: bool,
) -> impl tower::Service<
    Request<tower_admission::bounds::CappedBody<http_body_util::Full<Bytes>>>,
    Response = Response<http_body_util::StreamBody<BoxedFrames>>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone {
    use futures_util::StreamExt as _;
    tower::service_fn(
        move |req: Request<tower_admission::bounds::CappedBody<http_body_util::Full<Bytes>>>| async move {
            let end = async move {
                let read = req.into_body().collect().await;
                let mut map = http::HeaderMap::new();
                map.insert(
                    "grpc-status",
                    if read.is_ok() { "0" } else { "2" }.parse().unwrap(),
                );
                map.insert("grpc-message", MESSAGE.parse().unwrap());
                map.insert("x-trace", "kept".parse().unwrap());
                trailers.then(|| Ok(http_body::Frame::trailers(map)))
            };
            let frames: BoxedFrames = Box::pin(
                stream::once(std::future::ready(Ok(http_body::Frame::data(
                    Bytes::from_static(b"answer"),
                ))))
                .chain(stream::once(end).filter_map(std::future::ready)),
            );
            Ok(Response::new(http_body_util::StreamBody::new(frames)))
        },
    )
}

/// The `grpc-message` of [`answering_first`].
const MESSAGE: &str = "length limit exceeded";

type BoxedFrames = std::pin::Pin<
    Box<
        dyn futures_util::Stream<Item = Result<http_body::Frame<Bytes>, std::convert::Infallible>>
            + Send,
    >,
>;

/// A cap that trips after the handler answered a gRPC call replaces the
/// status in its trailers (or adds trailers with it); other trailers stay,
/// and a call within the caps or not gRPC keeps the handler's status.
#[tokio::test]
async fn a_cap_tripped_after_a_grpc_answer_replaces_the_status_in_the_trailers() {
    let mut grpc_call = http::HeaderMap::new();
    grpc_call.insert(header::CONTENT_TYPE, "application/grpc".parse().unwrap());
    let refusal = Rejection::DecodedTooLarge { limit: 4096 }.into_response(&grpc_call);
    let bomb = gzip_zeros(8 * KIB);
    let small = gzip(b"hello");
    // (content type, body, whether the handler sends trailers, whether the
    // status is the refusal's, else the handler's with its code)
    let cases = [
        ("application/grpc", &bomb, true, true, ""),
        ("application/grpc", &bomb, false, true, ""),
        ("application/json", &bomb, true, false, "2"),
        ("application/grpc", &small, true, false, "0"),
    ];
    for (content_type, body, sends_trailers, is_refusal, code) in cases {
        let service = tower::ServiceBuilder::new()
            .layer(BodyLimitsLayer::new(64 * KIB, 4 * KIB))
            .service(answering_first(sends_trailers));
        let req = Request::post("/test.Streams/Echo")
            .header(header::CONTENT_TYPE, content_type)
            .header(header::CONTENT_ENCODING, "gzip")
            .body(http_body_util::Full::new(Bytes::from(body.clone())))
            .unwrap();
        let response = service.oneshot(req).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(!response.headers().contains_key("grpc-status"));
        let collected = response.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned().unwrap();
        let case = format!("{content_type} {} trailers {sends_trailers}", body.len());
        let expected = |name: &str| match (is_refusal, name) {
            (true, _) => refusal.headers().get(name).cloned(),
            (false, "grpc-status") => Some(http::HeaderValue::from_static(code)),
            (false, "grpc-message") => Some(http::HeaderValue::from_static(MESSAGE)),
            (false, _) => None,
        };
        for name in [
            "grpc-status",
            "grpc-message",
            "grpc-retry-pushback-ms",
            "grpc-status-details-bin",
        ] {
            assert_eq!(trailers.get(name).cloned(), expected(name), "{case} {name}");
        }
        if is_refusal {
            assert_eq!(trailers["grpc-status"], "8", "{case}");
            assert_eq!(trailers["grpc-retry-pushback-ms"], "-1", "{case}");
        }
        assert_eq!(trailers.get("x-trace").is_some(), sends_trailers, "{case}");
        assert!(!trailers.contains_key(header::CONTENT_TYPE), "{case}");
        assert_eq!(collected.to_bytes(), "answer", "{case}");
    }
}

// ---------------------------------------------------------------- query validation

fn rules() -> QueryRules {
    QueryRules::new()
        .page_size(NonZeroU32::new(50).unwrap(), NonZeroU32::new(1000).unwrap())
        .unwrap()
        .max_span(Duration::from_secs(31 * 24 * 3600))
        .unwrap()
        .max_cursor_len(NonZeroUsize::new(64).unwrap())
        .ignore_unknown_params(false)
}

async fn show_query(q: ValidatedQuery) -> axum::Json<Value> {
    axum::Json(json!({
        "page_size": q.page_size,
        "from": q.from.map(|t| t.unix_timestamp()),
        "to": q.to.map(|t| t.unix_timestamp()),
        "cursor": q.cursor,
    }))
}

fn query_app(rules: QueryRules) -> Router {
    Router::new()
        .route("/reports", get(show_query))
        .layer(ValidateQueryLayer::new(rules))
        .layer(BodyLimitsLayer::new(MIB, 8 * MIB))
}

async fn get_query(app: &Router, query: &str) -> (StatusCode, Value) {
    let req = Request::get(format!("/reports?{query}"))
        .body(Body::empty())
        .unwrap();
    let (status, response) = send(app, req).await;
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

fn names(doc: &Value) -> Vec<String> {
    doc["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn each_bad_parameter_is_400_naming_it() {
    let app = query_app(rules());
    let cases: &[(&str, &str)] = &[
        ("page_size=0", "page_size"),
        ("page_size=100000", "page_size"),
        ("page_size=-1", "page_size"),
        ("page_size=99999999999999999999", "page_size"),
        ("page_size=abc", "page_size"),
        ("page_size=", "page_size"),
        ("page_size", "page_size"),
        ("page_size=%2B5", "page_size"),
        ("page_size=+5", "page_size"),
        ("page_size=007", "page_size"),
        ("page_size=1e3", "page_size"),
        ("page_size=10&page_size=10", "page_size"),
        ("from=2024-05-10T00:00:00Z&to=2024-05-01T00:00:00Z", "to"),
        ("from=2024-05-01T00:00:00Z&to=2024-05-01T00:00:00Z", "to"),
        ("from=2024-01-01T00:00:00Z&to=2024-03-01T00:00:00Z", "to"),
        ("from=2024-13-01T00:00:00Z&to=2024-05-01T00:00:00Z", "from"),
        ("from=yesterday&to=2024-05-01T00:00:00Z", "from"),
        ("from=2024-05-01&to=2024-05-02T00:00:00Z", "from"),
        (
            "from=2024-05-01T00:00:00Z&to=2024-05-02T00:00:00+02:00",
            "to",
        ),
        ("from=2024-05-01T00:00:00Z", "to"),
        ("to=2024-05-01T00:00:00Z", "from"),
        ("cursor=", "cursor"),
        (
            "cursor=xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
            "cursor",
        ),
        ("cursor=a%20b", "cursor"),
        ("cursor=%FF%FE", "cursor"),
        ("cursor=a&cursor=b", "cursor"),
        ("pagesize=10", "pagesize"),
    ];
    for (query, bad) in cases {
        let (status, doc) = get_query(&app, query).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}");
        assert_eq!(names(&doc), vec![bad.to_string()], "{query}: {doc}");
        assert_eq!(doc["status"], 400);
    }
}

#[tokio::test]
async fn every_bad_parameter_is_listed_with_its_reason() {
    let app = query_app(rules());
    let (status, doc) = get_query(
        &app,
        "page_size=abc&from=nope&to=2024-05-01T00:00:00Z&cursor=&x=1&y=2&x=3",
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(names(&doc), vec!["page_size", "from", "cursor", "x", "y"]);
    assert_eq!(
        doc["errors"][0]["reason"],
        "must be a whole number from 1 to 1000, written with the digits 0-9 only"
    );
    assert_eq!(
        doc["detail"],
        "invalid parameters: page_size, from, cursor, x, y"
    );

    let rules = rules();
    let err = rules
        .validate(Some(
            "page_size=0&page_size=5&to=2024-05-01T00:00:00Z&from=2024-06-01T00:00:00Z",
        ))
        .unwrap_err();
    assert_eq!(
        err,
        vec![
            InvalidParameter::new("page_size", "given more than once; give it at most once"),
            InvalidParameter::new("to", "must be later than from"),
        ]
    );
    assert_eq!(
        rules
            .validate(Some("page_size=99999999999999999999"))
            .unwrap_err(),
        vec![InvalidParameter::new("page_size", "must be at most 1000")]
    );
    assert_eq!(
        rules.validate(Some("page_size=0")).unwrap_err(),
        vec![InvalidParameter::new("page_size", "must be at least 1")]
    );
    assert_eq!(
        rules
            .validate(Some("from=2024-01-01T00:00:00Z&to=2024-03-01T00:00:00Z"))
            .unwrap_err(),
        vec![InvalidParameter::new(
            "to",
            "the range from..to spans 5184000 s, more than the maximum of 2678400 s"
        )]
    );
}

#[tokio::test]
async fn unknown_parameters_listed_are_capped() {
    let rules = rules();
    let query: String = (0..100).map(|i| format!("u{i}=1&")).collect();
    let err = rules.validate(Some(&query)).unwrap_err();
    assert_eq!(err.len(), 10);
    assert_eq!(err[0], InvalidParameter::new("u0", "unknown parameter"));
    assert_eq!(
        err[9],
        InvalidParameter::new(
            "u9",
            "unknown parameter; 90 more unknown parameters not listed"
        )
    );
}

#[tokio::test]
async fn valid_queries_reach_the_handler_decoded() {
    let app = query_app(rules());
    let (status, doc) = get_query(&app, "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        doc,
        json!({"page_size": 50, "from": null, "to": null, "cursor": null})
    );

    // 02:00+02:00 is 00:00Z: an empty range, refused.
    let (status, doc) = get_query(
        &app,
        "from=2024-05-01T00%3A00%3A00Z&to=2024-05-01T02:00:00%2B02:00",
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(names(&doc), vec!["to"]);
}

#[tokio::test]
async fn valid_query_values() {
    let app = query_app(rules());
    let (status, doc) = get_query(
        &app,
        "page_size=1000&from=2024-05-01T00%3A00%3A00Z&to=2024-05-31T02:00:00%2B02:00&cursor=abc%2Fdef%3D%3D",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{doc}");
    assert_eq!(
        doc,
        json!({
            "page_size": 1000,
            "from": 1_714_521_600,
            "to": 1_714_521_600 + 30 * 86_400,
            "cursor": "abc/def==",
        })
    );
    // Exactly the maximum span is allowed.
    let (status, _) = get_query(&app, "from=2024-05-01T00:00:00Z&to=2024-06-01T00:00:00Z").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn ignore_policy_drops_unknown_parameters_but_not_known_repeats() {
    let rules = QueryRules::new()
        .ignore_unknown_params(true)
        .allow("sort")
        .unwrap();
    let ok = rules
        .validate(Some("x=1&x=2&sort=name&page_size=7"))
        .unwrap();
    assert_eq!(ok.page_size, 7);
    assert_eq!(
        rules.validate(Some("sort=a&sort=b")).unwrap_err(),
        vec![InvalidParameter::new(
            "sort",
            "given more than once; give it at most once"
        )]
    );
    // Without a span limit an open range is fine.
    let open = rules.validate(Some("from=2024-05-01T00:00:00Z")).unwrap();
    assert_eq!(open.to, None);
}

#[test]
fn bad_rules_name_the_field() {
    let err = QueryRules::new()
        .page_size(NonZeroU32::new(100).unwrap(), NonZeroU32::new(10).unwrap())
        .unwrap_err();
    assert_eq!(err.field(), "page_size");
    let err = QueryRules::new().max_span(Duration::ZERO).unwrap_err();
    assert_eq!(err.field(), "max_span");
    let err = QueryRules::new().allow("cursor").unwrap_err();
    assert_eq!(err.field(), "allow");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_query_strings_never_panic(query in ".{0,200}") {
        let rules = rules();
        check_invariants(&rules, &query);
    }

    #[test]
    fn query_shaped_strings_never_panic(
        parts in proptest::collection::vec(
            (
                prop_oneof![
                    Just("page_size".to_owned()), Just("from".to_owned()), Just("to".to_owned()),
                    Just("cursor".to_owned()), Just("%70age_size".to_owned()), "[a-z%+=&]{0,6}",
                ],
                prop_oneof![
                    "[0-9]{0,25}", "-?[0-9+]{1,5}", "[ -~]{0,80}",
                    Just("2024-05-01T00:00:00Z".to_owned()),
                    Just("2024-05-01T00:00:00%2B02:00".to_owned()),
                    "%[0-9A-Fa-f]{2}%[0-9A-Fa-f]{2}",
                ],
            ),
            0..8,
        )
    ) {
        let query: String = parts
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("&");
        check_invariants(&rules(), &query);
    }
}

fn check_invariants(rules: &QueryRules, query: &str) {
    match rules.validate(Some(query)) {
        Ok(q) => {
            assert!((1..=rules.max_page_size()).contains(&q.page_size));
            if let (Some(from), Some(to)) = (q.from, q.to) {
                assert!(from < to);
                assert!(to - from <= time::Duration::days(31));
            }
            if let Some(cursor) = &q.cursor {
                assert!(!cursor.is_empty() && cursor.len() <= 64);
            }
        }
        Err(errors) => assert!(!errors.is_empty()),
    }
}

// ---------------------------------------------------------------- batch items

#[derive(Debug, serde::Deserialize)]
struct Item {
    n: u64,
}

/// A handler behind a `BatchItemsLayer` of `max` items: parses the batch
/// with `BatchItemsLayer::parse` and adds up the items' `n`.
fn ingest(ran: &AtomicU64, headers: &HeaderMap, body: &[u8], max: usize) -> Response {
    match BatchItemsLayer::parse::<Item>(body, max) {
        Ok(items) => {
            for item in &items {
                ran.fetch_add(item.n, Ordering::SeqCst);
            }
            items.len().to_string().into_response()
        }
        Err(refused) => refused.into_response(headers).into_response(),
    }
}

async fn ingest_1000(
    State(ran): State<Arc<AtomicU64>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    ingest(&ran, &headers, &body, 1000)
}

async fn ingest_100k(
    State(ran): State<Arc<AtomicU64>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    ingest(&ran, &headers, &body, 100_000)
}

/// `/small` caps batches at 1000 items, `/large` at 100,000.
fn batch_app(ran: Arc<AtomicU64>) -> Router {
    let cap = |n| BatchItemsLayer::new(NonZeroUsize::new(n).unwrap());
    Router::new()
        .route("/small", post(ingest_1000).layer(cap(1000)))
        .route("/large", post(ingest_100k).layer(cap(100_000)))
        .with_state(ran)
        .layer(BodyLimitsLayer::new(8 * MIB, 8 * MIB))
}

fn items_json(count: usize) -> String {
    let mut s = String::with_capacity(count * 8 + 16);
    s.push_str(r#"{"items":["#);
    for i in 0..count {
        if i > 0 {
            s.push(',');
        }
        s.push_str(r#"{"n":1}"#);
    }
    s.push_str("]}");
    s
}

async fn post_json(app: &Router, path: &str, body: String) -> (StatusCode, Response<Body>) {
    let req = Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .unwrap();
    send(app, req).await
}

#[tokio::test]
async fn batch_over_the_cap_is_413_before_any_item_runs() {
    let ran = Arc::new(AtomicU64::new(0));
    let app = batch_app(ran.clone());

    let (status, response) = post_json(&app, "/large", items_json(100_001)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let doc = problem(response).await;
    assert_eq!(doc["cap"], "items");
    assert_eq!(doc["limit"], 100_000);
    assert_eq!(ran.load(Ordering::SeqCst), 0);

    let (status, response) = post_json(&app, "/small", items_json(1001)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let doc = problem(response).await;
    assert_eq!(doc["cap"], "items");
    assert_eq!(doc["limit"], 1000);
    assert_eq!(ran.load(Ordering::SeqCst), 0);

    let (status, response) = post_json(&app, "/small", items_json(100)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(text(response).await, "100");
    assert_eq!(ran.load(Ordering::SeqCst), 100);

    let (status, response) = post_json(&app, "/small", items_json(1000)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(text(response).await, "1000");
    assert_eq!(ran.load(Ordering::SeqCst), 1100);

    // No item and one item pass; the content type is not checked.
    for count in [0, 1] {
        let req = Request::post("/small")
            .body(Body::from(items_json(count)))
            .unwrap();
        let (status, response) = send(&app, req).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(text(response).await, count.to_string());
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1101);
}

#[tokio::test]
async fn malformed_batches_are_400_naming_the_problem() {
    let ran = Arc::new(AtomicU64::new(0));
    let app = batch_app(ran.clone());
    let cases: &[(&str, &str)] = &[
        (r#"{"items":[{"n":1},{"n":"x"}]}"#, "items[1]"),
        (r#"{"items":[{"n":1} {"n":2}]}"#, "items[1]"),
        (r#"{"items":[{"n":1}"#, "items[1]"),
        (r#"{"things":[]}"#, "body"),
        (r#"{"items":[],"items":[]}"#, "body"),
        (r#"[1,2,3]"#, "body"),
        (r#"{"items":{}}"#, "body"),
        ("", "body"),
        (r#"{"items":[]} trailing"#, "body"),
    ];
    for (body, name) in cases {
        let (status, response) = post_json(&app, "/small", body.to_string()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let doc = problem(response).await;
        assert_eq!(names(&doc), vec![name.to_string()], "{body}: {doc}");
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0);

    let err = BatchItemsLayer::parse::<Item>(br#"{"items":[{"n":"x"}]}"#, 10).unwrap_err();
    assert_eq!(
        err,
        Rejection::InvalidParameters(vec![InvalidParameter::new(
            "items[0]",
            "invalid type: string \"x\", expected u64 at line 1 column 18"
        )])
    );
}

#[test]
fn counting_does_not_build_items() {
    let json = items_json(100_001);
    assert_eq!(count_batch_items(json.as_bytes(), 100_001), Ok(100_001));
    assert_eq!(
        count_batch_items(json.as_bytes(), 100_000),
        Err(Rejection::TooManyItems { limit: 100_000 })
    );
    // Extra members are ignored; an empty batch is fine.
    assert_eq!(
        count_batch_items(br#"{"meta":{"a":[1]},"items":[]}"#, 5),
        Ok(0)
    );
}

// ---------------------------------------------------------------- item count before the handler

#[derive(Clone, Default)]
struct Counters {
    charged: Arc<AtomicU64>,
    ran: Arc<AtomicU64>,
}

/// Stands in for a quota layer whose cost function is `item_cost`.
async fn charge_items(
    State(c): State<Counters>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let cost = BatchItemsLayer::item_cost(&parts);
    c.charged.fetch_add(cost, Ordering::SeqCst);
    next.run(axum::extract::Request::from_parts(parts, body))
        .await
}

async fn ingest_counted(
    State(c): State<Counters>,
    parts: http::request::Parts,
    body: Bytes,
) -> Response {
    match BatchItemsLayer::parse::<Item>(&body, 1000) {
        Ok(items) => {
            assert_eq!(BatchItemsLayer::item_cost(&parts), items.len() as u64);
            for item in &items {
                c.ran.fetch_add(item.n, Ordering::SeqCst);
            }
            items.len().to_string().into_response()
        }
        Err(refused) => refused.into_response(&parts.headers).into_response(),
    }
}

fn counted_app(c: Counters, wire: usize, decoded: usize) -> Router {
    Router::new()
        .route("/batch", post(ingest_counted))
        .layer(axum::middleware::from_fn_with_state(
            c.clone(),
            charge_items,
        ))
        .layer(BatchItemsLayer::new(NonZeroUsize::new(1000).unwrap()))
        .layer(BodyLimitsLayer::new(wire, decoded))
        .with_state(c)
}

#[tokio::test]
async fn batch_items_layer_counts_before_quota_and_handler() {
    let c = Counters::default();
    let app = counted_app(c.clone(), MIB, MIB);

    let (status, response) = post_json(&app, "/batch", items_json(1001)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let doc = problem(response).await;
    assert_eq!(doc["cap"], "items");
    assert_eq!(doc["limit"], 1000);
    assert_eq!(c.charged.load(Ordering::SeqCst), 0);
    assert_eq!(c.ran.load(Ordering::SeqCst), 0);

    let (status, response) = post_json(&app, "/batch", "{\"items\":[1,".to_owned()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(names(&problem(response).await), vec!["items[1]"]);
    assert_eq!(c.charged.load(Ordering::SeqCst), 0);

    let (status, response) = post_json(&app, "/batch", items_json(100)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(text(response).await, "100");
    assert_eq!(c.charged.load(Ordering::SeqCst), 100);
    assert_eq!(c.ran.load(Ordering::SeqCst), 100);
}

#[tokio::test]
async fn batch_items_layer_read_error_becomes_the_byte_cap_413() {
    let c = Counters::default();
    let app = counted_app(c.clone(), 2 * MIB, 64 * KIB);
    let req = Request::post("/batch")
        .header(header::CONTENT_ENCODING, "gzip")
        .body(Body::from(gzip(items_json(50_000).as_bytes())))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let doc = problem(response).await;
    assert_eq!(doc["cap"], "decoded-bytes");
    assert_eq!(doc["limit"], 64 * KIB);
    assert_eq!(c.charged.load(Ordering::SeqCst), 0);
    assert_eq!(c.ran.load(Ordering::SeqCst), 0);
}

// ---------------------------------------------------------------- content codings and query reasons

/// A POST to the byte-counting route with one `content-encoding` line per
/// entry of `lines`.
fn encoded(lines: &[&str], body: impl Into<Body>) -> Request<Body> {
    let mut req = Request::post("/stream");
    for line in lines {
        req = req.header(header::CONTENT_ENCODING, *line);
    }
    req.body(body.into()).unwrap()
}

#[tokio::test]
async fn several_content_codings_are_415_naming_them_before_the_handler() {
    let doubly_gzipped = gzip(&gzip(b"hello world"));
    let cases: Vec<(&[&str], Vec<u8>, &str)> = vec![
        (
            &["gzip", "compress"],
            gzip(b"hello world"),
            "gzip, compress",
        ),
        (
            &["identity", "x-unknown"],
            b"hello".to_vec(),
            "identity, x-unknown",
        ),
        (&["gzip", "gzip"], doubly_gzipped.clone(), "gzip, gzip"),
        (&["gzip, gzip"], doubly_gzipped, "gzip, gzip"),
        (&["identity, gzip"], gzip(b"hello world"), "identity, gzip"),
    ];
    for (lines, body, named) in cases {
        let seen = Arc::new(AtomicU64::new(0));
        let app = body_app(MIB, 8 * MIB, seen.clone());
        let (status, response) = send(&app, encoded(lines, body)).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{lines:?}");
        assert_eq!(
            response.extensions().get::<Rejection>(),
            Some(&Rejection::UnsupportedEncoding {
                encoding: named.to_owned()
            }),
            "{lines:?}"
        );
        assert_eq!(
            response.headers()[header::ACCEPT_ENCODING],
            "zstd,gzip,deflate,br",
            "{lines:?}"
        );
        assert_eq!(problem(response).await["status"], 415, "{lines:?}");
        assert_eq!(seen.load(Ordering::SeqCst), 0, "{lines:?}");
    }
    // A bodiless request and a gRPC one are refused the same way.
    let seen = Arc::new(AtomicU64::new(0));
    let app = body_app(MIB, 8 * MIB, seen.clone());
    let grpc = Request::post("/stream")
        .header(header::CONTENT_TYPE, "application/grpc")
        .header(header::CONTENT_ENCODING, "gzip")
        .header(header::CONTENT_ENCODING, "br")
        .body(Body::from(gzip(b"hello world")))
        .unwrap();
    let (status, response) = send(&app, grpc).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(response.headers()["grpc-status"], "3");
    let (status, _) = send(&app, encoded(&["gzip", "br"], Body::empty())).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(seen.load(Ordering::SeqCst), 0);
    // A decompressor set to pass unsupported codings through passes them
    // undecoded, every coding named in one line.
    let app = Router::new()
        .route(
            "/stream",
            post(|headers: axum::http::HeaderMap, body: Bytes| async move {
                let lines: Vec<_> = headers.get_all(header::CONTENT_ENCODING).iter().collect();
                format!("{lines:?} {}", body.len())
            }),
        )
        .layer(
            BodyLimitsLayer::new(MIB, 8 * MIB).decompression(
                tower_http::decompression::RequestDecompressionLayer::new()
                    .pass_through_unaccepted(true),
            ),
        );
    let sent = gzip(&gzip(b"hello world"));
    let len = sent.len();
    let (status, response) = send(&app, encoded(&["gzip", "gzip"], sent)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(text(response).await, format!("[\"gzip, gzip\"] {len}"));
}

#[tokio::test]
async fn one_content_coding_is_matched_in_any_case() {
    let hello = gzip(b"hello world");
    let decoded: &[&[&str]] = &[&["GZIP"], &["Gzip"], &[" gzip "], &["gzip,"], &["", "gZiP"]];
    for lines in decoded {
        let seen = Arc::new(AtomicU64::new(0));
        let app = body_app(MIB, 8 * MIB, seen.clone());
        let (status, response) = send(&app, encoded(lines, hello.clone())).await;
        assert_eq!(status, StatusCode::OK, "{lines:?}");
        assert_eq!(text(response).await, "11", "{lines:?}");
    }
    // A lone `identity`, in any case, passes the body as it came.
    let seen = Arc::new(AtomicU64::new(0));
    let app = body_app(MIB, 8 * MIB, seen.clone());
    let (status, response) = send(&app, encoded(&["IDENTITY"], "hello")).await;
    assert_eq!(
        (status, text(response).await),
        (StatusCode::OK, "5".to_owned())
    );
    // Not a known coding in any case, nor an alias: 415 naming it as sent.
    for unknown in ["COMPRESS", "x-gzip"] {
        let (status, response) = send(&app, encoded(&[unknown], hello.clone())).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{unknown}");
        assert_eq!(
            response.extensions().get::<Rejection>(),
            Some(&Rejection::UnsupportedEncoding {
                encoding: unknown.to_owned()
            })
        );
    }
    assert_eq!(seen.load(Ordering::SeqCst), 5);
}

#[test]
fn a_span_over_the_maximum_is_named_to_the_nanosecond() {
    let span = |max: Duration, to: &str| {
        QueryRules::new()
            .max_span(max)
            .unwrap()
            .validate(Some(&format!("from=2025-01-01T00:00:00Z&to={to}")))
    };
    let hour = Duration::from_secs(3600);
    assert_eq!(
        span(hour, "2025-01-01T01:00:00.5Z").unwrap_err(),
        vec![InvalidParameter::new(
            "to",
            "the range from..to spans 3600.5 s, more than the maximum of 3600 s"
        )]
    );
    assert_eq!(
        span(hour, "2025-01-01T01:00:00.000000001Z").unwrap_err(),
        vec![InvalidParameter::new(
            "to",
            "the range from..to spans 3600.000000001 s, more than the maximum of 3600 s"
        )]
    );
    assert_eq!(
        span(Duration::from_millis(1500), "2025-01-01T00:00:02Z").unwrap_err(),
        vec![InvalidParameter::new(
            "to",
            "the range from..to spans 2 s, more than the maximum of 1.5 s"
        )]
    );
    assert!(span(hour, "2025-01-01T01:00:00Z").is_ok());
}

#[test]
fn unlisted_unknown_parameters_are_counted_once_per_name() {
    let mut query: String = (0..10).map(|i| format!("u{i}=1&")).collect();
    query.push_str("k=1&k=2&k=3&u0=2&u9=3&j=1&%6B=4");
    let err = rules().validate(Some(&query)).unwrap_err();
    assert_eq!(err.len(), 10);
    assert_eq!(err[0], InvalidParameter::new("u0", "unknown parameter"));
    assert_eq!(
        err[9],
        InvalidParameter::new(
            "u9",
            "unknown parameter; 2 more unknown parameters not listed"
        )
    );
}

#[test]
fn a_cursor_of_non_ascii_characters_is_refused_for_its_characters_not_its_bytes() {
    let rules = rules(); // at most 64 characters
    let validate = |cursor: &str| rules.validate(Some(&format!("cursor={cursor}")));
    // 40 characters, 80 bytes.
    assert_eq!(
        validate(&"%C3%A9".repeat(40)).unwrap_err(),
        vec![InvalidParameter::new(
            "cursor",
            "must contain only visible ASCII characters"
        )]
    );
    assert_eq!(
        validate(&"a".repeat(65)).unwrap_err(),
        vec![InvalidParameter::new(
            "cursor",
            "must be at most 64 characters"
        )]
    );
    assert_eq!(
        validate(&"a".repeat(64)).unwrap().cursor,
        Some("a".repeat(64))
    );
}

#[tokio::test]
async fn unknown_names_that_share_their_first_64_characters_stay_distinct() {
    let prefix = "p".repeat(64);
    let echoed = format!("{prefix}…");
    let unknown = |reason: &str| InvalidParameter::new(echoed.as_str(), reason);
    // Two names differing only at character 65, one of them repeated: two
    // entries, each echoed cut to 64 characters.
    let query = format!("{prefix}a=1&{prefix}b=2&{prefix}a=3");
    assert_eq!(
        rules().validate(Some(&query)).unwrap_err(),
        vec![unknown("unknown parameter"), unknown("unknown parameter")]
    );
    let (status, doc) = get_query(&query_app(rules()), &query).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(names(&doc), [echoed.clone(), echoed.clone()]);

    // Past the listed ten they are counted apart too: the two names, once
    // each, are two more.
    let mut query: String = (0..9).map(|i| format!("u{i}=1&")).collect();
    query.push_str(&format!("{prefix}a=1&{prefix}b=1&{prefix}c=1&{prefix}b=2"));
    let err = rules().validate(Some(&query)).unwrap_err();
    assert_eq!(err.len(), 10);
    assert_eq!(
        err[9],
        unknown("unknown parameter; 2 more unknown parameters not listed")
    );
}

// ---------------------------------------------------------------- where the coded data ends

fn zlib(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

/// `data` through one of the codecs the decoder uses, as one stream.
fn encode(mut coder: impl compression_codecs::EncodeV2, data: &[u8]) -> Vec<u8> {
    use compression_codecs::core::util::{PartialBuffer, WriteBuffer};
    let mut out = vec![0u8; data.len() + 1024];
    let mut input = PartialBuffer::new(data);
    let mut output = WriteBuffer::new_initialized(&mut out);
    while !input.unwritten().is_empty() {
        coder.encode(&mut input, &mut output).unwrap();
    }
    while !coder.finish(&mut output).unwrap() {}
    let len = output.written_len();
    out.truncate(len);
    out
}

fn zstd(data: &[u8]) -> Vec<u8> {
    encode(compression_codecs::ZstdEncoder::new(3), data)
}

fn brotli(data: &[u8]) -> Vec<u8> {
    encode(
        compression_codecs::BrotliEncoder::new(Default::default()),
        data,
    )
}

fn concat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// A route that takes the whole body with axum's `Bytes` and echoes it,
/// counting its calls: a refused body never gets to it.
fn echo_app(wire: usize, decoded: usize, calls: Arc<AtomicU64>) -> Router {
    Router::new()
        .route(
            "/echo",
            post(
                |State(calls): State<Arc<AtomicU64>>, body: Bytes| async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    body
                },
            ),
        )
        .route("/stream", post(count_body))
        .with_state(calls)
        .layer(BodyLimitsLayer::new(wire, decoded))
}

/// A POST of `sent` in `content-encoding: coding`, as one frame, or as
/// frames of `frame` bytes.
fn coded(path: &str, coding: &str, sent: &[u8], frame: Option<usize>) -> Request<Body> {
    coded_frames(path, coding, sent, frame, false)
}

/// As [`coded`]; with `pending`, the body is not ready once before each
/// frame, so the decoder hands over what it has decoded so far.
fn coded_frames(
    path: &str,
    coding: &str,
    sent: &[u8],
    frame: Option<usize>,
    pending: bool,
) -> Request<Body> {
    use futures_util::StreamExt;
    let body = match frame {
        None => Body::from(sent.to_vec()),
        Some(n) => {
            let frames: Vec<Result<Bytes, std::io::Error>> = sent
                .chunks(n)
                .map(|c| Ok(Bytes::copy_from_slice(c)))
                .collect();
            if pending {
                Body::from_stream(stream::iter(frames).then(|frame| async move {
                    tokio::task::yield_now().await;
                    frame
                }))
            } else {
                Body::from_stream(stream::iter(frames))
            }
        }
    };
    Request::post(path)
        .header(header::CONTENT_ENCODING, coding)
        .body(body)
        .unwrap()
}

#[tokio::test]
async fn every_member_of_a_multi_member_gzip_body_reaches_the_handler() {
    let two_members = concat(&[&gzip(b"hello "), &gzip(b"world")]);
    let three_members = concat(&[&gzip(b"hello"), &gzip(b""), &gzip(b" world")]);
    let two_zstd_frames = concat(&[&zstd(b"hello "), &zstd(b"world")]);
    let cases: [(&str, &[u8]); 3] = [
        ("gzip", &two_members),
        ("gzip", &three_members),
        ("zstd", &two_zstd_frames),
    ];
    for (coding, sent) in cases {
        // One frame, a member boundary inside a frame, one byte a frame,
        // and frames that are not ready at once.
        let framings = [
            (None, false),
            (Some(7), false),
            (Some(1), false),
            (Some(3), true),
        ];
        for (frame, pending) in framings {
            let calls = Arc::new(AtomicU64::new(0));
            let app = echo_app(MIB, MIB, calls.clone());
            let req = coded_frames("/echo", coding, sent, frame, pending);
            let (status, response) = send(&app, req).await;
            assert_eq!(status, StatusCode::OK, "{coding} {frame:?}");
            assert_eq!(text(response).await, "hello world", "{coding} {frame:?}");
            assert_eq!(calls.load(Ordering::SeqCst), 1, "{coding} {frame:?}");
        }
    }
    // One stream of each coding, as before.
    let single: [(&str, Vec<u8>); 4] = [
        ("gzip", gzip(b"hello world")),
        ("deflate", zlib(b"hello world")),
        ("br", brotli(b"hello world")),
        ("zstd", zstd(b"hello world")),
    ];
    for (coding, sent) in single {
        let calls = Arc::new(AtomicU64::new(0));
        let app = echo_app(MIB, MIB, calls.clone());
        let (status, response) = send(&app, coded("/echo", coding, &sent, Some(3))).await;
        assert_eq!(status, StatusCode::OK, "{coding}");
        assert_eq!(text(response).await, "hello world", "{coding}");
    }
}

#[tokio::test]
async fn bytes_after_the_coded_data_are_400_naming_the_body_and_the_handler_never_runs() {
    let hello = gzip(b"hello ");
    let truncated = &gzip(b"hello world")[..12];
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "gzip",
            concat(&[&hello, b"garbage"]),
            "bytes that are not another gzip member follow the end of the gzip data",
        ),
        (
            "gzip",
            concat(&[&hello, &[0; 8]]),
            "bytes that are not another gzip member follow the end of the gzip data",
        ),
        (
            "gzip",
            concat(&[&hello, &gzip(b"world"), b"\n"]),
            "bytes that are not another gzip member follow the end of the gzip data",
        ),
        (
            "gzip",
            truncated.to_vec(),
            "the gzip data ends before it is complete",
        ),
        (
            "deflate",
            concat(&[&zlib(b"hello "), b"garbage"]),
            "bytes follow the end of the deflate data",
        ),
        (
            "deflate",
            concat(&[&zlib(b"hello "), &zlib(b"world")]),
            "bytes follow the end of the deflate data",
        ),
        (
            "br",
            concat(&[&brotli(b"hello "), b"garbage"]),
            "bytes follow the end of the br data",
        ),
        (
            "zstd",
            concat(&[&zstd(b"hello "), b"garbage"]),
            "bytes that are not another zstd frame follow the end of the zstd data",
        ),
    ];
    for (coding, sent, reason) in &cases {
        // The extra bytes in the member's own frame, and in a frame of their
        // own, byte by byte.
        for frame in [None, Some(1)] {
            let what = format!("{coding} {sent:?} {frame:?}");
            let calls = Arc::new(AtomicU64::new(0));
            let app = echo_app(MIB, MIB, calls.clone());
            let (status, response) = send(&app, coded("/echo", coding, sent, frame)).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{what}");
            assert_eq!(
                response.extensions().get::<Rejection>(),
                Some(&Rejection::InvalidParameters(vec![InvalidParameter::new(
                    "body", *reason
                )])),
                "{what}"
            );
            let doc = problem(response).await;
            assert_eq!(doc["status"], 400, "{what}");
            assert_eq!(names(&doc), ["body"], "{what}");
            assert_eq!(calls.load(Ordering::SeqCst), 0, "{what}");
        }
    }
    // A handler that streams the body gets the error, and its own answer is
    // replaced all the same. The 6 decoded bytes, still held back when the
    // garbage came, are dropped with it.
    let seen = Arc::new(AtomicU64::new(0));
    let app = echo_app(MIB, MIB, seen.clone());
    let (status, response) = send(&app, coded("/stream", "gzip", &cases[0].1, None)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(names(&problem(response).await), ["body"]);
    assert_eq!(seen.load(Ordering::SeqCst), 0);
    // Past a full 4 KiB frame, that frame has been handed over first.
    let long = concat(&[&gzip(&[b'a'; 5000]), b"garbage"]);
    let seen = Arc::new(AtomicU64::new(0));
    let app = echo_app(MIB, MIB, seen.clone());
    let (status, _) = send(&app, coded("/stream", "gzip", &long, None)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(seen.load(Ordering::SeqCst), 4096);
    // gRPC gets INVALID_ARGUMENT.
    let grpc = Request::post("/echo")
        .header(header::CONTENT_TYPE, "application/grpc")
        .header(header::CONTENT_ENCODING, "gzip")
        .body(Body::from(cases[0].1.clone()))
        .unwrap();
    let (status, response) = send(&app, grpc).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(response.headers()["grpc-status"], "3");
}

#[tokio::test]
async fn a_gzip_bomb_split_into_members_is_413_decoded_bytes_at_the_cap_over_all_members() {
    // 16 members of 4 MiB of zeros each: every member is under the 8 MiB
    // cap, all of them together are 64 MiB.
    let member = gzip_zeros(4 * MIB);
    let bomb: Vec<u8> = std::iter::repeat_n(&member[..], 16)
        .collect::<Vec<_>>()
        .concat();
    assert!(bomb.len() < 2 * MIB, "bomb is {} bytes", bomb.len());
    for path in ["/stream", "/echo"] {
        let seen = Arc::new(AtomicU64::new(0));
        let app = echo_app(2 * MIB, 8 * MIB, seen.clone());
        let (status, response) = send(&app, coded(path, "gzip", &bomb, Some(16 * KIB))).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{path}");
        let doc = problem(response).await;
        assert_eq!(doc["cap"], "decoded-bytes", "{path}");
        assert_eq!(doc["limit"], 8 * MIB, "{path}");
        // The streaming handler got exactly the cap, in 4 KiB frames across
        // the member boundaries; the buffering one never ran.
        let expected = if path == "/stream" { 8 * MIB as u64 } else { 0 };
        assert_eq!(seen.load(Ordering::SeqCst), expected, "{path}");
    }
}

#[tokio::test]
async fn a_body_longer_than_its_content_length_is_400_naming_the_body_not_the_wire_cap() {
    let declared = 100 * KIB;
    let expected = Rejection::InvalidParameters(vec![InvalidParameter::new(
        "body",
        format!("the body is longer than its content-length of {declared} bytes"),
    )]);
    let identity = |path: &str| {
        Request::post(path)
            .header(header::CONTENT_LENGTH, declared)
            .body(chunked(128 * KIB, b'a'))
            .unwrap()
    };
    let gzipped = |path: &str| {
        let mut sent = gzip_zeros(MIB);
        assert!(sent.len() < declared, "{} bytes", sent.len());
        sent.resize(declared + 1, 0);
        Request::post(path)
            .header(header::CONTENT_LENGTH, declared)
            .header(header::CONTENT_ENCODING, "gzip")
            .body(Body::from(sent))
            .unwrap()
    };
    for (name, build) in [
        ("identity", &identity as &dyn Fn(&str) -> Request<Body>),
        ("gzip", &gzipped),
    ] {
        for path in ["/stream", "/bytes"] {
            let seen = Arc::new(AtomicU64::new(0));
            let app = body_app(MIB, 8 * MIB, seen.clone());
            let (status, response) = send(&app, build(path)).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{name} {path}");
            assert_eq!(
                response.extensions().get::<Rejection>(),
                Some(&expected),
                "{name} {path}"
            );
            let doc = problem(response).await;
            assert_eq!(doc["errors"][0]["name"], "body", "{name} {path}");
            // The identity stream's first 64 KiB frame fits the declared
            // length; the gzip body is one frame over it, and the buffering
            // handler never runs.
            let read = match (name, path) {
                ("identity", "/stream") => 64 * KIB as u64,
                _ => 0,
            };
            assert_eq!(seen.load(Ordering::SeqCst), read, "{name} {path}");
        }
    }
    // With conflicting content-length lines, the first one is the length read to.
    let seen = Arc::new(AtomicU64::new(0));
    let app = body_app(MIB, 8 * MIB, seen.clone());
    let req = Request::post("/stream")
        .header(header::CONTENT_LENGTH, 16)
        .header(header::CONTENT_LENGTH, MIB)
        .body(chunked(64, b'a'))
        .unwrap();
    let (status, response) = send(&app, req).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        response.extensions().get::<Rejection>(),
        Some(&Rejection::InvalidParameters(vec![InvalidParameter::new(
            "body",
            "the body is longer than its content-length of 16 bytes",
        )]))
    );
    assert_eq!(seen.load(Ordering::SeqCst), 0);
    // A body exactly as long as its content-length passes.
    let seen = Arc::new(AtomicU64::new(0));
    let app = body_app(MIB, 8 * MIB, seen.clone());
    let req = Request::post("/stream")
        .header(header::CONTENT_LENGTH, 128 * KIB)
        .body(chunked(128 * KIB, b'a'))
        .unwrap();
    let (status, _) = send(&app, req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(seen.load(Ordering::SeqCst), 128 * KIB as u64);
}

#[tokio::test]
async fn a_content_encoding_that_names_no_coding_is_no_coding() {
    // Empty list elements do not count, so these lists name no coding: the
    // body is as sent, as for `gzip,` it is gzip.
    for lines in [&[""][..], &[","], &[" , ,"], &["", ""]] {
        let calls = Arc::new(AtomicU64::new(0));
        let app = echo_app(MIB, MIB, calls.clone());
        let mut req = Request::post("/echo")
            .body(Body::from("hello world"))
            .unwrap();
        for line in lines {
            req.headers_mut()
                .append(header::CONTENT_ENCODING, line.parse().unwrap());
        }
        let (status, response) = send(&app, req).await;
        assert_eq!(status, StatusCode::OK, "{lines:?}");
        assert_eq!(text(response).await, "hello world", "{lines:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "{lines:?}");
    }
}
