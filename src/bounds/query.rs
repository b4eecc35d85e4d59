//! Page and range validation of the query string.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::num::{NonZeroU32, NonZeroUsize};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use pin_project_lite::pin_project;
use smallvec::SmallVec;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tower::{Layer, Service};

use crate::reject::{InvalidParameter, Protocol, RefusalBody, Rejection};

use crate::ConfigError;

/// Name of the page size parameter.
pub const PAGE_SIZE: &str = "page_size";
/// Name of the range start parameter (inclusive), RFC 3339.
pub const FROM: &str = "from";
/// Name of the range end parameter (exclusive), RFC 3339.
pub const TO: &str = "to";
/// Name of the opaque cursor parameter.
pub const CURSOR: &str = "cursor";

/// At most this many unknown parameters are named in one rejection; the last
/// named one says how many more distinct names there were. Keeps a query of
/// thousands of tiny unknown names from becoming a response many times its
/// size.
const MAX_UNKNOWN_REPORTED: usize = 10;
/// Parameter names are echoed back cut to this many characters.
const MAX_ECHOED_NAME: usize = 64;

/// What to do with a parameter the rules do not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum UnknownParams {
    /// Refuse the request with 400, naming each unknown parameter. The default:
    /// a misspelt `pagesize` silently falling back to the default page size
    /// hides client bugs.
    #[default]
    Reject,
    /// Ignore unknown parameters entirely, repeats included.
    Ignore,
}

/// A query string that passed [`QueryRules::validate`]. Inserted into the
/// request extensions by [`ValidateQuery`]; with the `axum` feature it is also
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
/// | names added with [`allow`](QueryRulesBuilder::allow) | passed through unchecked |
/// | anything else | refused or ignored, per [`UnknownParams`] |
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
/// Clones share the rules through an `Arc`.
#[derive(Debug, Clone)]
pub struct QueryRules {
    inner: Arc<RulesInner>,
}

#[derive(Debug)]
struct RulesInner {
    default_page_size: u32,
    max_page_size: u32,
    max_span: Option<Duration>,
    max_cursor_len: usize,
    unknown: UnknownParams,
    allowed: Vec<String>,
}

/// Builder of [`QueryRules`].
#[derive(Debug, Clone)]
pub struct QueryRulesBuilder {
    default_page_size: NonZeroU32,
    max_page_size: NonZeroU32,
    max_span: Option<Duration>,
    max_cursor_len: NonZeroUsize,
    unknown: UnknownParams,
    allowed: Vec<String>,
}

impl Default for QueryRulesBuilder {
    fn default() -> Self {
        QueryRulesBuilder {
            default_page_size: NonZeroU32::new(50).unwrap_or(NonZeroU32::MIN),
            max_page_size: NonZeroU32::new(1000).unwrap_or(NonZeroU32::MIN),
            max_span: None,
            max_cursor_len: NonZeroUsize::new(512).unwrap_or(NonZeroUsize::MIN),
            unknown: UnknownParams::Reject,
            allowed: Vec::new(),
        }
    }
}

impl QueryRulesBuilder {
    /// Page size used when `page_size` is absent, and the largest accepted.
    /// Defaults: 50 and 1000.
    pub fn page_size(mut self, default: NonZeroU32, max: NonZeroU32) -> Self {
        self.default_page_size = default;
        self.max_page_size = max;
        self
    }

    /// Largest `to - from`. Without it any ordered range is accepted and
    /// either end may be omitted.
    pub fn max_span(mut self, span: Duration) -> Self {
        self.max_span = Some(span);
        self
    }

    /// Longest accepted `cursor`, in characters. Default 512.
    pub fn max_cursor_len(mut self, len: NonZeroUsize) -> Self {
        self.max_cursor_len = len;
        self
    }

    /// What to do with unknown parameters. Default [`UnknownParams::Reject`].
    pub fn unknown_params(mut self, policy: UnknownParams) -> Self {
        self.unknown = policy;
        self
    }

