use std::borrow::Cow;

use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::pairs::{find_byte, Pairs};
use super::stamp::{parse_plain_utc, parse_time};
use proptest::prelude::*;

proptest! {
    /// The in-place split of a query with nothing to decode gives exactly
    /// the pairs `form_urlencoded` gives, and so does every other query.
    #[test]
    fn pairs_are_form_urlencoded_pairs(raw in "[a-zé☃=&%+2B_.:-]{0,24}") {
        let ours: Vec<_> = Pairs::new(&raw).collect();
        let theirs: Vec<_> = form_urlencoded::parse(raw.as_bytes()).collect();
        prop_assert_eq!(ours, theirs);
    }
}

proptest! {
    #[test]
    fn find_byte_finds_the_first(s in proptest::collection::vec(
        // Each byte sought and `byte ^ 1`, which the borrow from a match
        // right below it flags.
        prop_oneof![
            Just(b'&'), Just(b'\''), Just(b'='), Just(b'<'), Just(0u8), Just(1u8),
            Just(0xffu8), Just(0xfeu8), any::<u8>(),
        ],
        0..40,
    )) {
        for byte in [b'&', b'=', 0, 0xff] {
            prop_assert_eq!(find_byte(&s, byte), s.iter().position(|&b| b == byte));
        }
    }
}

/// `parse_time` before the fast path: the `time` crate alone, with the
/// offset, which `OffsetDateTime` equality ignores, and only `T`, `t` or
/// a space between date and time (the crate takes any byte there).
fn by_time_crate(v: &str) -> Option<(OffsetDateTime, time::UtcOffset)> {
    if !matches!(v.as_bytes().get(10), Some(b'T' | b't' | b' ')) {
        return None;
    }
    OffsetDateTime::parse(v, &Rfc3339)
        .ok()
        .map(|t| (t, t.offset()))
}

fn ours(v: &str) -> Option<(OffsetDateTime, time::UtcOffset)> {
    parse_time(v).ok().map(|t| (t, t.offset()))
}

