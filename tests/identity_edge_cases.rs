//! The identity layer against what a caller or proxy may send: forwarding headers
//! in their odd but legal forms, IPv4-mapped addresses, credentials with odd
//! whitespace, and a real HTTP/1.1 server fed raw bytes.
#![cfg(feature = "axum")]

use std::net::{IpAddr, SocketAddr};

use http::{HeaderMap, HeaderValue};
use tower_admission::identity::{ApiKeys, ClientIpLayer, Identity};

/// `ApiKeys`'s refusals.
const MISSING: &str = "missing or malformed credential";
const UNKNOWN: &str = "unknown credential";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn trusted() -> ClientIpLayer {
    ClientIpLayer::new(["10.0.0.0/8"]).unwrap()
}

fn raw(name: &'static str, values: &[&[u8]]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for v in values {
        h.append(name, HeaderValue::from_bytes(v).unwrap());
    }
    h
}

#[test]
fn xff_lines_and_one_comma_list_agree() {
    let p = trusted();
    let peer = ip("10.0.0.1");
    let hops = ["6.6.6.6", "203.0.113.7", "10.0.0.3", "10.0.0.2"];
    // Every way of cutting the list into lines gives the same answer.
    for cuts in 0u8..8 {
        let mut lines: Vec<String> = vec![hops[0].to_owned()];
        for (i, hop) in hops.iter().enumerate().skip(1) {
            if cuts & (1 << (i - 1)) != 0 {
                lines.push((*hop).to_owned());
            } else {
                let last = lines.last_mut().unwrap();
                last.push_str(", ");
                last.push_str(hop);
            }
        }
        let values: Vec<&[u8]> = lines.iter().map(|l| l.as_bytes()).collect();
        let h = raw("x-forwarded-for", &values);
        assert_eq!(p.client_ip(peer, &h), ip("203.0.113.7"), "{lines:?}");
    }
}

#[test]
fn both_headers_in_one_request_the_configured_one_wins() {
    let peer = ip("10.0.0.1");
    let mut h = raw("x-forwarded-for", &[b"203.0.113.7"]);
    h.append("forwarded", HeaderValue::from_static("for=6.6.6.6"));
    // Proxies write X-Forwarded-For: the caller's Forwarded changes nothing.
    assert_eq!(trusted().client_ip(peer, &h), ip("203.0.113.7"));
    // Put the caller's header first or last: same answer.
    let mut h2 = raw("forwarded", &[b"for=6.6.6.6"]);
    h2.append("x-forwarded-for", HeaderValue::from_static("203.0.113.7"));
    assert_eq!(trusted().client_ip(peer, &h2), ip("203.0.113.7"));
    // Proxies write Forwarded: the caller's X-Forwarded-For changes nothing.
    let f = trusted().with_forwarded();
    let mut h = raw("forwarded", &[b"for=203.0.113.7"]);
    h.append("x-forwarded-for", HeaderValue::from_static("6.6.6.6"));
    assert_eq!(f.client_ip(peer, &h), ip("203.0.113.7"));
    // Without the configured header the peer is the answer, whatever else.
    let h = raw("x-forwarded-for", &[b"6.6.6.6"]);
    assert_eq!(f.client_ip(peer, &h), peer);
}

