use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use hashbrown::HashTable;
use parking_lot::Mutex;

use crate::clock::{Clock, SystemClock, Timestamp};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::quota::algorithm::{Algorithm, Hold, State, TokenBucket, TokenBucketState};
use crate::quota::store::{Store, StoreError};
use crate::quota::{Decisions, Holds, Quota, QuotaDecision};
use crate::ConfigError;

/// Sizing of a [`MemoryStore`].
#[derive(Debug, Clone, Copy)]
pub struct MemoryConfig {
    max_keys: NonZeroUsize,
    shards: NonZeroUsize,
}

impl MemoryConfig {
    /// At most `max_keys` keys, in a number of shards chosen from the CPU count.
    pub fn new(max_keys: NonZeroUsize) -> Self {
        let cpus = std::thread::available_parallelism().map_or(4, NonZeroUsize::get);
        // Enough shards that threads rarely meet, each holding at least 64 keys.
        let most = (max_keys.get() / 64).max(1);
        let most = 1 << most.ilog2();
        let shards = (cpus * 32).next_power_of_two().min(most);
        MemoryConfig {
            max_keys,
            shards: NonZeroUsize::new(shards).unwrap_or(NonZeroUsize::MIN),
        }
    }

    /// Sets the shard count, a power of two no larger than `max_keys`. The
    /// shard count only spreads lock contention: the key cap is global.
    pub fn shards(mut self, shards: NonZeroUsize) -> Result<Self, ConfigError> {
        if !shards.is_power_of_two() || shards > self.max_keys {
            return Err(ConfigError::new(
                "shards",
                "must be a power of two no larger than max_keys",
            ));
        }
        self.shards = shards;
        Ok(self)
    }
}

impl Default for MemoryConfig {
    /// 100,000 keys.
    fn default() -> Self {
        Self::new(NonZeroUsize::new(100_000).unwrap_or(NonZeroUsize::MIN))
    }
}

/// The embedded store: sharded, atomic per key, bounded by `max_keys`.
///
/// - **Atomic.** A key's policies live in one slot of one shard; cleanup,
///   check and record happen under that shard's lock.
/// - **Bounded, exactly.** The store holds at most `max_keys` keys in all,
///   whatever shard they hash to: it accepts exactly `max_keys` live keys,
///   and [`len`](Self::len) never exceeds it.
/// - **Lossless eviction.** Only state equivalent to fresh (an expired window,
///   a full bucket) is ever dropped, so dropping inflates no quota. Refusals
///   create no state at all.
/// - **When full of live keys**, a request for a *new* key gets
///   [`StoreError::Full`], with the time until the earliest key expires.
///   Before answering so, a full store drops every key that has become
///   equivalent to fresh (at most once per expiry, so a flood of new keys
///   against live ones costs no sweeps). The quota layer resolves it with the policy's
///   [`FailureMode`](crate::quota::FailureMode) (closed by default: 503 with
///   `Retry-After`). Known keys are never affected, so a flood of new
///   identities cannot reset or lock out existing ones.
/// - **Idle keys** are reclaimed lazily when a shard fills, and by
///   [`sweep`](Self::sweep) / [`spawn_sweeper`](Self::spawn_sweeper).
/// - **Memory per key**, besides the key's string (shared with the caller):
///   56 bytes for a quota of one token bucket, the most common shape, which
///   has a table of its own; 168 bytes for any other quota of up to two
///   policies, plus 16 bytes per entry of a sliding log.
///
/// Clones share state.
///
/// ```
/// use tower_admission::clock::{ManualClock, Timestamp};
/// use tower_admission::quota::{MemoryConfig, MemoryStore, Policy, Quota, Store};
/// use std::{num::NonZeroUsize, sync::Arc, time::Duration};
///
/// # tokio_test_block_on(async {
/// // At most 10,000 keys; a manual clock so the example never crosses a minute.
/// let config = MemoryConfig::new(NonZeroUsize::new(10_000).unwrap());
/// let store = MemoryStore::with_config(config, ManualClock::new(Timestamp::from_secs(1_800_000_000)));
/// let quota = Quota::new("api", [Policy::fixed_window("per-minute", 2, Duration::from_secs(60))?])?;
/// let alice: Arc<str> = "alice".into();
/// assert!(store.decide(&quota, &alice, 1).await.unwrap().admitted);
/// assert!(store.decide(&quota, &alice, 1).await.unwrap().admitted);
/// assert!(!store.decide(&quota, &alice, 1).await.unwrap().admitted);
/// # Ok::<(), tower_admission::ConfigError>(())
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
/// ```
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
    /// No key anywhere can be dropped before this time (a lower bound).
    next_expiry: AtomicU64,
    shards: Box<[Padded<Mutex<Shard>>]>,
}

