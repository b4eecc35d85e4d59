use std::borrow::Cow;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::header::FORWARDED;
use http::{Extensions, HeaderMap, HeaderName, Request};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use tower::{Layer, Service};

use crate::ConfigError;

/// Most forwarding hops read from the right of the chain. Hops further left
/// are ignored, so a long or hostile header costs bounded work and memory.
pub const MAX_HOPS: usize = 32;

/// The client's IP address, as established by [`ClientIpLayer`] from the TCP
/// peer and, behind trusted proxies only, the forwarding header.
///
/// Besides the address it carries the network that quotas should be keyed
/// on, [`key_network`](Self::key_network): the address masked to a prefix,
/// `/32` for IPv4 and `/64` for IPv6 unless [`TrustedProxies`] says
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

/// Prefix lengths that group client addresses into key networks; always
/// within range, since the builders refuse longer ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KeyPrefixes {
    v4: u8,
    v6: u8,
}

impl Default for KeyPrefixes {
    fn default() -> Self {
        KeyPrefixes { v4: 32, v6: 64 }
    }
}

impl KeyPrefixes {
    fn client(self, ip: IpAddr) -> ClientIp {
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

/// Which forwarding header the trusted proxies write.
///
/// Exactly one is read. Reading both would let a caller inject the header
/// the proxy does not rewrite and have it passed through untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (the default).
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for=proxy1;proto=https`.
    Forwarded,
}

impl ForwardedHeader {
    fn name(self) -> HeaderName {
        match self {
            ForwardedHeader::XForwardedFor => HeaderName::from_static("x-forwarded-for"),
            ForwardedHeader::Forwarded => FORWARDED,
        }
    }
}

/// The proxies whose forwarding headers are believed, as CIDR ranges
/// (parsed with the `ipnet` crate).
///
/// [`client_ip`](TrustedProxies::client_ip) walks the forwarding chain from
/// right to left, starting at the TCP peer:
///
/// 1. If the peer is not trusted, it is the client; headers are ignored.
/// 2. Otherwise move one hop left. Each hop was written by the trusted proxy
///    to its right, so it is genuine. The first hop that is not trusted is the
///    client. If every hop is trusted, the leftmost is the client.
/// 3. The walk stops at an obfuscated identifier (`unknown`, `_hidden`, or a
///    `Forwarded` element without `for=`): the client is hidden, and the
///    answer is the last known address, the trusted hop that received it.
/// 4. If the walk meets a hop that does not parse (not visible ASCII, an
///    unbalanced quote, not an address), the header is treated as giving no
///    forwarding information and the answer is the peer. This holds even
///    when trusted hops came before it: a trusted proxy that writes garbage
///    is a set-up error, and the peer is the one address known for sure.
///
/// Only the hops the walk reaches are parsed. Everything left of the first
/// untrusted hop, where a client's own header text ends up, is never read:
/// a stray quote, a non-ASCII byte or an invalid element there cannot change
/// the answer. Lines are read as bytes, so obs-text in the client's part
/// does not void the line. `X-Forwarded-For` is a plain comma list (no
/// quoted strings); `Forwarded` elements are split from the right,
/// ignoring commas inside quoted strings.
///
/// Several header lines form one list, in order: the walk starts at the last
/// line's last element and goes leftwards across lines. Only the rightmost
/// [`MAX_HOPS`] hops are read; if all are trusted the leftmost of them is the
/// answer. The walk never panics, and allocates only to unescape a quoted
/// `for=` value that holds a backslash.
///
/// [`ClientIpLayer`] also groups the answer into the network that quotas are
/// keyed on ([`ClientIp::key_network`]): `/64` for IPv6 and `/32` for IPv4
/// unless [`with_ipv6_key_prefix`](Self::with_ipv6_key_prefix) or
/// [`with_ipv4_key_prefix`](Self::with_ipv4_key_prefix) says otherwise.
///
/// ```
/// use std::net::IpAddr;
/// use http::HeaderMap;
/// use tower_admission::identity::TrustedProxies;
///
/// let proxies = TrustedProxies::new(["10.0.0.0/8"]).unwrap();
/// let mut headers = HeaderMap::new();
/// headers.insert("x-forwarded-for", "6.6.6.6, 1.1.1.1".parse().unwrap());
/// let peer: IpAddr = "10.0.0.1".parse().unwrap();
/// // 6.6.6.6 was written by 1.1.1.1, which is not ours: it may be a lie.
/// assert_eq!(proxies.client_ip(peer, &headers), "1.1.1.1".parse::<IpAddr>().unwrap());
/// ```
///
/// # IPv4 and IPv6 ranges
///
/// Addresses are compared in canonical form: an IPv4-mapped address
/// (`::ffff:10.0.0.1`, as a dual-stack socket reports an IPv4 peer) is the
/// IPv4 address `10.0.0.1`, and an IPv4-mapped range of `/96` or longer
/// (`::ffff:10.0.0.0/104`) is its IPv4 range (`10.0.0.0/8`). So an IPv4
/// address is matched by IPv4 ranges only, and an IPv6 range shorter than
/// `/96` matches IPv6 addresses only: `::/0` trusts every IPv6 peer and no
/// IPv4 one. To trust every peer, list both `0.0.0.0/0` and `::/0`.
///
/// ```
/// use std::net::IpAddr;
/// use tower_admission::identity::TrustedProxies;
///
/// let ip = |s: &str| s.parse::<IpAddr>().unwrap();
/// let ipv6 = TrustedProxies::new(["::/0"]).unwrap();
/// assert!(ipv6.is_trusted(ip("2001:db8::1")));
/// assert!(!ipv6.is_trusted(ip("::ffff:10.0.0.1")));
/// let mapped = TrustedProxies::new(["::ffff:10.0.0.0/104"]).unwrap();
/// assert!(mapped.is_trusted(ip("10.0.0.1")));
/// assert!(mapped.is_trusted(ip("::ffff:10.0.0.1")));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    nets: Vec<IpNet>,
    header: ForwardedHeader,
    key_prefixes: KeyPrefixes,
}

impl TrustedProxies {
    /// No trusted proxies: the client is always the TCP peer.
    pub fn none() -> Self {
        TrustedProxies::default()
    }

