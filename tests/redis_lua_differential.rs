//! Differential tests: the Redis store (the Lua scripts) against the memory
//! store (the Rust state machines and the one check-all-then-record-all
//! combinator), decision for decision, on random sequences, and the key
//! expiry of the production script against Redis `TIME`.
//!
//! - Each case is a quota of one to three policies (some in shadow mode) with
//!   random numbers (small and up to 2^45), and a random sequence of
//!   decisions (costs from 0 to beyond the limit), settlements of random
//!   earlier admissions (by their decisions, with any `i64` delta), and
//!   policy changes (the same kinds with other numbers, as a redeploy makes
//!   them). Every answer (a decision or a settle's, with what it holds) must
//!   be equal.
//! - Time never moves backwards here: a state equivalent to fresh is deleted
//!   by Redis but may be kept by the memory store, and the two are the same
//!   for every later time. A clock stepped back is covered by the
//!   conformance suite, on both stores.
//! - Settles under a quota's older numbers read a state as the memory store
//!   does: a log or weighted window is fresh only once the key's expiry has
//!   passed, which Redis keeps as data (the quota's expiry key, in injected
//!   time), so the comparison needs no exception for one key per policy
//!   against one slot per key.
//!
//! The Redis store runs the test-only script whose clock is injected from the
//! same `ManualClock` the memory store reads; it differs from the production
//! script only in its clock file. Each test starts its own `redis-server`.
#![cfg(feature = "redis")]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tower_admission::clock::ManualClock;
use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaDecision, RedisStore, Store};

use support::{runner, RedisServer};

const START: u64 = 1_700_000_000_000_000;
const TWO45: u64 = 1 << 45;
const YEAR_US: u64 = 365 * 24 * 3600 * 1_000_000;

#[derive(Debug, Clone)]
enum Op {
    Decide {
        step: (u8, u64),
        cost: (u8, u64),
    },
    Settle {
        step: (u8, u64),
        delta: (u8, u64),
        which: usize,
    },
    Change {
        to: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let step = (0u8..9, any::<u64>());
    prop_oneof![
        12 => (step.clone(), (0u8..12, any::<u64>()))
            .prop_map(|(step, cost)| Op::Decide { step, cost }),
        3 => (step, (0u8..6, any::<u64>()), any::<usize>())
            .prop_map(|(step, delta, which)| Op::Settle { step, delta, which }),
        1 => any::<usize>().prop_map(|to| Op::Change { to }),
    ]
}

/// The next time, never earlier: mostly the same or a little later,
/// sometimes a window or more later.
fn next_time(now: u64, (kind, raw): (u8, u64), window: u64) -> u64 {
    let w = window.max(1);
    let next = match kind {
        0..=3 => now,
        4..=6 => now + 1 + raw % 1000,
        7 => now + raw % (w + 1),
        _ => now + raw % (3 * w + 1),
    };
    next.min(1 << 52)
}

fn cost_of((kind, raw): (u8, u64), limit: u64) -> u64 {
    match kind {
        0 => 0,
        1..=5 => 1 + raw % limit.min(5),
        6..=7 => raw % (limit + 1),
        8 => limit,
        9 => (limit / 2).max(1),
        10 => limit + 1 + raw % 3,
        _ => u64::MAX - raw % 3,
    }
}

fn delta_of((kind, raw): (u8, u64), limit: u64) -> i64 {
    let bounded = i64::try_from(raw % (limit + 1)).unwrap_or(i64::MAX);
    match kind {
        0 | 1 => -bounded,
        2 | 3 => bounded,
        4 => i64::MIN + i64::try_from(raw % 3).unwrap(),
        _ => i64::MAX - i64::try_from(raw % 3).unwrap(),
    }
}

fn limit_strategy(max: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 1u64..=10,
        1 => Just(100u64),
        1 => Just(1000u64),
        1 => 1u64..=max,
        1 => Just(max),
    ]
}

fn window_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        2 => 1u64..=10,
        2 => Just(1_000u64),
        2 => Just(1_000_000u64),
        2 => Just(60_000_000u64),
        1 => Just(3_600_000_000u64),
        1 => Just(YEAR_US),
        1 => 1u64..=YEAR_US,
    ]
}

