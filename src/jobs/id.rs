use std::fmt;
use std::str::FromStr;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, LOCATION};
use http::{Response, StatusCode};
use http_body_util::Full;

/// Identifier of an accepted job: 128 random bits from a cryptographically
/// secure generator (`rand::random`, backed by the thread-local ChaCha RNG),
/// so it cannot be guessed and is safe to put in a URL.
///
/// Displayed and parsed as 32 lowercase hexadecimal digits. Parsing accepts
/// only that spelling (`0-9`, `a-f`): uppercase digits, a sign, a `0x` prefix
/// or whitespace are refused with an error, so every id has exactly
/// one text form and two different strings never name the same job.
///
/// ```
/// use tower_admission::jobs::JobId;
/// let id = JobId::random();
/// let text = id.to_string();
/// assert_eq!(text.len(), 32);
/// assert_eq!(text.parse::<JobId>(), Ok(id));
/// assert!("not-an-id".parse::<JobId>().is_err());
/// assert!("ABCDEF00000000000000000000000000".parse::<JobId>().is_err());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(u128);

impl JobId {
    /// A fresh random id.
    pub fn random() -> Self {
        JobId(rand::random::<u128>())
    }

    /// The id as a number.
    pub fn as_u128(self) -> u128 {
        self.0
    }

    /// A `202 Accepted` response pointing at `location`, where the job's status
    /// can be read, with the body `{"id": ..., "status": "queued"}`.
    ///
    /// Fails only when `location` is not a valid header value.
    pub fn accepted_response(
        self,
        location: &str,
    ) -> Result<Response<Full<Bytes>>, http::header::InvalidHeaderValue> {
        let location = HeaderValue::from_str(location)?;
        let body = serde_json::json!({ "id": self, "status": "queued" }).to_string();
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = StatusCode::ACCEPTED;
        response.headers_mut().insert(LOCATION, location);
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Ok(response)
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobId({self})")
    }
}

/// The text was not 32 lowercase hexadecimal digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseJobIdError;

impl fmt::Display for ParseJobIdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a job id is 32 lowercase hexadecimal digits")
    }
}

impl std::error::Error for ParseJobIdError {}

impl FromStr for JobId {
    type Err = ParseJobIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // Lowercase only: `u128::from_str_radix` would also take `A-F` (and a
        // leading `+`), which would give one id several spellings.
        if s.len() != 32 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(ParseJobIdError);
        }
        u128::from_str_radix(s, 16)
            .map(JobId)
            .map_err(|_| ParseJobIdError)
    }
}

impl serde::Serialize for JobId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for JobId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::{JobId, ParseJobIdError};

    #[test]
    fn job_id_parses_only_its_one_lowercase_spelling() {
        let lower = "0123456789abcdef0123456789abcdef";
        let id: JobId = lower.parse().unwrap();
        assert_eq!(id.to_string(), lower);
        assert_eq!(id.as_u128(), 0x0123456789abcdef0123456789abcdef);
        // Every other spelling of the same number is refused with the id error,
        // so a status lookup never finds one job under two paths.
        for other in [
            "0123456789ABCDEF0123456789ABCDEF",
            "0123456789abcdef0123456789abcdeF",
            "0123456789Abcdef0123456789abcdef",
            "+123456789abcdef0123456789abcdef",
        ] {
            assert_eq!(other.parse::<JobId>(), Err(ParseJobIdError), "{other}");
        }
        // The same holds through serde (a JSON body naming a job).
        assert!(serde_json::from_str::<JobId>("\"0123456789ABCDEF0123456789ABCDEF\"").is_err());
        assert_eq!(
            serde_json::from_str::<JobId>(&format!("\"{lower}\"")).unwrap(),
            id
        );
        // A random id's uppercase form is refused too.
        let random = JobId::random();
        let upper = format!("{:032X}", random.as_u128());
        if upper.bytes().any(|b| b.is_ascii_alphabetic()) {
            assert_eq!(upper.parse::<JobId>(), Err(ParseJobIdError));
        }
    }
}
