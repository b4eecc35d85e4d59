//! [`ClientIpLayer`].

use std::sync::Arc;

use tower::Layer;

use super::proxies::TrustedProxies;
use super::service::ClientIpService;

/// Layer that inserts the [`ClientIp`](super::ClientIp) into the request extensions.
///
/// The peer is read from the request extensions: axum's
/// `ConnectInfo<SocketAddr>` (feature `axum`; serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`), or a plain
/// [`SocketAddr`](std::net::SocketAddr). Without a peer address nothing is inserted, and the
/// `ClientIp` extractor answers 500, since that is a server set-up error.
///
/// Requests are never refused by this layer, and the response is the inner
/// service's. Clones share the [`TrustedProxies`] through an `Arc`.
///
/// ```
/// use axum::{routing::get, Router};
/// use tower_admission::identity::{ClientIp, ClientIpLayer, TrustedProxies};
///
/// let proxies = TrustedProxies::new(["10.0.0.0/8"]).unwrap();
/// let app: Router = Router::new()
///     .route("/ip", get(|client: ClientIp| async move { client.to_string() }))
///     .layer(ClientIpLayer::new(proxies));
/// ```
#[derive(Debug, Clone)]
pub struct ClientIpLayer {
    proxies: Arc<TrustedProxies>,
}

impl ClientIpLayer {
    /// A layer that believes forwarding headers only from `proxies`.
    pub fn new(proxies: TrustedProxies) -> Self {
        ClientIpLayer {
            proxies: Arc::new(proxies),
        }
    }

    /// The trusted proxies.
    pub fn proxies(&self) -> &TrustedProxies {
        &self.proxies
    }
}

impl<S> Layer<S> for ClientIpLayer {
    type Service = ClientIpService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ClientIpService {
            inner,
            proxies: Arc::clone(&self.proxies),
        }
    }
}