/// A policy of kind `code` named `name`, with random numbers.
fn policy_strategy(code: u8, name: String) -> BoxedStrategy<Policy> {
    let us = Duration::from_micros;
    let n = name.clone();
    match code {
        0 => (limit_strategy(TWO45), window_strategy())
            .prop_map(move |(l, w)| Policy::fixed_window(&n, l, us(w)).unwrap())
            .boxed(),
        1 => (limit_strategy(1_000_000), window_strategy())
            .prop_map(move |(l, w)| Policy::sliding_log(&n, l, us(w)).unwrap())
            .boxed(),
        2 => (limit_strategy(TWO45), window_strategy())
            .prop_map(move |(l, w)| Policy::sliding_window(&n, l, us(w)).unwrap())
            .boxed(),
        _ => (
            limit_strategy(1 << 30),
            prop_oneof![1u64..=10, Just(100u64), Just(7u64), 1u64..=1_000_000],
            window_strategy(),
        )
            .prop_filter_map(
                "a bucket both stores decide exactly",
                move |(b, refill, period)| {
                    let policy = Policy::token_bucket(&n, b, refill, us(period)).ok()?;
                    let quota = Quota::new("d", [policy.clone()]).ok()?;
                    exact_in_lua().validate(&quota).ok()?;
                    Some(policy)
                },
            )
            .boxed(),
    }
}

/// A store to ask what the scripts decide exactly (it never connects).
fn exact_in_lua() -> &'static RedisStore {
    static STORE: std::sync::OnceLock<RedisStore> = std::sync::OnceLock::new();
    STORE.get_or_init(|| RedisStore::builder("redis://127.0.0.1:1/").build().unwrap())
}

/// Up to three variants (a first deployment and redeploys) of a quota of
/// one to three policies of given kinds, some in shadow mode.
fn quotas_strategy() -> impl Strategy<Value = Vec<Quota>> {
    proptest::collection::vec((0u8..4, any::<bool>()), 1..=3).prop_flat_map(|kinds| {
        let variant = kinds
            .iter()
            .enumerate()
            .map(|(i, &(code, shadow))| {
                policy_strategy(code, format!("p{i}")).prop_map(move |p| (p, shadow))
            })
            .collect::<Vec<_>>();
        proptest::collection::vec(variant, 1..=3).prop_map(|variants| {
            variants
                .into_iter()
                .map(|policies| {
                    Quota::new(
                        "d",
                        policies
                            .into_iter()
                            .map(|(p, shadow)| if shadow { p.shadow() } else { p }),
                    )
                    .unwrap()
                })
                .collect()
        })
    })
}

/// A Redis server, a runtime, and both stores on one injected clock.
struct Rig {
    _server: RedisServer,
    rt: tokio::runtime::Runtime,
    clock: ManualClock,
    redis: RedisStore,
    memory: MemoryStore<ManualClock>,
    case: AtomicU64,
}

impl Rig {
    fn new() -> Self {
        let server = RedisServer::start();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let clock = ManualClock::default();
        let redis = RedisStore::builder(server.url())
            .test_clock(clock.clone())
            .deadline(Duration::from_secs(10))
            .build()
            .unwrap();
        let memory = MemoryStore::with_clock(clock.clone());
        Rig {
            _server: server,
            rt,
            clock,
            redis,
            memory,
            case: AtomicU64::new(0),
        }
    }

    fn key(&self) -> Arc<str> {
        let case = self.case.fetch_add(1, Ordering::Relaxed);
        Arc::from(format!("case{case}"))
    }
}

/// Quotas of one to three policies, some in shadow mode, changed between
/// decisions: the Lua driver and scripts against the memory store.
#[test]
fn redis_store_matches_memory_store() {
    let rig = Rig::new();
    let strategy = (
        quotas_strategy(),
        any::<u64>(),
        proptest::collection::vec(op(), 1..80),
    );
    runner(256)
        .run(&strategy, |(quotas, start, ops)| {
            rig.rt.block_on(compare(&rig, quotas, start, ops))
        })
        .unwrap();
}

