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
