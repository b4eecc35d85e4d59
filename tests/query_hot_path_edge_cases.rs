//! `QueryRules::validate` against an independent oracle: the pairs as
//! `form_urlencoded::parse` gives them and every timestamp as the `time`
//! crate parses it, ordered and subtracted as `OffsetDateTime`s. Random
//! queries, valid and not, with every rule switched on or off.

use std::borrow::Cow;
use std::collections::HashSet;
use std::num::NonZeroU32;
use std::time::Duration;

use proptest::prelude::*;
use time::format_description::well_known::Rfc3339;
use time::{OffsetDateTime, UtcOffset};
use tower_admission::bounds::QueryRules;

const TWICE: &str = "given more than once; give it at most once";
const NOT_RFC3339: &str = "must be an RFC 3339 timestamp such as 2024-05-01T00:00:00Z";

#[derive(Debug, Clone)]
struct Config {
    default: u32,
    max: u32,
    span: Option<Duration>,
    cursor: usize,
    /// Unknown parameters are ignored rather than refused.
    ignore_unknown: bool,
    allowed: Vec<String>,
}

impl Config {
    fn rules(&self) -> QueryRules {
        let mut rules = QueryRules::new()
            .page_size(
                NonZeroU32::new(self.default).unwrap(),
                NonZeroU32::new(self.max).unwrap(),
            )
            .unwrap()
            .max_cursor_len(self.cursor.try_into().unwrap())
            .ignore_unknown_params(self.ignore_unknown);
        if let Some(span) = self.span {
            rules = rules.max_span(span).unwrap();
        }
        for name in &self.allowed {
            rules = rules.allow(name.clone()).unwrap();
        }
        rules
    }
}

type Stamp = (OffsetDateTime, UtcOffset);
type Outcome = Result<(u32, Option<Stamp>, Option<Stamp>, Option<String>), Vec<(String, String)>>;

fn ours(config: &Config, raw: &str) -> Outcome {
    match config.rules().validate(Some(raw)) {
        Ok(q) => Ok((
            q.page_size,
            q.from.map(|t| (t, t.offset())),
            q.to.map(|t| (t, t.offset())),
            q.cursor,
        )),
        Err(e) => Err(e.into_iter().map(|e| (e.name, e.reason)).collect()),
    }
}

fn oracle_time(v: &str) -> Result<OffsetDateTime, String> {
    if v.is_empty() {
        return Err("must not be empty".to_owned());
    }
    let separated = matches!(v.as_bytes().get(10), Some(b'T' | b't' | b' '));
    match OffsetDateTime::parse(v, &Rfc3339) {
        Ok(t) if separated => Ok(t),
        Ok(_) => Err(format!(
            "{NOT_RFC3339}, with T or a space between date and time"
        )),
        Err(_) if v.contains(' ') => Err(format!(
            "{NOT_RFC3339}; a '+' in the offset must be sent as %2B"
        )),
        Err(_) => Err(NOT_RFC3339.to_owned()),
    }
}

fn oracle_page_size(v: &str, max: u32) -> Result<u32, String> {
    if v.is_empty() {
        return Err("must not be empty".to_owned());
    }
    if !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "must be a whole number from 1 to {max}, written with the digits 0-9 only"
        ));
    }
    if v.len() > 1 && v.starts_with('0') {
        return Err("must not have leading zeros".to_owned());
    }
    match v.parse::<u64>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) if n <= u64::from(max) => Ok(n as u32),
        _ => Err(format!("must be at most {max}")),
    }
}

fn secs(d: Duration) -> String {
    match d.subsec_nanos() {
        0 => d.as_secs().to_string(),
        n => format!(
            "{}.{}",
            d.as_secs(),
            format!("{n:09}").trim_end_matches('0')
        ),
    }
}