    /// Accepts another parameter, unchecked, at most once per query.
    pub fn allow(mut self, name: impl Into<String>) -> Self {
        self.allowed.push(name.into());
        self
    }

    /// The rules, or the first bad field.
    pub fn build(self) -> Result<QueryRules, ConfigError> {
        if self.default_page_size > self.max_page_size {
            return Err(ConfigError::new(
                "page_size",
                "the default page size is larger than the maximum",
            ));
        }
        if self.max_span == Some(Duration::ZERO) {
            return Err(ConfigError::new(
                "max_span",
                "a zero span refuses every range",
            ));
        }
        for name in &self.allowed {
            if [PAGE_SIZE, FROM, TO, CURSOR].contains(&name.as_str()) {
                return Err(ConfigError::new(
                    "allow",
                    "the name is already a validated parameter",
                ));
            }
        }
        Ok(QueryRules {
            inner: Arc::new(RulesInner {
                default_page_size: self.default_page_size.get(),
                max_page_size: self.max_page_size.get(),
                max_span: self.max_span,
                max_cursor_len: self.max_cursor_len.get(),
                unknown: self.unknown,
                allowed: self.allowed,
            }),
        })
    }
}

impl QueryRules {
    /// A builder with the defaults: page size 50, max 1000, no span limit,
    /// cursor up to 512 characters, unknown parameters refused.
    pub fn builder() -> QueryRulesBuilder {
        QueryRulesBuilder::default()
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

/// The name and value pairs of a raw query, decoded as
/// `application/x-www-form-urlencoded`, exactly as `form_urlencoded::parse`
/// gives them: split on the bytes `&`, then each pair at its first `=`
/// (empty pairs skipped, a pair without `=` has an empty value), then each
/// part decoded. A pair with no `%` and no `+` has nothing to decode, so it
/// is split in place, without the per-part decoding; a pair with either is
/// handed whole to `form_urlencoded`, which borrows each part it leaves as
/// is, as it would in the whole query. One scan finds the end of a pair and
/// whether it has a `%` or `+`.
struct Pairs<'a> {
    rest: &'a str,
}

impl<'a> Pairs<'a> {
    fn new(raw: &'a str) -> Self {
        Pairs { rest: raw }
    }
}

const ONES: u64 = u64::from_le_bytes([0x01; 8]);
const HIGHS: u64 = u64::from_le_bytes([0x80; 8]);

/// The high bit of each byte of `word` that is `byte`. Borrows can flag
/// bytes above the first match, never below it, so the lowest flag is
/// exact, and any flag at all means a match at or below it.
fn flags(word: u64, byte: u8) -> u64 {
    let x = word ^ (ONES * u64::from(byte));
    x.wrapping_sub(ONES) & !x & HIGHS
}

/// `s` split at the first `byte`, which is ASCII, or all of `s` and "".
fn split_at_byte(s: &str, byte: u8) -> (&str, &str) {
    match find_byte(s.as_bytes(), byte) {
        Some(i) => (&s[..i], &s[i + 1..]),
        None => (s, ""),
    }
}

/// The index of the first `byte` in `s`, eight bytes at a time.
fn find_byte(s: &[u8], byte: u8) -> Option<usize> {
    let (words, tail) = s.as_chunks::<8>();
    for (i, word) in words.iter().enumerate() {
        let found = flags(u64::from_le_bytes(*word), byte);
        if found != 0 {
            return Some(i * 8 + (found.trailing_zeros() / 8) as usize);
        }
    }
    let rest = tail.iter().position(|&b| b == byte)?;
    Some(words.len() * 8 + rest)
}

/// The index of the first `&` in `s` (or its length), and whether a `%` or
/// a `+` comes before it, eight bytes at a time.
fn pair_end(s: &[u8]) -> (usize, bool) {
    let (words, tail) = s.as_chunks::<8>();
    let mut encoded = 0;
    for (i, word) in words.iter().enumerate() {
        let word = u64::from_le_bytes(*word);
        let amp = flags(word, b'&');
        let enc = flags(word, b'%') | flags(word, b'+');
        if amp != 0 {
            // The bits up to the lowest `&`: a `%` or `+` flagged there is
            // one before it (a borrow's flag has a real match below it).
            let before = amp ^ amp.wrapping_sub(1);
            let end = i * 8 + (amp.trailing_zeros() / 8) as usize;
            return (end, encoded | (enc & before) != 0);
        }
        encoded |= enc;
    }
    let mut encoded = encoded != 0;
    for (i, &b) in tail.iter().enumerate() {
        if b == b'&' {
            return (words.len() * 8 + i, encoded);
        }
        encoded |= (b == b'%') | (b == b'+');
    }
    (s.len(), encoded)
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (Cow<'a, str>, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.rest.is_empty() {
                return None;
            }
            let (end, encoded) = pair_end(self.rest.as_bytes());
            // `&` is ASCII: both cuts are on character boundaries.
            let pair = self.rest.get(..end).unwrap_or("");
            self.rest = self.rest.get(end + 1..).unwrap_or("");
            if pair.is_empty() {
                continue;
            }
            if encoded {
                // One pair, as it has no `&` and is not empty.
                match form_urlencoded::parse(pair.as_bytes()).next() {
                    Some(decoded) => return Some(decoded),
                    None => continue,
                }
            }
            let (name, value) = split_at_byte(pair, b'=');
            return Some((Cow::Borrowed(name), Cow::Borrowed(value)));
        }
    }
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

