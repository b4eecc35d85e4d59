//! A key as a slot keeps it: short keys inline, so a lookup reads no memory
//! beyond the slot and the store keeps no string of its own for them.

use std::sync::Arc;

/// Keys of at most this many bytes are kept inline.
const INLINE: usize = 22;

/// Up to [`INLINE`] bytes, zero-padded, and their length.
#[derive(Debug, Clone, Copy)]
pub(super) struct Inline {
    len: u8,
    bytes: [u8; INLINE],
}

impl Inline {
    fn new(key: &str) -> Option<Self> {
        let key = key.as_bytes();
        let mut bytes = [0; INLINE];
        bytes.get_mut(..key.len())?.copy_from_slice(key);
        Some(Inline {
            len: key.len() as u8,
            bytes,
        })
    }

    /// True when `key` is these bytes: a few word compares, no copy.
    #[inline]
    fn same(&self, key: &[u8]) -> bool {
        let len = key.len();
        if usize::from(self.len) != len {
            return false;
        }
        let held = &self.bytes[..];
        match len {
            // Words at 0, at 8 when the key is longer than 16, and ending
            // at the key's end: together they cover it.
            8.. => {
                word(held, 0) == word(key, 0)
                    && (len <= 16 || word(held, 8) == word(key, 8))
                    && word(held, len - 8) == word(key, len - 8)
            }
            4.. => half(held, 0) == half(key, 0) && half(held, len - 4) == half(key, len - 4),
            0 => true,
            // The first, middle and last bytes cover up to 3 (a slice
            // compare would call `memcmp`).
            _ => {
                held[0] == key[0] && held[len / 2] == key[len / 2] && held[len - 1] == key[len - 1]
            }
        }
    }
}

/// Bytes `at..at + 8` of `bytes`, which holds them.
#[inline]
fn word(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_ne_bytes(word)
}

/// Bytes `at..at + 4` of `bytes`, which holds them.
#[inline]
fn half(bytes: &[u8], at: usize) -> u32 {
    let mut half = [0; 4];
    half.copy_from_slice(&bytes[at..at + 4]);
    u32::from_ne_bytes(half)
}

/// A slot's key: 24 bytes, inline up to [`INLINE`] bytes, else the caller's
/// `Arc` shared.
#[derive(Debug)]
pub(super) enum StoredKey {
    Inline(Inline),
    Shared(Arc<str>),
}

impl StoredKey {
    pub(super) fn new(key: &Arc<str>) -> Self {
        match Inline::new(key) {
            Some(inline) => StoredKey::Inline(inline),
            None => StoredKey::Shared(key.clone()),
        }
    }

    #[inline]
    pub(super) fn matches(&self, key: &Arc<str>) -> bool {
        match self {
            StoredKey::Inline(inline) => inline.same(key.as_bytes()),
            // Comparing pointers first: callers usually pass the very `Arc`
            // the slot holds.
            StoredKey::Shared(held) => Arc::ptr_eq(held, key) || held == key,
        }
    }

    /// The key's bytes, to hash it again when a table grows.
    pub(super) fn bytes(&self) -> &[u8] {
        match self {
            StoredKey::Inline(inline) => &inline.bytes[..usize::from(inline.len)],
            StoredKey::Shared(key) => key.as_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_inline_and_long_keys_shared() {
        assert_eq!(std::mem::size_of::<StoredKey>(), 24);
        for len in [0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 21, 22, 23, 40] {
            let key: Arc<str> = "k".repeat(len).into();
            let stored = StoredKey::new(&key);
            assert_eq!(matches!(stored, StoredKey::Inline(_)), len <= INLINE);
            assert_eq!(stored.bytes(), key.as_bytes());
            assert!(stored.matches(&key.to_string().into()));
            for other in [
                "k".repeat(len + 1),
                "j".repeat(len),
                format!("{}\0", "k".repeat(len)),
            ] {
                let other: Arc<str> = other.into();
                if other == key {
                    continue;
                }
                assert!(!stored.matches(&other), "{len}: {other:?}");
            }
        }
        // A key whose only difference is in the last inline byte.
        let a: Arc<str> = "abcdefghijklmnopqrstuv".into();
        let b: Arc<str> = "abcdefghijklmnopqrstuw".into();
        assert!(!StoredKey::new(&a).matches(&b));
    }
}
