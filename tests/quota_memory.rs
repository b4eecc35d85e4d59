//! Memory store: exactness under concurrency and bounded memory under
//! hostile key cardinality.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tower_admission::clock::ManualClock;
use tower_admission::quota::{MemoryStore, Policy, Quota, Store, StoreError};

const MINUTE: Duration = Duration::from_secs(60);

fn quotas(limit: u64) -> Vec<Quota> {
    [
        Policy::fixed_window("fixed", limit, MINUTE),
        Policy::sliding_log("log", limit, MINUTE),
        Policy::token_bucket("bucket", limit, 1, MINUTE),
        Policy::sliding_window("weighted", limit, MINUTE),
    ]
    .into_iter()
    .map(|p| {
        let p = p.unwrap();
        let name = p.name().to_owned();
        Quota::new(&name, [p]).unwrap()
    })
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_concurrent_tasks_admit_exactly_the_limit() {
    // The clock stands still so no refill or window change can add capacity.
    let clock = ManualClock::new(Duration::from_secs(1_800_000_030));
    let store = MemoryStore::with_clock(clock);
    for quota in quotas(100) {
        let admitted = Arc::new(AtomicU64::new(0));
        let key: Arc<str> = "shared".into();
        let tasks: Vec<_> = (0..1000)
            .map(|_| {
                let (store, quota, key, admitted) =
                    (store.clone(), quota.clone(), key.clone(), admitted.clone());
                tokio::spawn(async move {
                    if store.decide(&quota, &key, 1).await.unwrap().admitted {
                        admitted.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(admitted.load(Ordering::SeqCst), 100, "{}", quota.name());
    }
}

#[test]
fn a_million_identities_stay_within_max_keys() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store =
        MemoryStore::with_clock(clock.clone()).max_keys(NonZeroUsize::new(100_000).unwrap());
    let quota = Quota::new(
        "free",
        [Policy::sliding_log("per-minute", 100, MINUTE).unwrap()],
    )
    .unwrap();
    let alice: Arc<str> = "alice".into();
    assert!(
        store
            .decide(&quota, &alice, 1)
            .into_inner()
            .unwrap()
            .admitted
    );

    let (mut admitted, mut full) = (0usize, 0usize);
    for i in 0..1_000_000u32 {
        let key: Arc<str> = format!("attacker-{i}").into();
        match store.decide(&quota, &key, 1).into_inner() {
            Ok(d) => {
                assert!(d.admitted);
                admitted += 1;
            }
            Err(StoreError::Full { retry_after }) => {
                // The earliest live key frees when its minute is over.
                assert_eq!(retry_after, MINUTE);
                full += 1;
            }
            Err(other) => panic!("unexpected {other}"),
        }
        if i % 50_000 == 0 {
            assert!(store.len() <= store.capacity());
        }
    }
    assert_eq!(store.capacity(), 100_000);
    // Every admitted key holds a slot; every other new key was refused as full.
    assert_eq!(store.len(), admitted + 1);
    assert_eq!(admitted + full, 1_000_000);
    // The cap is global and exact: alice plus 99,999 newcomers.
    assert_eq!(admitted, 99_999);

    // Known keys are unaffected by the flood: alice had 99 left, now 98.
    let d = store.decide(&quota, &alice, 1).into_inner().unwrap();
    assert_eq!(d.decisions[0].remaining, 98);

    // Once the window passes, every slot is equivalent to fresh and is reclaimed.
    clock.advance(MINUTE);
    assert_eq!(store.sweep(), admitted + 1);
    assert!(store.is_empty());
    let key: Arc<str> = "newcomer".into();
    assert!(store.decide(&quota, &key, 1).into_inner().unwrap().admitted);
}

#[test]
fn a_store_of_a_million_keys_holds_exactly_a_million_live_keys() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store =
        MemoryStore::with_clock(clock.clone()).max_keys(NonZeroUsize::new(1_000_000).unwrap());
    let quota = Quota::new("q", [Policy::token_bucket("b", 10, 1, MINUTE).unwrap()]).unwrap();
    for i in 0..1_000_000u32 {
        let key: Arc<str> = format!("key-{i}").into();
        let decision = store.decide(&quota, &key, 1).into_inner();
        assert!(decision.unwrap().admitted, "key {i} refused");
    }
    assert_eq!(store.len(), 1_000_000);
    let next: Arc<str> = "one-too-many".into();
    assert_eq!(
        store.decide(&quota, &next, 1).into_inner(),
        Err(StoreError::Full {
            retry_after: MINUTE
        })
    );
    // Known keys still decide.
    let first: Arc<str> = "key-0".into();
    assert!(
        store
            .decide(&quota, &first, 1)
            .into_inner()
            .unwrap()
            .admitted
    );
}

#[test]
fn a_refund_brings_the_key_expiry_forward() {
    // One key of a one-key store: after a full refund it is equivalent to
    // fresh at once, so a new key takes its place instead of waiting for the
    // charge's original expiry.
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock.clone()).max_keys(NonZeroUsize::new(1).unwrap());
    let quota = Quota::new("q", [Policy::sliding_log("l", 10, MINUTE).unwrap()]).unwrap();
    let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
    let charge = store.decide(&quota, &a, 5).into_inner().unwrap();
    assert_eq!(
        store.decide(&quota, &b, 1).into_inner(),
        Err(StoreError::Full {
            retry_after: MINUTE
        })
    );
    store.settle(&quota, &a, &charge, -5).into_inner().unwrap();
    clock.advance(Duration::from_micros(1));
    assert!(store.decide(&quota, &b, 1).into_inner().unwrap().admitted);
    assert_eq!(store.len(), 1);
}

#[test]
fn refused_and_zero_cost_requests_create_no_state() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock);
    for quota in quotas(10) {
        for i in 0..100 {
            let key: Arc<str> = format!("k{i}").into();
            assert!(
                !store
                    .decide(&quota, &key, 11)
                    .into_inner()
                    .unwrap()
                    .admitted
            );
            assert!(store.decide(&quota, &key, 0).into_inner().unwrap().admitted);
        }
    }
    assert_eq!(store.len(), 0);
}

/// A store of at most 8 keys in one shard, on a manual clock.
fn eight_keys_one_shard() -> (MemoryStore<ManualClock>, ManualClock) {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock.clone())
        .max_keys(NonZeroUsize::new(8).unwrap())
        .shards(NonZeroUsize::MIN)
        .unwrap();
    (store, clock)
}