/// Equal strings, comparing pointers first: callers usually pass the very
/// `Arc` the slot holds.
#[inline]
fn same(a: &Arc<str>, b: &Arc<str>) -> bool {
    Arc::ptr_eq(a, b) || a == b
}

/// A key hashed as its bytes in one write.
struct KeyBytes<'a>(&'a str);

impl std::hash::Hash for KeyBytes<'_> {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write(self.0.as_bytes());
    }
}

/// Keeps each shard on its own cache lines, so threads working on
/// different shards do not contend.
#[derive(Debug)]
#[repr(align(128))]
struct Padded<T>(T);

#[derive(Debug, Default)]
struct Shard {
    /// Keys of quotas that are one token bucket: 56 bytes each, since this
    /// is the most common quota.
    buckets: HashTable<BucketSlot>,
    /// Keys of every other quota.
    slots: HashTable<Slot>,
    /// No key can be dropped before this time: a lower bound of every
    /// key's `fresh_at`.
    next_expiry: u64,
}

/// A key's states, one per policy, inline for up to two policies so a
/// decision touches no memory beyond its slot.
type States = smallvec::SmallVec<[State; 2]>;

#[derive(Debug)]
struct Slot {
    /// The quota's [`layout`](Quota::layout): same name, same algorithm kinds.
    layout: u64,
    key: Arc<str>,
    states: States,
    /// From this time every state is equivalent to fresh.
    fresh_at: u64,
}

/// The slot of a quota of one token bucket: its TAT is also the time from
/// which it is equivalent to fresh (a full bucket).
#[derive(Debug)]
struct BucketSlot {
    layout: u64,
    key: Arc<str>,
    state: TokenBucketState,
}

/// One key of one quota in one of a shard's tables.
trait Entry: Sized {
    /// What a decision changes.
    type State;
    fn table(shard: &mut Shard) -> &mut HashTable<Self>;
    fn new(quota: &Quota, key: &Arc<str>, state: Self::State) -> Self;
    fn fresh_state(quota: &Quota) -> Self::State;
    fn layout(&self) -> u64;
    fn key(&self) -> &Arc<str>;
    fn state_mut(&mut self) -> &mut Self::State;
    /// Keeps [`fresh_at`](Entry::fresh_at) up to date after a change.
    fn refresh(&mut self, quota: &Quota);
    fn fresh_at(&self) -> u64;
}

impl Entry for Slot {
    type State = States;

    fn table(shard: &mut Shard) -> &mut HashTable<Self> {
        &mut shard.slots
    }

    fn new(quota: &Quota, key: &Arc<str>, states: States) -> Self {
        Slot {
            layout: quota.layout(),
            key: key.clone(),
            fresh_at: fresh_at(quota, &states),
            states,
        }
    }

    fn fresh_state(quota: &Quota) -> States {
        quota
            .policies()
            .iter()
            .map(|p| p.algorithm().fresh_state())
            .collect()
    }

    fn layout(&self) -> u64 {
        self.layout
    }

    fn key(&self) -> &Arc<str> {
        &self.key
    }

    fn state_mut(&mut self) -> &mut States {
        // Same layout: the states are the quota's policies' kinds, in order.
        &mut self.states
    }

    fn refresh(&mut self, quota: &Quota) {
        debug_assert!(states_match(quota, &self.states));
        self.fresh_at = fresh_at(quota, &self.states);
    }

    fn fresh_at(&self) -> u64 {
        self.fresh_at
    }
}

impl Entry for BucketSlot {
    type State = TokenBucketState;

    fn table(shard: &mut Shard) -> &mut HashTable<Self> {
        &mut shard.buckets
    }

