//! Configuration errors.

use std::fmt;

/// A configuration value that cannot be used, naming the field.
///
/// ```
/// use tower_admission::quota::Policy;
/// use std::time::Duration;
/// let err = Policy::sliding_log("per-minute", 100, Duration::ZERO).unwrap_err();
/// assert_eq!(err.field(), "window");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    field: &'static str,
    reason: String,
}

impl ConfigError {
    /// An error for `field`, with the reason it is invalid.
    pub fn new(field: &'static str, reason: impl Into<String>) -> Self {
        ConfigError {
            field,
            reason: reason.into(),
        }
    }

    /// The name of the invalid field.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// Why the value is invalid.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid `{}`: {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}

/// The longest deadline of one Redis call: a deadline bounds the latency of
/// what waits on the call, so one of minutes would hide a failure.
#[cfg(feature = "redis")]
pub(crate) const MAX_REDIS_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// `deadline`, the deadline of a Redis call named `field`, checked: above
/// zero, at most [`MAX_REDIS_DEADLINE`].
#[cfg(feature = "redis")]
pub(crate) fn redis_deadline(
    field: &'static str,
    deadline: std::time::Duration,
) -> Result<(), ConfigError> {
    if deadline.is_zero() {
        return Err(ConfigError::new(field, "must be more than zero"));
    }
    if deadline > MAX_REDIS_DEADLINE {
        return Err(ConfigError::new(
            field,
            "must be at most 60 s: it bounds how long a caller waits on Redis",
        ));
    }
    Ok(())
}
