//! [`TrustedProxies`]: whose forwarding headers are believed, and the
//! client address they give.

use std::net::IpAddr;
use std::str::FromStr;

use http::{HeaderMap, HeaderName};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::forwarded::{hops_from_right, parse_hop, ForwardedHeader, Node};
use super::{ClientIp, MAX_HOPS};
use crate::ConfigError;

/// Prefix lengths that group client addresses into key networks; always
/// within range, since the builders refuse longer ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct KeyPrefixes {
    pub(super) v4: u8,
    pub(super) v6: u8,
}

impl Default for KeyPrefixes {
    fn default() -> Self {
        KeyPrefixes { v4: 32, v6: 64 }
    }
}

impl KeyPrefixes {
    pub(super) fn client(self, ip: IpAddr) -> ClientIp {
        let ip = ip.to_canonical();
        let network = match ip {
            IpAddr::V4(v4) => Ipv4Net::new(v4, self.v4).map(|net| IpNet::V4(net.trunc())),
            IpAddr::V6(v6) => Ipv6Net::new(v6, self.v6).map(|net| IpNet::V6(net.trunc())),
        };
        // The lengths are in range, so the fallback (the host itself) is
        // never taken; it keeps this total without a panic path.
        let network = network.unwrap_or_else(|_| IpNet::from(ip));
        ClientIp { ip, network }
    }
}

/// The proxies whose forwarding headers are believed: the configuration of
/// a [`ClientIpLayer`](super::ClientIpLayer), whose docs describe it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TrustedProxies {
    nets: Vec<IpNet>,
    header: ForwardedHeader,
    pub(super) key_prefixes: KeyPrefixes,
}

impl TrustedProxies {
    /// No trusted proxies: the client is always the TCP peer.
    pub(crate) fn none() -> Self {
        TrustedProxies::default()
    }

    /// Trusts the given ranges, each a CIDR (`10.0.0.0/8`, `fd00::/8`) or a
    /// single address (`192.0.2.1`). Reads `X-Forwarded-For` unless
    /// `with_forwarded` says otherwise.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for the field `trusted_proxies` naming the first
    /// range that does not parse.
    pub(crate) fn new<I>(ranges: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        ranges
            .into_iter()
            .try_fold(TrustedProxies::none(), |proxies, range| {
                let range = range.as_ref().trim();
                let net = IpNet::from_str(range)
                    .or_else(|_| IpAddr::from_str(range).map(IpNet::from))
                    .map_err(|_| {
                        ConfigError::new(
                            "trusted_proxies",
                            format!("{range:?} is neither a CIDR range nor an IP address"),
                        )
                    })?;
                Ok(proxies.with_net(net))
            })
    }

    /// Also trusts `net`. An IPv4-mapped IPv6 range of `/96` or longer
    /// (`::ffff:10.0.0.0/104`) is stored as its IPv4 range; any other IPv6
    /// range matches IPv6 addresses only (see
    /// the layer's docs).
    pub(crate) fn with_net(mut self, net: IpNet) -> Self {
        self.nets.push(canonical_net(net.trunc()));
        self
    }

    /// Reads RFC 7239 `Forwarded: for=client, for=proxy1;proto=https`
    /// instead of the default `X-Forwarded-For: client, proxy1, proxy2`.
    ///
    /// Exactly one header is read. Reading both would let a caller inject
    /// the header the proxy does not rewrite and have it passed through
    /// untouched.
    pub(crate) fn with_forwarded(mut self) -> Self {
        self.header = ForwardedHeader::Forwarded;
        self
    }

    /// Groups IPv6 clients into networks of `len` bits for
    /// [`ClientIp::key_network`]; the default is 64, one key per `/64`.
    /// 128 keys every address on its own.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for the field `ipv6_key_prefix` when `len` is above 128.
    pub(crate) fn with_ipv6_key_prefix(mut self, len: u8) -> Result<Self, ConfigError> {
        if len > 128 {
            return Err(ConfigError::new(
                "ipv6_key_prefix",
                format!("an IPv6 prefix is at most 128 bits, got {len}"),
            ));
        }
        self.key_prefixes.v6 = len;
        Ok(self)
    }

    /// Groups IPv4 clients into networks of `len` bits for
    /// [`ClientIp::key_network`]; the default is 32, one key per address.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for the field `ipv4_key_prefix` when `len` is above 32.
    pub(crate) fn with_ipv4_key_prefix(mut self, len: u8) -> Result<Self, ConfigError> {
        if len > 32 {
            return Err(ConfigError::new(
                "ipv4_key_prefix",
                format!("an IPv4 prefix is at most 32 bits, got {len}"),
            ));
        }
        self.key_prefixes.v4 = len;
        Ok(self)
    }

    /// The forwarding header that is read: `x-forwarded-for`, or
    /// `forwarded` after `with_forwarded`.
    pub(crate) fn header(&self) -> HeaderName {
        self.header.name()
    }

    /// The trusted ranges.
    pub(crate) fn nets(&self) -> &[IpNet] {
        &self.nets
    }

    /// True when `ip` is inside a trusted range.
    pub(crate) fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.nets.iter().any(|net| net.contains(&ip))
    }

    /// The client address for a request from `peer` carrying `headers`; see
    /// the type docs for the walk. Pure and total: it never panics, and the
    /// answer is always `peer` (canonical) or an address written in the
    /// configured header.
    pub(crate) fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = peer.to_canonical();
        if !self.is_trusted(peer) {
            return peer;
        }
        let mut current = peer;
        for hop in hops_from_right(headers, self.header).take(MAX_HOPS) {
            match parse_hop(hop, self.header) {
                Node::Ip(ip) => {
                    current = ip.to_canonical();
                    if !self.is_trusted(current) {
                        return current;
                    }
                }
                Node::Obfuscated => return current,
                Node::Malformed => return peer,
            }
        }
        current
    }
}

pub(super) fn canonical_net(net: IpNet) -> IpNet {
    if let IpNet::V6(v6) = net {
        if let (Some(v4), true) = (v6.addr().to_ipv4_mapped(), v6.prefix_len() >= 96) {
            if let Ok(v4net) = Ipv4Net::new(v4, v6.prefix_len() - 96) {
                return IpNet::V4(v4net);
            }
        }
    }
    net
}
