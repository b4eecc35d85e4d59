//! [`QueryRules`]: what a valid query string holds, and the check.

use std::borrow::Cow;
use std::collections::HashSet;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;
use time::OffsetDateTime;

use crate::reject::InvalidParameter;

use super::pairs::Pairs;
use super::stamp::parse_stamp;
use super::{CURSOR, FROM, PAGE_SIZE, TO};
use crate::ConfigError;

/// At most this many unknown parameters are named in one rejection; the last
/// named one says how many more distinct names there were. Keeps a query of
/// thousands of tiny unknown names from becoming a response many times its
/// size.
const MAX_UNKNOWN_REPORTED: usize = 10;
/// Parameter names are echoed back cut to this many characters.
const MAX_ECHOED_NAME: usize = 64;

/// What to do with a parameter the rules do not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum UnknownParams {
    /// Refuse the request with 400, naming each unknown parameter. The default:
    /// a misspelt `pagesize` silently falling back to the default page size
    /// hides client bugs.
    #[default]
    Reject,
    /// Ignore unknown parameters entirely, repeats included.
    Ignore,
}

/// A query string that passed [`QueryRules::validate`]. Inserted into the
/// request extensions by [`ValidateQueryLayer`](super::ValidateQueryLayer)'s service; with the `axum` feature it is also
/// an extractor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidatedQuery {
    /// The page size: the parameter, or the default when absent. Always in
    /// `1..=max`.
    pub page_size: u32,
    /// Range start, inclusive.
    pub from: Option<OffsetDateTime>,
    /// Range end, exclusive. When both are set, `from < to` and the span is
    /// at most the configured maximum.
    pub to: Option<OffsetDateTime>,
    /// The opaque cursor, visible ASCII, at most the configured length.
    pub cursor: Option<String>,
}

impl ValidatedQuery {
    /// The cost of a request for a [`QuotaLayer`](crate::quota::QuotaLayer):
    /// its validated page size, or 1 when the query was not validated.
    ///
    /// ```
    /// use tower_admission::bounds::ValidatedQuery;
    /// use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer};
    /// use std::time::Duration;
    ///
    /// let rows = Quota::new("rows", [Policy::sliding_window("per-minute", 2_000, Duration::from_secs(60))?])?;
    /// let layer = QuotaLayer::builder(MemoryStore::new())
    ///     .quota(rows)
    ///     .cost(ValidatedQuery::page_cost)
    ///     .build()?;
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn page_cost(parts: &http::request::Parts) -> u64 {
        parts
            .extensions
            .get::<ValidatedQuery>()
            .map_or(1, |q| u64::from(q.page_size))
    }
}

/// Rules for the page and range parameters of a query string.
///
/// | parameter | rule |
/// |---|---|
/// | `page_size` | digits `0-9` only: no sign, no `+`, no spaces, no leading zeros (`007` is refused so that one page size has one spelling); `1..=max`; absent means the default |
/// | `from`, `to` | RFC 3339 timestamps (`2024-05-01T00:00:00Z`; `T`, `t` or a space between date and time; a `+` offset must be sent as `%2B`, since `+` means space in a query); `from < to`, compared as instants whatever their offsets; `to - from <= max_span`; with a `max_span`, one without the other is refused |
/// | `cursor` | 1 to `max_cursor_len` visible ASCII characters (`!` to `~`); opaque otherwise |
/// | names added with [`allow`](QueryRules::allow) | passed through unchecked |
/// | anything else | refused, or ignored after [`ignore_unknown_params`](QueryRules::ignore_unknown_params) |
///
/// Timestamps are kept to the nanosecond, in the offset they were given in.
/// Fraction digits past the ninth are dropped. A leap second (`23:59:60`,
/// only as the last second of a month in UTC, with any fraction) is accepted
/// and read as `23:59:59.999999999`, since [`OffsetDateTime`] has no leap
/// seconds. Both keep the order of instants, never reverse it, but can make
/// two different values equal: `from` and `to` within one leap second, or
/// within one nanosecond, are refused as not in order.
///
/// Percent-encoding is decoded first (`application/x-www-form-urlencoded`,
/// with the `form_urlencoded` crate). A known parameter given twice is always
/// refused, even with equal values: which one wins is ambiguous across
/// frameworks and caches. Every bad parameter is reported, not only the first.
///
/// Clones share the rules through an `Arc`; a setter called on a clone
/// changes that clone only.
#[derive(Debug, Clone)]
pub struct QueryRules {
    inner: Arc<RulesInner>,
}