    fn new(quota: &Quota, key: &Arc<str>, state: TokenBucketState) -> Self {
        BucketSlot {
            layout: quota.layout(),
            key: key.clone(),
            state,
        }
    }

    fn fresh_state(_: &Quota) -> TokenBucketState {
        TokenBucketState::default()
    }

    fn layout(&self) -> u64 {
        self.layout
    }

    fn key(&self) -> &Arc<str> {
        &self.key
    }

    fn state_mut(&mut self) -> &mut TokenBucketState {
        &mut self.state
    }

    fn refresh(&mut self, _: &Quota) {}

    fn fresh_at(&self) -> u64 {
        self.state.fresh_at()
    }
}

/// The quota's token bucket and whether it only watches, when the quota is
/// exactly one token bucket.
#[inline]
fn lone_bucket(quota: &Quota) -> Option<(&TokenBucket, bool)> {
    match quota.policies() {
        [policy] => match policy.algorithm() {
            Algorithm::TokenBucket(bucket) => Some((bucket, policy.is_shadow())),
            _ => None,
        },
        _ => None,
    }
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
        self.sweep_at(self.inner.clock.now().as_micros())
    }

    fn sweep_at(&self, now: u64) -> usize {
        let mut next = u64::MAX;
        let mut swept = 0;
        for shard in self.inner.shards.iter() {
            let mut shard = shard.0.lock();
            swept += shard.sweep(now);
            next = next.min(shard.next_expiry);
        }
        self.inner.len.fetch_sub(swept, Ordering::Relaxed);
        self.inner.next_expiry.store(next, Ordering::Relaxed);
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

    /// The synchronous decision behind [`Store::decide`].
    #[inline]
    pub(crate) fn decide_now(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> Result<QuotaDecision, StoreError> {
        if let Some((bucket, shadow)) = lone_bucket(quota) {
            return self.update::<BucketSlot, _>(quota, key, |state, now| {
                state.read_fresh(now.as_micros());
                let (decision, hold) = bucket.step_in_place(state, now.as_micros(), cost);
                let hold = decision.admitted.then_some(hold);
                QuotaDecision::single(decision, shadow, hold)
            });
        }
        self.update::<Slot, _>(quota, key, |states, now| decide(quota, states, now, cost))
    }

    /// The synchronous settlement behind [`Store::settle`]. Settling a key
    /// with no live state starts from fresh: a refund then changes nothing.
    pub(crate) fn settle_now(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        holds: &Holds,
        delta: i64,
    ) -> Result<Holds, StoreError> {
        let hold = |i: usize| holds.0.get(i).copied().unwrap_or(Hold::default());
        if let Some((bucket, _)) = lone_bucket(quota) {
            return self.update::<BucketSlot, _>(quota, key, |state, now| {
                state.read_fresh(now.as_micros());
                Holds(
                    [bucket.settle(state, now.as_micros(), hold(0), delta)]
                        .into_iter()
                        .collect(),
                )
            });
        }
        self.update::<Slot, _>(quota, key, |states, now| {
            Holds(
                quota
                    .policies()
                    .iter()
                    .zip(states.iter_mut())
                    .enumerate()
                    .map(|(i, (policy, state))| {
                        read_fresh(policy.algorithm(), state, now);
                        policy.algorithm().settle(state, now, hold(i), delta)
                    })
                    .collect(),
            )
        })
    }

    /// Runs `change` on the key's state under its shard lock: the one
    /// critical section of every decision. A new key's state is stored only
    /// if `change` left it different from fresh.
    #[inline]
    fn update<E: Entry, R>(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        mut change: impl FnMut(&mut E::State, Timestamp) -> R,
    ) -> Result<R, StoreError> {
        let now = self.inner.clock.now();
        let hash = self.hash(quota.layout(), key);
        let mut shard = self.shard(hash).lock();
        let found = E::table(&mut shard)
            .find_mut(hash, |e| e.layout() == quota.layout() && same(e.key(), key));
        let Some(entry) = found else {
            return self.insert_new::<E, R>(shard, quota, key, hash, now, change);
        };
        let result = change(entry.state_mut(), now);
        entry.refresh(quota);
        // A refund can bring the key's expiry forward (rarely: the bounds are
        // read first, so decisions write no shared line).
        let fresh_at = entry.fresh_at();
        if fresh_at < shard.next_expiry {
            shard.next_expiry = fresh_at;
        }
        if fresh_at < self.inner.next_expiry.load(Ordering::Relaxed) {
            self.inner
                .next_expiry
                .fetch_min(fresh_at, Ordering::Relaxed);
        }
        Ok(result)
    }

    /// The first decision of a key, off the hot path: `change` on a fresh
    /// state, which is stored only if it is no longer fresh, making room
    /// under the global cap first.
    #[cold]
    #[inline(never)]
    fn insert_new<'a, E: Entry, R>(
        &'a self,
        mut shard: parking_lot::MutexGuard<'a, Shard>,
        quota: &Quota,
        key: &Arc<str>,
        hash: u64,
        now: Timestamp,
        mut change: impl FnMut(&mut E::State, Timestamp) -> R,
    ) -> Result<R, StoreError> {
        let mut state = E::fresh_state(quota);
        let result = change(&mut state, now);
        let entry = E::new(quota, key, state);
        let now = now.as_micros();
        if entry.fresh_at() > now {
            if !self.reserve() {
                // Full: drop what has become fresh, here first, then everywhere.
                let swept = if now >= shard.next_expiry {
                    shard.sweep(now)
                } else {
                    0
                };
                self.inner.len.fetch_sub(swept, Ordering::Relaxed);
                if !self.reserve() {
                    drop(shard);
                    if now >= self.inner.next_expiry.load(Ordering::Relaxed) {
                        self.sweep_at(now);
                    }
                    if !self.reserve() {
                        let next = self.inner.next_expiry.load(Ordering::Relaxed);
                        let retry_after = Duration::from_micros(next.saturating_sub(now));
                        return Err(StoreError::Full { retry_after });
                    }
                    shard = self.shard(hash).lock();
                }
            }
            shard.next_expiry = shard.next_expiry.min(entry.fresh_at());
            if entry.fresh_at() < self.inner.next_expiry.load(Ordering::Relaxed) {
                self.inner
                    .next_expiry
                    .fetch_min(entry.fresh_at(), Ordering::Relaxed);
            }
            let table = E::table(&mut shard);
            // Another thread may have inserted the key while the lock was dropped.
            if table
                .find(hash, |e| e.layout() == quota.layout() && same(e.key(), key))
                .is_some()
            {
                self.inner.len.fetch_sub(1, Ordering::Relaxed);
                drop(shard);
                return self.update::<E, R>(quota, key, change);
            }
            let hasher = |e: &E| self.hash(e.layout(), e.key());
            table.insert_unique(hash, entry, hasher);
        }
        Ok(result)
    }

    /// Takes one key's room under the global cap; false when full.
    #[inline]
    fn reserve(&self) -> bool {
        self.inner
            .len
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.inner.max_keys).then_some(n + 1)
            })
            .is_ok()
    }

    /// The store's keyed (SipHash) hash of the key, mixed with the quota
    /// [layout](Quota::layout) hash: one hasher pass per decision.
    #[inline]
    fn hash(&self, layout: u64, key: &Arc<str>) -> u64 {
        self.inner.hasher.hash_one(KeyBytes(key)) ^ layout
    }

    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        &self.inner.shards[self.shard_index(hash)].0
    }

    /// Every bit of the hash, remixed so the shard is independent of the
    /// bits the table uses, picks among any number of shards.
    #[inline]
    fn shard_index(&self, hash: u64) -> usize {
        let mixed = u128::from(hash.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        ((mixed * self.inner.shards.len() as u128) >> 64) as usize
    }
}