    /// Trusts the given ranges, each a CIDR (`10.0.0.0/8`, `fd00::/8`) or a
    /// single address (`192.0.2.1`). Reads `X-Forwarded-For` unless
    /// [`with_header`](Self::with_header) says otherwise.
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
    /// [IPv4 and IPv6 ranges](Self#ipv4-and-ipv6-ranges)).
    pub fn with_net(mut self, net: IpNet) -> Self {
        self.nets.push(canonical_net(net.trunc()));
        self
    }

    /// Reads `header` instead of the default `X-Forwarded-For`.
    pub fn with_header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Groups IPv6 clients into networks of `len` bits for
    /// [`ClientIp::key_network`]; the default is 64, one key per `/64`.
    /// 128 keys every address on its own.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for the field `ipv6_key_prefix` when `len` is above 128.
    pub fn with_ipv6_key_prefix(mut self, len: u8) -> Result<Self, ConfigError> {
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
    pub fn with_ipv4_key_prefix(mut self, len: u8) -> Result<Self, ConfigError> {
        if len > 32 {
            return Err(ConfigError::new(
                "ipv4_key_prefix",
                format!("an IPv4 prefix is at most 32 bits, got {len}"),
            ));
        }
        self.key_prefixes.v4 = len;
        Ok(self)
    }

    /// The forwarding header that is read.
    pub fn header(&self) -> ForwardedHeader {
        self.header
    }

    /// The trusted ranges.
    pub fn nets(&self) -> &[IpNet] {
        &self.nets
    }

    /// True when `ip` is inside a trusted range.
    pub fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.nets.iter().any(|net| net.contains(&ip))
    }

