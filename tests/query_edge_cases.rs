//! Page and range validation at its edges, through
//! `QueryRules::validate`.

use std::num::NonZeroU32;
use std::time::Duration;

use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tower_admission::bounds::{QueryRules, ValidatedQuery};

/// An instant written in RFC 3339 (without a leap second).
fn at(rfc3339: &str) -> OffsetDateTime {
    OffsetDateTime::parse(rfc3339, &Rfc3339).unwrap()
}

fn rules() -> QueryRules {
    QueryRules::new()
        .page_size(NonZeroU32::new(50).unwrap(), NonZeroU32::new(1000).unwrap())
        .unwrap()
        .max_span(Duration::from_secs(86_400))
        .unwrap()
}

/// The errors of `query` as `(name, reason)` pairs.
fn errors(query: &str) -> Vec<(String, String)> {
    match rules().validate(Some(query)) {
        Ok(ok) => panic!("{query:?} was accepted: {ok:?}"),
        Err(errors) => errors.into_iter().map(|e| (e.name, e.reason)).collect(),
    }
}

fn accepted(query: &str) -> ValidatedQuery {
    rules()
        .validate(Some(query))
        .unwrap_or_else(|e| panic!("{query:?} was refused: {e:?}"))
}

fn one(name: &str, reason: &str) -> Vec<(String, String)> {
    vec![(name.to_owned(), reason.to_owned())]
}

const NOT_RFC3339: &str = "must be an RFC 3339 timestamp such as 2024-05-01T00:00:00Z";
const DIGITS: &str = "must be a whole number from 1 to 1000, written with the digits 0-9 only";

/// RFC 3339 separates date and time with `T`, `t` or (its note) a space;
/// no other character.
#[test]
fn date_and_time_are_separated_by_t_or_a_space_only() {
    let separator = "must be an RFC 3339 timestamp such as 2024-05-01T00:00:00Z, \
                     with T or a space between date and time";
    for sep in ["x", "_", "%09", "-", "/", ":", "%00"] {
        let query = format!("from=2024-05-01{sep}00:00:00Z&to=2024-05-01T00:00:01Z");
        assert_eq!(errors(&query), one("from", separator), "{sep}");
    }
    for sep in ["", "TT", "%E2%98%83"] {
        let query = format!("from=2024-05-01{sep}00:00:00Z&to=2024-05-01T00:00:01Z");
        assert_eq!(errors(&query), one("from", NOT_RFC3339), "{sep}");
    }
    for sep in ["T", "t", "%20", "+"] {
        let query = format!("from=2024-05-01{sep}00:00:00Z&to=2024-05-01T00:00:01Z");
        assert_eq!(
            accepted(&query).from,
            Some(at("2024-05-01T00:00:00Z")),
            "{sep}"
        );
    }
}

#[test]
fn repeated_encoded_and_odd_page_sizes() {
    let twice = "given more than once; give it at most once";
    assert_eq!(
        errors("page_size=10&page_size=1000"),
        one("page_size", twice)
    );
    assert_eq!(errors("page_size=10&page_size=10"), one("page_size", twice));
    assert_eq!(
        errors("page_size=10&page%5Fsize=10"),
        one("page_size", twice)
    );
    assert_eq!(errors("page_size=10&page_size"), one("page_size", twice));
    assert_eq!(accepted("page%5Fsize=1%30").page_size, 10);
    assert_eq!(accepted("&&page_size=10&&").page_size, 10);
    assert_eq!(accepted("").page_size, 50);
    assert_eq!(accepted("page_size=1000").page_size, 1000);
    for v in [
        "+10",
        "10+",
        "%2B10",
        "-1",
        "1e3",
        "1.0",
        "%EF%BC%91",
        "0x10",
        "%",
        "1%",
    ] {
        assert_eq!(
            errors(&format!("page_size={v}")),
            one("page_size", DIGITS),
            "{v}"
        );
    }
    assert_eq!(errors("page_size="), one("page_size", "must not be empty"));
    assert_eq!(errors("page_size"), one("page_size", "must not be empty"));
    assert_eq!(
        errors("page_size=0"),
        one("page_size", "must be at least 1")
    );
    assert_eq!(
        errors("page_size=007"),
        one("page_size", "must not have leading zeros")
    );
    for v in [
        "1001",
        "4294967296",
        "18446744073709551616",
        "99999999999999999999999999999",
    ] {
        assert_eq!(
            errors(&format!("page_size={v}")),
            one("page_size", "must be at most 1000")
        );
    }
    assert_eq!(
        errors("PAGE_SIZE=10"),
        one("PAGE_SIZE", "unknown parameter")
    );
}

