mod key;
mod table;

use ahash::RandomState;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use self::key::StoredKey;
use self::table::{Keyed, Table};
use crate::clock::{Clock, SystemClock, Timestamp};
use crate::quota::algorithm::{
    Algorithm, FixedWindow, Hold, Machine, SlidingLog, SlidingWindow, State, TokenBucket,
    TokenBucketState,
};
use crate::quota::store::{Store, StoreError};
use crate::quota::{Decision, Decisions, Holds, Quota, QuotaDecision};
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
///   a full bucket) under the numbers that last decided it is ever dropped,
///   so under unchanged numbers dropping inflates no quota. A key dropped
///   before a redeploy to a longer window starts fresh under it, as its
///   Redis key, expired by then, would. Refusals create no state at all.
/// - **A changed quota shape starts fresh.** A key's state is kept under
///   the quota's name and its policies' algorithm kinds, in order. New
///   numbers keep it (each algorithm converts its state); a policy added,
///   removed or of another kind starts every key of the quota fresh, where
///   the Redis store keeps each policy's state by its position and kind. A
///   process that swaps such a quota in on a running store (a configuration
///   reload) so gives each key up to one more limit of the new quota.
/// - **Shadow policies never keep a key's room.** A full store also drops a
///   key whose enforcing policies' states are fresh, its shadow policies'
///   state with it (they start fresh), and a quota of shadow policies only
///   takes no room from a full store: its new keys are decided from fresh
///   and not recorded. So a shadow policy never turns an enforcing
///   quota's new key into [`StoreError::Full`].
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
/// - **Memory per key.** Each quota has a table per shard: its slots packed
///   in a vector, found through a hash index of 5 bytes a bucket. A key of
///   up to 22 bytes is kept inline; a longer one shares the caller's
///   `Arc<str>`. A slot is 48 bytes for a quota of one token bucket (plus a
///   32-byte box while the state has a fraction of a µs, a refund's offset
///   or more than 2^32 µs between its TAT and its last write), 64 for one
///   fixed window, 72 for one weighted window, 112 for one sliding log, and
///   208 for any other quota of up to two policies. A sliding log keeps
///   one entry inline and more in a buffer of 8 bytes an entry (16 when
///   its entries span 2^32 µs or 2^32 of cost).
///   `examples/memory_per_key.rs` measures it.
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
    /// No key anywhere can be dropped before this time, even by a full
    /// store (a lower bound).
    next_expiry: AtomicU64,
    shards: Box<[Padded<Mutex<Shard>>]>,
}

/// [`MemoryStore::update_as`] for a decision.
const DECIDE: bool = false;
/// [`MemoryStore::update_as`] for a settle.
const SETTLE: bool = true;

/// A key hashed as its bytes in one write.
struct KeyBytes<'a>(&'a [u8]);

impl std::hash::Hash for KeyBytes<'_> {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write(self.0);
    }
}

/// The store's keyed hash of a key's bytes, mixed with the quota
/// [layout](Quota::layout) hash: one hasher pass per decision. The hash is
/// aHash under random keys drawn for each store, so a client cannot choose
/// keys that collide in its tables.
#[inline]
fn key_hash(hasher: &RandomState, layout: u64, key: &[u8]) -> u64 {
    hasher.hash_one(KeyBytes(key)) ^ layout
}

/// Keeps each shard on its own cache lines, so threads working on
/// different shards do not contend.
#[derive(Debug)]
#[repr(align(128))]
struct Padded<T>(T);

#[derive(Debug, Default)]
struct Shard {
    /// The keys of each quota layout met in this shard, one table each;
    /// the first inline, on the lock's cache lines.
    tables: smallvec::SmallVec<[Tables; 1]>,
    /// No key can be dropped before this time, even by a full store: a
    /// lower bound of every key's [`droppable_at`].
    next_expiry: u64,
}

/// A shard's keys of one quota layout, in the slot type of the quota's
/// shape: a layout hash fixes the policies' algorithm kinds.
#[derive(Debug)]
struct Tables {
    layout: u64,
    /// Every policy of the quota that last decided here is a shadow: the
    /// keys hold no state that refuses, and a full store may drop them.
    shadow_only: bool,
    kind: Kind,
}