async fn compare(
    rig: &Rig,
    quotas: Vec<Quota>,
    start: u64,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    for quota in &quotas {
        prop_assert_eq!(rig.redis.validate(quota), Ok(()));
    }
    let key = rig.key();
    let mut quota = &quotas[0];
    // Every admission, as each store last answered it.
    let mut admissions: Vec<(QuotaDecision, QuotaDecision)> = Vec::new();
    let mut now = START + start % 1_000_000_000_000;
    for (i, op) in ops.into_iter().enumerate() {
        let limit = quota.policies().iter().map(|p| p.limit()).min().unwrap();
        let window = quota
            .policies()
            .iter()
            .map(|p| u64::try_from(p.window().as_micros()).unwrap_or(u64::MAX))
            .min()
            .unwrap();
        match op {
            Op::Decide { step, cost } => {
                now = next_time(now, step, window);
                rig.clock.set(Duration::from_micros(now));
                let cost = cost_of(cost, limit);
                let expected = rig.memory.decide(quota, &key, cost).await.unwrap();
                let got = rig.redis.decide(quota, &key, cost).await.unwrap();
                prop_assert_eq!(&got, &expected, "op {} decide cost {} at {}", i, cost, now);
                if got.admitted {
                    admissions.push((expected, got));
                }
            }
            Op::Settle { step, delta, which } => {
                if admissions.is_empty() {
                    continue;
                }
                now = next_time(now, step, window);
                rig.clock.set(Duration::from_micros(now));
                let delta = delta_of(delta, limit);
                let which = which % admissions.len();
                let (mem, red) = &admissions[which];
                let expected = rig.memory.settle(quota, &key, mem, delta).await.unwrap();
                let got = rig.redis.settle(quota, &key, red, delta).await.unwrap();
                prop_assert_eq!(&got, &expected, "op {} settle {} at {}", i, delta, now);
                admissions[which] = (expected, got);
            }
            Op::Change { to } => quota = &quotas[to % quotas.len()],
        }
    }
    Ok(())
}

