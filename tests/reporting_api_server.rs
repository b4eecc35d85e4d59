//! The sample reporting API's server loop: slow clients, peer addresses and
//! the end of serving. Time is Tokio's paused clock: it moves only when every
//! task waits, straight to the next timer.

#[path = "../examples/reporting_api/serve.rs"]
mod serve;

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::Router;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves a router whose `/` answers the peer address it saw, until the
/// returned sender is used; the handle ends when serving has.
async fn start() -> (
    SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = Router::new().route(
        "/",
        get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.to_string() }),
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(serve::serve(listener, router, HEADER_READ_TIMEOUT, async {
        let _ = stop_rx.await;
    }));
    (addr, stop_tx, served)
}

/// Reads until the server closes the connection, or `limit` passes.
async fn read_to_close(stream: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let read = tokio::time::timeout(limit, async {
        let mut buf = [0u8; 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    });
    read.await.ok().map(|()| got)
}

/// The server closes `stream` with nothing more sent, the header-read
/// timeout after `since` (within 1 s).
async fn closed_silently_at_the_timeout(stream: &mut TcpStream, since: Instant) {
    let rest = read_to_close(stream, Duration::from_secs(600))
        .await
        .expect("the connection is still open after 600 s");
    let held = since.elapsed();
    assert!(
        held >= HEADER_READ_TIMEOUT && held < HEADER_READ_TIMEOUT + Duration::from_secs(1),
        "closed after {held:?}"
    );
    assert_eq!(String::from_utf8_lossy(&rest), "");
}

#[tokio::test(start_paused = true)]
async fn a_client_that_never_finishes_its_request_head_is_closed_at_the_header_read_timeout() {
    let (addr, _stop, _served) = start().await;
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nhost: a\r\nx-slow: ")
        .await
        .unwrap();
    closed_silently_at_the_timeout(&mut stream, started).await;
}

#[tokio::test(start_paused = true)]
async fn an_idle_kept_alive_connection_is_closed_at_the_header_read_timeout_after_its_answer() {
    let (addr, _stop, _served) = start().await;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = stream.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200 OK"));
    closed_silently_at_the_timeout(&mut stream, Instant::now()).await;
}

#[tokio::test(start_paused = true)]
async fn each_request_carries_the_peer_address_and_stop_ends_serving() {
    let (addr, stop, served) = start().await;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let local = stream.local_addr().unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let answer = read_to_close(&mut stream, Duration::from_secs(1))
        .await
        .expect("answered and closed within 1 s");
    let answer = String::from_utf8(answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(answer.ends_with(&format!("\r\n\r\n{local}")), "{answer}");

    stop.send(()).unwrap();
    // With no request in flight, serving ends at once, and nothing accepts
    // on the port any more.
    tokio::time::timeout(Duration::from_secs(1), served)
        .await
        .expect("serving ended within 1 s of the stop")
        .unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(addr)).await;
    assert!(
        matches!(refused, Ok(Err(_))),
        "a connection was accepted after stop: {refused:?}"
    );
}