    /// The client address for a request from `peer` carrying `headers`; see
    /// the type docs for the walk. Pure and total: it never panics, and the
    /// answer is always `peer` (canonical) or an address written in the
    /// configured header.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
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

fn canonical_net(net: IpNet) -> IpNet {
    if let IpNet::V6(v6) = net {
        if let (Some(v4), true) = (v6.addr().to_ipv4_mapped(), v6.prefix_len() >= 96) {
            if let Ok(v4net) = Ipv4Net::new(v4, v6.prefix_len() - 96) {
                return IpNet::V4(v4net);
            }
        }
    }
    net
}

/// The non-empty list elements of every line of the configured header,
/// right to left: from the last line's last element leftwards across lines.
///
/// Lines are read as bytes, and nothing is validated here: only the elements
/// the walk takes are parsed, so whatever sits left of them (where a client's
/// own header text is) costs nothing and changes nothing.
fn hops_from_right(
    headers: &HeaderMap,
    header: ForwardedHeader,
) -> impl Iterator<Item = &[u8]> + '_ {
    let quoted = header == ForwardedHeader::Forwarded;
    headers
        .get_all(header.name())
        .iter()
        .rev()
        .flat_map(move |line| ElementsFromRight {
            rest: Some(line.as_bytes()),
            quoted,
        })
        .map(trim_ows)
        .filter(|element| !element.is_empty())
}

/// The comma-separated elements of one line, last first.
///
/// `X-Forwarded-For` is a plain comma list (`quoted: false`). `Forwarded`
/// (`quoted: true`) ignores commas inside quoted strings, found from the
/// right: a `"` ends a quoted string unless an odd run of backslashes
/// precedes it. An element whose quote is never closed runs to the start of
/// the line; the element parser then refuses it. Elements written by
/// proxies are well formed, so their boundaries never depend on the bytes
/// left of them.
struct ElementsFromRight<'a> {
    rest: Option<&'a [u8]>,
    quoted: bool,
}

impl<'a> Iterator for ElementsFromRight<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let rest = self.rest?;
        let mut in_quote = false;
        for i in (0..rest.len()).rev() {
            match rest[i] {
                b'"' if self.quoted => {
                    let backslashes = rest[..i].iter().rev().take_while(|&&b| b == b'\\');
                    if !in_quote || backslashes.count() % 2 == 0 {
                        in_quote = !in_quote;
                    }
                }
                b',' if !in_quote => {
                    self.rest = Some(&rest[..i]);
                    return Some(&rest[i + 1..]);
                }
                _ => {}
            }
        }
        self.rest = None;
        Some(rest)
    }
}

/// Strips RFC 9110 optional whitespace (spaces and tabs) from both ends.
fn trim_ows(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', tail @ ..] = bytes {
        bytes = tail;
    }
    while let [head @ .., b' ' | b'\t'] = bytes {
        bytes = head;
    }
    bytes
}

/// The node of one walked element. An element that is not visible ASCII
/// (with spaces and tabs) is malformed.
fn parse_hop(element: &[u8], header: ForwardedHeader) -> Node {
    let visible = |b: &u8| matches!(b, b'\t' | b' '..=b'~');
    if !element.iter().all(visible) {
        return Node::Malformed;
    }
    let Ok(text) = std::str::from_utf8(element) else {
        return Node::Malformed;
    };
    match header {
        ForwardedHeader::XForwardedFor => parse_node(text),
        ForwardedHeader::Forwarded => forwarded_for(text),
    }
}

