//! [`LeaseError`]: why a call to the grant script failed.

use std::fmt;
use std::time::Duration;

use crate::redis::CallError;

/// Why a call to the grant script failed. A failed refresh is always safe:
/// the instance keeps its current grant until it expires, and the script
/// keeps counting every grant it may have issued.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseError {
    /// No connection to Redis: nothing was sent.
    Unavailable {
        /// What went wrong.
        message: String,
    },
    /// The call was sent but failed (Redis answered an error, the connection
    /// dropped, or the reply was not the script's).
    Failed {
        /// What went wrong.
        message: String,
    },
    /// No answer before the deadline; the script may have run.
    Timeout,
    /// The lease was released; nothing was sent.
    Released,
    /// Refused: another live lease holds this instance id's grants (a second
    /// process configured with the same id, or the previous run of this one
    /// while its grants last). The script changed nothing; this lease
    /// spends the fallback capacity until a refresh succeeds, due when the
    /// other lease's grants expire unless it renews them.
    InstanceIdInUse {
        /// The instance id.
        id: String,
        /// Until the other lease's last grant expires (Redis time).
        free_in: Duration,
    },
}

impl fmt::Display for LeaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseError::Unavailable { message } => write!(f, "redis unavailable: {message}"),
            LeaseError::Failed { message } => write!(f, "lease call failed: {message}"),
            LeaseError::Timeout => f.write_str("no answer from redis before the deadline"),
            LeaseError::Released => f.write_str("the lease was released"),
            LeaseError::InstanceIdInUse { id, free_in } => write!(
                f,
                "instance id {id:?} is held by another live lease (two processes configured with one id?); free in {free_in:?} unless that lease renews"
            ),
        }
    }
}

impl std::error::Error for LeaseError {}

impl From<CallError> for LeaseError {
    fn from(error: CallError) -> Self {
        match error {
            CallError::Unavailable(message) => LeaseError::Unavailable { message },
            CallError::Rejected(message) | CallError::Unknown(message) => {
                LeaseError::Failed { message }
            }
            CallError::Timeout(_) => LeaseError::Timeout,
        }
    }
}
