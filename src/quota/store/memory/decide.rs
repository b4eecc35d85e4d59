//! Decisions and settlements: one critical section under a shard's lock.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::key::StoredKey;
use super::shard::key_hash;
use super::shard::{Shard, Sweep};
use super::slots::{droppable_at, lone_bucket};
use super::slots::{BucketSlot, Entry, Lone, LoneKind, Slot};
use super::MemoryStore;
use crate::clock::{Clock, Timestamp};
use crate::quota::algorithm::{Algorithm, Hold, Machine, State};
use crate::quota::store::StoreError;
use crate::quota::{Decisions, Holds, Quota, QuotaDecision};

/// [`MemoryStore::update_as`] for a decision.
pub(super) const DECIDE: bool = false;
/// A decision that records.
const RECORD: bool = false;
/// A decision that records nothing.
const PEEK: bool = true;
/// [`MemoryStore::update_as`] for a settle.
pub(super) const SETTLE: bool = true;

impl<C: Clock> MemoryStore<C> {
    /// The synchronous decision behind [`Store::decide`](crate::quota::Store::decide).
    #[inline]
    pub(crate) fn decide_now(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> Result<QuotaDecision, StoreError> {
        self.decide_as::<RECORD>(quota, key, cost)
    }

    /// The synchronous answer behind [`Store::peek`](crate::quota::Store::peek):
    /// the decision [`decide_now`](Self::decide_now) would make, made on a
    /// copy of the key's state, so nothing is recorded and no key is added.
    pub(crate) fn peek_now(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> Result<QuotaDecision, StoreError> {
        let mut decision = self.decide_as::<PEEK>(quota, key, cost)?;
        decision.holds = Holds::default();
        Ok(decision)
    }

    /// A decision that records (`RECORD`) or only looks (`PEEK`).
    #[inline]
    fn decide_as<const PEEKING: bool>(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> Result<QuotaDecision, StoreError> {
        // The most common quota first, on a path of its own.
        if let Some((bucket, shadow)) = lone_bucket(quota) {
            // The decision is made into the answer after the lock: a
            // smaller value moves out of the critical section.
            let step = self.step::<BucketSlot, _, PEEKING>(quota, key, |slot, now| {
                slot.step(bucket, now.as_micros(), cost)
            });
            return step.map(|(decision, hold)| {
                let hold = decision.admitted.then_some(hold);
                QuotaDecision::single(decision, shadow, hold)
            });
        }
        let [policy] = quota.policies() else {
            return self.step::<Slot, _, PEEKING>(quota, key, |states, now| {
                decide(quota, states, now, cost)
            });
        };
        let shadow = policy.is_shadow();
        match policy.algorithm() {
            Algorithm::FixedWindow(window) => {
                self.decide_lone::<_, PEEKING>(quota, window, shadow, key, cost)
            }
            Algorithm::SlidingWindow(window) => {
                self.decide_lone::<_, PEEKING>(quota, window, shadow, key, cost)
            }
            Algorithm::SlidingLog(log) => {
                self.decide_lone::<_, PEEKING>(quota, log, shadow, key, cost)
            }
            // Taken by the bucket's own path above.
            Algorithm::TokenBucket(_) => self.decide_as::<PEEKING>(quota, key, cost),
        }
    }

    /// A decision of a quota of the one policy `algorithm`, as [`decide`]
    /// makes it for one policy.
    #[inline]
    fn decide_lone<M: LoneKind, const PEEKING: bool>(
        &self,
        quota: &Quota,
        algorithm: &M,
        shadow: bool,
        key: &Arc<str>,
        cost: u64,
    ) -> Result<QuotaDecision, StoreError> {
        let step = self.step::<Lone<M>, _, PEEKING>(quota, key, |state, now| {
            let now = now.as_micros();
            read_fresh_lone(algorithm, state, now);
            let decision = algorithm.check(state, now, cost);
            let hold = decision
                .admitted
                .then(|| algorithm.record(state, now, cost));
            (decision, hold)
        });
        step.map(|(decision, hold)| QuotaDecision::single(decision, shadow, hold))
    }

    /// Runs `change` on the key's state ([`update`](Self::update)), or on a
    /// copy of it when `PEEKING` ([`look`](Self::look)).
    #[inline(always)]
    fn step<E: Entry, R, const PEEKING: bool>(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        change: impl FnMut(&mut E::State, Timestamp) -> R,
    ) -> Result<R, StoreError> {
        if PEEKING {
            Ok(self.look::<E, R>(quota, key, change))
        } else {
            self.update::<E, R>(quota, key, change)
        }
    }

    /// Runs `change` on a copy of the key's state (a fresh one if the key is
    /// not held), taken under its shard lock. Nothing is stored, swept or
    /// made room for.
    fn look<E: Entry, R>(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        mut change: impl FnMut(&mut E::State, Timestamp) -> R,
    ) -> R {
        let now = Timestamp::now(&self.inner.clock);
        let hash = key_hash(&self.inner.hasher, quota.layout(), key.as_bytes());
        let mut state = {
            let mut shard = self.shard(hash).lock();
            let found = shard
                .table::<E>(quota.layout(), quota.is_shadow_only())
                .and_then(|table| table.find_mut(hash, key));
            match found {
                Some(entry) => entry.state_copy(),
                None => E::fresh_state(quota),
            }
        };
        change(&mut state, now)
    }

    /// The synchronous settlement behind [`Store::settle`](crate::quota::Store::settle). Settling a key
    /// with no live state starts from fresh: a refund then changes nothing.
    pub(crate) fn settle_now(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        holds: &Holds,
        delta: i64,
    ) -> Result<Holds, StoreError> {
        let hold = |i: usize| holds.0.get(i).copied().unwrap_or(Hold::default());
        let [policy] = quota.policies() else {
            return self.update_as::<Slot, _, SETTLE>(quota, key, |states, now| {
                Holds(
                    quota
                        .policies()
                        .iter()
                        .zip(states.iter_mut())
                        .enumerate()
                        .map(|(i, (policy, state))| {
                            read_fresh_to_settle(policy.algorithm(), state, now);
                            policy.algorithm().settle(state, now, hold(i), delta)
                        })
                        .collect(),
                )
            });
        };
        match policy.algorithm() {
            Algorithm::TokenBucket(bucket) => {
                self.update_as::<BucketSlot, _, SETTLE>(quota, key, |slot, now| {
                    let mut state = slot.get();
                    state.read_fresh(now.as_micros());
                    let hold = bucket.settle(&mut state, now.as_micros(), hold(0), delta);
                    slot.set(state);
                    Holds([hold].into_iter().collect())
                })
            }
            Algorithm::FixedWindow(window) => self.settle_lone(quota, window, key, hold(0), delta),
            Algorithm::SlidingWindow(window) => {
                self.settle_lone(quota, window, key, hold(0), delta)
            }
            Algorithm::SlidingLog(log) => self.settle_lone(quota, log, key, hold(0), delta),
        }
    }

    /// A settlement of a quota of the one policy `algorithm`.
    fn settle_lone<M: LoneKind>(
        &self,
        quota: &Quota,
        algorithm: &M,
        key: &Arc<str>,
        hold: Hold,
        delta: i64,
    ) -> Result<Holds, StoreError> {
        self.update_as::<Lone<M>, _, SETTLE>(quota, key, |state, now| {
            let now = now.as_micros();
            Holds(
                [algorithm.settle(state, now, hold, delta)]
                    .into_iter()
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
        change: impl FnMut(&mut E::State, Timestamp) -> R,
    ) -> Result<R, StoreError> {
        self.update_as::<E, R, DECIDE>(quota, key, change)
    }

    /// [`update`](Self::update) for a decision (`DECIDE`) or a settle
    /// (`SETTLE`: see [`Entry::read_fresh_to_settle`] and
    /// [`Entry::keep_expiry`]).
    #[inline]
    fn update_as<E: Entry, R, const SETTLING: bool>(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        mut change: impl FnMut(&mut E::State, Timestamp) -> R,
    ) -> Result<R, StoreError> {
        let now = Timestamp::now(&self.inner.clock);
        let hash = key_hash(&self.inner.hasher, quota.layout(), key.as_bytes());
        let mut shard = self.shard(hash).lock();
        let shadow_only = quota.is_shadow_only();
        let found = shard
            .table::<E>(quota.layout(), shadow_only)
            .and_then(|table| table.find_mut(hash, key));
        let Some(entry) = found else {
            return self.insert_new::<E, R, SETTLING>(shard, quota, key, hash, now, change);
        };
        let before = (entry.fresh_at(), entry.enforced_at());
        if SETTLING {
            entry.read_fresh_to_settle(quota, now.as_micros());
        }
        let result = change(entry.state_mut(), now);
        entry.refresh(quota);
        if SETTLING {
            entry.keep_expiry(before);
        }
        // A refund can bring the key's expiry forward (rarely: the bounds are
        // read first, so decisions write no shared line).
        let droppable = droppable_at(entry, shadow_only);
        if droppable < shard.next_expiry {
            shard.next_expiry = droppable;
        }
        if droppable < self.inner.next_expiry.load(Ordering::Relaxed) {
            self.inner
                .next_expiry
                .fetch_min(droppable, Ordering::Relaxed);
        }
        Ok(result)
    }

    /// The first decision of a key, off the hot path: `change` on a fresh
    /// state, which is stored only if it is no longer fresh, making room
    /// under the global cap first.
    #[cold]
    #[inline(never)]
    fn insert_new<'a, E: Entry, R, const SETTLING: bool>(
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
        let entry = E::new(quota, StoredKey::new(key), state);
        let now = now.as_micros();
        if entry.fresh_at() > now {
            let full = |store: &Self| {
                let next = store.inner.next_expiry.load(Ordering::Relaxed);
                let retry_after = Duration::from_micros(next.saturating_sub(now));
                Err(StoreError::Full { retry_after })
            };
            let shadow_only = quota.is_shadow_only();
            if !self.reserve() {
                // A quota that only watches takes no room from a full store
                // (nor sweeps it): its key is decided from fresh, unrecorded.
                if shadow_only {
                    return Ok(result);
                }
                // Full: drop what a full store may, here first, then everywhere.
                let swept = if now >= shard.next_expiry {
                    shard.sweep(now, &self.inner.hasher, Sweep::Full)
                } else {
                    0
                };
                self.inner.len.fetch_sub(swept, Ordering::Relaxed);
                if !self.reserve() {
                    drop(shard);
                    if now >= self.inner.next_expiry.load(Ordering::Relaxed) {
                        self.sweep_at(now, Sweep::Full);
                    }
                    if !self.reserve() {
                        return full(self);
                    }
                    shard = self.shard(hash).lock();
                }
            }
            let droppable = droppable_at(&entry, shadow_only);
            shard.next_expiry = shard.next_expiry.min(droppable);
            if droppable < self.inner.next_expiry.load(Ordering::Relaxed) {
                self.inner
                    .next_expiry
                    .fetch_min(droppable, Ordering::Relaxed);
            }
            let layout = quota.layout();
            let table = shard.table_or_new::<E>(layout, shadow_only);
            // Another thread may have inserted the key while the lock was dropped.
            if table.find_mut(hash, key).is_some() || !table.has_room() {
                self.inner.len.fetch_sub(1, Ordering::Relaxed);
                if !table.has_room() {
                    return full(self);
                }
                drop(shard);
                return self.update_as::<E, R, SETTLING>(quota, key, change);
            }
            let hasher = &self.inner.hasher;
            table.insert(hash, entry, |e| key_hash(hasher, layout, e.key().bytes()));
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

    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        &self.inner.shards[self.shard_index(hash)].0
    }

    /// Every bit of the hash, remixed so the shard is independent of the
    /// bits the table uses, picks among any number of shards.
    #[inline]
    pub(super) fn shard_index(&self, hash: u64) -> usize {
        let mixed = u128::from(hash.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        ((mixed * self.inner.shards.len() as u128) >> 64) as usize
    }
}

/// A state of `algorithm` that is equivalent to fresh, read as fresh, as
/// [`read_fresh`] does for a [`State`].
#[inline]
pub(super) fn read_fresh_lone<M: Machine>(algorithm: &M, state: &mut M::State, now: u64) {
    if algorithm.fresh_at(state) <= now {
        *state = M::State::default();
    }
}

pub(super) fn states_match(quota: &Quota, states: &[State]) -> bool {
    states.len() == quota.policies().len()
        && quota
            .policies()
            .iter()
            .zip(states)
            .all(|(p, s)| p.algorithm().owns(s))
}

/// One policy's state that is equivalent to fresh, read as fresh: the Redis
/// store keeps each policy in a key of its own and deletes it once fresh,
/// so a state is read alike by both stores whatever numbers wrote it.
#[inline]
pub(super) fn read_fresh(algorithm: &Algorithm, state: &mut State, now: Timestamp) {
    if algorithm.fresh_at(state) <= now {
        *state = algorithm.fresh_state();
    }
}

/// [`read_fresh`] before a settle, of the states whose freshness depends on
/// no numbers (a fixed window's end, a bucket's TAT). A log's or a weighted
/// window's depends on the window, and the settling quota's may be older
/// than the one that decided the state since: such a state is read as
/// fresh only with its whole key too ([`Entry::read_fresh_to_settle`]).
#[inline]
pub(super) fn read_fresh_to_settle(algorithm: &Algorithm, state: &mut State, now: Timestamp) {
    if matches!(
        algorithm,
        Algorithm::FixedWindow(_) | Algorithm::TokenBucket(_)
    ) {
        read_fresh(algorithm, state, now);
    }
}

/// Checks every policy, then records in all that admitted if no enforcing
/// policy refused: the one place this rule is written. One critical section:
/// the caller holds the shard lock.
#[inline]
pub(super) fn decide(
    quota: &Quota,
    states: &mut [State],
    now: Timestamp,
    cost: u64,
) -> QuotaDecision {
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
    let policies = quota.policies().iter().zip(states.iter_mut());
    if admitted {
        for ((policy, state), d) in policies.zip(&decisions) {
            holds.0.push(if d.admitted {
                policy.algorithm().record(state, now, cost)
            } else {
                Hold::default()
            });
        }
    } else {
        // Nothing recorded: a policy that would have admitted reports its
        // state as it stands, as a check of nothing finds it.
        for ((policy, state), d) in policies.zip(&mut decisions) {
            if d.admitted {
                *d = policy.algorithm().check(state, now, 0);
            }
        }
    }
    QuotaDecision {
        admitted,
        decisions,
        holds,
    }
}