/// Timestamps in the fast form's shape with every field from 0 to 99
/// (month 13, February 30, hour 24, second 60...) or in plausible ranges,
/// then the fast form's separator and `Z` or a neighbour of them:
/// lowercase, other separators, fractions, offsets.
fn timestamp_like(fast_form: bool) -> impl Strategy<Value = String> {
    let fields = (
        0..10_000u32,
        0..100u8,
        0..100u8,
        0..100u8,
        0..100u8,
        0..100u8,
    );
    let plausible = (
        0..10_000u32,
        1..=12u8,
        1..=31u8,
        0..=24u8,
        0..=60u8,
        0..=60u8,
    );
    let (sep, tail) = if fast_form {
        (Just('T').boxed(), Just("Z".to_owned()).boxed())
    } else {
        (
            prop_oneof![Just('t'), Just(' '), any::<char>()].boxed(),
            prop_oneof![
                Just("z".to_owned()),
                "\\.[0-9]{1,10}[Zz]",
                "[+-][0-9]{2}:[0-9]{2}",
                "[ -~]{0,3}",
            ]
            .boxed(),
        )
    };
    (prop_oneof![fields, plausible], sep, tail).prop_map(|((y, mo, d, h, mi, s), sep, tail)| {
        format!("{y:04}-{mo:02}-{d:02}{sep}{h:02}:{mi:02}:{s:02}{tail}")
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    /// The fast path and the `time` crate accept the same timestamps as
    /// the same instants with the same offsets.
    #[test]
    fn parse_time_agrees_with_the_time_crate(v in prop_oneof![
        timestamp_like(true),
        timestamp_like(false),
        // A fast-form timestamp with one byte replaced.
        (timestamp_like(true), 0..20usize, "[ -~]").prop_map(|(v, i, c)| {
            let mut v = v.into_bytes();
            v[i] = c.as_bytes()[0];
            String::from_utf8(v).unwrap()
        }),
        "[0-9TZtz:+. -]{0,24}",
        ".{0,24}",
    ]) {
        prop_assert_eq!(ours(&v), by_time_crate(&v));
        if let Some(t) = parse_plain_utc(v.as_bytes()) {
            prop_assert_eq!(Some((t, t.offset())), by_time_crate(&v));
        }
    }
}

#[test]
fn parse_time_edge_cases() {
    let utc = |s: &str| {
        OffsetDateTime::parse(s, &Rfc3339)
            .unwrap()
            .unix_timestamp_nanos()
    };
    let leap_stand_in = |s: &str| utc(s) + 999_999_999;
    // (value, taken by the fast path, instant in ns)
    let cases: &[(&str, bool, Option<i128>)] = &[
        (
            "2026-11-01T00:00:00Z",
            true,
            Some(1_793_491_200 * 1_000_000_000),
        ),
        (
            "2024-02-29T12:00:00Z",
            true,
            Some(utc("2024-02-29T12:00:00+00:00")),
        ),
        (
            "2000-02-29T00:00:00Z",
            true,
            Some(utc("2000-02-29T00:00:00+00:00")),
        ),
        (
            "0000-01-01T00:00:00Z",
            true,
            Some(utc("0000-01-01T00:00:00+00:00")),
        ),
        (
            "9999-12-31T23:59:59Z",
            true,
            Some(utc("9999-12-31T23:59:59+00:00")),
        ),
        ("2023-02-29T00:00:00Z", false, None),
        ("1900-02-29T00:00:00Z", false, None),
        ("2024-02-30T00:00:00Z", false, None),
        ("2024-04-31T00:00:00Z", false, None),
        ("2024-00-01T00:00:00Z", false, None),
        ("2024-13-01T00:00:00Z", false, None),
        ("2024-05-00T00:00:00Z", false, None),
        ("2024-05-01T24:00:00Z", false, None),
        ("2024-05-01T00:60:00Z", false, None),
        ("2024-05-01T00:00:61Z", false, None),
        // A leap second only as the last second of a month, in UTC.
        (
            "2024-12-31T23:59:60Z",
            false,
            Some(leap_stand_in("2024-12-31T23:59:59Z")),
        ),
        (
            "2024-06-30T23:59:60Z",
            false,
            Some(leap_stand_in("2024-06-30T23:59:59Z")),
        ),
        ("2024-06-29T23:59:60Z", false, None),
        (
            "2024-05-01t00:00:00z",
            false,
            Some(utc("2024-05-01T00:00:00Z")),
        ),
        (
            "2024-05-01 00:00:00Z",
            false,
            Some(utc("2024-05-01T00:00:00Z")),
        ),
        ("2024-05-01x00:00:00Z", false, None),
        ("2024-05-01_00:00:00Z", false, None),
        ("2024-05-01\t00:00:00Z", false, None),
        (
            "2024-05-01T00:00:00.5Z",
            false,
            Some(utc("2024-05-01T00:00:00Z") + 500_000_000),
        ),
        (
            "2024-05-01T02:00:00+02:00",
            false,
            Some(utc("2024-05-01T00:00:00Z")),
        ),
        (
            "2024-05-01T00:00:00-00:00",
            false,
            Some(utc("2024-05-01T00:00:00Z")),
        ),
        ("2024-05-01T00:00:00", false, None),
        ("2024-05-01T00:00:00ZZ", false, None),
        ("2024-5-01T00:00:00Z", false, None),
        ("+2024-05-01T00:00:00Z", false, None),
        ("2024-05-01T00:00:0\u{661}Z", false, None),
        ("", false, None),
    ];
    for &(v, fast, instant) in cases {
        assert_eq!(parse_plain_utc(v.as_bytes()).is_some(), fast, "{v}");
        assert_eq!(
            parse_time(v).ok().map(|t| t.unix_timestamp_nanos()),
            instant,
            "{v}"
        );
        assert_eq!(ours(v), by_time_crate(v), "{v}");
    }
}

#[test]
fn plain_pairs_are_split_in_place() {
    let pairs: Vec<_> = Pairs::new("a=1&&b&c==2&").collect();
    assert!(pairs
        .iter()
        .all(|(n, v)| matches!((n, v), (Cow::Borrowed(_), Cow::Borrowed(_)))));
    let pairs: Vec<(&str, &str)> = pairs.iter().map(|(n, v)| (&**n, &**v)).collect();
    assert_eq!(pairs, [("a", "1"), ("b", ""), ("c", "=2")]);
}
