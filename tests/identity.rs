//! Authenticated identity and client address: the layer, the extractors,
//! spoofing attempts and the forwarding-header parser.
#![cfg(feature = "axum")]

use std::collections::HashSet;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use ipnet::IpNet;
use proptest::prelude::*;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_admission::identity::{
    ApiKeys, AuthenticateLayer, Authenticator, ClientIp, ClientIpLayer, Identity,
};

/// Most forwarding hops read from the right of a chain, as documented on
/// [`ClientIpLayer`].
const MAX_HOPS: usize = 32;
use tower_admission::reject::Rejection;

/// Which forwarding header a case writes, and the proxies read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ForwardedHeader {
    XForwardedFor,
    Forwarded,
}

/// `proxies` reading `header`.
fn reading(proxies: ClientIpLayer, header: ForwardedHeader) -> ClientIpLayer {
    match header {
        ForwardedHeader::XForwardedFor => proxies,
        ForwardedHeader::Forwarded => proxies.with_forwarded(),
    }
}

const MALFORMED: &str = "missing or malformed credential";
const UNKNOWN: &str = "unknown credential";

fn keys() -> ApiKeys {
    ApiKeys::new()
        .with_key("demo-free", Identity::new("alice", "acme", "free"))
        .with_key("demo-pro", Identity::new("bob", "globex", "pro"))
}

async fn whoami(who: Identity) -> String {
    format!("{} {} {}", who.subject(), who.tenant(), who.plan())
}

fn app() -> Router {
    Router::new()
        .route("/whoami", get(whoami))
        .layer(AuthenticateLayer::new(keys()))
}

fn request(headers: &[(&str, &[u8])]) -> Request<Body> {
    let mut builder = Request::builder().uri("/whoami");
    for (name, value) in headers {
        builder = builder.header(*name, HeaderValue::from_bytes(value).unwrap());
    }
    builder.body(Body::empty()).unwrap()
}

async fn send(app: Router, req: Request<Body>) -> (Response<()>, Bytes) {
    let response = app.oneshot(req).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (Response::from_parts(parts, ()), body)
}

/// Asserts a 401 problem+json with the given detail and returns the body.
fn assert_unauthenticated(response: &Response<()>, body: &Bytes, detail: &str) {
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
    assert_eq!(response.headers()[WWW_AUTHENTICATE], "Bearer");
    let doc: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(doc["status"], 401);
    assert_eq!(doc["detail"], detail);
    assert_eq!(
        doc["type"],
        "https://docs.rs/tower-admission/latest/tower_admission/reject/#unauthenticated"
    );
}

#[tokio::test]
async fn valid_key_reaches_handler_with_its_identity() {
    let (response, body) = send(app(), request(&[("authorization", b"Bearer demo-free")])).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body, "alice acme free");

    let (response, body) = send(app(), request(&[("authorization", b"Bearer demo-pro")])).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body, "bob globex pro");
}

#[tokio::test]
async fn bearer_scheme_is_case_insensitive() {
    let (response, body) = send(app(), request(&[("authorization", b"bearer demo-free")])).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body, "alice acme free");
}

#[tokio::test]
async fn missing_header_is_401_problem_json_with_www_authenticate() {
    let (response, body) = send(app(), request(&[])).await;
    assert_unauthenticated(&response, &body, MALFORMED);
    assert_eq!(
        response.extensions().get::<Rejection>(),
        Some(&Rejection::Unauthenticated { reason: MALFORMED })
    );
}

#[tokio::test]
async fn unknown_key_is_401_and_not_echoed() {
    let (response, body) = send(
        app(),
        request(&[("authorization", b"Bearer guessed-secret-123")]),
    )
    .await;
    assert_unauthenticated(&response, &body, UNKNOWN);
    let text = std::str::from_utf8(&body).unwrap();
    assert!(!text.contains("guessed-secret-123"));
}

#[tokio::test]
async fn malformed_authorization_variants_are_401() {
    let too_long = [b"Bearer ".as_slice(), &[b'a'; 4090]].concat();
    assert_eq!(too_long.len(), 4097);
    let variants: Vec<Vec<&[u8]>> = vec![
        vec![b"Basic ZGVtbzpmcmVl"],
        vec![b"Token demo-free"],
        vec![b"Bearer"],
        vec![b"Bearer "],
        vec![b"Bearer    "],
        vec![b"Bearerdemo-free"],
        vec![b"Bearer demo free"],
        vec![b"Bearer demo-free\t"],
        vec![b"Bearer d\xe9mo-free"],
        vec![&too_long],
        vec![b"demo-free"],
        vec![b"Bearer demo-free", b"Bearer demo-free"],
    ];
    assert_eq!(variants.len(), 12);
    for values in variants {
        let headers: Vec<(&str, &[u8])> = values.iter().map(|v| ("authorization", *v)).collect();
        let (response, body) = send(app(), request(&headers)).await;
        assert_unauthenticated(&response, &body, MALFORMED);
    }
    // Exactly at the cap the header is parsed (and the key is unknown).
    let at_cap = [b"Bearer ".as_slice(), &[b'a'; 4089]].concat();
    assert_eq!(at_cap.len(), 4096);
    let (response, body) = send(app(), request(&[("authorization", &at_cap)])).await;
    assert_unauthenticated(&response, &body, UNKNOWN);
}

#[tokio::test]
async fn grpc_request_gets_grpc_status_16() {
    for auth in [None, Some(b"Bearer nope".as_slice())] {
        let mut headers: Vec<(&str, &[u8])> = vec![("content-type", b"application/grpc")];
        if let Some(auth) = auth {
            headers.push(("authorization", auth));
        }
        let (response, _) = send(app(), request(&headers)).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["grpc-status"], "16");
        assert!(
            !response.headers().contains_key(WWW_AUTHENTICATE),
            "gRPC answers carry the status, not an HTTP challenge"
        );
    }
}