/// What a sweep drops.
#[derive(Debug, Clone, Copy)]
enum Sweep {
    /// Keys whose every state is equivalent to fresh: losing them loses
    /// nothing.
    Fresh,
    /// Also, for a full store, keys whose enforcing states are: a shadow
    /// policy's state is dropped with them and starts fresh.
    Full,
}

#[derive(Debug)]
enum Kind {
    /// One token bucket, the most common quota: 48-byte slots.
    Bucket(Table<BucketSlot>),
    /// One policy of another algorithm: the state alone beside the key.
    FixedWindow(Table<Lone<FixedWindow>>),
    SlidingWindow(Table<Lone<SlidingWindow>>),
    SlidingLog(Table<Lone<SlidingLog>>),
    /// Any other quota.
    General(Table<Slot>),
}

/// Applies `$body` to the table, whatever its slot type.
macro_rules! each_table {
    ($kind:expr, |$t:ident| $body:expr) => {
        match $kind {
            Kind::Bucket($t) => $body,
            Kind::FixedWindow($t) => $body,
            Kind::SlidingWindow($t) => $body,
            Kind::SlidingLog($t) => $body,
            Kind::General($t) => $body,
        }
    };
}

/// A key's states, one per policy, inline for up to two policies so a
/// decision touches no memory beyond its slot.
type States = smallvec::SmallVec<[State; 2]>;

#[derive(Debug)]
struct Slot {
    key: StoredKey,
    states: States,
    /// From this time every state is equivalent to fresh.
    fresh_at: u64,
    /// From this time every enforcing policy's state is.
    enforced_at: u64,
}

/// The slot of a quota of one policy other than a token bucket.
#[derive(Debug)]
struct Lone<M: Machine> {
    key: StoredKey,
    state: M::State,
    /// From this time the state is equivalent to fresh.
    fresh_at: u64,
}

/// The slot of a quota of one token bucket: its TAT is also the time from
/// which it is equivalent to fresh (a full bucket).
#[derive(Debug)]
struct BucketSlot {
    key: StoredKey,
    state: Bucket,
}

/// A bucket's state in 24 bytes when its TAT is whole µs with no offset
/// (every state of a whole-µs rate without refunds), else boxed.
#[derive(Debug)]
enum Bucket {
    /// The TAT `at` (whole µs, no offset), last written at `at - lag`, in
    /// the life that began at `born`; or, when `lag` is
    /// [`FRESH`](Bucket::FRESH), a TAT of 0 last written at `at`.
    Whole {
        lag: u32,
        at: u64,
        born: u64,
    },
    Full(Box<TokenBucketState>),
}

impl Default for Bucket {
    fn default() -> Self {
        Bucket::Whole {
            lag: 0,
            at: 0,
            born: 0,
        }
    }
}

impl Bucket {
    const FRESH: u32 = u32::MAX;

    #[inline]
    fn get(&self) -> TokenBucketState {
        match *self {
            Bucket::Whole {
                lag: Self::FRESH,
                at,
                ..
            } => TokenBucketState::from_whole(0, at, 0),
            Bucket::Whole { lag, at, born } => {
                TokenBucketState::from_whole(at, at - u64::from(lag), born)
            }
            Bucket::Full(ref state) => (**state).clone(),
        }
    }

    /// The TAT and last write of a whole state.
    #[inline]
    fn whole(lag: u32, at: u64) -> (u64, u64) {
        if lag == Self::FRESH {
            (0, at)
        } else {
            (at, at - u64::from(lag))
        }
    }

    /// A decision of `bucket` at `now`, as `read_fresh` then `step_in_place`
    /// make it on the state this holds.
    #[inline]
    fn step(&mut self, bucket: &TokenBucket, now: u64, cost: u64) -> (Decision, Hold) {
        if let Bucket::Whole { lag, at, born } = *self {
            let (mut tat, mut last) = Self::whole(lag, at);
            let mut born = born;
            if let Some(step) = bucket.step_whole(&mut tat, &mut last, &mut born, now, cost) {
                self.set_whole(tat, last, born);
                return step;
            }
        }
        let mut state = self.get();
        state.read_fresh(now);
        let step = bucket.step_in_place(&mut state, now, cost);
        self.set(state);
        step
    }

    #[inline]
    fn set(&mut self, state: TokenBucketState) {
        match state.whole() {
            Some((tat, last, born)) => self.set_whole(tat, last, born),
            None => self.set_full(state),
        }
    }

