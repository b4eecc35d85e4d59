//! The client's IP address: the TCP peer, or behind trusted proxies the
//! forwarding header.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

mod forwarded;
mod layer;
mod proxies;
mod service;

pub use layer::ClientIpLayer;
use proxies::KeyPrefixes;

/// Most forwarding hops read from the right of the chain. Hops further left
/// are ignored, so a long or hostile header costs bounded work and memory.
pub(crate) const MAX_HOPS: usize = 32;

/// The client's IP address, as established by [`ClientIpLayer`] from the TCP
/// peer and, behind trusted proxies only, the forwarding header.
///
/// Besides the address it carries the network that quotas should be keyed
/// on, [`key_network`](Self::key_network): the address masked to a prefix,
/// `/32` for IPv4 and `/64` for IPv6 unless [`ClientIpLayer`] says
/// otherwise. One IPv6 host is usually handed a whole `/64`, so keying on
/// the full address would give it as many keys as it likes.
///
/// ```
/// use std::net::IpAddr;
/// use tower_admission::identity::ClientIp;
///
/// let a = ClientIp::new("2001:db8:1:2::1".parse().unwrap());
/// let b = ClientIp::new("2001:db8:1:2::ffff".parse().unwrap());
/// assert_ne!(a.ip(), b.ip());
/// assert_eq!(a.key_network(), b.key_network());
/// assert_eq!(a.key_network().to_string(), "2001:db8:1:2::/64");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClientIp {
    ip: IpAddr,
    network: IpNet,
}

impl ClientIp {
    /// The client at `ip`, keyed by the default prefixes (`/32` for IPv4,
    /// `/64` for IPv6). An IPv4-mapped IPv6 address is stored as IPv4.
    pub fn new(ip: IpAddr) -> Self {
        KeyPrefixes::default().client(ip)
    }

    /// The address.
    pub fn ip(&self) -> IpAddr {
        self.ip
    }

    /// The network to key per-client state (quotas) on: the address masked
    /// to the configured prefix. Its `Display` form, such as
    /// `2001:db8:1:2::/64` or `192.0.2.7/32`, is a stable key.
    pub fn key_network(&self) -> IpNet {
        self.network
    }
}

impl From<ClientIp> for IpAddr {
    fn from(client: ClientIp) -> Self {
        client.ip
    }
}

/// The address, without the prefix.
impl fmt::Display for ClientIp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.ip.fmt(f)
    }
}

#[cfg(test)]
mod tests;