/// A quota of one bucket of 5 tokens refilled at 1 per second.
fn five_per_five_seconds(name: &str) -> Quota {
    let bucket = Policy::token_bucket("b", 5, 5, Duration::from_secs(5)).unwrap();
    Quota::new(name, [bucket]).unwrap()
}

#[test]
fn full_store_lazily_reclaims_expired_keys() {
    let (store, clock) = eight_keys_one_shard();
    let quota = five_per_five_seconds("q");
    for i in 0..8 {
        let key: Arc<str> = format!("k{i}").into();
        assert!(store.decide(&quota, &key, 1).into_inner().unwrap().admitted);
    }
    let late: Arc<str> = "late".into();
    assert_eq!(
        store.decide(&quota, &late, 1).into_inner(),
        Err(StoreError::Full {
            retry_after: Duration::from_secs(1)
        })
    );
    // One second later every bucket is full again: equivalent to fresh.
    clock.advance(Duration::from_secs(1));
    assert!(
        store
            .decide(&quota, &late, 1)
            .into_inner()
            .unwrap()
            .admitted
    );
    assert_eq!(store.len(), 1);
}

#[test]
fn buckets_and_other_quotas_share_one_cap() {
    // Quotas of one token bucket live in their own compact table; the cap,
    // `len`, `sweep` and the full outcome count both tables together.
    let (store, clock) = eight_keys_one_shard();
    let bucket = five_per_five_seconds("bucket");
    let log = Quota::new("log", [Policy::sliding_log("l", 5, MINUTE).unwrap()]).unwrap();
    for i in 0..4 {
        let key: Arc<str> = format!("k{i}").into();
        // The same key under both quotas: two independent states.
        for _ in 0..5 {
            assert!(
                store
                    .decide(&bucket, &key, 1)
                    .into_inner()
                    .unwrap()
                    .admitted
            );
            assert!(store.decide(&log, &key, 1).into_inner().unwrap().admitted);
        }
        assert!(
            !store
                .decide(&bucket, &key, 1)
                .into_inner()
                .unwrap()
                .admitted
        );
        assert!(!store.decide(&log, &key, 1).into_inner().unwrap().admitted);
    }
    assert_eq!(store.len(), 8);
    let late: Arc<str> = "late".into();
    // The buckets refill first (5 s), so that is the earliest a key frees.
    for quota in [&bucket, &log] {
        assert_eq!(
            store.decide(quota, &late, 1).into_inner(),
            Err(StoreError::Full {
                retry_after: Duration::from_secs(5)
            })
        );
    }
    clock.advance(Duration::from_secs(5));
    assert_eq!(store.sweep(), 4);
    assert_eq!(store.len(), 4);
    assert!(
        store
            .decide(&bucket, &late, 1)
            .into_inner()
            .unwrap()
            .admitted
    );
    clock.advance(MINUTE);
    assert_eq!(store.sweep(), 5);
    assert!(store.is_empty());
}