/// A timestamp as given, and its instant as seconds and nanoseconds since
/// the Unix epoch, which order and subtract as integers (an
/// [`OffsetDateTime`] compares and subtracts through its calendar date).
#[derive(Debug, Clone, Copy)]
struct Stamp {
    at: OffsetDateTime,
    instant: (i64, u32),
}

impl Stamp {
    fn new(at: OffsetDateTime) -> Self {
        Stamp {
            at,
            instant: (at.unix_timestamp(), at.nanosecond()),
        }
    }

    /// `later - self`, which is `(later.at - self.at).unsigned_abs()`, for
    /// `self` before `later`.
    fn until(&self, later: &Stamp) -> Duration {
        let ((s0, n0), (s1, n1)) = (self.instant, later.instant);
        let (secs, nanos) = if n1 >= n0 {
            (s1 - s0, n1 - n0)
        } else {
            (s1 - s0 - 1, n1 + 1_000_000_000 - n0)
        };
        Duration::new(secs.unsigned_abs(), nanos)
    }
}

#[cfg(test)]
fn parse_time(v: &str) -> Result<OffsetDateTime, String> {
    parse_stamp(v).map(|t| t.at)
}

/// The common form inline, anything else (and every error) out of line.
#[inline]
fn parse_stamp(v: &str) -> Result<Stamp, String> {
    match plain_utc(v.as_bytes()) {
        Some(t) => Ok(t),
        None => parse_other_stamp(v),
    }
}

#[cold]
#[inline(never)]
fn parse_other_stamp(v: &str) -> Result<Stamp, String> {
    if v.is_empty() {
        return Err("must not be empty".to_owned());
    }
    // The `time` crate takes any byte between date and time; RFC 3339 has
    // `T`, `t` or (by its note) a space there, after the 10 bytes of the date.
    let separated = matches!(v.as_bytes().get(10), Some(b'T' | b't' | b' '));
    match OffsetDateTime::parse(v, &Rfc3339) {
        Ok(t) if separated => Ok(Stamp::new(t)),
        Ok(_) => Err(
            "must be an RFC 3339 timestamp such as 2024-05-01T00:00:00Z, \
             with T or a space between date and time"
                .to_owned(),
        ),
        Err(_) if v.contains(' ') => Err(
            "must be an RFC 3339 timestamp such as 2024-05-01T00:00:00Z; \
             a '+' in the offset must be sent as %2B"
                .to_owned(),
        ),
        Err(_) => Err("must be an RFC 3339 timestamp such as 2024-05-01T00:00:00Z".to_owned()),
    }
}