/// The moment a key's raw state becomes equivalent to fresh, read back from
/// Redis, in µs.
fn fresh_at_from_redis(server: &RedisServer, key: &str, policy: &Policy) -> u64 {
    let num = |s: &str| s.trim().parse::<u64>().unwrap();
    let lines = |args: &[&str]| -> Vec<String> {
        server
            .cli(args)
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let window = u64::try_from(policy.window().as_micros()).unwrap();
    // The policies of the one quota this reads, by name.
    match policy.name() {
        "fw" => {
            let v = lines(&["hmget", key, "e", "c"]);
            assert!(num(&v[1]) > 0);
            num(&v[0])
        }
        "sl" => {
            let v = lines(&["zrange", key, "-1", "-1", "withscores"]);
            num(&v[1]) + window
        }
        "tb" => {
            let raw = server.cli(&["get", key]);
            num(raw.split(':').next().unwrap())
        }
        "sw" => {
            let v = lines(&["hmget", key, "e", "c", "p"]);
            let (e, c, p) = (num(&v[0]), num(&v[1]), num(&v[2]));
            if c > 0 {
                e + window
            } else {
                assert!(p > 0);
                e
            }
        }
        other => unreachable!("no policy {other} in the quota"),
    }
}

/// A Redis server of its own, a runtime, and a store on it that runs the
/// production script (Redis `TIME`), its keys under `prefix`.
fn production(prefix: &str) -> (RedisServer, tokio::runtime::Runtime, RedisStore) {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = RedisStore::builder(server.url())
        .prefix(prefix)
        .deadline(Duration::from_secs(10))
        .build()
        .unwrap();
    (server, rt, store)
}

/// The production script (Redis `TIME`): after decisions every key has an
/// expiry (never -1), and it is the moment its state becomes fresh, to the
/// millisecond, and the quota key's expiry key the latest of them; a state
/// that is fresh again is deleted.
#[test]
fn every_key_expires_when_its_state_becomes_fresh() {
    let (server, rt, store) = production("ttl");
    let quota = Quota::new(
        "all",
        [
            // An hour, aligned to Redis time: a minute's end between the
            // decisions and the checks below expired the key (PTTL -2).
            Policy::fixed_window("fw", 100, Duration::from_secs(3600)).unwrap(),
            Policy::sliding_log("sl", 100, Duration::from_secs(60)).unwrap(),
            // One token per 180 s: a bucket charged 1 at 100/min was fresh,
            // and its key gone, 600 ms later, before a loaded machine had
            // read it back.
            Policy::token_bucket("tb", 20, 20, Duration::from_secs(3600)).unwrap(),
            Policy::sliding_window("sw", 100, Duration::from_secs(60)).unwrap(),
        ],
    )
    .unwrap();
    let keys: Vec<Arc<str>> = (0..5).map(|i| Arc::from(format!("user{i}"))).collect();
    // The longest call: a script's commands run after its `TIME` read by
    // at most that much, on a loaded machine milliseconds.
    let mut slowest = Duration::ZERO;
    let first = rt.block_on(async {
        let mut first = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            for cost in 1..=(i as u64 + 1) {
                let sent = std::time::Instant::now();
                let decision = store.decide(&quota, key, cost).await.unwrap();
                slowest = slowest.max(sent.elapsed());
                assert!(decision.admitted);
                if cost == 1 {
                    first.push(decision);
                }
            }
        }
        first
    });
    let all_keys = server.cli(&["keys", "ttl:*"]);
    assert_eq!(all_keys.lines().count(), 25, "{all_keys}");
    for key in &keys {
        let mut expiries: Vec<(String, u64)> = store
            .keys(&quota, key)
            .into_iter()
            .zip(quota.policies())
            .map(|(k, p)| {
                let fresh_at = fresh_at_from_redis(&server, &k, p);
                (k, fresh_at)
            })
            .collect();
        // The quota key's expiry: the latest of its states'.
        let latest = expiries.iter().map(|(_, at)| *at).max().unwrap();
        let expiry_key = store.expiry_key(&quota, key).unwrap();
        let expiry: u64 = server.cli(&["get", &expiry_key]).trim().parse().unwrap();
        assert_eq!(expiry, latest, "{expiry_key}");
        expiries.push((expiry_key, latest));
        for (redis_key, fresh_at) in &expiries {
            let pttl: i64 = server.cli(&["pttl", redis_key]).trim().parse().unwrap();
            assert!(pttl > 0, "{redis_key} has PTTL {pttl}");
            let expires_ms: u64 = server
                .cli(&["pexpiretime", redis_key])
                .trim()
                .parse()
                .unwrap();
            // The script sets PEXPIRE ceil((fresh_at - TIME) / 1 ms); PEXPIRE
            // adds its own clock read, after the script's TIME by no more
            // than the call took. So the expiry is within 1 ms of fresh_at,
            // plus that...
            let diff = i128::from(expires_ms) * 1000 - i128::from(*fresh_at);
            let slack = i128::try_from(slowest.as_micros()).unwrap();
            assert!(
                diff.abs() <= 1_000 + slack,
                "{redis_key}: expires at {expires_ms} ms, fresh at {fresh_at} µs \
                 (slowest call {slowest:?})"
            );
            // ...and never early: Redis drops a key only once its millisecond
            // clock is past the expiry, so the state lives until
            // (expires_ms + 1) ms, after fresh_at.
            assert!(
                (i128::from(expires_ms) + 1) * 1000 > i128::from(*fresh_at),
                "{redis_key}: expires at {expires_ms} ms, before fresh at {fresh_at} µs"
            );
        }
    }
    // Refund everything: the fixed window and the log are fresh again and
    // their keys are gone. The bucket is full again but keeps its refund
    // offset (so an older hold cannot claim the refunded tokens) until one
    // refill interval, 180 s, after the charge. While it lives, the quota
    // key does, to its expiry (a settle never brings it forward), and so
    // does the weighted window, holding nothing, as in the memory store's
    // slot.
    rt.block_on(async {
        store.settle(&quota, &keys[0], &first[0], -1).await.unwrap();
    });
    let exists = |k: &str| server.cli(&["exists", k]).trim() == "1";
    let remaining: Vec<String> = store
        .keys(&quota, &keys[0])
        .into_iter()
        .filter(|k| exists(k))
        .collect();
    let expiry_key = store.expiry_key(&quota, &keys[0]).unwrap();
    assert_eq!(remaining, ["ttl:{all:user0}:2:tb", "ttl:{all:user0}:3:sw"]);
    let pttl = |k: &str| -> i64 { server.cli(&["pttl", k]).trim().parse().unwrap() };
    let bucket = pttl(&remaining[0]);
    assert!(bucket > 0 && bucket <= 180_000, "{bucket}");
    assert!(pttl(&remaining[1]) > 0 && pttl(&expiry_key) > 0);
}

