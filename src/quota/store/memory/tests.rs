use std::num::NonZeroUsize;

use super::bucket::Bucket;
use super::shard::key_hash;
use super::slots::{BucketSlot, Lone, Slot};
use super::*;
use crate::quota::algorithm::{
    FixedWindow, SlidingLog, SlidingWindow, TokenBucket, TokenBucketState,
};

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
/// a 60 s window.
fn sweep_race() -> (Duration, Quota, Quota) {
    let window = |name: &str, secs| {
        let policy = crate::quota::Policy::fixed_window(name, 10, Duration::from_secs(secs));
        Quota::new(name, [policy.unwrap()]).unwrap()
    };
    (
        Duration::from_secs(1_800_000_000),
        window("second", 1),
        window("minute", 60),
    )
}

/// A store of [`SHARDS`] keys in as many shards on `clock`.
fn race_store(clock: crate::clock::ManualClock) -> MemoryStore<crate::clock::ManualClock> {
    let shards = NonZeroUsize::new(SHARDS).unwrap();
    MemoryStore::with_clock(clock)
        .max_keys(shards)
        .shards(shards)
        .unwrap()
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
fn key_in(store: &MemoryStore<crate::clock::ManualClock>, quota: &Quota, first: bool) -> Arc<str> {
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
    let (start, second, minute) = sweep_race();
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
        let store = race_store(clock.clone());
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
    let (start, second, minute) = sweep_race();
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
        let store = race_store(clock.clone());
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
    let store = MemoryStore::new()
        .max_keys(NonZeroUsize::new(shards).unwrap())
        .shards(NonZeroUsize::new(shards).unwrap())
        .unwrap();
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

/// A peek takes no room: a full store still answers it, for a held key and
/// for one it has never seen, and holds the same keys afterwards.
#[test]
fn a_peek_adds_no_key_even_when_full() {
    use crate::clock::ManualClock;
    use crate::quota::{Policy, Quota};
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock).max_keys(NonZeroUsize::MIN);
    let minute = std::time::Duration::from_secs(60);
    let quota = Quota::new("q", [Policy::sliding_log("sl", 2, minute).unwrap()]).unwrap();
    let held: Arc<str> = "held".into();
    assert!(store.decide_now(&quota, &held, 1).unwrap().admitted);
    assert_eq!(store.len(), 1);
    let unseen: Arc<str> = "unseen".into();
    assert_eq!(
        store.decide_now(&quota, &unseen, 1),
        Err(StoreError::Full {
            retry_after: minute
        })
    );
    let peeked = store.peek_now(&quota, &unseen, 2).unwrap();
    assert!(peeked.admitted);
    assert_eq!(peeked.decisions[0].remaining, 0);
    let peeked = store.peek_now(&quota, &held, 2).unwrap();
    assert!(!peeked.admitted);
    assert_eq!(peeked.decisions[0].remaining, 1);
    assert_eq!(store.len(), 1);
    assert!(store.decide_now(&quota, &held, 1).unwrap().admitted);
    assert!(!store.decide_now(&quota, &held, 1).unwrap().admitted);
}

#[test]
fn a_shard_count_that_is_not_a_power_of_two_or_exceeds_max_keys_is_refused() {
    let n = |n| NonZeroUsize::new(n).unwrap();
    let store = MemoryStore::new().max_keys(n(1024)).shards(n(16)).unwrap();
    assert_eq!(store.capacity(), 1024);
    for (max_keys, shards) in [(8, 16), (1024, 12)] {
        let error = MemoryStore::new()
            .max_keys(n(max_keys))
            .shards(n(shards))
            .unwrap_err();
        assert_eq!(error.field(), "shards");
    }
}