#[derive(Debug, Clone)]
struct RulesInner {
    default_page_size: u32,
    max_page_size: u32,
    max_span: Option<Duration>,
    max_cursor_len: usize,
    unknown: UnknownParams,
    allowed: Vec<String>,
}

impl Default for QueryRules {
    fn default() -> Self {
        QueryRules {
            inner: Arc::new(RulesInner {
                default_page_size: 50,
                max_page_size: 1000,
                max_span: None,
                max_cursor_len: 512,
                unknown: UnknownParams::Reject,
                allowed: Vec::new(),
            }),
        }
    }
}

impl QueryRules {
    /// The defaults: page size 50, max 1000, no span limit, cursor up to
    /// 512 characters, unknown parameters refused. Each setter below checks
    /// its own value, so rules that hold are always valid.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use std::time::Duration;
    /// use tower_admission::bounds::QueryRules;
    ///
    /// let page = |n| NonZeroU32::new(n).unwrap();
    /// let rules = QueryRules::new()
    ///     .page_size(page(20), page(200))?
    ///     .max_span(Duration::from_secs(7 * 24 * 3600))?
    ///     .allow("sort")?;
    /// assert_eq!(rules.validate(Some("sort=name")).unwrap().page_size, 20);
    /// let error = QueryRules::new().page_size(page(300), page(200)).unwrap_err();
    /// assert_eq!(error.field(), "page_size");
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Page size used when `page_size` is absent, and the largest accepted;
    /// an error naming `page_size` when the default is the larger.
    /// Defaults: 50 and 1000.
    pub fn page_size(mut self, default: NonZeroU32, max: NonZeroU32) -> Result<Self, ConfigError> {
        if default > max {
            return Err(ConfigError::new(
                "page_size",
                "the default page size is larger than the maximum",
            ));
        }
        let inner = Arc::make_mut(&mut self.inner);
        inner.default_page_size = default.get();
        inner.max_page_size = max.get();
        Ok(self)
    }

    /// Largest `to - from`; an error naming `max_span` when zero. Without it
    /// any ordered range is accepted and either end may be omitted.
    pub fn max_span(mut self, span: Duration) -> Result<Self, ConfigError> {
        if span.is_zero() {
            return Err(ConfigError::new(
                "max_span",
                "a zero span refuses every range",
            ));
        }
        Arc::make_mut(&mut self.inner).max_span = Some(span);
        Ok(self)
    }

    /// Longest accepted `cursor`, in characters. Default 512.
    pub fn max_cursor_len(mut self, len: NonZeroUsize) -> Self {
        Arc::make_mut(&mut self.inner).max_cursor_len = len.get();
        self
    }

    /// Whether to ignore parameters the rules do not know, repeats
    /// included. By default (`false`) a request with one is refused with
    /// 400, naming each: a misspelt `pagesize` silently falling back to the
    /// default page size hides client bugs.
    pub fn ignore_unknown_params(mut self, yes: bool) -> Self {
        Arc::make_mut(&mut self.inner).unknown = if yes {
            UnknownParams::Ignore
        } else {
            UnknownParams::Reject
        };
        self
    }

    /// Accepts another parameter, unchecked, at most once per query; an
    /// error naming `allow` when it is one of the validated parameters.
    pub fn allow(mut self, name: impl Into<String>) -> Result<Self, ConfigError> {
        let name = name.into();
        if [PAGE_SIZE, FROM, TO, CURSOR].contains(&name.as_str()) {
            return Err(ConfigError::new(
                "allow",
                "the name is already a validated parameter",
            ));
        }
        Arc::make_mut(&mut self.inner).allowed.push(name);
        Ok(self)
    }

