//! Fuzzes the forwarding-header walk of `TrustedProxies::client_ip`.
//!
//! Run from the repository root:
//!
//! ```text
//! cargo +nightly fuzz run forwarded_header -- -max_total_time=60
//! ```
//!
//! Input: byte 0 picks the header (bit 0) and the peer (bits 1-2); the rest
//! is split on `\n` into header lines. Checked: no panic; the answer is the
//! peer or an address written in the header; an untrusted peer is returned
//! unchanged.
#![no_main]

use std::collections::HashSet;
use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tower_admission::identity::{ForwardedHeader, TrustedProxies};

const PEERS: [&str; 4] = ["10.0.0.1", "203.0.113.9", "::ffff:10.0.0.1", "fd00::1"];

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

fuzz_target!(|data: &[u8]| {
    let Some((&control, rest)) = data.split_first() else {
        return;
    };
    let (header, name) = if control & 1 == 0 {
        (ForwardedHeader::XForwardedFor, "x-forwarded-for")
    } else {
        (ForwardedHeader::Forwarded, "forwarded")
    };
    let peer: IpAddr = PEERS[usize::from(control >> 1 & 3)].parse().unwrap();
    let proxies = TrustedProxies::new(["10.0.0.0/8", "fd00::/8"])
        .unwrap()
        .with_header(header);

    let mut headers = HeaderMap::new();
    let mut text = String::new();
    for line in rest.split(|&b| b == b'\n').take(4) {
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
});