/// The production script: a log redeployed with a longer window keeps its
/// entries until they leave the new window, so its key's expiry moves with
/// the window even on a decision that records nothing. Before, the key
/// kept the old window's expiry and Redis dropped entries that still held
/// the new limit: 3 per 300 ms, then 3 per 30 s admitted 3 more 300 ms on.
#[test]
fn a_longer_window_moves_the_logs_expiry_on_a_refusal_too() {
    let (server, rt, store) = production("admission");
    let log = |window| Quota::new("api", [Policy::sliding_log("per", 3, window).unwrap()]).unwrap();
    let (old, new) = (
        log(Duration::from_millis(300)),
        log(Duration::from_secs(30)),
    );
    let key: Arc<str> = "grow".into();
    let pttl = || -> i64 {
        let redis_key = &store.keys(&new, &key)[0];
        server.cli(&["pttl", redis_key]).trim().parse().unwrap()
    };
    rt.block_on(async {
        for _ in 0..3 {
            assert!(store.decide(&old, &key, 1).await.unwrap().admitted);
        }
        assert!(pttl() <= 300);
        assert!(!store.decide(&new, &key, 1).await.unwrap().admitted);
    });
    // 30 s after the newest entry, less the few ms the calls took.
    let after = pttl();
    assert!((25_000..=30_000).contains(&after), "PTTL {after} ms");
}

/// The production script: a settle under a shorter window than the one
/// that decided the state since (a charge made before a redeploy to 10 per
/// hour, settled under 10 per minute) never brings a key's expiry forward.
/// Before, the settle's write set the log's and the weighted window's
/// expiry to the minute's, and Redis dropped what the hour still held.
#[test]
fn a_settle_under_a_shorter_window_keeps_each_keys_expiry() {
    let (server, rt, store) = production("admission");
    let both = |window| {
        Quota::new(
            "api",
            [
                Policy::sliding_log("log", 10, window).unwrap(),
                Policy::sliding_window("weighted", 10, window).unwrap(),
            ],
        )
        .unwrap()
    };
    let (minute, hour) = (
        both(Duration::from_secs(60)),
        both(Duration::from_secs(3600)),
    );
    let key: Arc<str> = "redeployed".into();
    rt.block_on(async {
        let a = store.decide(&minute, &key, 1).await.unwrap();
        assert!(a.admitted);
        assert!(store.decide(&hour, &key, 1).await.unwrap().admitted);
        store.settle(&minute, &key, &a, 1).await.unwrap();
    });
    let mut names = store.keys(&hour, &key);
    names.extend(store.expiry_key(&hour, &key));
    for name in &names {
        let pttl: i64 = server.cli(&["pttl", name]).trim().parse().unwrap();
        // An hour at least from the hour's decision, less the few ms taken.
        assert!(pttl > 3_590_000, "{name}: PTTL {pttl} ms");
    }
}

/// The production script: a log whose expiry key is missing (written by a
/// script that kept none, before an upgrade) or trails it (written before
/// such a script appended to the log) is settled as it stands, never read
/// as fresh: a refund of one of 3 charges admits exactly 1 more. Before, a
/// trailing key made the refund delete the live log, and 3 were admitted.
#[test]
fn a_log_is_settled_as_it_stands_without_a_current_expiry_key() {
    let (server, rt, store) = production("admission");
    let quota = Quota::new(
        "api",
        [Policy::sliding_log("log", 3, Duration::from_secs(60)).unwrap()],
    )
    .unwrap();
    for (name, tamper, reply) in [
        ("missing", &["del"][..], "1"),
        ("trailing", &["set", "1"][..], "OK"),
    ] {
        let key: Arc<str> = name.into();
        let expiry_key = store.expiry_key(&quota, &key).unwrap();
        rt.block_on(async {
            let mut admissions = Vec::new();
            for _ in 0..3 {
                let decision = store.decide(&quota, &key, 1).await.unwrap();
                assert!(decision.admitted, "{name}");
                admissions.push(decision);
            }
            let mut command = vec![tamper[0], &expiry_key];
            command.extend(&tamper[1..]);
            assert_eq!(server.cli(&command).trim(), reply, "{name}");
            store
                .settle(&quota, &key, &admissions[1], -1)
                .await
                .unwrap();
            let mut admitted = 0;
            for _ in 0..3 {
                admitted += u32::from(store.decide(&quota, &key, 1).await.unwrap().admitted);
            }
            assert_eq!(admitted, 1, "{name}");
        });
    }
}

