use std::collections::HashMap;
use std::fmt;
use std::future::{ready, Future};
use std::hash::{Hash, Hasher};

use http::header::AUTHORIZATION;
use http::request::Parts;
use http::HeaderMap;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq;

use super::{Authenticator, Identity};

/// The refusal of a missing or malformed header.
const MISSING: &str = "missing or malformed credential";
/// The refusal of a well-formed key that is not configured.
const UNKNOWN: &str = "unknown credential";
use crate::ConfigError;

/// Longest `Authorization` header value that is parsed, in bytes. Longer
/// values are refused as malformed before any hashing.
pub(crate) const MAX_AUTHORIZATION_LEN: usize = 4096;

/// Longest key a request can present: `MAX_AUTHORIZATION_LEN` less the
/// `Bearer ` before it (4089 bytes).
const MAX_KEY_LEN: usize = MAX_AUTHORIZATION_LEN - BEARER.len();

/// The scheme and its one space, matched case-insensitively.
const BEARER: &[u8] = b"bearer ";

/// API keys presented as `Authorization: Bearer <key>`.
///
/// Only the SHA-256 digest of each key is stored, so a memory dump or a debug
/// print does not reveal keys. A presented key is hashed and the digest is
/// looked up in a `HashMap`:
///
/// * the bucket is chosen by std's randomly keyed SipHash of the *digest*,
///   never of the key, so probe timing depends on a value the caller can
///   neither choose nor observe;
/// * equality of digests inside the bucket is constant-time (the words'
///   differences are folded together and compared with
///   [`subtle::ConstantTimeEq`]), so no comparison stops early at the first
///   differing byte.
///
/// Even a leak of a stored digest prefix would not help to find a key:
/// that needs a SHA-256 preimage. The lookup is O(1) whatever the number of
/// keys, which a constant-time scan over every stored digest would not be.
///
/// The scheme `Bearer` is matched case-insensitively (RFC 9110 §11.1) and is
/// followed by one or more spaces, never a tab (RFC 9110 §11.4). The token
/// must be 1 or more visible ASCII characters without spaces.
/// A missing, repeated, non-ASCII, oversized (over 4096 bytes) or
/// otherwise malformed header is refused as a `"missing or malformed
/// credential"`; a well-formed key that is not configured as an `"unknown
/// credential"`.
///
/// ```
/// use tower_admission::identity::{ApiKeys, Identity};
///
/// let keys = ApiKeys::new()
///     .with_key("demo-free", Identity::new("alice", "acme", "free"))
///     // sha256("demo-pro"), e.g. from `printf demo-pro | sha256sum`
///     .with_hashed_key(
///         "de4562274bd40421c1e8c1a589f4ec9f96c4c6e529fa843be4ef0d99d9256b7e",
///         Identity::new("bob", "globex", "pro"),
///     )
///     .unwrap();
/// assert_eq!(keys.len(), 2);
/// ```
#[derive(Clone, Default)]
pub struct ApiKeys {
    keys: HashMap<KeyDigest, Identity>,
}

/// A SHA-256 digest whose equality is constant-time.
#[derive(Clone, Copy)]
struct KeyDigest([u8; 32]);

impl KeyDigest {
    fn of(key: &[u8]) -> Self {
        KeyDigest(Sha256::digest(key).into())
    }
}

impl PartialEq for KeyDigest {
    /// The XOR of each pair of 8-byte words, ORed together, then one
    /// constant-time comparison with zero: no branch on any byte, and a
    /// quarter of the work of comparing byte by byte.
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.0.as_chunks::<8>().0, other.0.as_chunks::<8>().0);
        let diff = a.iter().zip(b).fold(0u64, |diff, (a, b)| {
            diff | (u64::from_ne_bytes(*a) ^ u64::from_ne_bytes(*b))
        });
        diff.ct_eq(&0).into()
    }
}

impl Eq for KeyDigest {}

impl Hash for KeyDigest {
    /// The 32 bytes in one write, without the length an array would add.
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(&self.0);
    }
}