/// Calls `f` with each `delim`-separated piece of `text`, ignoring delimiters
/// inside quoted strings. Returns false when a quote is left open.
fn split_quoted<'t>(text: &'t str, delim: u8, mut f: impl FnMut(&'t str)) -> bool {
    let (mut start, mut in_quote, mut escaped) = (0, false, false);
    for (i, &b) in text.as_bytes().iter().enumerate() {
        if in_quote {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_quote = false;
            }
        } else if b == b'"' {
            in_quote = true;
        } else if b == delim {
            // `delim` is ASCII, so `i` is a char boundary.
            f(&text[start..i]);
            start = i + 1;
        }
    }
    if in_quote {
        return false;
    }
    f(&text[start..]);
    true
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    Ip(IpAddr),
    Obfuscated,
    Malformed,
}

/// The node of the `for` parameter of one RFC 7239 forwarded-element.
fn forwarded_for(element: &str) -> Node {
    let mut node = None;
    let mut malformed = false;
    let balanced = split_quoted(element, b';', |pair| {
        let pair = pair.trim_matches([' ', '\t']);
        if pair.is_empty() || malformed {
            return;
        }
        let Some((name, value)) = pair.split_once('=') else {
            malformed = true;
            return;
        };
        let name = name.trim_matches([' ', '\t']);
        if name.is_empty() || !name.bytes().all(is_tchar) {
            malformed = true;
            return;
        }
        let Some(value) = unquote(value.trim_matches([' ', '\t'])) else {
            malformed = true;
            return;
        };
        if name.eq_ignore_ascii_case("for") {
            if node.is_some() {
                // RFC 7239 §4: a parameter must not occur twice in an element.
                malformed = true;
            } else {
                node = Some(parse_node(&value));
            }
        }
    });
    match (malformed || !balanced, node) {
        (true, _) => Node::Malformed,
        (false, Some(node)) => node,
        // A proxy that does not disclose the client.
        (false, None) => Node::Obfuscated,
    }
}

/// A token, or the contents of a quoted string with escapes removed.
fn unquote(value: &str) -> Option<Cow<'_, str>> {
    let Some(inner) = value.strip_prefix('"') else {
        return (!value.is_empty() && value.bytes().all(is_token_value_char))
            .then_some(Cow::Borrowed(value));
    };
    let inner = inner.strip_suffix('"')?;
    if !inner.contains('\\') {
        return (!inner.contains('"')).then_some(Cow::Borrowed(inner));
    }
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.push(chars.next()?),
            '"' => return None,
            c => out.push(c),
        }
    }
    Some(Cow::Owned(out))
}

/// RFC 9110 tchar.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Characters accepted in an unquoted value: tchar plus `:` `[` `]`, which
/// some proxies write unquoted around IPv6 addresses and ports.
fn is_token_value_char(b: u8) -> bool {
    is_tchar(b) || b":[]".contains(&b)
}

/// One node: an IPv4 or IPv6 address, optionally `[v6]` and optionally with a
/// port, or an obfuscated identifier.
fn parse_node(node: &str) -> Node {
    if is_obfuscated(node) {
        return Node::Obfuscated;
    }
    if let Ok(ip) = IpAddr::from_str(node) {
        return Node::Ip(ip);
    }
    if let Some(rest) = node.strip_prefix('[') {
        let Some((v6, after)) = rest.split_once(']') else {
            return Node::Malformed;
        };
        let port_ok = after.is_empty() || after.strip_prefix(':').is_some_and(is_port);
        return match Ipv6Addr::from_str(v6) {
            Ok(ip) if port_ok => Node::Ip(IpAddr::V6(ip)),
            _ => Node::Malformed,
        };
    }
    if let Some((host, port)) = node.split_once(':') {
        if is_port(port) {
            if let Ok(ip) = Ipv4Addr::from_str(host) {
                return Node::Ip(IpAddr::V4(ip));
            }
            if is_obfuscated(host) {
                return Node::Obfuscated;
            }
        }
    }
    Node::Malformed
}

