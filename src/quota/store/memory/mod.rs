mod bucket;
mod config;
mod decide;
mod key;
mod shard;
mod slots;
mod table;

use ahash::RandomState;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::clock::{Clock, SystemClock};
use crate::quota::store::{Store, StoreError};
use crate::quota::{Holds, Quota, QuotaDecision};

pub use config::MemoryConfig;
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

impl MemoryStore<SystemClock> {
    /// A store of at most 100,000 keys on the system clock.
    pub fn new() -> Self {
        Self::with_config(MemoryConfig::default(), SystemClock::new())
    }
}

impl Default for MemoryStore<SystemClock> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> MemoryStore<C> {
    /// A store with the given sizing and clock.
    pub fn with_config(config: MemoryConfig, clock: C) -> Self {
        let shards = config.shards.get();
        MemoryStore {
            inner: Arc::new(Inner {
                clock,
                hasher: RandomState::new(),
                max_keys: config.max_keys.get(),
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
        self.sweep_at(self.inner.clock.now().as_micros(), Sweep::Fresh)
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
    type SettleFuture = std::future::Ready<Result<Holds, StoreError>>;

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
        holds: &Holds,
        delta: i64,
    ) -> Self::SettleFuture {
        std::future::ready(self.settle_now(quota, key, holds, delta))
    }
}

#[cfg(test)]
mod tests;
