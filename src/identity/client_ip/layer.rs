//! [`ClientIpLayer`].

use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderMap, HeaderName};
use ipnet::IpNet;
use tower::Layer;

use super::proxies::TrustedProxies;
use super::service::ClientIpService;
use crate::ConfigError;

/// Layer that inserts the [`ClientIp`](super::ClientIp) into the request
/// extensions: the TCP peer, or behind the trusted proxies it is built
/// with, the client their forwarding header names.
///
/// The peer is read from the request extensions: axum's
/// `ConnectInfo<SocketAddr>` (feature `axum`; serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`), or a plain
/// [`SocketAddr`](std::net::SocketAddr). Without a peer address nothing is
/// inserted, and the `ClientIp` extractor answers 500, since that is a
/// server set-up error.
///
/// Requests are never refused by this layer, and the response is the inner
/// service's. Clones share the configuration through an `Arc`. The
/// [`Default`] layer trusts no proxy: the client is always the TCP peer.
///
/// ```
/// use axum::{routing::get, Router};
/// use tower_admission::identity::{ClientIp, ClientIpLayer};
///
/// let app: Router = Router::new()
///     .route("/ip", get(|client: ClientIp| async move { client.to_string() }))
///     .layer(ClientIpLayer::new(["10.0.0.0/8"]).unwrap());
/// ```
///
/// # The trusted proxies
///
#[doc = include_str!("../../../docs/trusted_proxies.md")]
#[derive(Debug, Clone, Default)]
pub struct ClientIpLayer {
    proxies: Arc<TrustedProxies>,
}

impl ClientIpLayer {
    /// Trusts the given ranges, each a CIDR (`10.0.0.0/8`, `fd00::/8`) or a
    /// single address (`192.0.2.1`). Reads `X-Forwarded-For` unless
    /// [`with_forwarded`](Self::with_forwarded) says otherwise.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for the field `trusted_proxies` naming the first
    /// range that does not parse.
    pub fn new<I>(ranges: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Ok(ClientIpLayer {
            proxies: Arc::new(TrustedProxies::new(ranges)?),
        })
    }

    fn edit(mut self, edit: impl FnOnce(TrustedProxies) -> TrustedProxies) -> Self {
        let proxies = Arc::make_mut(&mut self.proxies);
        *proxies = edit(std::mem::take(proxies));
        self
    }

    fn try_edit(
        mut self,
        edit: impl FnOnce(TrustedProxies) -> Result<TrustedProxies, ConfigError>,
    ) -> Result<Self, ConfigError> {
        let proxies = Arc::make_mut(&mut self.proxies);
        *proxies = edit(std::mem::take(proxies))?;
        Ok(self)
    }

    /// Also trusts `net`. An IPv4-mapped IPv6 range of `/96` or longer
    /// (`::ffff:10.0.0.0/104`) is stored as its IPv4 range; any other IPv6
    /// range matches IPv6 addresses only (see
    /// [IPv4 and IPv6 ranges](Self#ipv4-and-ipv6-ranges)).
    pub fn with_net(self, net: IpNet) -> Self {
        self.edit(|p| p.with_net(net))
    }

    /// Reads RFC 7239 `Forwarded: for=client, for=proxy1;proto=https`
    /// instead of the default `X-Forwarded-For: client, proxy1, proxy2`.
    ///
    /// Exactly one header is read. Reading both would let a caller inject
    /// the header the proxy does not rewrite and have it passed through
    /// untouched.
    pub fn with_forwarded(self) -> Self {
        self.edit(TrustedProxies::with_forwarded)
    }

    /// Groups IPv6 clients into networks of `len` bits for
    /// [`ClientIp::key_network`](super::ClientIp::key_network); the default
    /// is 64, one key per `/64`. 128 keys every address on its own.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for the field `ipv6_key_prefix` when `len` is above 128.
    pub fn with_ipv6_key_prefix(self, len: u8) -> Result<Self, ConfigError> {
        self.try_edit(|p| p.with_ipv6_key_prefix(len))
    }

    /// Groups IPv4 clients into networks of `len` bits for
    /// [`ClientIp::key_network`](super::ClientIp::key_network); the default
    /// is 32, one key per address.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for the field `ipv4_key_prefix` when `len` is above 32.
    pub fn with_ipv4_key_prefix(self, len: u8) -> Result<Self, ConfigError> {
        self.try_edit(|p| p.with_ipv4_key_prefix(len))
    }

    /// The forwarding header that is read: `x-forwarded-for`, or
    /// `forwarded` after [`with_forwarded`](Self::with_forwarded).
    pub fn header(&self) -> HeaderName {
        self.proxies.header()
    }

    /// The trusted ranges.
    pub fn nets(&self) -> &[IpNet] {
        self.proxies.nets()
    }

    /// True when `ip` is inside a trusted range.
    pub fn is_trusted(&self, ip: IpAddr) -> bool {
        self.proxies.is_trusted(ip)
    }

    /// The client address for a request from `peer` carrying `headers`; see
    /// [the trusted proxies](Self#the-trusted-proxies) for the walk. Pure and
    /// total: it never panics, and the answer is always `peer` (canonical)
    /// or an address written in the configured header.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        self.proxies.client_ip(peer, headers)
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