#[tokio::test]
async fn spoofed_x_user_id_does_not_change_identity() {
    let (response, body) = send(
        app(),
        request(&[
            ("authorization", b"Bearer demo-free"),
            ("x-user-id", b"bob"),
            ("x-tenant-id", b"globex"),
            ("x-plan", b"enterprise"),
        ]),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body, "alice acme free");

    let (response, body) = send(app(), request(&[("x-user-id", b"bob")])).await;
    assert_unauthenticated(&response, &body, MALFORMED);
}

#[tokio::test]
async fn hashed_key_authenticates_and_bad_hex_is_config_error() {
    // printf s3cret | sha256sum
    let hex = "1ec1c26b50d5d3c58d9583181af8076655fe00756bf7285940ba3670f99fcba0";
    let keys = ApiKeys::new()
        .with_hashed_key(hex, Identity::new("carol", "initech", "pro"))
        .unwrap();
    let app = Router::new()
        .route("/whoami", get(whoami))
        .layer(AuthenticateLayer::new(keys));
    let (response, body) = send(app, request(&[("authorization", b"Bearer s3cret")])).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body, "carol initech pro");

    let err = ApiKeys::new()
        .with_hashed_key("not-hex", Identity::new("x", "y", "z"))
        .unwrap_err();
    assert_eq!(err.field(), "hashed_key");
    assert!(!err.to_string().contains("not-hex"));
    let err = ApiKeys::new()
        .with_hashed_key(&hex.replace('4', "g"), Identity::new("x", "y", "z"))
        .unwrap_err();
    assert_eq!(err.field(), "hashed_key");
}

/// A key is presented after `Bearer ` in a header read up to
/// `MAX_AUTHORIZATION_LEN` bytes: a longer key could never match, so the key
/// set refuses it, naming its position and never its value.
#[test]
fn a_key_too_long_to_present_is_refused_by_position() {
    // The documented longest `Authorization` value read (on `ApiKeys`).
    const MAX_AUTHORIZATION_LEN: usize = 4096;
    let longest = "k".repeat(MAX_AUTHORIZATION_LEN - "Bearer ".len());
    let too_long = "k".repeat(longest.len() + 1);
    let who = || Identity::new("alice", "acme", "free");
    let bearer = |key: &str| {
        let mut headers = http::HeaderMap::new();
        let value = format!("Bearer {key}");
        headers.insert("authorization", value.parse().unwrap());
        headers
    };
    let keys = ApiKeys::from_keys([("demo-free", who()), (longest.as_str(), who())]).unwrap();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys.identify(&bearer(&longest)), Ok(who()));
    // The header of a key one byte longer is never read.
    let unchecked = ApiKeys::new().with_key(&too_long, who());
    assert_eq!(
        unchecked.identify(&bearer(&too_long)),
        Err("missing or malformed credential")
    );

    let err = ApiKeys::from_keys([("demo-free", who()), (too_long.as_str(), who())]).unwrap_err();
    assert_eq!(err.field(), "keys");
    assert_eq!(
        err.reason(),
        "keys[1]: is 4090 bytes; a request can present at most 4089 \
         (an Authorization header is read up to 4096)"
    );
    assert!(!err.to_string().contains("kkk"));
    let err = ApiKeys::from_keys([("demo pro", who())]).unwrap_err();
    assert_eq!(
        err.reason(),
        "keys[0]: must be 1 or more visible ASCII characters (! to ~)"
    );
    assert_eq!(ApiKeys::check_key(b"").unwrap_err().field(), "key");
    assert_eq!(ApiKeys::check_key(longest.as_bytes()), Ok(()));
}

#[tokio::test]
async fn route_layer_leaves_later_routes_open() {
    let app = Router::new()
        .route("/whoami", get(whoami))
        .route_layer(AuthenticateLayer::new(keys()))
        .route("/healthz", get(|| async { "ok" }));
    let health = Request::get("/healthz").body(Body::empty()).unwrap();
    let (response, body) = send(app.clone(), health).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body, "ok");
    let (response, body) = send(app.clone(), request(&[])).await;
    assert_unauthenticated(&response, &body, MALFORMED);
    let (response, body) = send(app, request(&[("authorization", b"Bearer demo-pro")])).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body, "bob globex pro");
}

#[tokio::test]
async fn works_under_service_builder() {
    let service = ServiceBuilder::new()
        .layer(AuthenticateLayer::new(keys()))
        .service_fn(|req: Request<String>| async move {
            let who = req.extensions().get::<Identity>().cloned();
            Ok::<_, Infallible>(Response::new(format!("{who:?}")))
        });
    let req = Request::builder()
        .header(AUTHORIZATION, "Bearer demo-free")
        .body(String::new())
        .unwrap();
    let response = service.clone().oneshot(req).await.unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        body,
        format!("{:?}", Some(Identity::new("alice", "acme", "free")))
    );

    let response = service.oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
}

/// An async authenticator that counts its calls.
struct Counting {
    calls: Arc<AtomicUsize>,
}

impl Authenticator for Counting {
    async fn authenticate(&self, parts: &Parts) -> Result<Identity, &'static str> {
        tokio::task::yield_now().await;
        self.calls.fetch_add(1, Ordering::SeqCst);
        match parts.headers.get("x-client-cert-subject") {
            Some(v) if v == "CN=svc-a" => Ok(Identity::new("svc-a", "internal", "service")),
            Some(_) => Err("certificate not allowed"),
            None => Err("missing or malformed credential"),
        }
    }
}

/// Answers with the subject of the request's identity.
async fn answer_subject(req: Request<Body>) -> Result<Response<Body>, Infallible> {
    let who = req
        .extensions()
        .get::<Identity>()
        .unwrap()
        .subject()
        .to_owned();
    Ok(Response::new(Body::from(who)))
}

/// Answers at once for some requests (a cached certificate) and waits for
/// the others: counts both kinds of call.
struct SometimesNow {
    now: Arc<AtomicUsize>,
    calls: Arc<AtomicUsize>,
}

