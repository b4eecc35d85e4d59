//! What may go into a Redis key: the rule every caller's prefix and names
//! follow.

use crate::ConfigError;

/// True if `s` is 1 to `max` characters of `[A-Za-z0-9._:-]`: no braces,
/// which would change a key's hash tag, and nothing to quote.
pub(crate) fn valid_key_part(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// A key prefix: 1 to 64 characters of `[A-Za-z0-9._:-]`, or a
/// [`ConfigError`] naming the field `prefix`.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), ConfigError> {
    if valid_key_part(prefix, 64) {
        return Ok(());
    }
    Err(ConfigError::new(
        "prefix",
        format!("{prefix:?} must be 1 to 64 characters of [A-Za-z0-9._:-]"),
    ))
}