/// The weighted window's products beyond 2^53 (here about 2^89) go through
/// the script's exact limb arithmetic and still match the u128 reference.
#[test]
fn sliding_window_products_beyond_2_53_are_exact() {
    let rig = Rig::new();
    let policy = Policy::sliding_window("p", TWO45, Duration::from_micros(YEAR_US)).unwrap();
    let window_start = (START / YEAR_US + 1) * YEAR_US;
    let ops: Vec<(u64, u64)> = vec![
        (window_start + 12_345, TWO45 - 7),
        (window_start + YEAR_US + 1, 3),
        (window_start + YEAR_US + YEAR_US / 3, TWO45 / 3),
        (window_start + YEAR_US + YEAR_US / 3, TWO45 / 2),
        (window_start + YEAR_US + YEAR_US / 2 + 17, TWO45 / 2),
        (window_start + 2 * YEAR_US - 1, 1),
        (window_start + 2 * YEAR_US + 999_999_999, TWO45 - 1),
    ];
    let quota = Quota::new("big", [policy]).unwrap();
    let key = rig.key();
    rig.rt.block_on(async {
        for (now, cost) in ops {
            rig.clock.set(Duration::from_micros(now));
            let expected = rig.memory.decide(&quota, &key, cost).await.unwrap();
            let got = rig.redis.decide(&quota, &key, cost).await.unwrap();
            assert_eq!(got, expected, "cost {cost} at {now}");
        }
    });
}

/// A sliding log of 1,100 entries, full: a refusal's wait (a search over
/// the whole log), refunds on both sides of the refund reach (the 1,024
/// newest entries) and a charge by settle, decision for decision against
/// the Rust log.
#[test]
fn a_full_log_at_the_refund_reach_matches() {
    const N: u64 = 1_100;
    let rig = Rig::new();
    let quota = Quota::new(
        "reach",
        [Policy::sliding_log("p", N, Duration::from_secs(60)).unwrap()],
    )
    .unwrap();
    let key = rig.key();
    rig.rt.block_on(async {
        let mut admissions = Vec::new();
        for i in 0..N {
            // Two entries per µs, so entries share times too.
            rig.clock.set(Duration::from_micros(START + i / 2));
            let expected = rig.memory.decide(&quota, &key, 1).await.unwrap();
            let got = rig.redis.decide(&quota, &key, 1).await.unwrap();
            assert_eq!(got, expected, "admission {i}");
            admissions.push((expected, got));
        }
        let at = START + N;
        rig.clock.set(Duration::from_micros(at));
        let full = rig.redis.decide(&quota, &key, 3).await.unwrap();
        assert_eq!(full, rig.memory.decide(&quota, &key, 3).await.unwrap());
        assert!(!full.admitted);
        // Entries 0 to 75 are beyond the reach (nothing back), 76 on within
        // it; a second refund of one entry gives nothing.
        for which in [75usize, 76, 77, 0, 1, 500, 1_099, 1_099] {
            let (mem, red) = &admissions[which];
            let expected = rig.memory.settle(&quota, &key, mem, -1).await.unwrap();
            let got = rig.redis.settle(&quota, &key, red, -1).await.unwrap();
            assert_eq!(got, expected, "refund of entry {which}");
            admissions[which] = (expected, got);
            let expected = rig.memory.decide(&quota, &key, 0).await.unwrap();
            let got = rig.redis.decide(&quota, &key, 0).await.unwrap();
            assert_eq!(got, expected, "after the refund of entry {which}");
        }
        let remaining = rig.redis.decide(&quota, &key, 0).await.unwrap();
        assert_eq!(remaining.decisions[0].remaining, 4);
        let (mem, red) = &admissions[10];
        let expected = rig.memory.settle(&quota, &key, mem, 9).await.unwrap();
        let got = rig.redis.settle(&quota, &key, red, 9).await.unwrap();
        assert_eq!(got, expected);
        for cost in [1, 0] {
            let expected = rig.memory.decide(&quota, &key, cost).await.unwrap();
            let got = rig.redis.decide(&quota, &key, cost).await.unwrap();
            assert_eq!(got, expected, "cost {cost} after the settle's charge");
        }
    });
}
