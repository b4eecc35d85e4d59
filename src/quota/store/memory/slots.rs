//! The slot types a table holds, one per quota shape, and what a decision
//! asks of each ([`Entry`]).

use super::bucket::Bucket;
use super::decide::{read_fresh, states_match};
use super::key::StoredKey;
use super::table::{Keyed, Table};
use crate::clock::Timestamp;
use crate::quota::algorithm::{
    Algorithm, FixedWindow, Machine, SlidingLog, SlidingWindow, State, TokenBucket,
};
use crate::quota::Quota;

#[derive(Debug)]
pub(super) enum Kind {
    /// One token bucket, the most common quota: 48-byte slots.
    Bucket(Table<BucketSlot>),
    /// One policy of another algorithm: the state alone beside the key.
    FixedWindow(Table<Lone<FixedWindow>>),
    SlidingWindow(Table<Lone<SlidingWindow>>),
    SlidingLog(Table<Lone<SlidingLog>>),
    /// Any other quota.
    General(Table<Slot>),
}

/// A key's states, one per policy, inline for up to two policies so a
/// decision touches no memory beyond its slot.
pub(super) type States = smallvec::SmallVec<[State; 2]>;

#[derive(Debug)]
pub(super) struct Slot {
    key: StoredKey,
    states: States,
    /// From this time every state is equivalent to fresh.
    fresh_at: u64,
    /// From this time every enforcing policy's state is.
    enforced_at: u64,
}

/// The slot of a quota of one policy other than a token bucket.
#[derive(Debug)]
pub(super) struct Lone<M: Machine> {
    key: StoredKey,
    state: M::State,
    /// From this time the state is equivalent to fresh.
    fresh_at: u64,
}

/// The slot of a quota of one token bucket: its TAT is also the time from
/// which it is equivalent to fresh (a full bucket).
#[derive(Debug)]
pub(super) struct BucketSlot {
    key: StoredKey,
    state: Bucket,
}

/// One key of one quota in one of a shard's tables.
pub(super) trait Entry: Keyed + Sized {
    /// What a decision changes.
    type State: Clone;
    /// The table of this slot type, if `kind` is one.
    fn table(kind: &mut Kind) -> Option<&mut Table<Self>>;
    /// An empty table of this slot type.
    fn new_table() -> Kind;
    fn new(quota: &Quota, key: StoredKey, state: Self::State) -> Self;
    fn fresh_state(quota: &Quota) -> Self::State;
    fn state_mut(&mut self) -> &mut Self::State;
    /// A copy of the state, for a decision that records nothing.
    fn state_copy(&self) -> Self::State;
    /// Keeps [`fresh_at`](Entry::fresh_at) up to date after a change.
    fn refresh(&mut self, quota: &Quota);
    fn fresh_at(&self) -> u64;
    /// From this time the enforcing policies' states are equivalent to
    /// fresh: a full store may drop the key then, whatever its shadow
    /// policies still hold. A quota of one policy: see [`droppable_at`].
    fn enforced_at(&self) -> u64 {
        self.fresh_at()
    }
    /// Before a settle: each state read as fresh if the whole key is, as a
    /// sweep would find it, and the state is fresh under the settling
    /// quota's numbers too. Not under those numbers alone: a charge made
    /// before a redeploy settles under the old numbers, and a state live
    /// under the new ones may look fresh under those. Not by the key alone:
    /// the Redis store keeps the key's expiry apart from its states, and one
    /// written before another instance changed them must drop nothing live.
    fn read_fresh_to_settle(&mut self, quota: &Quota, now: u64);
    /// After a settle, given the expiry before it (see
    /// [`fresh_at`](Entry::fresh_at), [`enforced_at`](Entry::enforced_at)):
    /// a settle never brings a live key's expiry forward. A refund leaves
    /// the expiry as it was under unchanged numbers (unless it leaves the
    /// state fresh), and the settling quota's numbers may be older than the
    /// state's.
    fn keep_expiry(&mut self, before: (u64, u64)) {
        let _ = before;
    }
}

/// The later of `before` and `after`, unless `after` is 0: fresh.
#[inline]
pub(super) fn kept(before: u64, after: u64) -> u64 {
    if after == 0 {
        0
    } else {
        after.max(before)
    }
}

/// When a full store may drop `entry`, of a table whose quota is
/// `shadow_only` or not: shadow policies never keep a key's room.
#[inline]
pub(super) fn droppable_at<E: Entry>(entry: &E, shadow_only: bool) -> u64 {
    if shadow_only {
        0
    } else {
        entry.enforced_at()
    }
}

impl Keyed for Slot {
    fn key(&self) -> &StoredKey {
        &self.key
    }
}

impl Entry for Slot {
    type State = States;

    fn table(kind: &mut Kind) -> Option<&mut Table<Self>> {
        match kind {
            Kind::General(table) => Some(table),
            _ => None,
        }
    }

    fn new_table() -> Kind {
        Kind::General(Table::default())
    }

    fn new(quota: &Quota, key: StoredKey, states: States) -> Self {
        let mut slot = Slot {
            key,
            states,
            fresh_at: 0,
            enforced_at: 0,
        };
        slot.refresh(quota);
        slot
    }

    fn fresh_state(quota: &Quota) -> States {
        quota
            .policies()
            .iter()
            .map(|p| p.algorithm().fresh_state())
            .collect()
    }

    fn state_mut(&mut self) -> &mut States {
        // Same layout: the states are the quota's policies' kinds, in order.
        &mut self.states
    }

