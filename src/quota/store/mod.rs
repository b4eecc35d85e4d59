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
pub use memory::MemoryStore;

use crate::quota::{Quota, QuotaDecision};
use crate::ConfigError;

/// Shared quota state with atomic per-key decisions.
///
/// Clones share state.
///
/// # The contract
///
/// - [`decide`](Self::decide) is one atomic step per key: remove expired
///   state, check every policy of the quota, and record the admission in
///   every policy that admitted it only if no enforcing policy refused. A
///   refusal consumes nothing. The answer carries what the admission holds.
/// - [`settle`](Self::settle) adjusts one earlier admission, given its
///   decision, and answers that decision with what it still holds.
/// - [`validate`](Self::validate) is called once per quota when a layer is
///   built, so a quota the store cannot decide is a [`ConfigError`], not a
///   failure at request time.
///
/// The futures are named types, so a layer can hold them without boxing: a
/// store that decides synchronously returns [`std::future::Ready`].
///
/// Room to grow: a store can add lease operations (grant a caller `k` units
/// of a quota in one round trip, and take back what it did not use) on the
/// same keys and scripts; see the design notes.
pub trait Store: Clone + Send + Sync + 'static {
    /// The future of [`decide`](Self::decide).
    type DecideFuture: Future<Output = Result<QuotaDecision, StoreError>> + Send + Unpin + 'static;
    /// The future of [`settle`](Self::settle).
    type SettleFuture: Future<Output = Result<QuotaDecision, StoreError>> + Send + Unpin + 'static;

    /// Decides whether `cost` may be admitted under every policy of `quota`
    /// for `key`, and records it if so. Atomic per key.
    ///
    /// Shadow policies are checked and reported but never block: when every
    /// enforcing policy admits, the admission is recorded in every policy
    /// that admitted it. When one refuses, nothing is recorded, and each
    /// policy that would have admitted reports its state as it stands: what
    /// remains and when it is whole again without this request.
    fn decide(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture;

    /// The decision [`decide`](Self::decide) would make now, recording
    /// nothing: no admission, no cleanup, no new key. It holds nothing.
    /// Another decision may change the answer before the caller acts on it.
    fn peek(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture;

    /// Settles the admission `decision` (as [`decide`](Self::decide) or the
    /// last settle of it answered): `delta > 0` charges more, capped at what
    /// each policy has left; `delta < 0` refunds at most what the admission
    /// still holds in each policy. Answers the same decision holding what is
    /// left, which the next settle of that admission must be given: a fixed
    /// or weighted window keeps one count per window, not one per charge, so
    /// it trusts what a decision says it holds
    /// ([`Settlement`](crate::quota::Settlement) keeps them so).
    fn settle(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        decision: &QuotaDecision,
        delta: i64,
    ) -> Self::SettleFuture;

    /// Checks that this store can decide `quota` exactly.
    fn validate(&self, quota: &Quota) -> Result<(), ConfigError> {
        let _ = quota;
        Ok(())
    }
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