#[test]
fn a_shadow_bucket_counts_but_never_refuses() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock);
    let quota = Quota::new(
        "watch",
        [Policy::token_bucket("b", 2, 1, MINUTE).unwrap().shadow()],
    )
    .unwrap();
    let key: Arc<str> = "alice".into();
    let decisions: Vec<_> = (0..3)
        .map(|_| store.decide(&quota, &key, 1).into_inner().unwrap())
        .collect();
    assert!(decisions.iter().all(|d| d.admitted));
    assert_eq!(
        decisions
            .iter()
            .map(|d| d.decisions[0].admitted)
            .collect::<Vec<_>>(),
        [true, true, false]
    );
    assert_eq!(decisions[2].decisions[0].retry_after, Some(MINUTE));
}

#[test]
fn keys_alike_up_to_any_length_keep_their_own_state() {
    // Short keys are kept inline and long ones shared: keys that differ only
    // in their length, or in their last byte, on either side of that line,
    // are distinct keys in every quota shape.
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock);
    let mut keys: Vec<Arc<str>> = Vec::new();
    for len in [1, 3, 4, 7, 8, 9, 16, 17, 21, 22, 23, 24, 40] {
        keys.push("k".repeat(len).into());
        keys.push(format!("{}j", "k".repeat(len - 1)).into());
    }
    let mut shapes = quotas(1);
    let pair = [
        Policy::fixed_window("fixed", 1, MINUTE).unwrap(),
        Policy::token_bucket("bucket", 1, 1, MINUTE).unwrap(),
    ];
    shapes.push(Quota::new("pair", pair).unwrap());
    for quota in &shapes {
        for key in &keys {
            let first = store.decide(quota, key, 1).into_inner().unwrap();
            assert!(first.admitted, "{}: {key} refused", quota.name());
        }
        for key in &keys {
            // The very same string in another allocation.
            let again: Arc<str> = key.to_string().into();
            let second = store.decide(quota, &again, 1).into_inner().unwrap();
            assert!(!second.admitted, "{}: {key} admitted twice", quota.name());
        }
    }
    assert_eq!(store.len(), shapes.len() * keys.len());
}

/// A full store of 64 keys: shadow policies never keep a key's room, so they
/// never turn an enforcing quota's new key into `StoreError::Full` (a 503).
#[test]
fn shadow_policies_never_keep_room_from_a_full_store() {
    use futures_util::FutureExt;
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock.clone()).max_keys(NonZeroUsize::new(64).unwrap());
    let decide = |quota: &Quota, key: &str| {
        store
            .decide(quota, &Arc::from(key), 1)
            .now_or_never()
            .unwrap()
    };
    let per_second = || Policy::fixed_window("per-second", 5, Duration::from_secs(1)).unwrap();
    let hourly = || {
        Policy::sliding_log("hourly", 5, Duration::from_secs(3600))
            .unwrap()
            .shadow()
    };
    // 64 keys of an enforcing per-second window beside a shadow hourly log.
    let watched = Quota::new("watched", [per_second(), hourly()]).unwrap();
    for i in 0..64 {
        assert!(decide(&watched, &format!("user{i}")).unwrap().admitted);
    }
    clock.advance(Duration::from_secs(2));
    // Not full: a sweep keeps what the shadow log still holds.
    assert_eq!((store.sweep(), store.len()), (0, 64));
    // Full: a new key drops one whose enforcing window is over. Before, the
    // shadow log kept every key, and the new one was refused for an hour.
    assert!(decide(&watched, "newcomer").unwrap().admitted);
    assert_eq!(store.len(), 1);

    // A quota of shadow policies only fills the store...
    let shadow_only = Quota::new("shadow-only", [hourly()]).unwrap();
    for i in 0..63 {
        assert!(decide(&shadow_only, &format!("user{i}")).unwrap().admitted);
    }
    assert_eq!(store.len(), 64);
    // ...and an enforcing quota's new keys still find room at once (63 of
    // them: the newcomer's window is live).
    let enforcing = Quota::new("enforcing", [per_second()]).unwrap();
    for i in 0..63 {
        assert!(decide(&enforcing, &format!("user{i}")).unwrap().admitted);
    }
    assert_eq!(store.len(), 64);
    // Full of live enforcing keys: a shadow-only key is decided, not kept...
    assert!(decide(&shadow_only, "late").unwrap().admitted);
    assert_eq!(store.len(), 64);
    // ...and an enforcing one is refused, as before.
    assert!(matches!(
        decide(&enforcing, "late"),
        Err(StoreError::Full { .. })
    ));
}