impl Shard {
    fn len(&self) -> usize {
        self.buckets.len() + self.slots.len()
    }

    fn sweep(&mut self, now: u64) -> usize {
        fn retain_live<E: Entry>(table: &mut HashTable<E>, now: u64, next: &mut u64) {
            table.retain(|e| {
                let live = e.fresh_at() > now;
                if live {
                    *next = (*next).min(e.fresh_at());
                }
                live
            });
        }
        let before = self.len();
        let mut next = u64::MAX;
        retain_live(&mut self.buckets, now, &mut next);
        retain_live(&mut self.slots, now, &mut next);
        self.next_expiry = next;
        before - self.len()
    }
}

fn states_match(quota: &Quota, states: &[State]) -> bool {
    states.len() == quota.policies().len()
        && quota
            .policies()
            .iter()
            .zip(states)
            .all(|(p, s)| p.algorithm().owns(s))
}

#[inline]
fn fresh_at(quota: &Quota, states: &[State]) -> u64 {
    quota
        .policies()
        .iter()
        .zip(states)
        .map(|(p, s)| p.algorithm().fresh_at(s).as_micros())
        .max()
        .unwrap_or(0)
}

/// One policy's state that is equivalent to fresh, read as fresh: the Redis
/// store keeps each policy in a key of its own and deletes it once fresh,
/// so a state is read alike by both stores whatever numbers wrote it.
#[inline]
fn read_fresh(algorithm: &Algorithm, state: &mut State, now: Timestamp) {
    if algorithm.fresh_at(state) <= now {
        *state = algorithm.fresh_state();
    }
}