    fn state_copy(&self) -> States {
        self.states.clone()
    }

    fn refresh(&mut self, quota: &Quota) {
        debug_assert!(states_match(quota, &self.states));
        (self.fresh_at, self.enforced_at) = (0, 0);
        for (p, s) in quota.policies().iter().zip(&self.states) {
            let at = p.algorithm().fresh_at(s).as_micros();
            self.fresh_at = self.fresh_at.max(at);
            if !p.is_shadow() {
                self.enforced_at = self.enforced_at.max(at);
            }
        }
    }

    fn fresh_at(&self) -> u64 {
        self.fresh_at
    }

    fn enforced_at(&self) -> u64 {
        self.enforced_at
    }

    fn read_fresh_to_settle(&mut self, quota: &Quota, now: u64) {
        if self.fresh_at <= now {
            for (policy, state) in quota.policies().iter().zip(self.states.iter_mut()) {
                read_fresh(policy.algorithm(), state, Timestamp(now));
            }
        }
    }

    fn keep_expiry(&mut self, (fresh_at, enforced_at): (u64, u64)) {
        self.fresh_at = kept(fresh_at, self.fresh_at);
        self.enforced_at = kept(enforced_at, self.enforced_at);
    }
}

/// The algorithms a [`Lone`] slot holds, each with its table.
pub(super) trait LoneKind: Machine + Sized {
    fn table(kind: &mut Kind) -> Option<&mut Table<Lone<Self>>>;
    fn new_table() -> Kind;
}

macro_rules! lone_kind {
    ($($alg:ident),*) => {$(
        impl LoneKind for $alg {
            #[inline]
            fn table(kind: &mut Kind) -> Option<&mut Table<Lone<Self>>> {
                match kind {
                    Kind::$alg(table) => Some(table),
                    _ => None,
                }
            }

            fn new_table() -> Kind {
                Kind::$alg(Table::default())
            }
        }
    )*};
}

lone_kind!(FixedWindow, SlidingWindow, SlidingLog);

/// The quota's one policy as an `M`: the quota of a [`Lone<M>`] slot.
#[inline]
pub(super) fn lone<M: Machine>(quota: &Quota) -> Option<&M> {
    match quota.policies() {
        [policy] => M::of(policy.algorithm()),
        _ => None,
    }
}

impl<M: Machine> Keyed for Lone<M> {
    fn key(&self) -> &StoredKey {
        &self.key
    }
}

impl<M: LoneKind> Entry for Lone<M> {
    type State = M::State;

    #[inline]
    fn table(kind: &mut Kind) -> Option<&mut Table<Self>> {
        M::table(kind)
    }

    fn new_table() -> Kind {
        M::new_table()
    }

    fn new(quota: &Quota, key: StoredKey, state: M::State) -> Self {
        let mut slot = Lone {
            key,
            state,
            fresh_at: 0,
        };
        slot.refresh(quota);
        slot
    }

    fn fresh_state(_: &Quota) -> M::State {
        M::State::default()
    }

    fn state_mut(&mut self) -> &mut M::State {
        &mut self.state
    }

    fn state_copy(&self) -> M::State {
        self.state.clone()
    }

    #[inline]
    fn refresh(&mut self, quota: &Quota) {
        if let Some(algorithm) = lone::<M>(quota) {
            self.fresh_at = algorithm.fresh_at(&self.state);
        }
    }

    fn fresh_at(&self) -> u64 {
        self.fresh_at
    }

    fn read_fresh_to_settle(&mut self, quota: &Quota, now: u64) {
        let fresh = lone::<M>(quota).is_some_and(|a| a.fresh_at(&self.state) <= now);
        if self.fresh_at <= now && fresh {
            self.state = M::State::default();
        }
    }

    fn keep_expiry(&mut self, (fresh_at, _): (u64, u64)) {
        self.fresh_at = kept(fresh_at, self.fresh_at);
    }
}

impl Keyed for BucketSlot {
    fn key(&self) -> &StoredKey {
        &self.key
    }
}

impl Entry for BucketSlot {
    type State = Bucket;

    #[inline]
    fn table(kind: &mut Kind) -> Option<&mut Table<Self>> {
        match kind {
            Kind::Bucket(table) => Some(table),
            _ => None,
        }
    }

    fn new_table() -> Kind {
        Kind::Bucket(Table::default())
    }

    fn new(_: &Quota, key: StoredKey, state: Bucket) -> Self {
        BucketSlot { key, state }
    }

    fn fresh_state(_: &Quota) -> Bucket {
        Bucket::default()
    }

    fn state_mut(&mut self) -> &mut Bucket {
        &mut self.state
    }

    fn state_copy(&self) -> Bucket {
        self.state.clone()
    }

    fn refresh(&mut self, _: &Quota) {}

    #[inline]
    fn fresh_at(&self) -> u64 {
        self.state.fresh_at()
    }

    /// The settle reads its state as fresh itself, keeping its last write;
    /// a bucket's freshness depends on no numbers.
    fn read_fresh_to_settle(&mut self, _: &Quota, _: u64) {}
}

/// The quota's token bucket and whether it only watches, when the quota is
/// exactly one token bucket.
#[inline]
pub(super) fn lone_bucket(quota: &Quota) -> Option<(&TokenBucket, bool)> {
    match quota.policies() {
        [policy] => match policy.algorithm() {
            Algorithm::TokenBucket(bucket) => Some((bucket, policy.is_shadow())),
            _ => None,
        },
        _ => None,
    }
}
