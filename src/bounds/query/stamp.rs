//! RFC 3339 timestamps, with a fast path for the common UTC form.

use std::time::Duration;

use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::pairs::HIGHS;

/// A timestamp as given, and its instant as seconds and nanoseconds since
/// the Unix epoch, which order and subtract as integers (an
/// [`OffsetDateTime`] compares and subtracts through its calendar date).
#[derive(Debug, Clone, Copy)]
pub(super) struct Stamp {
    pub(super) at: OffsetDateTime,
    pub(super) instant: (i64, u32),
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
    pub(super) fn until(&self, later: &Stamp) -> Duration {
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
pub(super) fn parse_time(v: &str) -> Result<OffsetDateTime, String> {
    parse_stamp(v).map(|t| t.at)
}

/// The common form inline, anything else (and every error) out of line.
#[inline]
pub(super) fn parse_stamp(v: &str) -> Result<Stamp, String> {
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
pub(super) fn parse_plain_utc(v: &[u8]) -> Option<OffsetDateTime> {
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