/// Checks every policy, then records in all that admitted if no enforcing
/// policy refused: the one place this rule is written. One critical section:
/// the caller holds the shard lock.
#[inline]
fn decide(quota: &Quota, states: &mut [State], now: Timestamp, cost: u64) -> QuotaDecision {
    if let ([policy], [state]) = (quota.policies(), &mut *states) {
        // One policy: nothing to keep atomic across policies.
        read_fresh(policy.algorithm(), state, now);
        let d = policy.algorithm().check(state, now, cost);
        let hold = d
            .admitted
            .then(|| policy.algorithm().record(state, now, cost));
        return QuotaDecision::single(d, policy.is_shadow(), hold);
    }
    let mut admitted = true;
    let mut decisions = Decisions::new();
    for (policy, state) in quota.policies().iter().zip(states.iter_mut()) {
        read_fresh(policy.algorithm(), state, now);
        let d = policy.algorithm().check(state, now, cost);
        admitted &= d.admitted || policy.is_shadow();
        decisions.push(d);
    }
    let mut holds = Holds::default();
    if admitted {
        for ((policy, state), d) in quota
            .policies()
            .iter()
            .zip(states.iter_mut())
            .zip(&decisions)
        {
            holds.0.push(if d.admitted {
                policy.algorithm().record(state, now, cost)
            } else {
                Hold::default()
            });
        }
    }
    QuotaDecision {
        admitted,
        decisions,
        holds,
    }
}

impl<C: Clock> Store for MemoryStore<C> {
    type DecideFuture = std::future::Ready<Result<QuotaDecision, StoreError>>;
    type SettleFuture = std::future::Ready<Result<Holds, StoreError>>;

    #[inline]
    fn decide(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        std::future::ready(self.decide_now(quota, key, cost))
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
mod tests {
    use super::*;

    #[test]
    fn slot_sizes() {
        // The compact bucket slot: layout, key, and the exact-rate TAT with
        // its settlement offset.
        assert_eq!(std::mem::size_of::<BucketSlot>(), 56);
        // Two states inline, the largest being a sliding log's.
        assert_eq!(std::mem::size_of::<Slot>(), 168);
    }

    #[test]
    fn every_shard_is_reachable_beyond_65536_shards() {
        let shards = 1 << 18;
        let config = MemoryConfig::new(NonZeroUsize::new(shards).unwrap())
            .shards(NonZeroUsize::new(shards).unwrap())
            .unwrap();
        let store = MemoryStore::with_config(config, SystemClock::new());
        let mut hit = vec![false; shards];
        for i in 0..(shards as u64 * 16) {
            hit[store.shard_index(store.hash(0, &Arc::from(i.to_string())))] = true;
        }
        // 16 keys per shard on average: a shard misses with probability
        // e^-16, so about 0.03 of them do; a 16-bit index would miss 3/4.
        let missed = hit.iter().filter(|h| !**h).count();
        assert!(missed <= shards / 1000, "{missed} shards never chosen");
        assert!(hit[shards - 1] || hit[shards - 2]);
    }
}
