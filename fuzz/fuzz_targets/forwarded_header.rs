//! Fuzzes the forwarding-header walk of `ClientIpLayer::client_ip`.
//!
//! Run from the repository root:
//!
//! ```text
//! cargo +nightly fuzz run forwarded_header -- -max_total_time=60
//! ```
//!
//! Input: byte 0 is the control byte, the rest is split on `\n` into header
//! lines. Two things are checked on every input.
//!
//! 1. Arbitrary lines. Bit 0 picks the header and bits 1-2 the peer.
//!    Checked: no panic; the answer is the peer or an address written in the
//!    header; an untrusted peer is returned unchanged.
//! 2. The lines as a client's own header text, with hops appended by trusted
//!    proxies. Bits 1-2 give how many proxies (1 to 4), bits 3-5 the client's
//!    address and how it is written, bit 6 whether the first proxy appends
//!    to the client's last line or adds a line, bit 7 the same for the other
//!    proxies. Checked: whatever the client's bytes, the answer is the
//!    client's address.
#![no_main]

use std::collections::HashSet;
use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tower_admission::identity::ClientIpLayer;

/// Which forwarding header a case writes, and the proxies read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ForwardedHeader {
    XForwardedFor,
    Forwarded,
}

/// `proxies` reading `header`.
fn reading(proxies: ClientIpLayer, header: ForwardedHeader) -> ClientIpLayer {
    match header {
        ForwardedHeader::XForwardedFor => proxies,
        ForwardedHeader::Forwarded => proxies.with_forwarded(),
    }
}

const PEERS: [&str; 4] = ["10.0.0.1", "203.0.113.9", "::ffff:10.0.0.1", "fd00::1"];

/// Untrusted client addresses as a proxy may write them (`X-Forwarded-For`
/// form; quoted for `Forwarded` when they hold a `:`).
const CLIENTS: [&str; 8] = [
    "203.0.113.7",
    "203.0.113.7:5555",
    "2001:db8::7",
    "[2001:db8::7]:443",
    "::ffff:198.51.100.4",
    "[2001:db8:1:2::1]",
    "192.0.2.60",
    "[fe80::1]:80",
];

/// Trusted proxies in chain order: each writes the hop it received from,
/// and the last one used is the peer.
const PROXIES: [&str; 4] = ["10.0.0.1", "fd00::2", "10.1.2.3", "::ffff:10.9.9.9"];

fn addresses_in(text: &str) -> HashSet<IpAddr> {
    let text = text.replace('\\', "");
    let mut found = HashSet::new();
    for token in text.split([',', ';', '=', '"', '[', ']', ' ', '\t']) {
        if let Ok(ip) = token.parse::<IpAddr>() {
            found.insert(ip.to_canonical());
        }
        if let Some((host, _)) = token.split_once(':') {
            if let Ok(ip) = host.parse::<IpAddr>() {
                found.insert(ip.to_canonical());
            }
        }
    }
    found
}

/// The address a `CLIENTS` entry names, in canonical form.
fn address_of(node: &str) -> IpAddr {
    let host = match node.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None if node.matches(':').count() == 1 => node.split(':').next().unwrap_or(node),
        None => node,
    };
    host.parse::<IpAddr>().unwrap().to_canonical()
}

/// One hop in the configured header's syntax; `variant` picks extra
/// `Forwarded` parameters.
fn render(header: ForwardedHeader, node: &str, variant: usize) -> String {
    if header == ForwardedHeader::XForwardedFor {
        return node.to_owned();
    }
    let value = if node.contains(':') {
        format!("\"{node}\"")
    } else {
        node.to_owned()
    };
    match variant % 3 {
        0 => format!("for={value}"),
        1 => format!("proto=https;for={value};by=10.0.0.1"),
        _ => format!("For={value};host=\"a, b\\\"c\""),
    }
}

fn arbitrary_lines(control: u8, lines: &[&[u8]]) {
    let (header, name) = if control & 1 == 0 {
        (ForwardedHeader::XForwardedFor, "x-forwarded-for")
    } else {
        (ForwardedHeader::Forwarded, "forwarded")
    };
    let peer: IpAddr = PEERS[usize::from(control >> 1 & 3)].parse().unwrap();
    let proxies = reading(
        ClientIpLayer::new(["10.0.0.0/8", "fd00::/8"]).unwrap(),
        header,
    );

    let mut headers = HeaderMap::new();
    let mut text = String::new();
    for line in lines {
        if let Ok(value) = HeaderValue::from_bytes(line) {
            headers.append(HeaderName::from_static(name), value);
            text.push_str(&String::from_utf8_lossy(line));
            text.push(',');
        }
    }

    let got = proxies.client_ip(peer, &headers);
    let peer = peer.to_canonical();
    assert!(
        got == peer || addresses_in(&text).contains(&got),
        "{got} is neither the peer {peer} nor in {text:?}"
    );
    if !proxies.is_trusted(peer) {
        assert_eq!(got, peer);
    }
}

fn client_prefix(control: u8, lines: &[&[u8]]) {
    let proxies_n = usize::from(control >> 1 & 3) + 1;
    let client = CLIENTS[usize::from(control >> 3 & 7)];
    let first_new_line = control & 0x40 != 0;
    let later_new_line = control & 0x80 != 0;
    let want = address_of(client);

    for (header, name) in [
        (ForwardedHeader::XForwardedFor, "x-forwarded-for"),
        (ForwardedHeader::Forwarded, "forwarded"),
    ] {
        // The client's lines, less the bytes a header value cannot hold.
        let mut values: Vec<Vec<u8>> = lines
            .iter()
            .map(|line| {
                line.iter()
                    .copied()
                    .filter(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
                    .collect()
            })
            .collect();
        for i in 0..proxies_n {
            let from = if i == 0 { client } else { PROXIES[i - 1] };
            let hop = render(header, from, i + usize::from(control));
            let new_line = if i == 0 {
                first_new_line
            } else {
                later_new_line
            };
            match values.last_mut() {
                Some(last) if !new_line => {
                    last.extend_from_slice(b", ");
                    last.extend_from_slice(hop.as_bytes());
                }
                _ => values.push(hop.into_bytes()),
            }
        }
        let mut headers = HeaderMap::new();
        for v in &values {
            let value = HeaderValue::from_bytes(v).expect("only valid bytes are kept");
            headers.append(HeaderName::from_static(name), value);
        }
        let peer: IpAddr = PROXIES[proxies_n - 1].parse().unwrap();
        let proxies = reading(
            ClientIpLayer::new(["10.0.0.0/8", "fd00::/8"]).unwrap(),
            header,
        );
        let got = proxies.client_ip(peer, &headers);
        assert_eq!(
            got, want,
            "{header:?} via {proxies_n} proxies: client bytes changed the answer in {values:?}"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&control, rest)) = data.split_first() else {
        return;
    };
    let lines: Vec<&[u8]> = rest.split(|&b| b == b'\n').take(4).collect();
    arbitrary_lines(control, &lines);
    client_prefix(control, &lines);
});