impl Authenticator for SometimesNow {
    fn authenticate_now(&self, parts: &Parts) -> Option<Result<Identity, &'static str>> {
        self.now.fetch_add(1, Ordering::SeqCst);
        parts
            .headers
            .contains_key("x-cached")
            .then(|| Ok(Identity::new("cached", "internal", "service")))
    }

    async fn authenticate(&self, _parts: &Parts) -> Result<Identity, &'static str> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        tokio::task::yield_now().await;
        Ok(Identity::new("late", "internal", "service"))
    }
}

#[tokio::test]
async fn each_request_is_authenticated_once_now_or_by_waiting() {
    let (now, calls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let layer = AuthenticateLayer::new(SometimesNow {
        now: Arc::clone(&now),
        calls: Arc::clone(&calls),
    });
    let cached = Request::builder()
        .header("x-cached", "1")
        .body(Body::empty())
        .unwrap();
    let response = layer
        .layer(tower::service_fn(answer_subject))
        .oneshot(cached)
        .await
        .unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "cached");
    // Answered at once: the waiting method was never called.
    assert_eq!(
        (now.load(Ordering::SeqCst), calls.load(Ordering::SeqCst)),
        (1, 0)
    );
    let handler = tower::service_fn(answer_subject);
    let response = layer
        .layer(handler)
        .oneshot(Request::new(Body::empty()))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "late");
    // No answer at once, so one awaited call: never two.
    assert_eq!(
        (now.load(Ordering::SeqCst), calls.load(Ordering::SeqCst)),
        (2, 1)
    );
}

