//! The forwarding headers: which one is read, and its elements parsed from
//! the right.

use std::borrow::Cow;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use http::header::FORWARDED;
use http::{HeaderMap, HeaderName};

/// Which forwarding header the trusted proxies write.
///
/// Exactly one is read. Reading both would let a caller inject the header
/// the proxy does not rewrite and have it passed through untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (the default).
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for=proxy1;proto=https`.
    Forwarded,
}

impl ForwardedHeader {
    pub(crate) fn name(self) -> HeaderName {
        match self {
            ForwardedHeader::XForwardedFor => HeaderName::from_static("x-forwarded-for"),
            ForwardedHeader::Forwarded => FORWARDED,
        }
    }
}

/// The non-empty list elements of every line of the configured header,
/// right to left: from the last line's last element leftwards across lines.
///
/// Lines are read as bytes, and nothing is validated here: only the elements
/// the walk takes are parsed, so whatever sits left of them (where a client's
/// own header text is) costs nothing and changes nothing.
pub(super) fn hops_from_right(
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
pub(super) struct ElementsFromRight<'a> {
    pub(super) rest: Option<&'a [u8]>,
    pub(super) quoted: bool,
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
pub(super) fn trim_ows(mut bytes: &[u8]) -> &[u8] {
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
pub(super) fn parse_hop(element: &[u8], header: ForwardedHeader) -> Node {
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
pub(super) fn split_quoted<'t>(text: &'t str, delim: u8, mut f: impl FnMut(&'t str)) -> bool {
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
pub(super) enum Node {
    Ip(IpAddr),
    Obfuscated,
    Malformed,
}

/// The node of the `for` parameter of one RFC 7239 forwarded-element.
pub(super) fn forwarded_for(element: &str) -> Node {
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
pub(super) fn unquote(value: &str) -> Option<Cow<'_, str>> {
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
pub(super) fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Characters accepted in an unquoted value: tchar plus `:` `[` `]`, which
/// some proxies write unquoted around IPv6 addresses and ports.
pub(super) fn is_token_value_char(b: u8) -> bool {
    is_tchar(b) || b":[]".contains(&b)
}

/// One node: an IPv4 or IPv6 address, optionally `[v6]` and optionally with a
/// port, or an obfuscated identifier.
pub(super) fn parse_node(node: &str) -> Node {
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
pub(super) fn is_obfuscated(node: &str) -> bool {
    node.eq_ignore_ascii_case("unknown") || is_obfuscated_token(node)
}

pub(super) fn is_obfuscated_token(s: &str) -> bool {
    s.len() > 1
        && s.starts_with('_')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// RFC 7239 node-port: 1 to 5 digits up to 65535, or an obfuscated port.
pub(super) fn is_port(port: &str) -> bool {
    ((1..=5).contains(&port.len())
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok())
        || is_obfuscated_token(port)
}