    /// The default page size.
    pub fn default_page_size(&self) -> u32 {
        self.inner.default_page_size
    }

    /// The largest page size.
    pub fn max_page_size(&self) -> u32 {
        self.inner.max_page_size
    }

    /// Validates a raw (still percent-encoded) query string, as in
    /// `Uri::query()`. Pure and total: never panics, whatever the input.
    ///
    /// On failure every bad parameter is listed once, known parameters first
    /// in the order `page_size`, `from`, `to`, `cursor`, allowed names, then
    /// unknown ones in the order they appear. Unknown names are told apart
    /// by their whole decoded name and only echoed cut to 64 characters
    /// and `…`: two long names that share their first 64 characters are two
    /// entries (or two counted as not listed), echoed alike.
    pub fn validate(
        &self,
        raw_query: Option<&str>,
    ) -> Result<ValidatedQuery, Vec<InvalidParameter>> {
        let rules = &*self.inner;
        // The first value given for each of the four fixed names and how
        // many were given: a valid query costs no allocation here.
        let mut seen: [Seen<'_>; 4] = Default::default();
        // How many times each allowed name was given (their values are not
        // looked at), sized on the first allowed name met.
        let mut allowed: SmallVec<[usize; 8]> = SmallVec::new();
        // Unknown names, each once, compared whole: the first ones listed,
        // the others only counted. Names are cut only when echoed, so two
        // names that share their first `MAX_ECHOED_NAME` characters stay two.
        // At most one entry per pair of the query, each its name as decoded
        // (borrowed from the query when nothing was decoded), so the
        // entries never outgrow the query, whose length the HTTP server caps.
        let mut unknown: Vec<Cow<'_, str>> = Vec::new();
        let mut unlisted: Option<HashSet<Cow<'_, str>>> = None;

        for (name, value) in Pairs::new(raw_query.unwrap_or("")) {
            if let Some(i) = fixed_index(name.as_bytes()) {
                let entry = &mut seen[i];
                entry.count += 1;
                if entry.first.is_none() {
                    entry.first = Some(value);
                }
                continue;
            }
            // The first index wins, as for a name allowed twice.
            if let Some(i) = rules.allowed.iter().position(|a| *a == *name) {
                if allowed.is_empty() {
                    allowed.resize(rules.allowed.len(), 0);
                }
                allowed[i] += 1;
                continue;
            }
            if rules.unknown == UnknownParams::Reject {
                if unknown.contains(&name) {
                    continue;
                }
                if unknown.len() < MAX_UNKNOWN_REPORTED {
                    unknown.push(name);
                } else {
                    unlisted.get_or_insert_with(HashSet::new).insert(name);
                }
            }
        }

        let mut errors = Vec::new();
        let single = |i: usize, errors: &mut Vec<InvalidParameter>| -> Option<&str> {
            match &seen[i] {
                Seen { count: 0, .. } => None,
                Seen {
                    count: 1,
                    first: Some(one),
                } => Some(one),
                _ => {
                    errors.push(InvalidParameter::new(
                        FIXED[i],
                        "given more than once; give it at most once",
                    ));
                    None
                }
            }
        };

        let page_size = match single(0, &mut errors) {
            None => rules.default_page_size,
            Some(v) => match parse_page_size(v, rules.max_page_size) {
                Ok(n) => n,
                Err(reason) => {
                    errors.push(InvalidParameter::new(PAGE_SIZE, reason));
                    rules.default_page_size
                }
            },
        };

        let from_raw = single(1, &mut errors);
        let to_raw = single(2, &mut errors);
        let from = from_raw.and_then(|v| match parse_stamp(v) {
            Ok(t) => Some(t),
            Err(reason) => {
                errors.push(InvalidParameter::new(FROM, reason));
                None
            }
        });
        let to = to_raw.and_then(|v| match parse_stamp(v) {
            Ok(t) => Some(t),
            Err(reason) => {
                errors.push(InvalidParameter::new(TO, reason));
                None
            }
        });
        match (&from, &to) {
            (Some(from), Some(to)) => {
                if from.instant >= to.instant {
                    errors.push(InvalidParameter::new(TO, "must be later than from"));
                } else if let Some(max) = rules.max_span {
                    // Positive: `from < to`.
                    let span = from.until(to);
                    if span > max {
                        errors.push(InvalidParameter::new(
                            TO,
                            format!(
                                "the range from..to spans {} s, more than the maximum of {} s",
                                seconds(span),
                                seconds(max)
                            ),
                        ));
                    }
                }
            }
            _ if rules.max_span.is_some() => {
                // With a span limit an open range is unbounded: both ends or
                // neither.
                if seen[1].count > 0 && seen[2].count == 0 {
                    errors.push(InvalidParameter::new(TO, "required when from is given"));
                }
                if seen[2].count > 0 && seen[1].count == 0 {
                    errors.push(InvalidParameter::new(FROM, "required when to is given"));
                }
            }
            _ => {}
        }

        let cursor =
            single(3, &mut errors).and_then(|v| match check_cursor(v, rules.max_cursor_len) {
                Ok(()) => Some(v.to_owned()),
                Err(reason) => {
                    errors.push(InvalidParameter::new(CURSOR, reason));
                    None
                }
            });

        for (name, &count) in rules.allowed.iter().zip(&allowed) {
            if count > 1 {
                errors.push(InvalidParameter::new(
                    name.as_str(),
                    "given more than once; give it at most once",
                ));
            }
        }

        let unlisted = unlisted.map_or(0, |u| u.len());
        let last = unknown.len().saturating_sub(1);
        for (i, name) in unknown.into_iter().enumerate() {
            let reason = if i == last && unlisted > 0 {
                format!("unknown parameter; {unlisted} more unknown parameters not listed")
            } else {
                "unknown parameter".to_owned()
            };
            errors.push(InvalidParameter::new(echo_name(&name), reason));
        }

        if errors.is_empty() {
            Ok(ValidatedQuery {
                page_size,
                from: from.map(|t| t.at),
                to: to.map(|t| t.at),
                cursor,
            })
        } else {
            Err(errors)
        }
    }
}

/// The four validated names, by index in [`QueryRules::validate`]'s `seen`.
const FIXED: [&str; 4] = [PAGE_SIZE, FROM, TO, CURSOR];

/// The index in [`FIXED`] of `name`. A match on bytes compares lengths
/// first, then a few bytes inline, with no call to `memcmp`.
fn fixed_index(name: &[u8]) -> Option<usize> {
    match name {
        b"page_size" => Some(0),
        b"from" => Some(1),
        b"to" => Some(2),
        b"cursor" => Some(3),
        _ => None,
    }
}

/// What a query gave for one known parameter.
#[derive(Default)]
struct Seen<'a> {
    first: Option<Cow<'a, str>>,
    count: usize,
}