#[tokio::test]
async fn custom_async_authenticator_and_clones_share_it() {
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = AuthenticateLayer::new(Counting {
        calls: Arc::clone(&calls),
    });
    let handler = tower::service_fn(answer_subject);
    let mut a = layer.clone().layer(handler);
    let mut b = a.clone();
    assert!(std::ptr::eq(a.authenticator(), b.authenticator()));

    let ok = Request::builder()
        .header("x-client-cert-subject", "CN=svc-a")
        .body(Body::empty())
        .unwrap();
    let response = a.ready().await.unwrap().call(ok).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let bad = Request::builder()
        .header("x-client-cert-subject", "CN=evil")
        .body(Body::empty())
        .unwrap();
    let response = b.ready().await.unwrap().call(bad).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        response.extensions().get::<Rejection>(),
        Some(&Rejection::Unauthenticated {
            reason: "certificate not allowed"
        })
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn identity_extractor_without_layer_is_401() {
    let app = Router::new().route("/whoami", get(whoami));
    let (response, body) = send(app, request(&[("authorization", b"Bearer demo-free")])).await;
    assert_unauthenticated(&response, &body, "no authenticated identity");
}

// ---------------------------------------------------------------- client IP

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn trusted() -> ClientIpLayer {
    ClientIpLayer::new(["10.0.0.0/8"]).unwrap()
}

fn headers(name: &str, values: &[&str]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for v in values {
        h.append(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

fn xff(values: &[&str]) -> HeaderMap {
    headers("x-forwarded-for", values)
}

fn fwd(values: &[&str]) -> HeaderMap {
    headers("forwarded", values)
}

#[test]
fn untrusted_peer_ignores_forwarding_headers() {
    let p = trusted();
    let peer = ip("203.0.113.9");
    assert_eq!(p.client_ip(peer, &xff(&["1.2.3.4"])), peer);
    assert_eq!(p.client_ip(peer, &xff(&["1.2.3.4, 10.0.0.2"])), peer);
    let none = ClientIpLayer::default();
    assert_eq!(
        none.client_ip(ip("10.0.0.1"), &xff(&["1.2.3.4"])),
        ip("10.0.0.1")
    );
}

#[test]
fn trusted_peer_takes_rightmost_untrusted_hop() {
    let p = trusted();
    let peer = ip("10.0.0.1");
    assert_eq!(
        p.client_ip(peer, &xff(&["1.1.1.1, 10.0.0.2"])),
        ip("1.1.1.1")
    );
    // The leftmost entry was written by 1.1.1.1, which is not ours.
    assert_eq!(
        p.client_ip(peer, &xff(&["6.6.6.6, 1.1.1.1"])),
        ip("1.1.1.1")
    );
    assert_eq!(p.client_ip(peer, &xff(&["1.1.1.1"])), ip("1.1.1.1"));
    // Every hop trusted: the leftmost.
    assert_eq!(
        p.client_ip(peer, &xff(&["10.0.0.3, 10.0.0.2"])),
        ip("10.0.0.3")
    );
    // No header: the peer.
    assert_eq!(p.client_ip(peer, &HeaderMap::new()), peer);
    // Several lines are one list; empty elements are skipped.
    assert_eq!(
        p.client_ip(peer, &xff(&["6.6.6.6", "1.1.1.1,, 10.0.0.2"])),
        ip("1.1.1.1")
    );
    // Ports and IPv6 forms that proxies write.
    assert_eq!(p.client_ip(peer, &xff(&["1.1.1.1:5555"])), ip("1.1.1.1"));
    assert_eq!(p.client_ip(peer, &xff(&["2001:db8::7"])), ip("2001:db8::7"));
    assert_eq!(
        p.client_ip(peer, &xff(&["[2001:db8::7]:443"])),
        ip("2001:db8::7")
    );
    // An IPv4-mapped peer is the IPv4 peer.
    assert_eq!(
        p.client_ip(ip("::ffff:10.0.0.1"), &xff(&["1.1.1.1"])),
        ip("1.1.1.1")
    );
}

#[test]
fn rfc7239_forwarded_cases() {
    let p = trusted().with_forwarded();
    let peer = ip("10.0.0.1");
    assert_eq!(
        p.client_ip(peer, &fwd(&[r#"for="[2001:db8::1]:4711""#])),
        ip("2001:db8::1")
    );
    assert_eq!(
        p.client_ip(
            peer,
            &fwd(&["for=192.0.2.60;proto=http, for=198.51.100.17"])
        ),
        ip("198.51.100.17")
    );
    let p2 = ClientIpLayer::new(["10.0.0.0/8", "198.51.100.0/24"])
        .unwrap()
        .with_forwarded();
    assert_eq!(
        p2.client_ip(
            peer,
            &fwd(&["for=192.0.2.60;proto=http, for=198.51.100.17"])
        ),
        ip("192.0.2.60")
    );
    assert_eq!(
        p.client_ip(peer, &fwd(&["For=192.0.2.43;By=10.0.0.9"])),
        ip("192.0.2.43")
    );
}

#[test]
fn obfuscated_identifiers_stop_the_walk() {
    let p = trusted().with_forwarded();
    let peer = ip("10.0.0.1");
    // The last known address is the trusted hop that received the hidden client.
    assert_eq!(
        p.client_ip(peer, &fwd(&["for=6.6.6.6, for=_hidden, for=10.0.0.2"])),
        ip("10.0.0.2")
    );
    assert_eq!(p.client_ip(peer, &fwd(&["for=unknown"])), peer);
    assert_eq!(p.client_ip(peer, &fwd(&["proto=https"])), peer);
    assert_eq!(p.client_ip(peer, &fwd(&[r#"for="_hidden:_port""#])), peer);
    assert_eq!(
        trusted().client_ip(peer, &xff(&["6.6.6.6, unknown, 10.0.0.2"])),
        ip("10.0.0.2")
    );
}

#[test]
fn malformed_headers_give_the_peer() {
    let p = trusted();
    let peer = ip("10.0.0.1");
    assert_eq!(p.client_ip(peer, &xff(&["1.1.1.1, garbage"])), peer);
    assert_eq!(p.client_ip(peer, &xff(&["1.1.1.1, 10.0.0.2:99999"])), peer);
    assert_eq!(p.client_ip(peer, &xff(&["1.1.1.1, \"10.0.0.2"])), peer);
    assert_eq!(p.client_ip(peer, &xff(&["010.0.0.2"])), peer);
    let mut non_ascii = HeaderMap::new();
    non_ascii.insert(
        "x-forwarded-for",
        HeaderValue::from_bytes(b"1.1.1.1, 10.0.0.\xff").unwrap(),
    );
    assert_eq!(p.client_ip(peer, &non_ascii), peer);
    // Hops left of the first untrusted one are never read.
    assert_eq!(
        p.client_ip(peer, &xff(&["garbage, 1.1.1.1"])),
        ip("1.1.1.1")
    );

    let f = trusted().with_forwarded();
    assert_eq!(f.client_ip(peer, &fwd(&[r#"for="1.1.1.1"#])), peer);
    assert_eq!(f.client_ip(peer, &fwd(&["for=1.1.1.1;for=2.2.2.2"])), peer);
    assert_eq!(f.client_ip(peer, &fwd(&["1.1.1.1"])), peer);
    // Unquoted IPv6 is tolerated, brackets and ports too.
    assert_eq!(
        f.client_ip(peer, &fwd(&["for=2001:db8::1"])),
        ip("2001:db8::1")
    );
}

/// Header lines from raw bytes, so a line may hold obs-text.
fn raw(name: &'static str, values: &[&[u8]]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for v in values {
        h.append(name, HeaderValue::from_bytes(v).unwrap());
    }
    h
}

/// What a client can put left of the hops its proxy appends: a lone quote,
/// unbalanced quotes, a backslash, obs-text, non-UTF-8, and invalid elements.
const CLIENT_GARBAGE: [&[u8]; 10] = [
    b"\"",
    b"\"1.2.3.4",
    b"for=\"1.2.3.4",
    b"1.2.3.4\"",
    b"\\",
    b"\xff",
    b"caf\xc3\xa9",
    b"not-an-address",
    b"for=1.2.3.4;for=5.6.7.8",
    b"1.2.3.4:99999",
];

#[test]
fn x_forwarded_for_client_garbage_is_ignored() {
    let p = trusted();
    let peer = ip("10.0.0.1");
    let client = ip("203.0.113.7");
    for garbage in CLIENT_GARBAGE {
        let shown = String::from_utf8_lossy(garbage);
        // The proxy appended to the client's line.
        let line = [garbage, b", 203.0.113.7"].concat();
        let h = raw("x-forwarded-for", &[&line]);
        assert_eq!(p.client_ip(peer, &h), client, "one line after {shown:?}");
        // Two trusted proxies appended.
        let line = [garbage, b", 203.0.113.7, 10.0.0.2"].concat();
        let h = raw("x-forwarded-for", &[&line]);
        assert_eq!(p.client_ip(peer, &h), client, "two hops after {shown:?}");
        // The proxy added a line of its own after the client's.
        let h = raw("x-forwarded-for", &[garbage, b"203.0.113.7"]);
        assert_eq!(p.client_ip(peer, &h), client, "two lines after {shown:?}");
        let h = raw("x-forwarded-for", &[garbage, b"203.0.113.7", b"10.0.0.2"]);
        assert_eq!(p.client_ip(peer, &h), client, "three lines after {shown:?}");
        // IPv6 with a port.
        let line = [garbage, b", [2001:db8::7]:443"].concat();
        let h = raw("x-forwarded-for", &[&line]);
        assert_eq!(
            p.client_ip(peer, &h),
            ip("2001:db8::7"),
            "v6 after {shown:?}"
        );
    }
}

#[test]
fn forwarded_client_garbage_is_ignored() {
    let p = trusted().with_forwarded();
    let peer = ip("10.0.0.1");
    let client = ip("203.0.113.7");
    for garbage in CLIENT_GARBAGE {
        let shown = String::from_utf8_lossy(garbage);
        let line = [garbage, b", for=203.0.113.7"].concat();
        let h = raw("forwarded", &[&line]);
        assert_eq!(p.client_ip(peer, &h), client, "one line after {shown:?}");
        let line = [garbage, b", for=203.0.113.7;proto=https, for=10.0.0.2"].concat();
        let h = raw("forwarded", &[&line]);
        assert_eq!(p.client_ip(peer, &h), client, "two hops after {shown:?}");
        let h = raw("forwarded", &[garbage, b"for=\"203.0.113.7:5555\""]);
        assert_eq!(p.client_ip(peer, &h), client, "two lines after {shown:?}");
        let h = raw("forwarded", &[garbage, b"for=203.0.113.7", b"for=10.0.0.2"]);
        assert_eq!(p.client_ip(peer, &h), client, "three lines after {shown:?}");
        let line = [garbage, b", for=\"[2001:db8::7]:443\";by=10.0.0.1"].concat();
        let h = raw("forwarded", &[&line]);
        assert_eq!(
            p.client_ip(peer, &h),
            ip("2001:db8::7"),
            "v6 after {shown:?}"
        );
    }
}

#[test]
fn forwarded_quoted_commas_and_escapes_in_walked_elements() {
    let p = ClientIpLayer::new(["10.0.0.0/8", "198.51.100.0/24"])
        .unwrap()
        .with_forwarded();
    let peer = ip("10.0.0.1");
    // A comma inside a quoted string does not end the element.
    let h = fwd(&[r#"for=6.6.6.6, for=192.0.2.60;ext="a, b", for=198.51.100.17"#]);
    assert_eq!(p.client_ip(peer, &h), ip("192.0.2.60"));
    // Nor does one after an escaped quote.
    let h = fwd(&[r#"for=6.6.6.6, for=192.0.2.60;ext="a\", b\\", for=198.51.100.17"#]);
    assert_eq!(p.client_ip(peer, &h), ip("192.0.2.60"));
    // A quote the client opened stays in the client's part.
    let h = fwd(&[r#"for="6.6.6.6, for=192.0.2.60, for=198.51.100.17"#]);
    assert_eq!(p.client_ip(peer, &h), ip("192.0.2.60"));
}

#[test]
fn malformed_walked_hop_gives_the_peer() {
    // A hop that the walk reaches and that does not parse voids the header,
    // even behind a trusted hop: the answer is the peer.
    let p = trusted();
    let peer = ip("10.0.0.1");
    assert_eq!(
        p.client_ip(peer, &xff(&["203.0.113.7, garbage, 10.0.0.2"])),
        peer
    );
    assert_eq!(
        p.client_ip(peer, &xff(&["203.0.113.7", "\"10.0.0.2"])),
        peer
    );
    let h = raw("x-forwarded-for", &[b"203.0.113.7, 10.0.0.2\xff, 10.0.0.3"]);
    assert_eq!(p.client_ip(peer, &h), peer);
    let f = trusted().with_forwarded();
    assert_eq!(
        f.client_ip(peer, &fwd(&["for=203.0.113.7, for=\"10.0.0.2"])),
        peer
    );
    let h = raw("forwarded", &[b"for=203.0.113.7", b"for=\"10.0.0.\xe9\""]);
    assert_eq!(f.client_ip(peer, &h), peer);
}

#[test]
fn only_the_configured_header_is_read() {
    let peer = ip("10.0.0.1");
    let mut h = xff(&["1.1.1.1"]);
    h.insert("forwarded", HeaderValue::from_static("for=6.6.6.6"));
    assert_eq!(trusted().client_ip(peer, &h), ip("1.1.1.1"));
    let f = trusted().with_forwarded();
    assert_eq!(f.client_ip(peer, &h), ip("6.6.6.6"));
    assert_eq!(f.client_ip(peer, &xff(&["1.1.1.1"])), peer);
}

#[test]
fn at_most_max_hops_are_read() {
    assert_eq!(MAX_HOPS, 32);
    let mut chain = vec!["1.1.1.1".to_owned()];
    chain.extend((0..40).map(|i| format!("10.0.1.{i}")));
    let h = xff(&[&chain.join(", ")]);
    // The rightmost 32 hops are 10.0.1.8 ..= 10.0.1.39, all trusted.
    assert_eq!(trusted().client_ip(ip("10.0.0.1"), &h), ip("10.0.1.8"));
    let h = xff(&[&chain[9..].join(", ")]);
    assert_eq!(trusted().client_ip(ip("10.0.0.1"), &h), ip("10.0.1.8"));
    // 33 hops: the untrusted leftmost is one too far to be read.
    let h = xff(&[&chain[..33].join(", ")]);
    assert_eq!(trusted().client_ip(ip("10.0.0.1"), &h), ip("10.0.1.0"));
    // 32 hops: it is read.
    let h = xff(&[&chain[..32].join(", ")]);
    assert_eq!(trusted().client_ip(ip("10.0.0.1"), &h), ip("1.1.1.1"));
}

#[test]
fn trusted_proxies_config() {
    let p = ClientIpLayer::new(["10.0.0.0/8", "192.0.2.1", " fd00::/8 "]).unwrap();
    assert_eq!(p.nets().len(), 3);
    assert!(p.is_trusted(ip("10.255.0.1")));
    assert!(p.is_trusted(ip("192.0.2.1")));
    assert!(!p.is_trusted(ip("192.0.2.2")));
    assert!(p.is_trusted(ip("fd12::1")));
    assert!(!p.is_trusted(ip("11.0.0.1")));
    assert_eq!(p.header(), "x-forwarded-for");
    let err = ClientIpLayer::new(["10.0.0.0/8", "ten/8"]).unwrap_err();
    assert_eq!(err.field(), "trusted_proxies");
    assert_eq!(
        err.reason(),
        "\"ten/8\" is neither a CIDR range nor an IP address"
    );
}

async fn show_ip(client: ClientIp) -> String {
    client.to_string()
}

fn ip_app() -> Router {
    Router::new().route("/ip", get(show_ip)).layer(trusted())
}

fn ip_request(peer: &str, xff: Option<&str>) -> Request<Body> {
    let mut builder =
        Request::get("/ip").extension(ConnectInfo(peer.parse::<SocketAddr>().unwrap()));
    if let Some(xff) = xff {
        builder = builder.header("x-forwarded-for", xff);
    }
    builder.body(Body::empty()).unwrap()
}

#[tokio::test]
async fn client_ip_layer_ignores_spoofed_header_from_untrusted_peer() {
    let (response, body) = send(ip_app(), ip_request("203.0.113.9:5000", Some("1.2.3.4"))).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body, "203.0.113.9");

    let (_, body) = send(
        ip_app(),
        ip_request("10.0.0.1:5000", Some("6.6.6.6, 1.2.3.4")),
    )
    .await;
    assert_eq!(body, "1.2.3.4");

    let (_, body) = send(ip_app(), ip_request("[2001:db8::9]:5000", None)).await;
    assert_eq!(body, "2001:db8::9");
}

#[tokio::test]
async fn client_ip_layer_accepts_plain_socket_addr_and_needs_a_peer() {
    let service =
        ServiceBuilder::new()
            .layer(trusted())
            .service_fn(|req: Request<()>| async move {
                Ok::<_, Infallible>(req.extensions().get::<ClientIp>().copied())
            });
    let req = Request::builder()
        .extension("10.0.0.1:80".parse::<SocketAddr>().unwrap())
        .header("x-forwarded-for", "1.1.1.1")
        .body(())
        .unwrap();
    assert_eq!(
        service.clone().oneshot(req).await.unwrap(),
        Some(ClientIp::new(ip("1.1.1.1")))
    );
    assert_eq!(service.oneshot(Request::new(())).await.unwrap(), None);

    // Without a peer the extractor reports a set-up error.
    let req = Request::get("/ip").body(Body::empty()).unwrap();
    let (response, _) = send(ip_app(), req).await;
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
}

#[tokio::test]
async fn identity_and_client_ip_together() {
    let app = Router::new()
        .route(
            "/both",
            get(|who: Identity, client: ClientIp| async move {
                format!("{}@{}", who.subject(), client.ip())
            }),
        )
        .layer(AuthenticateLayer::new(keys()))
        .layer(trusted());
    let req = Request::get("/both")
        .extension(ConnectInfo("10.0.0.1:1234".parse::<SocketAddr>().unwrap()))
        .header("authorization", "Bearer demo-pro")
        .header("x-forwarded-for", "198.51.100.4")
        .header("x-user-id", "alice")
        .body(Body::empty())
        .unwrap();
    let (response, body) = send(app, req).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body, "bob@198.51.100.4");
}

// ---------------------------------------------------------------- keying

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

/// The [`ClientIp`] that [`ClientIpLayer`] inserts for a request from `peer`.
async fn layer_client(proxies: ClientIpLayer, peer: &str, xff: Option<&str>) -> ClientIp {
    let service = ServiceBuilder::new()
        .layer(proxies)
        .service_fn(|req: Request<()>| async move {
            Ok::<_, Infallible>(req.extensions().get::<ClientIp>().copied())
        });
    let mut req = Request::builder().extension(peer.parse::<SocketAddr>().unwrap());
    if let Some(xff) = xff {
        req = req.header("x-forwarded-for", xff);
    }
    service
        .oneshot(req.body(()).unwrap())
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn ipv6_clients_in_one_64_share_a_key() {
    let a = layer_client(trusted(), "[2001:db8:1:2::1]:5000", None).await;
    let b = layer_client(trusted(), "[2001:db8:1:2:ffff:ffff:ffff:ffff]:5000", None).await;
    // Behind a trusted proxy, the forwarded address is grouped the same way.
    let c = layer_client(trusted(), "10.0.0.1:80", Some("2001:db8:1:2::abcd")).await;
    let other = layer_client(trusted(), "[2001:db8:1:3::1]:5000", None).await;
    assert_eq!(a.ip(), ip("2001:db8:1:2::1"));
    assert_eq!(a.to_string(), "2001:db8:1:2::1");
    assert_eq!(c.ip(), ip("2001:db8:1:2::abcd"));
    assert_eq!(a.key_network(), net("2001:db8:1:2::/64"));
    assert_eq!(b.key_network(), net("2001:db8:1:2::/64"));
    assert_eq!(c.key_network(), net("2001:db8:1:2::/64"));
    assert_eq!(a.key_network().to_string(), "2001:db8:1:2::/64");
    assert_eq!(other.key_network(), net("2001:db8:1:3::/64"));
    assert_ne!(a.key_network(), other.key_network());
    assert_eq!(ClientIp::new(ip("2001:db8:1:2::1")), a);
}

#[tokio::test]
async fn ipv4_clients_are_keyed_per_address_by_default() {
    let a = layer_client(trusted(), "203.0.113.7:5000", None).await;
    let b = layer_client(trusted(), "203.0.113.8:5000", None).await;
    let mapped = layer_client(trusted(), "[::ffff:203.0.113.7]:5000", None).await;
    assert_eq!(a.key_network(), net("203.0.113.7/32"));
    assert_eq!(b.key_network(), net("203.0.113.8/32"));
    assert_eq!(mapped.ip(), ip("203.0.113.7"));
    assert_eq!(mapped.key_network(), net("203.0.113.7/32"));
    assert_eq!(
        ClientIp::new(ip("::ffff:203.0.113.7")).key_network(),
        net("203.0.113.7/32")
    );
}

#[tokio::test]
async fn custom_key_prefixes() {
    let p = trusted()
        .with_ipv6_key_prefix(48)
        .unwrap()
        .with_ipv4_key_prefix(24)
        .unwrap();
    let a = layer_client(p.clone(), "[2001:db8:1:2::1]:5000", None).await;
    let b = layer_client(p.clone(), "[2001:db8:1:ffff::1]:5000", None).await;
    let other = layer_client(p.clone(), "[2001:db8:2::1]:5000", None).await;
    assert_eq!(a.key_network(), net("2001:db8:1::/48"));
    assert_eq!(b.key_network(), net("2001:db8:1::/48"));
    assert_eq!(other.key_network(), net("2001:db8:2::/48"));
    let v4 = layer_client(p.clone(), "10.0.0.1:80", Some("203.0.113.7")).await;
    assert_eq!(v4.ip(), ip("203.0.113.7"));
    assert_eq!(v4.key_network(), net("203.0.113.0/24"));

    // The extremes: every address alone, and everyone together.
    let each = trusted().with_ipv6_key_prefix(128).unwrap();
    let a = layer_client(each, "[2001:db8:1:2::1]:5000", None).await;
    assert_eq!(a.key_network(), net("2001:db8:1:2::1/128"));
    let all = trusted()
        .with_ipv6_key_prefix(0)
        .unwrap()
        .with_ipv4_key_prefix(0)
        .unwrap();
    let a = layer_client(all.clone(), "[2001:db8:1:2::1]:5000", None).await;
    assert_eq!(a.key_network(), net("::/0"));
    let a = layer_client(all, "203.0.113.7:5000", None).await;
    assert_eq!(a.key_network(), net("0.0.0.0/0"));
}

#[test]
fn invalid_key_prefix_is_config_error() {
    let err = trusted().with_ipv6_key_prefix(129).unwrap_err();
    assert_eq!(err.field(), "ipv6_key_prefix");
    assert_eq!(err.reason(), "an IPv6 prefix is at most 128 bits, got 129");
    let err = trusted().with_ipv4_key_prefix(33).unwrap_err();
    assert_eq!(err.field(), "ipv4_key_prefix");
    assert_eq!(err.reason(), "an IPv4 prefix is at most 32 bits, got 33");
    assert_eq!(
        ClientIpLayer::default()
            .with_ipv4_key_prefix(u8::MAX)
            .unwrap_err()
            .field(),
        "ipv4_key_prefix"
    );
    assert!(trusted().with_ipv6_key_prefix(128).is_ok());
    assert!(trusted().with_ipv4_key_prefix(32).is_ok());
}

// ---------------------------------------------------------------- properties

/// Every address a header text could name: tokens between separators, with
/// or without a port, in canonical form. Escapes are dropped first.
fn addresses_in(text: &str) -> HashSet<IpAddr> {
    let text = text.replace('\\', "");
    let mut found = HashSet::new();
    for token in text.split([',', ';', '=', '"', '[', ']', ' ', '\t']) {
        if let Ok(ip) = token.parse::<IpAddr>() {
            found.insert(ip.to_canonical());
        }
        if let Some((host, _)) = token.split_once(':') {
            if let Ok(ip) = host.parse::<IpAddr>() {
                found.insert(ip.to_canonical());
            }
        }
    }
    found
}

fn hop() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(|o| Ipv4Addr::from(o).to_string()),
        (0u8..3, any::<u8>()).prop_map(|(a, b)| format!("10.0.{a}.{b}")),
        (any::<[u8; 4]>(), any::<u16>())
            .prop_map(|(o, port)| format!("{}:{port}", Ipv4Addr::from(o))),
        any::<[u16; 8]>().prop_map(|s| Ipv6Addr::from(s).to_string()),
        any::<[u16; 8]>().prop_map(|s| format!("[{}]:443", Ipv6Addr::from(s))),
        any::<[u8; 4]>().prop_map(|o| Ipv4Addr::from(o).to_ipv6_mapped().to_string()),
        Just("unknown".to_owned()),
        Just("_hidden".to_owned()),
        "[ -~]{0,12}",
    ]
}

fn forwarded_element() -> impl Strategy<Value = String> {
    (hop(), 0u8..4).prop_map(|(hop, form)| match form {
        0 => format!("for={hop}"),
        1 => format!("for=\"{hop}\""),
        2 => format!("proto=https;for=\"{hop}\";by=10.0.0.1"),
        _ => hop,
    })
}

fn peer() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        Just(ip("10.0.0.1")),
        Just(ip("203.0.113.9")),
        any::<[u8; 4]>().prop_map(IpAddr::from),
        Just(ip("::ffff:10.0.0.1")),
    ]
}

fn proxies() -> ClientIpLayer {
    ClientIpLayer::new(["10.0.0.0/8", "fd00::/8"]).unwrap()
}

fn check(peer: IpAddr, header: ForwardedHeader, values: &[Vec<u8>]) -> Result<(), TestCaseError> {
    let name = match header {
        ForwardedHeader::Forwarded => "forwarded",
        _ => "x-forwarded-for",
    };
    let mut map = HeaderMap::new();
    let mut text = String::new();
    for v in values {
        let Ok(value) = HeaderValue::from_bytes(v) else {
            continue;
        };
        map.append(name, value);
        text.push_str(&String::from_utf8_lossy(v));
        text.push(',');
    }
    let p = reading(proxies(), header);
    let got = p.client_ip(peer, &map);
    let peer = peer.to_canonical();
    prop_assert!(
        got == peer || addresses_in(&text).contains(&got),
        "{got} is neither the peer {peer} nor in {text:?}"
    );
    if !p.is_trusted(peer) {
        prop_assert_eq!(got, peer);
    }
    Ok(())
}

/// Bytes a client may send, weighted toward those the parsers care about.
fn client_byte() -> impl Strategy<Value = u8> {
    prop_oneof![
        3 => any::<u8>(),
        2 => prop::sample::select(b"\"\\,;=[]: \t".to_vec()),
        1 => 0x80u8..=0xff,
    ]
}

/// Addresses that [`proxies`] does not trust, IPv4-mapped ones included.
fn untrusted_client() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(IpAddr::from),
        any::<[u16; 8]>().prop_map(|s| IpAddr::from(Ipv6Addr::from(s))),
        any::<[u8; 4]>().prop_map(|o| IpAddr::V6(Ipv4Addr::from(o).to_ipv6_mapped())),
    ]
    .prop_filter("untrusted", |ip| !proxies().is_trusted(*ip))
}

/// One hop as a proxy writes it, in one of several valid forms.
fn render_hop(header: ForwardedHeader, ip: IpAddr, form: u8) -> String {
    let node = match (ip, form % 3) {
        (_, 0) => ip.to_string(),
        (IpAddr::V4(v4), _) => format!("{v4}:{}", 1000 + u16::from(form)),
        (IpAddr::V6(v6), 1) => format!("[{v6}]"),
        (IpAddr::V6(v6), _) => format!("[{v6}]:443"),
    };
    match header {
        ForwardedHeader::Forwarded => {
            let value = if node.contains(':') {
                format!("\"{node}\"")
            } else {
                node
            };
            match form % 4 {
                0 => format!("for={value}"),
                1 => format!("for={value};proto=https"),
                2 => format!("proto=http;for={value};by=10.0.0.1"),
                _ => format!("For={value};host=\"a, b\\\"c\""),
            }
        }
        _ => node,
    }
}

/// Trusted proxies that receive from `client` and forward to the next; the
/// last of them is the peer.
const PROXY_CHAIN: [&str; 4] = ["10.0.0.1", "fd00::2", "10.1.2.3", "::ffff:10.9.9.9"];

/// The header lines a chain of `proxies` trusted proxies leaves: the client's
/// `lines` (bytes a header value cannot hold are dropped), then each proxy
/// appends the hop it received from, to the last line (`new_line[i]` false)
/// or on a line of its own.
fn appended_chain(
    header: ForwardedHeader,
    lines: &[Vec<u8>],
    client: IpAddr,
    proxies: usize,
    forms: &[u8],
    new_line: &[bool],
) -> (IpAddr, HeaderMap) {
    let mut values: Vec<Vec<u8>> = lines
        .iter()
        .map(|line| {
            line.iter()
                .copied()
                .filter(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
                .collect()
        })
        .collect();
    for i in 0..proxies {
        let from = if i == 0 {
            client
        } else {
            ip(PROXY_CHAIN[i - 1])
        };
        let hop = render_hop(header, from, forms[i]);
        match values.last_mut() {
            Some(last) if !new_line[i] => {
                last.extend_from_slice(b", ");
                last.extend_from_slice(hop.as_bytes());
            }
            _ => values.push(hop.into_bytes()),
        }
    }
    let name = match header {
        ForwardedHeader::Forwarded => "forwarded",
        _ => "x-forwarded-for",
    };
    let mut map = HeaderMap::new();
    for v in values {
        map.append(name, HeaderValue::from_bytes(&v).unwrap());
    }
    (ip(PROXY_CHAIN[proxies - 1]), map)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn parser_on_structured_chains_returns_peer_or_a_header_address(
        peer in peer(),
        xff_hops in prop::collection::vec(hop(), 0..40),
        fwd_hops in prop::collection::vec(forwarded_element(), 0..40),
        sep in prop_oneof![Just(", "), Just(","), Just(" ,\t")],
    ) {
        check(peer, ForwardedHeader::XForwardedFor, &[xff_hops.join(sep).into_bytes()])?;
        check(peer, ForwardedHeader::Forwarded, &[fwd_hops.join(sep).into_bytes()])?;
    }

    #[test]
    fn parser_on_arbitrary_bytes_returns_peer_or_a_header_address(
        peer in peer(),
        values in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..120), 0..3),
        printable in "[ -~]{0,200}",
    ) {
        check(peer, ForwardedHeader::XForwardedFor, &values)?;
        check(peer, ForwardedHeader::Forwarded, &values)?;
        check(peer, ForwardedHeader::XForwardedFor, &[printable.clone().into_bytes()])?;
        check(peer, ForwardedHeader::Forwarded, &[printable.into_bytes()])?;
    }

    #[test]
    fn client_prefix_never_changes_the_answer(
        lines in prop::collection::vec(prop::collection::vec(client_byte(), 0..40), 0..3),
        client in untrusted_client(),
        proxies_n in 1..=PROXY_CHAIN.len(),
        forms in prop::collection::vec(any::<u8>(), PROXY_CHAIN.len()),
        new_line in prop::collection::vec(any::<bool>(), PROXY_CHAIN.len()),
    ) {
        for header in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded] {
            let (peer, map) =
                appended_chain(header, &lines, client, proxies_n, &forms, &new_line);
            let got = reading(proxies(), header).client_ip(peer, &map);
            prop_assert_eq!(got, client.to_canonical(), "{:?} from {}: {:?}", header, peer, map);
        }
    }

    #[test]
    fn parser_matches_reference_walk_on_well_formed_chains(
        hops in prop::collection::vec(
            prop_oneof![
                (0u8..3, any::<u8>()).prop_map(|(a, b)| Ipv4Addr::new(10, 0, a, b)),
                any::<[u8; 4]>().prop_map(Ipv4Addr::from),
            ],
            0..40,
        ),
    ) {
        let peer = ip("10.0.0.1");
        let p = proxies();
        let text: Vec<String> = hops.iter().map(|h| h.to_string()).collect();
        let got = p.client_ip(peer, &xff(&[&text.join(", ")]));
        // Reference: walk the rightmost MAX_HOPS from the right.
        let start = hops.len().saturating_sub(MAX_HOPS);
        let mut want = peer;
        for h in hops[start..].iter().rev() {
            want = IpAddr::V4(*h);
            if !p.is_trusted(want) {
                break;
            }
        }
        prop_assert_eq!(got, want);
    }
}

/// An IPv4 peer on a dual-stack socket (`::ffff:10.0.0.1`) is IPv4: `::/0`
/// trusts every IPv6 proxy and no IPv4 one, so its header is not believed;
/// `0.0.0.0/0`, or the IPv4-mapped `::ffff:0:0/96`, trusts it.
#[test]
fn an_ipv6_range_shorter_than_96_bits_does_not_trust_ipv4_peers() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let mut headers = http::HeaderMap::new();
    headers.insert("x-forwarded-for", "198.51.100.7".parse().unwrap());
    let mapped_peer = ip("::ffff:10.0.0.1");

    let ipv6_only = ClientIpLayer::new(["::/0"]).unwrap();
    assert_eq!(ipv6_only.client_ip(mapped_peer, &headers), ip("10.0.0.1"));
    assert_eq!(
        ipv6_only.client_ip(ip("2001:db8::1"), &headers),
        ip("198.51.100.7")
    );
    for every_ipv4 in ["0.0.0.0/0", "::ffff:0:0/96"] {
        let proxies = ClientIpLayer::new([every_ipv4]).unwrap();
        assert_eq!(
            proxies.client_ip(mapped_peer, &headers),
            ip("198.51.100.7"),
            "{every_ipv4}"
        );
        assert_eq!(
            proxies.client_ip(ip("2001:db8::1"), &headers),
            ip("2001:db8::1"),
            "{every_ipv4}"
        );
    }
}
