//! The name and value pairs of a query string.

use std::borrow::Cow;

/// The name and value pairs of a raw query, decoded as
/// `application/x-www-form-urlencoded`, exactly as `form_urlencoded::parse`
/// gives them: split on the bytes `&`, then each pair at its first `=`
/// (empty pairs skipped, a pair without `=` has an empty value), then each
/// part decoded. A pair with no `%` and no `+` has nothing to decode, so it
/// is split in place, without the per-part decoding; a pair with either is
/// handed whole to `form_urlencoded`, which borrows each part it leaves as
/// is, as it would in the whole query. One scan finds the end of a pair and
/// whether it has a `%` or `+`.
pub(super) struct Pairs<'a> {
    rest: &'a str,
}

impl<'a> Pairs<'a> {
    pub(super) fn new(raw: &'a str) -> Self {
        Pairs { rest: raw }
    }
}

const ONES: u64 = u64::from_le_bytes([0x01; 8]);
pub(super) const HIGHS: u64 = u64::from_le_bytes([0x80; 8]);

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
pub(super) fn find_byte(s: &[u8], byte: u8) -> Option<usize> {
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