#[test]
fn forwarded_forms() {
    let f = trusted().with_forwarded();
    let peer = ip("10.0.0.1");
    let cases: [(&[u8], IpAddr); 16] = [
        (br#"for="[2001:db8::1]:4711""#, ip("2001:db8::1")),
        (br#"for="[2001:db8::1]""#, ip("2001:db8::1")),
        (br#"for="192.0.2.43:47011""#, ip("192.0.2.43")),
        (
            br#"FOR="[2001:db8::1]:4711";PROTO=https"#,
            ip("2001:db8::1"),
        ),
        (b"fOr=192.0.2.43", ip("192.0.2.43")),
        // Obfuscated: the client is hidden; the last known address is the peer.
        (b"for=_hidden", peer),
        (b"for=unknown", peer),
        (b"for=UNKNOWN", peer),
        (br#"for="_hidden:_port""#, peer),
        (b"for=_hidden, for=10.0.0.2", ip("10.0.0.2")),
        // `for` twice in one element is malformed: the peer.
        (b"for=192.0.2.43;for=198.51.100.1", peer),
        (b"for=192.0.2.43;FOR=198.51.100.1", peer),
        // A mapped hop from the trusted range is that proxy; the walk goes on.
        (
            br#"for=192.0.2.43, for="[::ffff:10.0.0.2]""#,
            ip("192.0.2.43"),
        ),
        (
            br#"for=192.0.2.43, for="[::ffff:10.0.0.2]:80""#,
            ip("192.0.2.43"),
        ),
        // A mapped untrusted hop is the IPv4 client.
        (br#"for="[::ffff:192.0.2.43]""#, ip("192.0.2.43")),
        (
            b"for=198.51.100.1;proto=https;by=10.0.0.1",
            ip("198.51.100.1"),
        ),
    ];
    for (value, want) in cases {
        let h = raw("forwarded", &[value]);
        let shown = String::from_utf8_lossy(value);
        assert_eq!(f.client_ip(peer, &h), want, "{shown}");
        // A mapped peer is the same peer.
        let mapped = ip("::ffff:10.0.0.1");
        let want_mapped = if want == peer { peer } else { want };
        assert_eq!(f.client_ip(mapped, &h), want_mapped, "mapped peer, {shown}");
    }
}

#[test]
fn ipv4_mapped_hops_from_an_ipv4_range() {
    let p = trusted();
    let peer = ip("10.0.0.1");
    let cases: [(&[u8], IpAddr); 6] = [
        (b"203.0.113.7, ::ffff:10.0.0.2", ip("203.0.113.7")),
        (b"203.0.113.7, [::ffff:10.0.0.2]:443", ip("203.0.113.7")),
        (b"203.0.113.7, ::FFFF:A00:2", ip("203.0.113.7")),
        (b"::ffff:203.0.113.7", ip("203.0.113.7")),
        (b"::ffff:10.0.0.3, ::ffff:10.0.0.2", ip("10.0.0.3")),
        // IPv4-compatible (not mapped) is IPv6, so not the proxy: the client.
        (b"203.0.113.7, ::10.0.0.2", ip("::10.0.0.2")),
    ];
    for (value, want) in cases {
        let h = raw("x-forwarded-for", &[value]);
        let shown = String::from_utf8_lossy(value);
        assert_eq!(p.client_ip(peer, &h), want, "{shown}");
        assert_eq!(
            p.client_ip(ip("::ffff:10.0.0.1"), &h),
            want,
            "mapped peer, {shown}"
        );
    }
    // A mapped range is the IPv4 range.
    let m = ClientIpLayer::new(["::ffff:10.0.0.0/104"]).unwrap();
    let h = raw("x-forwarded-for", &[b"203.0.113.7, 10.0.0.2"]);
    assert_eq!(m.client_ip(peer, &h), ip("203.0.113.7"));
}

#[test]
fn a_chain_longer_than_the_proxies() {
    let p = ClientIpLayer::new(["10.0.0.1", "10.0.0.2"]).unwrap();
    let peer = ip("10.0.0.1");
    // The caller prepends hops, trusted addresses among them: the first
    // untrusted hop from the right is the answer.
    let h = raw(
        "x-forwarded-for",
        &[b"10.0.0.2, 10.0.0.1, 6.6.6.6, 203.0.113.7, 10.0.0.2"],
    );
    assert_eq!(p.client_ip(peer, &h), ip("203.0.113.7"));
    // A hop in the range 10/8 but not configured is the client.
    let h = raw("x-forwarded-for", &[b"6.6.6.6, 10.0.0.9, 10.0.0.2"]);
    assert_eq!(p.client_ip(peer, &h), ip("10.0.0.9"));
}

#[test]
fn invalid_utf8_and_tabs() {
    let p = trusted();
    let peer = ip("10.0.0.1");
    // In the caller's part: ignored.
    let h = raw("x-forwarded-for", &[b"\xc3\x28\xff\xfe, 203.0.113.7"]);
    assert_eq!(p.client_ip(peer, &h), ip("203.0.113.7"));
    let h = raw("x-forwarded-for", &[b"\xc3\x28", b"\t203.0.113.7\t"]);
    assert_eq!(p.client_ip(peer, &h), ip("203.0.113.7"));
    // In a walked hop: malformed, the peer.
    let h = raw("x-forwarded-for", &[b"203.0.113.7\xa0"]);
    assert_eq!(p.client_ip(peer, &h), peer);
    let h = raw("x-forwarded-for", &[b"203.0.\t113.7"]);
    assert_eq!(p.client_ip(peer, &h), peer);
}

fn keys() -> ApiKeys {
    ApiKeys::new().with_key("demo-free", Identity::new("alice", "acme", "free"))
}

fn auth(values: &[&[u8]]) -> Result<Identity, &'static str> {
    keys().identify(&raw("authorization", values))
}

#[test]
fn authorization_forms() {
    let alice = Ok(Identity::new("alice", "acme", "free"));
    assert_eq!(auth(&[b"Bearer demo-free"]), alice);
    assert_eq!(auth(&[b"bearer demo-free"]), alice);
    assert_eq!(auth(&[b"BEARER demo-free"]), alice);
    assert_eq!(auth(&[b"Bearer   demo-free"]), alice);
    assert_eq!(auth(&[b"Bearer"]), Err(MISSING));
    assert_eq!(auth(&[b"Bearer "]), Err(MISSING));
    assert_eq!(auth(&[b""]), Err(MISSING));
    assert_eq!(auth(&[b"Bearer\tdemo-free"]), Err(MISSING));
    assert_eq!(auth(&[b" Bearer demo-free"]), Err(MISSING));
    assert_eq!(auth(&[b"Bearer demo-free "]), Err(MISSING));
    assert_eq!(
        auth(&[b"Bearer demo-free", b"Bearer demo-free"]),
        Err(MISSING)
    );
    assert_eq!(auth(&[b"Bearer demo-free", b"Bearer other"]), Err(MISSING));
    assert_eq!(auth(&[b"Bearer demo-free, Basic x"]), Err(MISSING));
    assert_eq!(auth(&[b"Bearer demo-free,"]), Err(UNKNOWN));
}

/// RFC 9110 §11.4: the scheme and the token are separated by one or more
/// spaces (`1*SP`), never a tab. A tab right after the scheme was refused,
/// but one after a space was skipped and the key accepted.
#[test]
fn only_spaces_separate_the_scheme_from_the_token() {
    let alice = Ok(Identity::new("alice", "acme", "free"));
    assert_eq!(auth(&[b"Bearer  demo-free"]), alice);
    for value in [
        &b"Bearer\tdemo-free"[..],
        b"Bearer \tdemo-free",
        b"Bearer  \t demo-free",
        b"bearer \t\tdemo-free",
    ] {
        let shown = String::from_utf8_lossy(value);
        assert_eq!(auth(&[value]), Err(MISSING), "{shown:?}");
    }
}

// ------------------------------------------------------- over a real socket

use axum::routing::get;
use axum::Router;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_admission::identity::{AuthenticateLayer, ClientIp};

async fn serve() -> SocketAddr {
    let app = Router::new()
        .route(
            "/",
            get(|who: Identity, client: ClientIp| async move {
                format!("{}@{}", who.subject(), client.ip())
            }),
        )
        .layer(AuthenticateLayer::new(keys()))
        .layer(ClientIpLayer::new(["127.0.0.0/8"]).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    addr
}

/// Sends `head` (header lines, CRLF-terminated) and returns the status code
/// and body.
async fn send_raw(addr: SocketAddr, head: &[u8]) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n".to_vec();
    req.extend_from_slice(head);
    req.extend_from_slice(b"\r\n");
    stream.write_all(&req).await.unwrap();
    let mut out = Vec::new();
    stream.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text[9..12].parse().unwrap();
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    (status, body)
}

#[tokio::test]
async fn raw_http1_requests() {
    let addr = serve().await;
    let key = b"authorization: Bearer demo-free\r\n";
    let with = |extra: &[u8]| [key.as_slice(), extra].concat();
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (with(b""), 200, "alice@127.0.0.1"),
        (
            with(b"x-forwarded-for: 6.6.6.6\r\nx-forwarded-for: 203.0.113.7\r\n"),
            200,
            "alice@203.0.113.7",
        ),
        (
            with(b"x-forwarded-for: 6.6.6.6, 203.0.113.7\r\n"),
            200,
            "alice@203.0.113.7",
        ),
        (
            with(b"X-Forwarded-For: \xff\xfe, 203.0.113.7   \r\n"),
            200,
            "alice@203.0.113.7",
        ),
        (
            with(b"forwarded: for=6.6.6.6\r\nx-forwarded-for: 203.0.113.7\r\n"),
            200,
            "alice@203.0.113.7",
        ),
        (
            b"authorization:   bearer demo-free   \r\n".to_vec(),
            200,
            "alice@127.0.0.1",
        ),
        (
            b"Authorization: Bearer demo-free\r\nAuthorization: Bearer demo-free\r\n".to_vec(),
            401,
            "",
        ),
        (b"authorization: Bearer\r\n".to_vec(), 401, ""),
        (b"authorization: Bearer \r\n".to_vec(), 401, ""),
        (b"x-user-id: alice\r\n".to_vec(), 401, ""),
        (b"authorization: Bearer d\xe9mo-free\r\n".to_vec(), 401, ""),
        (b"authorization: Bearer \tdemo-free\r\n".to_vec(), 401, ""),
        (
            [b"authorization: Bearer ".as_slice(), &[b'k'; 5000], b"\r\n"].concat(),
            401,
            "",
        ),
        (
            with(b"x-forwarded-for: 6.6.6.6,\t203.0.113.7,\t127.0.0.2\r\n"),
            200,
            "alice@203.0.113.7",
        ),
    ];
    for (head, status, body) in cases {
        let shown = String::from_utf8_lossy(&head).into_owned();
        let (got_status, got_body) = send_raw(addr, &head).await;
        assert_eq!(got_status, status, "{shown}");
        if status == 200 {
            assert_eq!(got_body, body, "{shown}");
        }
    }
}