/// `unknown`, or RFC 7239 obfnode: `_` followed by ALPHA / DIGIT / `.` `_` `-`.
fn is_obfuscated(node: &str) -> bool {
    node.eq_ignore_ascii_case("unknown") || is_obfuscated_token(node)
}

fn is_obfuscated_token(s: &str) -> bool {
    s.len() > 1
        && s.starts_with('_')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// RFC 7239 node-port: 1 to 5 digits up to 65535, or an obfuscated port.
fn is_port(port: &str) -> bool {
    ((1..=5).contains(&port.len())
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok())
        || is_obfuscated_token(port)
}

/// Layer that inserts the [`ClientIp`] into the request extensions.
///
/// The peer is read from the request extensions: axum's
/// `ConnectInfo<SocketAddr>` (feature `axum`; serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`), or a plain
/// [`SocketAddr`]. Without a peer address nothing is inserted, and the
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

/// Service built by [`ClientIpLayer`].
#[derive(Debug, Clone)]
pub struct ClientIpService<S> {
    inner: S,
    proxies: Arc<TrustedProxies>,
}

impl<S> ClientIpService<S> {
    /// Wraps `inner`, believing forwarding headers only from `proxies`.
    pub fn new(inner: S, proxies: TrustedProxies) -> Self {
        ClientIpService {
            inner,
            proxies: Arc::new(proxies),
        }
    }

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

fn peer_ip(extensions: &Extensions) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(axum::extract::ConnectInfo(addr)) =
        extensions.get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(addr.ip());
    }
    extensions.get::<SocketAddr>().map(SocketAddr::ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn nodes() {
        assert_eq!(parse_node("1.2.3.4"), Node::Ip(ip("1.2.3.4")));
        assert_eq!(parse_node("1.2.3.4:80"), Node::Ip(ip("1.2.3.4")));
        assert_eq!(parse_node("1.2.3.4:_p"), Node::Ip(ip("1.2.3.4")));
        assert_eq!(parse_node("2001:db8::1"), Node::Ip(ip("2001:db8::1")));
        assert_eq!(parse_node("[2001:db8::1]"), Node::Ip(ip("2001:db8::1")));
        assert_eq!(
            parse_node("[2001:db8::1]:4711"),
            Node::Ip(ip("2001:db8::1"))
        );
        assert_eq!(parse_node("unknown"), Node::Obfuscated);
        assert_eq!(parse_node("_hidden"), Node::Obfuscated);
        assert_eq!(parse_node("_hidden:80"), Node::Obfuscated);
        assert_eq!(parse_node("_"), Node::Malformed);
        assert_eq!(parse_node("1.2.3.4:123456"), Node::Malformed);
        assert_eq!(parse_node("[2001:db8::1"), Node::Malformed);
        assert_eq!(parse_node("example.com"), Node::Malformed);
        assert_eq!(parse_node("010.0.0.1"), Node::Malformed);
    }

    #[test]
    fn forwarded_elements() {
        assert_eq!(
            forwarded_for("for=192.0.2.60;proto=http"),
            Node::Ip(ip("192.0.2.60"))
        );
        assert_eq!(
            forwarded_for("For=\"[2001:db8::1]:4711\""),
            Node::Ip(ip("2001:db8::1"))
        );
        assert_eq!(forwarded_for("proto=https;by=10.0.0.1"), Node::Obfuscated);
        assert_eq!(forwarded_for("for=1.2.3.4;for=5.6.7.8"), Node::Malformed);
        assert_eq!(forwarded_for("for"), Node::Malformed);
        assert_eq!(forwarded_for("for=\"1.2.3.4"), Node::Malformed);
        assert_eq!(forwarded_for("for=\"1\\.2.3.4\""), Node::Ip(ip("1.2.3.4")));
    }

    fn elements(line: &[u8], quoted: bool) -> Vec<&[u8]> {
        ElementsFromRight {
            rest: Some(line),
            quoted,
        }
        .map(trim_ows)
        .collect()
    }

    #[test]
    fn elements_from_the_right() {
        let plain = |line| elements(line, false);
        assert_eq!(plain(b"a, b,\tc"), [&b"c"[..], b"b", b"a"]);
        assert_eq!(plain(b""), [&b""[..]]);
        assert_eq!(plain(b",,"), [&b""[..], b"", b""]);
        // No quoted strings in X-Forwarded-For.
        assert_eq!(plain(b"\"a, b\""), [&b"b\""[..], b"\"a"]);

        let quoted = |line| elements(line, true);
        assert_eq!(
            quoted(b"for=a, for=b;x=\"1, 2\", for=c"),
            [&b"for=c"[..], b"for=b;x=\"1, 2\"", b"for=a"]
        );
        // An escaped quote does not end the string; an escaped backslash does not escape it.
        assert_eq!(
            quoted(br#"x="\", y", z="\\", w"#),
            [&b"w"[..], br#"z="\\""#, br#"x="\", y""#]
        );
        // Read from the right, a lone quote opens a string that runs to the
        // start of the line; one met last is an element of its own.
        assert_eq!(quoted(b"a, \"b, c"), [&b"c"[..], b"a, \"b"]);
        assert_eq!(quoted(b"\", a, for=b"), [&b"for=b"[..], b"a", b"\""]);
        // Obs-text is carried through, to be refused only if walked.
        assert_eq!(quoted(b"\xff, for=b"), [&b"for=b"[..], b"\xff"]);
    }

    #[test]
    fn walked_hops_must_be_visible_ascii() {
        let xff = ForwardedHeader::XForwardedFor;
        assert_eq!(parse_hop(b"1.2.3.4", xff), Node::Ip(ip("1.2.3.4")));
        assert_eq!(parse_hop(b"1.2.3.\xff", xff), Node::Malformed);
        assert_eq!(parse_hop(b"\"1.2.3.4\"", xff), Node::Malformed);
        let fwd = ForwardedHeader::Forwarded;
        assert_eq!(parse_hop(b"for=\"1.2.3.4\"", fwd), Node::Ip(ip("1.2.3.4")));
        assert_eq!(parse_hop(b"for=1.2.3.4;x=\"\xe9\"", fwd), Node::Malformed);
    }

    #[test]
    fn key_prefixes_mask_the_address() {
        let p = KeyPrefixes { v4: 24, v6: 56 };
        let c = p.client(ip("::ffff:192.0.2.77"));
        assert_eq!(c.ip(), ip("192.0.2.77"));
        assert_eq!(c.key_network(), "192.0.2.0/24".parse::<IpNet>().unwrap());
        let c = p.client(ip("2001:db8:aa:bbcc::1"));
        assert_eq!(
            c.key_network(),
            "2001:db8:aa:bb00::/56".parse::<IpNet>().unwrap()
        );
        // Out-of-range lengths cannot be configured; if they were, the host
        // itself would be the key rather than a panic.
        let c = KeyPrefixes { v4: 33, v6: 129 }.client(ip("2001:db8::1"));
        assert_eq!(c.key_network(), "2001:db8::1/128".parse::<IpNet>().unwrap());
        let p = TrustedProxies::none().with_ipv6_key_prefix(129);
        assert_eq!(p.unwrap_err().field(), "ipv6_key_prefix");
    }

    #[test]
    fn mapped_ranges_are_ipv4() {
        let p = TrustedProxies::new(["::ffff:10.0.0.0/104"]).unwrap();
        assert_eq!(p.nets(), &["10.0.0.0/8".parse::<IpNet>().unwrap()]);
        assert!(p.is_trusted(ip("::ffff:10.1.2.3")));
        assert!(p.is_trusted(ip("10.1.2.3")));
        let e = TrustedProxies::new(["10.0.0.0/33"]).unwrap_err();
        assert_eq!(e.field(), "trusted_proxies");
    }
}