impl ApiKeys {
    /// No keys: every request is refused until keys are added.
    pub fn new() -> Self {
        ApiKeys::default()
    }

    /// The keys in clear with their identities; only the SHA-256 digests are
    /// kept. A key added twice maps to the identity added last.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for the field `keys` when a key could never match
    /// a request ([`check_key`](Self::check_key)); its reason names the
    /// key's position from 0, e.g. `keys[2]: ...`, never the key.
    pub fn from_keys<K: AsRef<[u8]>>(
        keys: impl IntoIterator<Item = (K, Identity)>,
    ) -> Result<Self, ConfigError> {
        keys.into_iter()
            .enumerate()
            .try_fold(ApiKeys::new(), |keys, (i, (key, identity))| {
                ApiKeys::check_key(key.as_ref())
                    .map_err(|e| ConfigError::new("keys", format!("keys[{i}]: {}", e.reason())))?;
                Ok(keys.with_key(key, identity))
            })
    }

    /// Checks that a request can present `key` as its bearer token: 1 to
    /// 4089 visible ASCII characters (`!` to `~`), since `Bearer ` and the
    /// key fit in the 4096 bytes of an `Authorization` header that are read.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for the field `key`; it does not repeat the key.
    pub fn check_key(key: &[u8]) -> Result<(), ConfigError> {
        if key.is_empty() || !key.iter().all(is_visible) {
            return Err(ConfigError::new(
                "key",
                "must be 1 or more visible ASCII characters (! to ~)",
            ));
        }
        if key.len() > MAX_KEY_LEN {
            return Err(ConfigError::new(
                "key",
                format!(
                    "is {} bytes; a request can present at most {MAX_KEY_LEN} \
                     (an Authorization header is read up to {MAX_AUTHORIZATION_LEN})",
                    key.len()
                ),
            ));
        }
        Ok(())
    }

    /// Adds a key in clear; only its SHA-256 digest is kept. A key added twice
    /// maps to the identity added last. A key that cannot be presented as a
    /// bearer token (empty, spaces, non-ASCII, longer than 4089 bytes)
    /// never matches; [`from_keys`](Self::from_keys) refuses it.
    pub fn with_key(mut self, key: impl AsRef<[u8]>, identity: Identity) -> Self {
        self.keys.insert(KeyDigest::of(key.as_ref()), identity);
        self
    }

    /// Adds a key by its SHA-256 digest written as 64 hex digits (either
    /// case), so configuration files need not hold keys in clear.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for the field `hashed_key` when the text is not 64
    /// hex digits. The error does not repeat the text.
    pub fn with_hashed_key(
        mut self,
        hex_sha256: &str,
        identity: Identity,
    ) -> Result<Self, ConfigError> {
        let digest = parse_hex_digest(hex_sha256.trim())?;
        self.keys.insert(KeyDigest(digest), identity);
        Ok(self)
    }

    /// Number of configured keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// True when no key is configured.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The identity for the bearer token in `headers`.
    ///
    /// # Errors
    ///
    /// `"missing or malformed credential"` for a missing or malformed
    /// header, `"unknown credential"` for a key that is not configured.
    pub fn identify(&self, headers: &HeaderMap) -> Result<Identity, &'static str> {
        let token = bearer_token(headers).ok_or(MISSING)?;
        self.keys.get(&KeyDigest::of(token)).cloned().ok_or(UNKNOWN)
    }
}

impl Authenticator for ApiKeys {
    /// A lookup in memory: the answer is ready at once.
    fn authenticate_now(&self, parts: &Parts) -> Option<Result<Identity, &'static str>> {
        Some(self.identify(&parts.headers))
    }

    fn authenticate(
        &self,
        parts: &Parts,
    ) -> impl Future<Output = Result<Identity, &'static str>> + Send {
        ready(self.identify(&parts.headers))
    }
}

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Neither keys nor digests are printed.
        f.debug_struct("ApiKeys")
            .field("keys", &self.keys.len())
            .finish()
    }
}

