mod bucket;
mod decide;
mod key;
mod shard;
mod slots;
mod table;

use ahash::RandomState;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::clock::{Clock, SystemClock, Timestamp};
use crate::quota::store::{Store, StoreError};
use crate::quota::{Quota, QuotaDecision};
use shard::{Padded, Shard, Sweep};

#[doc = include_str!("../../../../docs/memory_store.md")]
#[derive(Debug, Clone)]
pub struct MemoryStore<C = SystemClock> {
    inner: Arc<Inner<C>>,
}

#[derive(Debug)]
struct Inner<C> {
    clock: C,
    hasher: RandomState,
    max_keys: usize,
    /// Keys held in all shards: the cap is global.
    len: AtomicUsize,
    /// No key anywhere can be dropped before this time, even by a full
    /// store (a lower bound).
    next_expiry: AtomicU64,
    shards: Box<[Padded<Mutex<Shard>>]>,
}

/// The most keys a store holds unless [`MemoryStore::max_keys`] says otherwise.
const DEFAULT_MAX_KEYS: NonZeroUsize = match NonZeroUsize::new(100_000) {
    Some(n) => n,
    None => NonZeroUsize::MIN,
};

impl MemoryStore<SystemClock> {
    /// A store of at most 100,000 keys on the system clock.
    pub fn new() -> Self {
        Self::with_clock(SystemClock::new())
    }
}

impl Default for MemoryStore<SystemClock> {
    fn default() -> Self {
        Self::new()
    }
}

/// Enough shards that threads rarely meet, each holding at least 64 keys.
fn default_shards(max_keys: NonZeroUsize) -> NonZeroUsize {
    let cpus = std::thread::available_parallelism().map_or(4, NonZeroUsize::get);
    let most = (max_keys.get() / 64).max(1);
    let most = 1 << most.ilog2();
    let shards = (cpus * 32).next_power_of_two().min(most);
    NonZeroUsize::new(shards).unwrap_or(NonZeroUsize::MIN)
}

impl<C: Clock> MemoryStore<C> {
    /// A store of at most 100,000 keys on `clock`.
    pub fn with_clock(clock: C) -> Self {
        Self::sized(clock, DEFAULT_MAX_KEYS, default_shards(DEFAULT_MAX_KEYS))
    }

    /// At most `max_keys` keys, in a number of shards chosen from it and the
    /// CPU count. The shard count only spreads lock contention: the key cap
    /// is global.
    ///
    /// The sizing is set on a new store, before it is used or cloned: this
    /// answers an empty store on the same clock.
    ///
    /// ```
    /// use std::num::NonZeroUsize;
    /// use tower_admission::quota::MemoryStore;
    ///
    /// let store = MemoryStore::new().max_keys(NonZeroUsize::new(1024).unwrap());
    /// assert_eq!(store.capacity(), 1024);
    /// ```
    pub fn max_keys(self, max_keys: NonZeroUsize) -> Self {
        Self::sized(self.inner.clock.clone(), max_keys, default_shards(max_keys))
    }

    /// The same store with `shards` shards (feature `test-hooks`, for tests
    /// that need one shard or many): a power of two no larger than
    /// [`max_keys`](Self::max_keys), set after it.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn shards(self, shards: NonZeroUsize) -> Result<Self, crate::ConfigError> {
        if !shards.is_power_of_two() || shards.get() > self.inner.max_keys {
            return Err(crate::ConfigError::new(
                "shards",
                "must be a power of two no larger than max_keys",
            ));
        }
        let max_keys = NonZeroUsize::new(self.inner.max_keys).unwrap_or(NonZeroUsize::MIN);
        Ok(Self::sized(self.inner.clock.clone(), max_keys, shards))
    }

    /// An empty store of at most `max_keys` keys in `shards` shards.
    fn sized(clock: C, max_keys: NonZeroUsize, shards: NonZeroUsize) -> Self {
        let shards = shards.get();
        MemoryStore {
            inner: Arc::new(Inner {
                clock,
                hasher: RandomState::new(),
                max_keys: max_keys.get(),
                len: AtomicUsize::new(0),
                next_expiry: AtomicU64::new(0),
                shards: (0..shards)
                    .map(|_| Padded(Mutex::new(Shard::default())))
                    .collect(),
            }),
        }
    }

    /// The store's clock.
    pub fn clock(&self) -> &C {
        &self.inner.clock
    }

    /// Number of keys held.
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// True when no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most keys this store will ever hold.
    pub fn capacity(&self) -> usize {
        self.inner.max_keys
    }

    /// Drops every key whose state is equivalent to fresh; returns how many.
    pub fn sweep(&self) -> usize {
        self.sweep_at(Timestamp::now(&self.inner.clock).as_micros(), Sweep::Fresh)
    }

    fn sweep_at(&self, now: u64, sweep: Sweep) -> usize {
        let mut swept = 0;
        for shard in self.inner.shards.iter() {
            let mut shard = shard.0.lock();
            let dropped = shard.sweep(now, &self.inner.hasher, sweep);
            // Under the shard's lock, as a full store's own sweep does: a
            // new key's sweep that finds these keys gone finds their room
            // free too, not only once this sweep has passed every shard.
            self.inner.len.fetch_sub(dropped, Ordering::Relaxed);
            swept += dropped;
        }
        // The bound is read and stored with every shard locked: a key added
        // to a shard already swept lowers the bound before this store, which
        // would lift it above that key. Decisions lower it under their shard
        // lock and hold no other.
        let shards: Vec<_> = self.inner.shards.iter().map(|s| s.0.lock()).collect();
        let next = shards.iter().map(|s| s.next_expiry).min();
        self.inner
            .next_expiry
            .store(next.unwrap_or(u64::MAX), Ordering::Relaxed);
        drop(shards);
        swept
    }

    /// Runs [`sweep`](Self::sweep) every `period` on the current tokio runtime
    /// until the returned handle is aborted or the store is dropped.
    pub fn spawn_sweeper(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                let swept = MemoryStore { inner }.sweep();
                tracing::debug!(swept, "memory store sweep");
            }
        })
    }
}

impl<C: Clock> Store for MemoryStore<C> {
    type DecideFuture = std::future::Ready<Result<QuotaDecision, StoreError>>;
    type SettleFuture = std::future::Ready<Result<QuotaDecision, StoreError>>;

    #[inline]
    fn decide(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        std::future::ready(self.decide_now(quota, key, cost))
    }

    fn peek(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        std::future::ready(self.peek_now(quota, key, cost))
    }

    fn settle(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        decision: &QuotaDecision,
        delta: i64,
    ) -> Self::SettleFuture {
        std::future::ready(
            self.settle_now(quota, key, &decision.holds, delta)
                .map(|holds| decision.holding(holds)),
        )
    }
}

#[cfg(test)]
mod tests;
