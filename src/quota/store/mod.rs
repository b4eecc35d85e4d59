//! Where quota state lives.
//!
//! A [`Store`] makes one atomic decision per call: cleanup, check of every
//! policy of the quota, and recording, for one key. It reads time from its own
//! trusted source ([`MemoryStore`]: its [`Clock`](crate::clock::Clock)).

mod memory;
#[cfg(feature = "redis")]
mod redis;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "redis")]
pub use self::redis::{RedisStore, RedisStoreBuilder};
pub use memory::{MemoryConfig, MemoryStore};

use crate::quota::{Quota, QuotaDecision};

/// Shared quota state with atomic per-key decisions.
///
/// Clones share state.
pub trait Store: Clone + Send + Sync + 'static {
    /// Decides whether `cost` may be admitted under every policy of `quota`
    /// for `key`, and records it if so. Atomic per key.
    ///
    /// `shadow` policies are checked and reported but never block: when every
    /// enforcing policy admits, the admission is recorded in every policy that
    /// admitted it.
    fn decide(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> impl Future<Output = Result<QuotaDecision, StoreError>> + Send;

    /// The same decision made without awaiting, for stores that never wait
    /// (the memory store). `None`, the default, means "use
    /// [`decide`](Self::decide)". Layers use it to skip a boxed future per
    /// request.
    fn decide_sync(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> Option<Result<QuotaDecision, StoreError>> {
        let _ = (quota, key, cost);
        None
    }

    /// Settles an earlier admission: `delta > 0` charges more, `delta < 0`
    /// refunds. A charge never drives a policy past empty and a refund never
    /// past full.
    fn adjust(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        delta: i64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// Why a store could not decide.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreError {
    /// The store holds its maximum number of live keys and none can be
    /// dropped without losing state. Retry after the earliest key expires.
    Full {
        /// When the earliest live key becomes droppable.
        retry_after: Duration,
    },
    /// The store could not be reached, or failed before the request was sent:
    /// nothing was consumed.
    Unavailable {
        /// What failed.
        message: String,
    },
    /// The deadline passed (or the connection dropped) after the request
    /// was sent: the outcome is **unknown**, and callers count it as consumed.
    Timeout,
}

impl StoreError {
    /// True when the store may have recorded the admission.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, StoreError::Timeout)
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Full { retry_after } => write!(
                f,
                "store is full of live keys; earliest frees in {retry_after:?}"
            ),
            StoreError::Unavailable { message } => write!(f, "store unavailable: {message}"),
            StoreError::Timeout => f.write_str("store deadline passed; outcome unknown"),
        }
    }
}

impl std::error::Error for StoreError {}