fn echo_name(name: &str) -> String {
    match name.char_indices().nth(MAX_ECHOED_NAME) {
        Some((cut, _)) => format!("{}…", &name[..cut]),
        None => name.to_owned(),
    }
}

fn parse_page_size(v: &str, max: u32) -> Result<u32, String> {
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
    // Digits only, so the only parse failure is overflow.
    match v.parse::<u64>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) if n <= u64::from(max) => Ok(u32::try_from(n).unwrap_or(max)),
        _ => Err(format!("must be at most {max}")),
    }
}

/// `d` in seconds, with only the fraction digits it needs (`3600`,
/// `3600.5`), so two different durations never print the same.
fn seconds(d: Duration) -> String {
    match d.subsec_nanos() {
        0 => d.as_secs().to_string(),
        nanos => {
            let fraction = format!("{nanos:09}");
            format!("{}.{}", d.as_secs(), fraction.trim_end_matches('0'))
        }
    }
}

/// The character class first: once a cursor is all ASCII, its length in
/// bytes is its length in characters.
fn check_cursor(v: &str, max: usize) -> Result<(), String> {
    if v.is_empty() {
        return Err("must not be empty".to_owned());
    }
    if !v.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("must contain only visible ASCII characters".to_owned());
    }
    if v.len() > max {
        return Err(format!("must be at most {max} characters"));
    }
    Ok(())
}
