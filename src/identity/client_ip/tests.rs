use super::forwarded::{
    forwarded_for, parse_hop, parse_node, trim_ows, ElementsFromRight, ForwardedHeader, Node,
};
use super::proxies::TrustedProxies;
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
