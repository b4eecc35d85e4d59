//! One call: the deadline, the two failure phases and what they mean.

use std::fmt;
use std::time::Duration;

use redis::{ErrorKind, FromRedisValue, RedisError};
use tokio::time::Instant;

use super::connection::{Checkout, Connector};

/// What is sent: a script (EVALSHA, loaded again on NOSCRIPT) or a command.
pub(crate) enum Request<'a> {
    Script(&'a redis::ScriptInvocation<'a>),
    Cmd(&'a redis::Cmd),
}

/// Why a call failed, by what it may have done. Each caller maps it to its
/// own public error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CallError {
    /// Nothing was sent: no connection, connecting failed or was still
    /// running at the deadline, a reconnect backoff, a refused connection.
    Unavailable(String),
    /// Redis answered with an error (a script error, `BUSY`, `OOM`,
    /// `LOADING`, `MOVED`...): the command did not run, or the script stopped
    /// before its first write.
    Rejected(String),
    /// Sent, then the connection failed or the answer could not be read:
    /// the command may have run.
    Unknown(String),
    /// Sent, and no answer before the deadline: the command may have run.
    Timeout(Duration),
}

impl CallError {
    /// True when the command may have run.
    pub(crate) fn outcome_unknown(&self) -> bool {
        matches!(self, CallError::Unknown(_) | CallError::Timeout(_))
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Unavailable(m) | CallError::Rejected(m) | CallError::Unknown(m) => {
                f.write_str(m)
            }
            CallError::Timeout(deadline) => write!(f, "no answer within {deadline:?}"),
        }
    }
}

impl Connector {
    /// Sends `request` under the deadline ([`Timing::deadline`]), connecting
    /// first if needed, and classifies a failure by whether it was sent.
    ///
    /// [`Timing::deadline`]: super::Timing::deadline
    pub(crate) async fn call<T: FromRedisValue>(
        &self,
        request: Request<'_>,
    ) -> Result<T, CallError> {
        let timeout = self.timing().deadline;
        let deadline = Instant::now() + timeout;
        let checkout = self.acquire(deadline).await?;
        let mut conn = checkout.conn.clone();
        let unanswered = Unanswered {
            connector: self,
            checkout: &checkout,
        };
        let result = tokio::time::timeout_at(deadline, conn.send::<T>(&request)).await;
        std::mem::forget(unanswered);
        match result {
            Ok(Ok(reply)) => {
                self.answered(&checkout);
                Ok(reply)
            }
            Ok(Err(error)) => Err(self.classify(&error, &checkout)),
            Err(_) => {
                self.timed_out(&checkout);
                Err(CallError::Timeout(timeout))
            }
        }
    }

    /// Maps an error from a call that was handed to a live connection.
    fn classify(&self, error: &RedisError, checkout: &Checkout) -> CallError {
        let message = error.to_string();
        if error.is_connection_refusal() {
            // Nothing was sent (a cluster node refusing a new connection).
            return CallError::Unavailable(message);
        }
        if error.code().is_some() {
            // Redis answered with an error: the command did not run, or the
            // script stopped before writing.
            return CallError::Rejected(message);
        }
        if error.is_io_error() || error.is_connection_dropped() || error.is_unrecoverable_error() {
            // The connection died with the command on it: it may have run.
            self.broken(checkout, "connection dropped during a call");
            return CallError::Unknown(message);
        }
        match error.kind() {
            ErrorKind::Client
            | ErrorKind::InvalidClientConfig
            | ErrorKind::ClusterConnectionNotFound => CallError::Unavailable(message),
            // An answer that could not be read, or a crate timeout: the
            // command may have run.
            _ => CallError::Unknown(message),
        }
    }
}

/// A call handed to a connection and not answered yet. Dropped unanswered
/// (the caller gave up before the deadline), it counts toward a stall as a
/// timeout does, so a stalled connection is replaced even when every caller
/// gives up first.
struct Unanswered<'a> {
    connector: &'a Connector,
    checkout: &'a Checkout,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        self.connector.timed_out(self.checkout);
    }
}