/// The rules as documented, written plainly.
fn oracle(config: &Config, raw: &str) -> Outcome {
    let mut names: Vec<String> = vec![
        "page_size".into(),
        "from".into(),
        "to".into(),
        "cursor".into(),
    ];
    names.extend(config.allowed.iter().cloned());
    let mut given: Vec<Vec<Cow<'_, str>>> = vec![Vec::new(); names.len()];
    let mut unknown: Vec<Cow<'_, str>> = Vec::new();
    for (name, value) in form_urlencoded::parse(raw.as_bytes()) {
        match names.iter().position(|n| *n == *name) {
            Some(i) => given[i].push(value),
            None if !config.ignore_unknown && !unknown.contains(&name) => {
                unknown.push(name);
            }
            None => {}
        }
    }
    let mut errors: Vec<(String, String)> = Vec::new();
    let mut err = |name: &str, reason: String| errors.push((name.to_owned(), reason));
    let single = |i: usize, err: &mut dyn FnMut(&str, String)| match given[i].len() {
        0 => None,
        1 => Some(given[i][0].to_string()),
        _ => {
            err(&names[i], TWICE.to_owned());
            None
        }
    };
    let page_size = match single(0, &mut err) {
        None => config.default,
        Some(v) => oracle_page_size(&v, config.max).unwrap_or_else(|r| {
            err("page_size", r);
            config.default
        }),
    };
    let (from_raw, to_raw) = (single(1, &mut err), single(2, &mut err));
    let from = from_raw.and_then(|v| oracle_time(&v).map_err(|r| err("from", r)).ok());
    let to = to_raw.and_then(|v| oracle_time(&v).map_err(|r| err("to", r)).ok());
    match (from, to) {
        (Some(f), Some(t)) => {
            if f >= t {
                err("to", "must be later than from".to_owned());
            } else if let Some(max) = config.span {
                let span = (t - f).unsigned_abs();
                if span > max {
                    err(
                        "to",
                        format!(
                            "the range from..to spans {} s, more than the maximum of {} s",
                            secs(span),
                            secs(max)
                        ),
                    );
                }
            }
        }
        _ if config.span.is_some() => {
            if !given[1].is_empty() && given[2].is_empty() {
                err("to", "required when from is given".to_owned());
            }
            if !given[2].is_empty() && given[1].is_empty() {
                err("from", "required when to is given".to_owned());
            }
        }
        _ => {}
    }
    let cursor = single(3, &mut err).and_then(|v| {
        let reason = if v.is_empty() {
            "must not be empty".to_owned()
        } else if !v.bytes().all(|b| b.is_ascii_graphic()) {
            "must contain only visible ASCII characters".to_owned()
        } else if v.len() > config.cursor {
            format!("must be at most {} characters", config.cursor)
        } else {
            return Some(v);
        };
        err("cursor", reason);
        None
    });
    for i in 4..names.len() {
        let _ = single(i, &mut err);
    }
    let listed = unknown.len().min(10);
    let unlisted: HashSet<&Cow<'_, str>> = unknown[listed..].iter().collect();
    for (i, name) in unknown[..listed].iter().enumerate() {
        let echoed = match name.char_indices().nth(64) {
            Some((cut, _)) => format!("{}…", &name[..cut]),
            None => name.to_string(),
        };
        let reason = if i + 1 == listed && !unlisted.is_empty() {
            format!(
                "unknown parameter; {} more unknown parameters not listed",
                unlisted.len()
            )
        } else {
            "unknown parameter".to_owned()
        };
        err(&echoed, reason);
    }
    if errors.is_empty() {
        Ok((
            page_size,
            from.map(|t| (t, t.offset())),
            to.map(|t| (t, t.offset())),
            cursor,
        ))
    } else {
        Err(errors)
    }
}

/// Timestamps near the common form `YYYY-MM-DDTHH:MM:SSZ`: every field
/// from 0 to 99 or in range, neighbouring separators and tails (fractions,
/// offsets, `%2B`, `+`), and the form with one byte replaced.
fn timestamp() -> impl Strategy<Value = String> {
    let fields = prop_oneof![
        (
            0..10_000u32,
            0..100u8,
            0..100u8,
            0..100u8,
            0..100u8,
            0..100u8
        ),
        (
            prop_oneof![
                0..10_000u32,
                1965..2035u32,
                Just(2000u32),
                Just(1900u32),
                Just(0u32)
            ],
            1..=12u8,
            prop_oneof![1..=31u8, 27..=31u8],
            0..=24u8,
            0..=60u8,
            prop_oneof![0..=60u8, 58..=60u8],
        ),
    ];
    let sep = prop_oneof![
        8 => Just("T".to_owned()),
        1 => Just("t".to_owned()),
        1 => Just("%20".to_owned()),
        1 => Just("+".to_owned()),
        1 => "[ -~]",
    ];
    let tail = prop_oneof![
        8 => Just("Z".to_owned()),
        1 => Just("z".to_owned()),
        1 => "\\.[0-9]{1,11}[Zz]",
        1 => "(%2B|-|\\+)[0-9]{2}:[0-9]{2}",
        1 => "[ -~]{0,3}",
    ];
    let plain = (fields, sep, tail).prop_map(|((y, mo, d, h, mi, s), sep, tail)| {
        format!("{y:04}-{mo:02}-{d:02}{sep}{h:02}:{mi:02}:{s:02}{tail}")
    });
    prop_oneof![
        6 => plain.clone(),
        2 => (plain, any::<prop::sample::Index>(), "[ -~]").prop_map(|(v, i, c)| {
            let mut v = v.into_bytes();
            let i = i.index(v.len());
            v[i] = c.as_bytes()[0];
            String::from_utf8(v).unwrap()
        }),
        1 => "[0-9TZtz:+. %-]{0,24}",
    ]
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => Just("from".to_owned()),
        4 => Just("to".to_owned()),
        2 => Just("page_size".to_owned()),
        1 => Just("cursor".to_owned()),
        1 => Just("fr%6Fm".to_owned()),
        1 => Just("page%5Fsize".to_owned()),
        1 => Just("region".to_owned()),
        1 => Just("t+o".to_owned()),
        1 => "[a-z_%+=]{0,6}",
        1 => "[a-z]{60,70}",
    ]
}

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => timestamp(),
        2 => prop_oneof![Just("20".to_owned()), "[0-9]{0,4}", "[0-9+%a-]{0,5}"],
        1 => "[ -~]{0,8}",
        1 => ".{0,6}".prop_map(|s| s.replace(['&', '#'], "")),
    ]
}