#[cfg(test)]
fn parse_plain_utc(v: &[u8]) -> Option<OffsetDateTime> {
    plain_utc(v).map(|t| t.at)
}

/// The shape of the common form: `0` for a digit, else the byte itself.
const FORM: &[u8; 20] = b"0000-00-00T00:00:00Z";

/// Eight bytes of [`FORM`] from `at`, as a little-endian word: `pattern`
/// gives each byte itself, `limit` the largest value each byte of the input
/// xor the form may have (9 under a digit, 0 under a separator) as
/// `0x7f - limit`.
const fn form_word(at: usize, limit: bool) -> u64 {
    let mut word = 0;
    let mut i = 0;
    while i < 8 {
        let byte = FORM[at + i];
        let byte = match (limit, byte) {
            (false, _) => byte,
            (true, b'0') => 0x7f - 9,
            (true, _) => 0x7f,
        };
        word |= (byte as u64) << (8 * i);
        i += 1;
    }
    word
}

/// Days before the first of each month in a common year.
const DAYS_BEFORE_MONTH: [u16; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];

/// The common form `YYYY-MM-DDTHH:MM:SSZ` (uppercase `T` and `Z`, no
/// fraction, second at most 59), parsed without the `time` crate's general
/// parser; `None` for anything else, valid or not, which goes to that parser.
/// What this accepts the `time` crate accepts as the same instant in UTC.
///
/// Eight bytes at a time: each byte xor the form's is 0-9 under a digit and
/// 0 under a separator exactly when the byte fits, and each two-digit field
/// is then one byte of `x * 10 + (x >> 8)`.
#[inline]
fn plain_utc(v: &[u8]) -> Option<Stamp> {
    const LOWS: u64 = !HIGHS;
    let v: &[u8; 20] = v.try_into().ok()?;
    let (head, tail) = v.split_at(8);
    let (middle, _) = tail.split_at(8);
    let (_, last) = v.split_at(12);
    let word = |bytes: &[u8]| -> Option<u64> { Some(u64::from_le_bytes(bytes.try_into().ok()?)) };
    let words = [word(head)?, word(middle)?, word(last)?];
    let mut fields = [0u64; 3];
    let mut misfit = 0;
    for (k, (&w, field)) in words.iter().zip(&mut fields).enumerate() {
        let at = [0, 8, 12][k];
        let x = w ^ form_word(at, false);
        misfit |= ((x & LOWS).wrapping_add(form_word(at, true)) | x) & HIGHS;
        *field = x.wrapping_mul(10).wrapping_add(x >> 8);
    }
    if misfit != 0 {
        return None;
    }
    let [a, b, c] = fields;
    let two = |word: u64, byte: u32| (word >> (8 * byte)) as u8;
    let year = u16::from(two(a, 0)) * 100 + u16::from(two(a, 2));
    let (month, day) = (two(a, 5), two(b, 0));
    let (hour, minute, second) = (two(b, 3), two(b, 6), two(c, 5));
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days_in_month = match month {
        2 => 28 + u8::from(leap),
        4 | 6 | 9 | 11 => 30,
        1..=12 => 31,
        _ => return None,
    };
    // A leap second (`:60`) fails here and is left to the `time` crate.
    if day == 0 || day > days_in_month || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let ordinal =
        DAYS_BEFORE_MONTH[usize::from(month - 1)] + u16::from(day) + u16::from(leap && month > 2);
    let date = time::Date::from_ordinal_date(i32::from(year), ordinal).ok()?;
    let time = time::Time::from_hms(hour, minute, second).ok()?;
    // Days from 0000-01-01 to the first of `year`: the leap years before it
    // are the multiples of 4, less those of 100, plus those of 400, in
    // `0..year`; then to the Unix epoch, 1970-01-01, day 719,528.
    let y = i64::from(year);
    let days =
        365 * y + (y + 3) / 4 - (y + 99) / 100 + (y + 399) / 400 + i64::from(ordinal) - 1 - 719_528;
    let secs = days * 86_400 + i64::from(hour) * 3_600 + i64::from(minute) * 60 + i64::from(second);
    Some(Stamp {
        at: time::PrimitiveDateTime::new(date, time).assume_utc(),
        instant: (secs, 0),
    })
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

/// Validates the query string with [`QueryRules`] before the inner service
/// runs. Builds [`ValidateQuery`].
#[derive(Debug, Clone)]
pub struct ValidateQueryLayer {
    rules: QueryRules,
}

impl ValidateQueryLayer {
    /// A layer applying `rules`.
    pub fn new(rules: QueryRules) -> Self {
        ValidateQueryLayer { rules }
    }
}

impl<S> Layer<S> for ValidateQueryLayer {
    type Service = ValidateQuery<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ValidateQuery {
            inner,
            rules: self.rules.clone(),
        }
    }
}