    /// Holds the whole-µs state of TAT `tat` and last write `last` in the
    /// life that began at `born`.
    #[inline]
    fn set_whole(&mut self, tat: u64, last: u64, born: u64) {
        // A TAT before `last` wraps to a lag too large to keep.
        let lag = tat.wrapping_sub(last);
        if lag < u64::from(Self::FRESH) {
            *self = Bucket::Whole {
                lag: lag as u32,
                at: tat,
                born,
            };
        } else if tat == 0 {
            *self = Bucket::Whole {
                lag: Self::FRESH,
                at: last,
                born: 0,
            };
        } else {
            self.set_full(TokenBucketState::from_whole(tat, last, born));
        }
    }

    #[cold]
    #[inline(never)]
    fn set_full(&mut self, state: TokenBucketState) {
        match self {
            Bucket::Full(boxed) => **boxed = state,
            this => *this = Bucket::Full(Box::new(state)),
        }
    }

    #[inline]
    fn fresh_at(&self) -> u64 {
        match *self {
            Bucket::Whole {
                lag: Self::FRESH, ..
            } => 0,
            Bucket::Whole { at, .. } => at,
            Bucket::Full(ref state) => state.fresh_at(),
        }
    }
}

/// One key of one quota in one of a shard's tables.
trait Entry: Keyed + Sized {
    /// What a decision changes.
    type State;
    /// The table of this slot type, if `kind` is one.
    fn table(kind: &mut Kind) -> Option<&mut Table<Self>>;
    /// An empty table of this slot type.
    fn new_table() -> Kind;
    fn new(quota: &Quota, key: StoredKey, state: Self::State) -> Self;
    fn fresh_state(quota: &Quota) -> Self::State;
    fn state_mut(&mut self) -> &mut Self::State;
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
fn kept(before: u64, after: u64) -> u64 {
    if after == 0 {
        0
    } else {
        after.max(before)
    }
}

/// When a full store may drop `entry`, of a table whose quota is
/// `shadow_only` or not: shadow policies never keep a key's room.
#[inline]
fn droppable_at<E: Entry>(entry: &E, shadow_only: bool) -> u64 {
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
trait LoneKind: Machine + Sized {
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
fn lone<M: Machine>(quota: &Quota) -> Option<&M> {
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

    /// The synchronous decision behind [`Store::decide`].
    #[inline]
    pub(crate) fn decide_now(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> Result<QuotaDecision, StoreError> {
        // The most common quota first, on a path of its own.
        if let Some((bucket, shadow)) = lone_bucket(quota) {
            // The decision is made into the answer after the lock: a
            // smaller value moves out of the critical section.
            let step = self.update::<BucketSlot, _>(quota, key, |slot, now| {
                slot.step(bucket, now.as_micros(), cost)
            });
            return step.map(|(decision, hold)| {
                let hold = decision.admitted.then_some(hold);
                QuotaDecision::single(decision, shadow, hold)
            });
        }
        self.decide_other(quota, key, cost)
    }

    /// [`decide_now`](Self::decide_now) for any quota but one token bucket.
    #[inline]
    fn decide_other(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> Result<QuotaDecision, StoreError> {
        let [policy] = quota.policies() else {
            return self
                .update::<Slot, _>(quota, key, |states, now| decide(quota, states, now, cost));
        };
        let shadow = policy.is_shadow();
        match policy.algorithm() {
            Algorithm::FixedWindow(window) => self.decide_lone(quota, window, shadow, key, cost),
            Algorithm::SlidingWindow(window) => self.decide_lone(quota, window, shadow, key, cost),
            Algorithm::SlidingLog(log) => self.decide_lone(quota, log, shadow, key, cost),
            // Taken by `decide_now` before it comes here.
            Algorithm::TokenBucket(_) => self.decide_now(quota, key, cost),
        }
    }

    /// A decision of a quota of the one policy `algorithm`, as [`decide`]
    /// makes it for one policy.
    #[inline]
    fn decide_lone<M: LoneKind>(
        &self,
        quota: &Quota,
        algorithm: &M,
        shadow: bool,
        key: &Arc<str>,
        cost: u64,
    ) -> Result<QuotaDecision, StoreError> {
        let step = self.update::<Lone<M>, _>(quota, key, |state, now| {
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
        let now = self.inner.clock.now();
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
    fn shard_index(&self, hash: u64) -> usize {
        let mixed = u128::from(hash.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        ((mixed * self.inner.shards.len() as u128) >> 64) as usize
    }
}

impl Shard {
    /// The table of `layout` in slot type `E`, if this shard has one,
    /// noting whether its quota is now `shadow_only`.
    #[inline]
    fn table<E: Entry>(&mut self, layout: u64, shadow_only: bool) -> Option<&mut Table<E>> {
        self.tables.iter_mut().find_map(|t| {
            if t.layout != layout {
                return None;
            }
            if t.shadow_only != shadow_only {
                t.shadow_only = shadow_only;
            }
            E::table(&mut t.kind)
        })
    }

    fn table_or_new<E: Entry>(&mut self, layout: u64, shadow_only: bool) -> &mut Table<E> {
        let at = self
            .tables
            .iter_mut()
            .position(|t| t.layout == layout && E::table(&mut t.kind).is_some());
        let at = at.unwrap_or_else(|| {
            self.tables.push(Tables {
                layout,
                shadow_only,
                kind: E::new_table(),
            });
            self.tables.len() - 1
        });
        let tables = &mut self.tables[at];
        tables.shadow_only = shadow_only;
        let table = E::table(&mut tables.kind);
        table.expect("the table of this layout and slot type")
    }

    /// Drops the keys that `sweep` may drop at `now`; returns how many.
    fn sweep(&mut self, now: u64, hasher: &RandomState, sweep: Sweep) -> usize {
        fn retain_live<E: Entry>(
            table: &mut Table<E>,
            (layout, shadow_only): (u64, bool),
            now: u64,
            sweep: Sweep,
            next: &mut u64,
            hasher: &RandomState,
        ) -> usize {
            table.retain(
                |e| {
                    let droppable = droppable_at(e, shadow_only);
                    let live = match sweep {
                        Sweep::Fresh => e.fresh_at() > now,
                        Sweep::Full => droppable > now,
                    };
                    if live {
                        *next = (*next).min(droppable);
                    }
                    live
                },
                |e| key_hash(hasher, layout, e.key().bytes()),
            )
        }
        let mut next = u64::MAX;
        let mut swept = 0;
        for t in &mut self.tables {
            let table = (t.layout, t.shadow_only);
            swept += each_table!(&mut t.kind, |kind| retain_live(
                kind, table, now, sweep, &mut next, hasher
            ));
        }
        self.next_expiry = next;
        swept
    }
}

/// A state of `algorithm` that is equivalent to fresh, read as fresh, as
/// [`read_fresh`] does for a [`State`].
#[inline]
fn read_fresh_lone<M: Machine>(algorithm: &M, state: &mut M::State, now: u64) {
    if algorithm.fresh_at(state) <= now {
        *state = M::State::default();
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

/// One policy's state that is equivalent to fresh, read as fresh: the Redis
/// store keeps each policy in a key of its own and deletes it once fresh,
/// so a state is read alike by both stores whatever numbers wrote it.
#[inline]
fn read_fresh(algorithm: &Algorithm, state: &mut State, now: Timestamp) {
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
fn read_fresh_to_settle(algorithm: &Algorithm, state: &mut State, now: Timestamp) {
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
        // The bucket slot: the key, then a whole-µs TAT, its lag and life.
        assert_eq!(std::mem::size_of::<BucketSlot>(), 48);
        assert_eq!(std::mem::size_of::<Lone<FixedWindow>>(), 64);
        assert_eq!(std::mem::size_of::<Lone<SlidingWindow>>(), 72);
        assert_eq!(std::mem::size_of::<Lone<SlidingLog>>(), 112);
        // Two states inline, the largest being a sliding log's.
        assert_eq!(std::mem::size_of::<Slot>(), 208);
        // A shard's lock and its first table share its two cache lines.
        assert_eq!(std::mem::size_of::<Padded<Mutex<Shard>>>(), 128);
    }

    proptest::proptest! {
        /// Every state a bucket reaches (clock set back, long intervals,
        /// fractional rates, refunds, states read as fresh) is kept exactly,
        /// inline or boxed, and a slot decides as the state it holds.
        #[test]
        fn a_bucket_slot_keeps_every_state(
            capacity in 1u64..40,
            refill in 1u64..8,
            period in proptest::prop_oneof![1u64..3_000_000, 1u64 << 32..1u64 << 40],
            steps in proptest::collection::vec((0u8..4, 0u64..5_000_000, 0u64..6, -4i64..3), 1..80),
        ) {
            let bucket = TokenBucket::new(capacity, refill, period).unwrap();
            let mut state = TokenBucketState::default();
            let mut slot = Bucket::default();
            let mut now = 1_800_000_000_000_000u64;
            for (kind, step, cost, delta) in steps {
                now = if kind == 0 { now - step } else { now + step };
                state.read_fresh(now);
                let (decision, hold) = bucket.step_in_place(&mut state, now, cost);
                proptest::prop_assert_eq!(slot.step(&bucket, now, cost), (decision.clone(), hold));
                proptest::prop_assert_eq!(slot.get(), state.clone());
                if decision.admitted && delta != 0 {
                    bucket.settle(&mut state, now, hold, delta);
                }
                slot.set(state.clone());
                proptest::prop_assert_eq!(slot.get(), state.clone());
                proptest::prop_assert_eq!(slot.fresh_at(), state.fresh_at());
            }
        }
    }

    /// Each store draws its own hash keys: which keys collide in one store
    /// says nothing of another, and cannot be worked out from the key bytes.
    #[test]
    fn each_store_hashes_keys_under_keys_of_its_own() {
        let (a, b) = (MemoryStore::new(), MemoryStore::new());
        let same = (0..64u32)
            .filter(|i| {
                let key = format!("key-{i}");
                key_hash(&a.inner.hasher, 0, key.as_bytes())
                    == key_hash(&b.inner.hasher, 0, key.as_bytes())
            })
            .count();
        assert_eq!(same, 0);
    }

    /// One key slot per shard in the sweep race tests below.
    const SHARDS: usize = 64;

    /// The sweep race tests' start time, a quota of a 1 s window and one of
    /// a 60 s window, and a store config of [`SHARDS`] keys in as many
    /// shards.
    fn sweep_race() -> (Timestamp, Quota, Quota, MemoryConfig) {
        let window = |name: &str, secs| {
            let policy = crate::quota::Policy::fixed_window(name, 10, Duration::from_secs(secs));
            Quota::new(name, [policy.unwrap()]).unwrap()
        };
        let config = MemoryConfig::new(NonZeroUsize::new(SHARDS).unwrap())
            .shards(NonZeroUsize::new(SHARDS).unwrap())
            .unwrap();
        (
            Timestamp::from_secs(1_800_000_000),
            window("second", 1),
            window("minute", 60),
            config,
        )
    }

    /// Takes every key slot of `store` but one under `quota`.
    fn fill_all_but_one(store: &MemoryStore<crate::clock::ManualClock>, quota: &Quota) {
        for i in 0..SHARDS - 1 {
            let key: Arc<str> = format!("filler-{i}").into();
            assert!(store.decide_now(quota, &key, 1).unwrap().admitted);
        }
    }

    /// The first key, by number, that `quota` puts in the first shard
    /// (`first`) or in another.
    fn key_in(
        store: &MemoryStore<crate::clock::ManualClock>,
        quota: &Quota,
        first: bool,
    ) -> Arc<str> {
        (0..)
            .map(|i| Arc::<str>::from(format!("key-{i}")))
            .find(|key| {
                let hash = key_hash(&store.inner.hasher, quota.layout(), key.as_bytes());
                (store.shard_index(hash) == 0) == first
            })
            .unwrap()
    }

    /// A sweep of every shard races a key's first decision in the shard it
    /// swept first, two threads meeting at a barrier; 20,000 rounds on a
    /// store full but for that key. Once the key is fresh again, a new key
    /// elsewhere gets its room: the sweep never lifts the bound on the
    /// earliest expiry above the key it did not see, which would skip the
    /// sweep that drops it and answer `Full` until a minute has passed.
    #[test]
    fn a_key_added_while_a_sweep_runs_keeps_the_earliest_expiry_bound() {
        use crate::clock::ManualClock;
        use std::sync::Barrier;

        /// The store of a round and its racing key.
        type Round = (MemoryStore<ManualClock>, Arc<str>);

        const ROUNDS: usize = 20_000;
        let (start, second, minute, config) = sweep_race();
        let slot: Arc<Mutex<Option<Round>>> = Arc::default();
        let barrier = Arc::new(Barrier::new(3));
        let threads: Vec<_> = [false, true]
            .into_iter()
            .map(|sweeps| {
                let (slot, barrier, second) = (slot.clone(), barrier.clone(), second.clone());
                std::thread::spawn(move || {
                    for _ in 0..ROUNDS {
                        barrier.wait();
                        let (store, key) = slot.lock().clone().unwrap();
                        if sweeps {
                            store.sweep();
                        } else {
                            assert!(store.decide_now(&second, &key, 1).unwrap().admitted);
                        }
                        barrier.wait();
                    }
                })
            })
            .collect();
        let mut refused = 0;
        for _ in 0..ROUNDS {
            let clock = ManualClock::new(start);
            let store = MemoryStore::with_config(config, clock.clone());
            // Every room but one, taken for a minute.
            fill_all_but_one(&store, &minute);
            store.sweep();
            // The racing key in the first shard swept, the new one elsewhere.
            let racing = key_in(&store, &second, true);
            let new = key_in(&store, &minute, false);
            *slot.lock() = Some((store.clone(), racing));
            barrier.wait();
            barrier.wait();
            clock.advance(Duration::from_secs(2));
            refused += usize::from(store.decide_now(&minute, &new, 1).is_err());
        }
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(refused, 0, "of {ROUNDS} rounds");
    }

    /// A sweep of every shard races a new key's first decision on a store
    /// full of live keys but for one fresh key in the first shard swept, two
    /// threads meeting at a barrier; 20,000 rounds. The new key always gets
    /// the fresh key's room: when its own sweep finds that key already
    /// dropped, the room is already counted free, not only once the other
    /// sweep has passed every shard.
    #[test]
    fn a_key_decided_while_a_sweep_runs_gets_the_room_it_frees() {
        use crate::clock::ManualClock;
        use std::sync::Barrier;

        const ROUNDS: usize = 20_000;
        let (start, second, minute, config) = sweep_race();
        let slot: Arc<Mutex<Option<MemoryStore<ManualClock>>>> = Arc::default();
        let barrier = Arc::new(Barrier::new(3));
        let sweeper = {
            let (slot, barrier) = (slot.clone(), barrier.clone());
            std::thread::spawn(move || {
                for _ in 0..ROUNDS {
                    barrier.wait();
                    let store = slot.lock().clone().unwrap();
                    store.sweep();
                    barrier.wait();
                }
            })
        };
        let decider = {
            let (slot, barrier, minute) = (slot.clone(), barrier.clone(), minute.clone());
            std::thread::spawn(move || {
                let mut refused = 0;
                for _ in 0..ROUNDS {
                    barrier.wait();
                    let store = slot.lock().clone().unwrap();
                    let new = key_in(&store, &minute, false);
                    refused += usize::from(store.decide_now(&minute, &new, 1).is_err());
                    barrier.wait();
                }
                refused
            })
        };
        for _ in 0..ROUNDS {
            let clock = ManualClock::new(start);
            let store = MemoryStore::with_config(config, clock.clone());
            // Every room but one taken for a minute, the last for a second.
            fill_all_but_one(&store, &minute);
            let fresh_soon = key_in(&store, &second, true);
            assert!(store.decide_now(&second, &fresh_soon, 1).unwrap().admitted);
            store.sweep();
            clock.advance(Duration::from_secs(2));
            *slot.lock() = Some(store);
            barrier.wait();
            barrier.wait();
        }
        sweeper.join().unwrap();
        assert_eq!(decider.join().unwrap(), 0, "of {ROUNDS} rounds");
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
            let hash = key_hash(&store.inner.hasher, 0, i.to_string().as_bytes());
            hit[store.shard_index(hash)] = true;
        }
        // 16 keys per shard on average: a shard misses with probability
        // e^-16, so about 0.03 of them do; a 16-bit index would miss 3/4.
        let missed = hit.iter().filter(|h| !**h).count();
        assert!(missed <= shards / 1000, "{missed} shards never chosen");
        assert!(hit[shards - 1] || hit[shards - 2]);
    }
}