fn query() -> impl Strategy<Value = String> {
    let pair = prop_oneof![
        10 => (name(), value()).prop_map(|(n, v)| format!("{n}={v}")),
        1 => name(),
        1 => Just(String::new()),
        1 => (name(), value()).prop_map(|(n, v)| format!("{n}=={v}")),
    ];
    prop::collection::vec(pair, 0..6).prop_map(|pairs| pairs.join("&"))
}

fn config() -> impl Strategy<Value = Config> {
    (
        1..30u32,
        prop_oneof![Just(100u32), 30..2000u32],
        prop_oneof![
            Just(None),
            Just(Some(Duration::from_secs(31 * 86_400))),
            Just(Some(Duration::from_secs(86_400))),
            (1..100_000u64, 0..1_000_000_000u32).prop_map(|(s, n)| Some(Duration::new(s, n))),
        ],
        1..20usize,
        any::<bool>(),
        prop_oneof![Just(vec![]), Just(vec!["region".to_owned()])],
    )
        .prop_map(|(default, max, span, cursor, unknown, allowed)| Config {
            default,
            max,
            span,
            cursor,
            ignore_unknown: unknown,
            allowed,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    /// Any query, under any rules: the same values with the same offsets,
    /// or the same errors in the same order.
    #[test]
    fn validate_agrees_with_the_oracle(config in config(), raw in query()) {
        prop_assert_eq!(ours(&config, &raw), oracle(&config, &raw), "{}", raw);
    }

    /// Two timestamps, each of them valid often, so that order and span
    /// (compared as integers on the hot path) are checked to the second.
    #[test]
    fn range_order_and_span_agree(from in timestamp(), to in timestamp(), span in 1..400_000_000u64) {
        let config = Config {
            default: 20,
            max: 100,
            span: Some(Duration::from_secs(span)),
            cursor: 512,
            ignore_unknown: false,
            allowed: vec![],
        };
        let raw = format!("from={from}&to={to}&page_size=20");
        prop_assert_eq!(ours(&config, &raw), oracle(&config, &raw), "{}", raw);
    }
}

/// The benchmark's query and its neighbours at the edges of the fast path.
#[test]
fn fixed_cases_agree() {
    let config = Config {
        default: 20,
        max: 100,
        span: Some(Duration::from_secs(31 * 86_400)),
        cursor: 512,
        ignore_unknown: false,
        allowed: vec!["region".to_owned()],
    };
    for raw in [
        "from=2026-11-01T00:00:00Z&to=2026-11-02T00:00:00Z&page_size=20",
        "from=2026-11-01T00:00:00Z&to=2026-12-02T00:00:00Z",
        "from=2026-11-01T00:00:00Z&to=2026-12-02T00:00:01Z",
        "from=0000-01-01T00:00:00Z&to=9999-12-31T23:59:59Z",
        "from=1969-12-31T23:59:59Z&to=1970-01-01T00:00:00Z",
        "from=2000-02-29T00:00:00Z&to=2000-03-01T00:00:00Z",
        "from=2100-02-28T00:00:00Z&to=2100-03-01T00:00:00Z",
        "from=2024-12-31T23:59:60Z&to=2025-01-01T00:00:00Z",
        "from=2024-12-31T23:59:59.5Z&to=2025-01-01T00:00:00Z",
        "from=2025-01-01T00:00:00%2B01:00&to=2025-01-01T00:00:00Z",
        "from=2025-01-01T00:00:00+01:00&to=2025-01-01T00:00:00Z",
        "fr%6Fm=2026-11-01T00:00:00Z&to=2026-11-02T00:00:00Z",
        "from=2026-11-01T00:00:00Z&&to=2026-11-02T00:00:00Z&region=eu&region=us",
        "a=1&b=2&c=3&d=4&e=5&f=6&g=7&h=8&i=9&j=10&k=11&l=12&a=13",
        "",
        "&",
        "=",
    ] {
        assert_eq!(ours(&config, raw), oracle(&config, raw), "{raw}");
    }
}
