use std::fmt;

/// Why a request could not be authenticated.
///
/// The error never carries the presented credential, so it is safe to log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuthError {
    /// No credential was presented, or it could not be parsed (wrong scheme,
    /// empty, non-ASCII or oversized).
    Missing,
    /// A well-formed credential that no configured identity matches.
    Unknown,
    /// Refused for another reason named by a custom [`Authenticator`]
    /// (for example `"expired credential"`). The reason is sent to the caller
    /// in the problem `detail`, so it must not contain secrets.
    ///
    /// [`Authenticator`]: super::Authenticator
    Other(&'static str),
}

impl AuthError {
    /// The text of the problem `detail` (and the gRPC message).
    pub fn reason(&self) -> &'static str {
        match self {
            AuthError::Missing => "missing or malformed credential",
            AuthError::Unknown => "unknown credential",
            AuthError::Other(reason) => reason,
        }
    }
}

impl fmt::Display for AuthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}

impl std::error::Error for AuthError {}
