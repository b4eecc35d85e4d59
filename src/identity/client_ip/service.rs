//! [`ClientIpService`]: the client address into the request extensions.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Extensions, Request};
use tower::Service;

use super::proxies::TrustedProxies;

/// Service built by [`ClientIpLayer`](super::ClientIpLayer).
#[derive(Debug, Clone)]
pub struct ClientIpService<S> {
    pub(super) inner: S,
    pub(super) proxies: Arc<TrustedProxies>,
}

impl<S> ClientIpService<S> {
    crate::macros::inner_accessors!(inner: S);
}

impl<S, B> Service<Request<B>> for ClientIpService<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        if let Some(peer) = peer_ip(req.extensions()) {
            let ip = self.proxies.client_ip(peer, req.headers());
            let client = self.proxies.key_prefixes.client(ip);
            req.extensions_mut().insert(client);
        }
        self.inner.call(req)
    }
}

pub(super) fn peer_ip(extensions: &Extensions) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(axum::extract::ConnectInfo(addr)) =
        extensions.get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(addr.ip());
    }
    extensions.get::<SocketAddr>().map(SocketAddr::ip)
}