/// Service built by [`ValidateQueryLayer`]: refuses a bad query with 400
/// ([`Rejection::InvalidParameters`]) and otherwise inserts the
/// [`ValidatedQuery`] into the request extensions.
///
/// Clones share the rules.
#[derive(Debug, Clone)]
pub struct ValidateQuery<S> {
    inner: S,
    rules: QueryRules,
}

impl<S> ValidateQuery<S> {
    crate::macros::inner_accessors!(inner: S);
}

impl<S, B, RB> Service<Request<B>> for ValidateQuery<S>
where
    S: Service<Request<B>, Response = Response<RB>>,
    RB: RefusalBody,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, RB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        match self.rules.validate(req.uri().query()) {
            Ok(validated) => {
                req.extensions_mut().insert(validated);
                ResponseFuture {
                    kind: Kind::Inner {
                        future: self.inner.call(req),
                    },
                }
            }
            Err(errors) => ResponseFuture {
                kind: Kind::Rejected {
                    response: Some(
                        Rejection::InvalidParameters(errors)
                            .into_layer_response(Protocol::of(req.headers())),
                    ),
                },
            },
        }
    }
}

pin_project! {
    /// Response future of [`ValidateQuery`].
    pub struct ResponseFuture<F, RB> {
        #[pin]
        kind: Kind<F, RB>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, RB> {
        Inner { #[pin] future: F },
        Rejected { response: Option<Response<RB>> },
    }
}

impl<F, RB> fmt::Debug for ResponseFuture<F, RB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Inner { .. } => "inner",
            Kind::Rejected { .. } => "rejected",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}

impl<F, RB, E> Future for ResponseFuture<F, RB>
where
    F: Future<Output = Result<Response<RB>, E>>,
{
    type Output = Result<Response<RB>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Inner { future } => {
                let response = ready!(future.poll(cx))?;
                Poll::Ready(Ok(response))
            }
            KindProj::Rejected { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("ResponseFuture polled after completion"),
            },
        }
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum::extract::FromRequestParts;
    use axum::response::{IntoResponse, Response};
    use http::request::Parts;
    use http::StatusCode;

    use super::ValidatedQuery;

    /// Rejection of the [`ValidatedQuery`] extractor: the route has no
    /// [`ValidateQueryLayer`](super::ValidateQueryLayer). A server bug, so 500.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct MissingValidatedQuery;

    impl IntoResponse for MissingValidatedQuery {
        fn into_response(self) -> Response {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "ValidatedQuery extractor used on a route without ValidateQueryLayer",
            )
                .into_response()
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for ValidatedQuery {
        type Rejection = MissingValidatedQuery;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<ValidatedQuery>()
                .cloned()
                .ok_or(MissingValidatedQuery)
        }
    }
}

#[cfg(feature = "axum")]
pub use extract::MissingValidatedQuery;

#[cfg(test)]
mod tests {
    use super::*;
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
}
