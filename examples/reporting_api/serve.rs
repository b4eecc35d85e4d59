//! The HTTP server: the router over hyper, with the limit on slow clients
//! that `axum::serve` leaves unset.

use std::future::Future;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::ServiceExt;

/// Serves `router` on `listener` until `stop` resolves, then stops
/// accepting and returns once every request in flight has its answer
/// (idle kept-alive connections are closed at once).
///
/// An HTTP/1 connection that has not sent a whole request head within
/// `header_read_timeout` (of its start, or of its previous response) is
/// closed: a client that trickles its headers, or never sends them, holds
/// neither a connection nor a shutdown open. Each request carries the
/// peer's address as `ConnectInfo<SocketAddr>`, as
/// `into_make_service_with_connect_info` gives it.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    header_read_timeout: Duration,
    stop: impl Future<Output = ()>,
) {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    let graceful = GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, say: retried shortly, not in
                    // a busy loop.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let service =
            router
                .clone()
                .map_request(move |mut req: http::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(ConnectInfo(peer));
                    req
                });
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), TowerToHyperService::new(service))
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "connection closed with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