/// Admits cost 1 on `key` under `quota` until refused; returns how many.
fn admit_all(store: &MemoryStore<ManualClock>, quota: &Quota, key: &Arc<str>) -> u64 {
    let mut admitted = 0;
    while store.decide(quota, key, 1).into_inner().unwrap().admitted {
        admitted += 1;
    }
    admitted
}

/// A redeploy replaces a quota with one of the same name and kinds but other
/// numbers, on the same store. A request admitted under the old quota settles
/// (its handler's real cost, or a refund) after the new quota has decided
/// the key: the settle gives back at most its own charge, and never reshapes
/// the key's state under the old numbers. Before, it did: the bucket's TAT
/// was clamped to the old, smaller capacity (even by an extra charge), the
/// fixed window was realigned to the old, shorter window, and the log was
/// trimmed to the old, shorter window (or read as fresh under it, and then
/// dropped by a sweep), each admitting a second full limit in the new
/// policy's window.
#[test]
fn a_settle_under_the_old_numbers_never_refills_the_new_policy() {
    let secs = Duration::from_secs;
    let cases = [
        (
            Policy::token_bucket("p", 1, 1, secs(1)).unwrap(),
            Policy::token_bucket("p", 100, 1, secs(1)).unwrap(),
            Duration::ZERO,
            Duration::ZERO,
            // The old charge's own token is still held: a refund gives it back.
            1,
        ),
        (
            Policy::fixed_window("p", 1, secs(1)).unwrap(),
            Policy::fixed_window("p", 100, secs(60)).unwrap(),
            secs(2),
            secs(2),
            // Its window is not the key's window any more.
            0,
        ),
        (
            Policy::sliding_log("p", 1, secs(1)).unwrap(),
            Policy::sliding_log("p", 100, secs(60)).unwrap(),
            secs(2),
            secs(2),
            // Its entry has left the old window.
            0,
        ),
    ];
    let other = || Policy::token_bucket("other", 1000, 1, secs(3600)).unwrap();
    for (old, new, before, after, refunded) in cases {
        for stacked in [false, true] {
            for delta in [-1, 1] {
                let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
                let store = MemoryStore::with_clock(clock.clone());
                let (old, new) = if stacked {
                    (
                        Quota::new("q", [old.clone(), other()]).unwrap(),
                        Quota::new("q", [new.clone(), other()]).unwrap(),
                    )
                } else {
                    (
                        Quota::new("q", [old.clone()]).unwrap(),
                        Quota::new("q", [new.clone()]).unwrap(),
                    )
                };
                let key: Arc<str> = "k".into();
                let charge = store.decide(&old, &key, 1).into_inner().unwrap();
                assert!(charge.admitted);
                // The new deploy takes all the new policy leaves in its window.
                let first = admit_all(&store, &new, &key);
                clock.advance(before);
                store
                    .settle(&old, &key, &charge, delta)
                    .into_inner()
                    .unwrap();
                clock.advance(after);
                // Nothing of the key is fresh under the new numbers.
                assert_eq!(store.sweep(), 0);
                let again = admit_all(&store, &new, &key);
                let expected = if delta < 0 { refunded } else { 0 };
                assert_eq!(
                    (first, again),
                    (99, expected),
                    "{:?} stacked {stacked}, settle {delta}",
                    new.policies()[0]
                );
            }
        }
    }
}