/// The token of a single well-formed `Authorization: Bearer <token>` header.
fn bearer_token(headers: &HeaderMap) -> Option<&[u8]> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let bytes = value.as_bytes();
    if bytes.len() > MAX_AUTHORIZATION_LEN {
        return None;
    }
    if bytes.len() <= BEARER.len() || !bytes[..BEARER.len()].eq_ignore_ascii_case(BEARER) {
        return None;
    }
    // RFC 9110 §11.4: `auth-scheme 1*SP token68`. Only spaces separate the
    // two; a tab is neither separator nor token.
    let mut token = &bytes[BEARER.len()..];
    while let [b' ', rest @ ..] = token {
        token = rest;
    }
    (!token.is_empty() && token.iter().all(is_visible)).then_some(token)
}

/// A byte a bearer token may hold: visible ASCII, `!` to `~`.
fn is_visible(b: &u8) -> bool {
    (0x21..=0x7e).contains(b)
}

fn parse_hex_digest(hex: &str) -> Result<[u8; 32], ConfigError> {
    let bytes = hex.as_bytes();
    if bytes.len() != 64 {
        return Err(ConfigError::new(
            "hashed_key",
            format!(
                "a SHA-256 digest is 64 hex digits, got {} characters",
                hex.chars().count()
            ),
        ));
    }
    let nibble = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    };
    let mut digest = [0u8; 32];
    for (out, pair) in digest.iter_mut().zip(bytes.chunks_exact(2)) {
        match (nibble(pair[0]), nibble(pair[1])) {
            (Some(hi), Some(lo)) => *out = hi << 4 | lo,
            _ => {
                return Err(ConfigError::new(
                    "hashed_key",
                    "a SHA-256 digest is 64 hex digits; found a non-hex character",
                ))
            }
        }
    }
    Ok(digest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(AUTHORIZATION, HeaderValue::from_bytes(v).unwrap());
        }
        h
    }

    #[test]
    fn bearer_token_parsing() {
        assert_eq!(bearer_token(&headers(&[b"Bearer abc"])), Some(&b"abc"[..]));
        assert_eq!(
            bearer_token(&headers(&[b"bEaReR   abc"])),
            Some(&b"abc"[..])
        );
        assert_eq!(bearer_token(&headers(&[])), None);
        assert_eq!(bearer_token(&headers(&[b"Bearer"])), None);
        assert_eq!(bearer_token(&headers(&[b"Bearer "])), None);
        assert_eq!(bearer_token(&headers(&[b"Bearer a b"])), None);
        assert_eq!(bearer_token(&headers(&[b"Bearer \tabc"])), None);
        assert_eq!(bearer_token(&headers(&[b"Basic abc"])), None);
        assert_eq!(bearer_token(&headers(&[b"Bearer \xe9t\xe9"])), None);
        assert_eq!(bearer_token(&headers(&[b"Bearer a", b"Bearer a"])), None);
    }

    #[test]
    fn digests_differing_in_any_one_bit_are_unequal() {
        let digest = KeyDigest::of(b"demo-pro");
        assert!(digest == KeyDigest::of(b"demo-pro"));
        for byte in 0..32 {
            for bit in 0..8 {
                let mut other = digest;
                other.0[byte] ^= 1 << bit;
                assert!(digest != other, "byte {byte}, bit {bit}");
            }
        }
    }

    #[test]
    fn hex_digest_round_trip() {
        let hex = "de4562274bd40421c1e8c1a589f4ec9f96c4c6e529fa843be4ef0d99d9256b7e";
        assert_eq!(parse_hex_digest(hex).unwrap(), KeyDigest::of(b"demo-pro").0);
        assert_eq!(
            parse_hex_digest(&hex.to_uppercase()).unwrap(),
            KeyDigest::of(b"demo-pro").0
        );
        assert_eq!(parse_hex_digest("zz").unwrap_err().field(), "hashed_key");
        let bad = format!("{}g", &hex[..63]);
        assert_eq!(parse_hex_digest(&bad).unwrap_err().field(), "hashed_key");
    }
}