#[test]
fn range_ends_order_and_span() {
    let later = "must be later than from";
    assert_eq!(
        errors("from=2024-05-01T00:00:00Z&to=2024-05-01T00:00:00Z"),
        one("to", later)
    );
    // The same instant in two offsets.
    assert_eq!(
        errors("from=2024-05-01T02:00:00%2B02:00&to=2024-05-01T00:00:00Z"),
        one("to", later)
    );
    assert_eq!(
        errors("from=2024-05-02T00:00:00Z&to=2024-05-01T00:00:00Z"),
        one("to", later)
    );
    // Exactly the maximum span, in any offsets and with fractions.
    for q in [
        "from=2024-05-01T00:00:00Z&to=2024-05-02T00:00:00Z",
        "from=2024-05-01T00:00:00.5Z&to=2024-05-02T00:00:00.5Z",
        "from=2024-05-01T02:00:00%2B02:00&to=2024-05-01T22:00:00-02:00",
    ] {
        let ok = accepted(q);
        assert_eq!(
            ok.to.unwrap() - ok.from.unwrap(),
            time::Duration::DAY,
            "{q}"
        );
    }
    assert_eq!(
        errors("from=2024-05-01T00:00:00Z&to=2024-05-02T00:00:00.000001Z"),
        one(
            "to",
            "the range from..to spans 86400.000001 s, more than the maximum of 86400 s"
        )
    );
    assert_eq!(
        errors("from=2024-05-01T02:00:00%2B02:00&to=2024-05-02T00:00:00.000000001Z"),
        one(
            "to",
            "the range from..to spans 86400.000000001 s, more than the maximum of 86400 s"
        )
    );
    // An unencoded `+` is a space: the offset is lost, and the error says so.
    assert_eq!(
        errors("from=2024-05-01T02:00:00+02:00&to=2024-05-02T00:00:00Z"),
        one(
            "from",
            "must be an RFC 3339 timestamp such as 2024-05-01T00:00:00Z; \
             a '+' in the offset must be sent as %2B"
        )
    );
    assert_eq!(
        errors("from=&to="),
        vec![
            ("from".to_owned(), "must not be empty".to_owned()),
            ("to".to_owned(), "must not be empty".to_owned()),
        ]
    );
    assert_eq!(
        errors("from=2024-05-01T00:00:00Z"),
        one("to", "required when from is given")
    );
    for bad in [
        "2024-05-01T00:00:00",
        "2024-05-01T00:00:00,5Z",
        "2024-05-01T00:00:00.Z",
        "2024-05-01T00:00:00%2B24:00",
        "2024-05-01T00:00:00%2B00:60",
        "-0001-01-01T00:00:00Z",
        "2024-05-01T00:00:00%00Z",
    ] {
        assert_eq!(
            errors(&format!("from={bad}&to=2024-05-01T00:00:01Z")),
            one("from", NOT_RFC3339),
            "{bad}"
        );
    }
}

/// A leap second is accepted and read as the last nanosecond of the second
/// before it, its fractions too; digits past the ninth are dropped. Both
/// keep the order of instants (never reversed, possibly equal).
#[test]
fn leap_seconds_and_sub_nanosecond_digits() {
    let ok = accepted("from=2016-12-31T23:59:60Z&to=2017-01-01T00:00:00Z");
    assert_eq!(ok.from, Some(at("2016-12-31T23:59:59.999999999Z")));
    let ok = accepted("from=2016-12-31T23:59:59Z&to=2016-12-31T23:59:60.5Z");
    assert_eq!(ok.to, Some(at("2016-12-31T23:59:59.999999999Z")));
    // In an offset, the leap second is the last of the UTC month.
    let ok = accepted("from=2017-01-01T00:59:60%2B01:00&to=2017-01-01T00:00:00Z");
    assert_eq!(ok.from, Some(at("2016-12-31T23:59:59.999999999Z")));
    let later = "must be later than from";
    assert_eq!(
        errors("from=2016-12-31T23:59:60.5Z&to=2016-12-31T23:59:60.9Z"),
        one("to", later)
    );
    assert_eq!(
        errors("from=2016-12-31T23:59:59.999999999Z&to=2016-12-31T23:59:60Z"),
        one("to", later)
    );
    assert_eq!(
        errors("from=2024-05-01T00:00:00.1234567891Z&to=2024-05-01T00:00:00.1234567892Z"),
        one("to", later)
    );
    // Not the last second of a UTC month: no leap second.
    assert_eq!(
        errors("from=2016-12-30T23:59:60Z&to=2017-01-01T00:00:00Z"),
        one("from", NOT_RFC3339)
    );
}
