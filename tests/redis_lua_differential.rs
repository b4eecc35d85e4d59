//! Differential tests: each Lua script against its Rust reference state
//! machine, on random sequences of (time step, cost, key), and the key expiry
//! of the production script against Redis `TIME`.
//!
//! - One algorithm per test: random numbers (small and up to 2^45), random
//!   steps forwards and backwards in time, costs from 0 to beyond the limit,
//!   settlements with any `i64`; every decision (admitted, remaining,
//!   retry_after, reset, limit) must equal `Algorithm::step`, and every
//!   `adjust` is mirrored into the reference.
//! - Multi-policy quotas (with shadow policies) against the same reference
//!   driven the way `MemoryStore` decides: check every policy, record in the
//!   ones that admitted only if no enforcing policy refused.
//!
//! The reference drops a state once `Algorithm::fresh_at(state) <= now`,
//! because that is what the Redis store does: a key expires at `fresh_at`
//! in Redis time, and a call that finds its state fresh deletes the key. A
//! dropped state holds no usage (an empty window, a full bucket, an empty
//! log), so dropping admits nothing extra; after a clock step backwards it
//! can change only `reset` and the window a later admission lands in.
//!
//! The store runs the test-only script whose clock is injected from a
//! `ManualClock`; it differs from the production script only in its clock
//! file. Each test starts its own `redis-server`.
#![cfg(feature = "redis")]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tower_admission::clock::{ManualClock, Timestamp};
use tower_admission::quota::algorithm::{
    Algorithm, FixedWindow, SlidingLog, SlidingWindow, State, TokenBucket,
};
use tower_admission::quota::{Decisions, Policy, Quota, QuotaDecision, RedisStore, Store};

use support::RedisServer;

const START: u64 = 1_700_000_000_000_000;
const TWO45: u64 = 1 << 45;
const YEAR_US: u64 = 365 * 24 * 3600 * 1_000_000;

#[derive(Debug, Clone)]
enum Op {
    Decide {
        step: (u8, u64),
        cost: (u8, u64),
        key: u8,
    },
    Adjust {
        step: (u8, u64),
        delta: (u8, u64),
        key: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let step = (0u8..10, any::<u64>());
    prop_oneof![
        9 => (step.clone(), (0u8..12, any::<u64>()), 0u8..3)
            .prop_map(|(step, cost, key)| Op::Decide { step, cost, key }),
        1 => (step, (0u8..6, any::<u64>()), 0u8..3)
            .prop_map(|(step, delta, key)| Op::Adjust { step, delta, key }),
    ]
}

/// The next time: mostly the same or a little later, sometimes a window or
/// more later, sometimes earlier (a clock stepped back).
fn next_time(now: u64, (kind, raw): (u8, u64), window: u64) -> u64 {
    let now = i128::from(now);
    let w = i128::from(window.max(1));
    let raw = i128::from(raw);
    let next = match kind {
        0..=3 => now,
        4..=6 => now + 1 + raw % 1000,
        7 => now + raw % (w + 1),
        8 => now + raw % (3 * w + 1),
        _ => now - raw % (w + 1),
    };
    u64::try_from(next.clamp(0, 1 << 52)).unwrap()
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

fn algorithm_strategy(code: &'static str) -> BoxedStrategy<Algorithm> {
    match code {
        "fw" => (limit_strategy(TWO45), window_strategy())
            .prop_map(|(limit, window)| Algorithm::FixedWindow(FixedWindow { limit, window }))
            .boxed(),
        "sl" => (limit_strategy(1_000_000), window_strategy())
            .prop_map(|(limit, window)| Algorithm::SlidingLog(SlidingLog { limit, window }))
            .boxed(),
        "sw" => (limit_strategy(TWO45), window_strategy())
            .prop_map(|(limit, window)| Algorithm::SlidingWindow(SlidingWindow { limit, window }))
            .boxed(),
        _ => (
            limit_strategy(TWO45),
            prop_oneof![1u64..=10, Just(600_000u64), 1u64..=1_000_000_000],
        )
            .prop_map(|(capacity, interval)| {
                // Keep capacity * interval within the store's 2^51 µs bound.
                let interval = interval.min((1u64 << 51) / capacity).max(1);
                Algorithm::TokenBucket(TokenBucket { capacity, interval })
            })
            .boxed(),
    }
}

/// A Redis server, a runtime, and a store on the injected clock.
struct Rig {
    _server: RedisServer,
    rt: tokio::runtime::Runtime,
    clock: ManualClock,
    store: RedisStore,
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
        let store = RedisStore::builder(server.url())
            .test_clock(clock.clone())
            .deadline(Duration::from_secs(10))
            .build()
            .unwrap();
        Rig {
            _server: server,
            rt,
            clock,
            store,
            case: AtomicU64::new(0),
        }
    }

    fn keys(&self) -> [Arc<str>; 3] {
        let case = self.case.fetch_add(1, Ordering::Relaxed);
        [0, 1, 2].map(|k| Arc::from(format!("case{case}-key{k}")))
    }
}

/// `cases` random sequences, or `PROPTEST_CASES` when set.
fn runner(cases: u32) -> TestRunner {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(cases);
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

/// The store's expiry: a state equivalent to fresh is gone.
fn drop_if_fresh(algorithm: &Algorithm, state: &mut State, now: u64) {
    if algorithm.fresh_at(state) <= Timestamp(now) {
        *state = algorithm.fresh_state();
    }
}

/// The reference decision for a quota, as `MemoryStore` makes it, plus the
/// store's expiry per policy.
fn reference_decide(quota: &Quota, states: &mut [State], now: u64, cost: u64) -> QuotaDecision {
    let now = Timestamp(now);
    let mut admitted = true;
    let decisions: Decisions = quota
        .policies()
        .iter()
        .zip(states.iter_mut())
        .map(|(policy, state)| {
            let d = policy.algorithm().check(state, now, cost);
            if !d.admitted && !policy.is_shadow() {
                admitted = false;
            }
            d
        })
        .collect();
    for ((policy, state), d) in quota
        .policies()
        .iter()
        .zip(states.iter_mut())
        .zip(&decisions)
    {
        if admitted && d.admitted {
            policy.algorithm().record(state, now, cost);
        }
        drop_if_fresh(policy.algorithm(), state, now.as_micros());
    }
    QuotaDecision {
        admitted,
        decisions,
    }
}

/// One algorithm: Lua vs `Algorithm::step` / `Algorithm::adjust`.
fn differential(code: &'static str) {
    let rig = Rig::new();
    let strategy = (
        algorithm_strategy(code),
        any::<u64>(),
        proptest::collection::vec(op(), 1..80),
    );
    runner(128)
        .run(&strategy, |(algorithm, start, ops)| {
            rig.rt.block_on(one_algorithm(&rig, algorithm, start, ops))
        })
        .unwrap();
}

async fn one_algorithm(
    rig: &Rig,
    algorithm: Algorithm,
    start: u64,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let quota = Quota::new("d", [Policy::new("p", algorithm.clone()).unwrap()]).unwrap();
    let keys = rig.keys();
    let mut states: Vec<State> = (0..3).map(|_| algorithm.fresh_state()).collect();
    let limit = algorithm.limit();
    let window = u64::try_from(algorithm.window().as_micros()).unwrap_or(u64::MAX);
    let mut now = START + start % 1_000_000_000_000;
    for (i, op) in ops.into_iter().enumerate() {
        match op {
            Op::Decide { step, cost, key } => {
                now = next_time(now, step, window);
                rig.clock.set(Timestamp(now));
                let cost = cost_of(cost, limit);
                let k = usize::from(key);
                let (next, expected) = algorithm.step(&states[k], Timestamp(now), cost);
                states[k] = next;
                drop_if_fresh(&algorithm, &mut states[k], now);
                let got = rig.store.decide(&quota, &keys[k], cost).await.unwrap();
                prop_assert_eq!(
                    &got.decisions[0],
                    &expected,
                    "op {} decide cost {} at {} on key {}",
                    i,
                    cost,
                    now,
                    k
                );
                prop_assert_eq!(got.admitted, expected.admitted);
            }
            Op::Adjust { step, delta, key } => {
                now = next_time(now, step, window);
                rig.clock.set(Timestamp(now));
                let delta = delta_of(delta, limit);
                let k = usize::from(key);
                algorithm.adjust(&mut states[k], Timestamp(now), delta);
                drop_if_fresh(&algorithm, &mut states[k], now);
                rig.store.adjust(&quota, &keys[k], delta).await.unwrap();
            }
        }
    }
    Ok(())
}

#[test]
fn fixed_window_lua_matches_rust() {
    differential("fw");
}

#[test]
fn sliding_log_lua_matches_rust() {
    differential("sl");
}

#[test]
fn token_bucket_lua_matches_rust() {
    differential("tb");
}

#[test]
fn sliding_window_lua_matches_rust() {
    differential("sw");
}

/// Quotas of one to three policies, some in shadow mode: the driver script
/// against the reference decision (check all, record in all that admitted
/// only if no enforcing policy refused).
#[test]
fn multi_policy_driver_matches_reference() {
    let rig = Rig::new();
    let policy = prop_oneof![
        algorithm_strategy("fw"),
        algorithm_strategy("sl"),
        algorithm_strategy("tb"),
        algorithm_strategy("sw"),
    ];
    let strategy = (
        proptest::collection::vec((policy, any::<bool>()), 1..=3),
        any::<u64>(),
        proptest::collection::vec(op(), 1..60),
    );
    runner(128)
        .run(&strategy, |(policies, start, ops)| {
            rig.rt.block_on(multi_policy(&rig, policies, start, ops))
        })
        .unwrap();
}

async fn multi_policy(
    rig: &Rig,
    policies: Vec<(Algorithm, bool)>,
    start: u64,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let quota = Quota::new(
        "m",
        policies.iter().enumerate().map(|(i, (algorithm, shadow))| {
            let p = Policy::new(&format!("p{i}"), algorithm.clone()).unwrap();
            if *shadow {
                p.shadow()
            } else {
                p
            }
        }),
    )
    .unwrap();
    let limit = policies.iter().map(|(a, _)| a.limit()).min().unwrap();
    let window = policies
        .iter()
        .map(|(a, _)| u64::try_from(a.window().as_micros()).unwrap_or(u64::MAX))
        .min()
        .unwrap();
    let mut states: Vec<Vec<State>> = (0..3)
        .map(|_| {
            quota
                .policies()
                .iter()
                .map(|p| p.algorithm().fresh_state())
                .collect()
        })
        .collect();
    let keys = rig.keys();
    let mut now = START + start % 1_000_000_000_000;
    for (i, op) in ops.into_iter().enumerate() {
        match op {
            Op::Decide { step, cost, key } => {
                now = next_time(now, step, window);
                rig.clock.set(Timestamp(now));
                let cost = cost_of(cost, limit);
                let k = usize::from(key);
                let expected = reference_decide(&quota, &mut states[k], now, cost);
                let got = rig.store.decide(&quota, &keys[k], cost).await.unwrap();
                prop_assert_eq!(got, expected, "op {} cost {} at {}", i, cost, now);
            }
            Op::Adjust { step, delta, key } => {
                now = next_time(now, step, window);
                rig.clock.set(Timestamp(now));
                let delta = delta_of(delta, limit);
                let k = usize::from(key);
                for (policy, state) in quota.policies().iter().zip(states[k].iter_mut()) {
                    policy.algorithm().adjust(state, Timestamp(now), delta);
                    drop_if_fresh(policy.algorithm(), state, now);
                }
                rig.store.adjust(&quota, &keys[k], delta).await.unwrap();
            }
        }
    }
    Ok(())
}

/// The moment a key's raw state becomes equivalent to fresh, read back from
/// Redis, in µs.
fn fresh_at_from_redis(server: &RedisServer, key: &str, algorithm: &Algorithm) -> u64 {
    let num = |s: &str| s.trim().parse::<u64>().unwrap();
    let lines = |args: &[&str]| -> Vec<String> {
        server
            .cli(args)
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    match algorithm {
        Algorithm::FixedWindow(a) => {
            let v = lines(&["hmget", key, "k", "c"]);
            assert!(num(&v[1]) > 0);
            (num(&v[0]) + 1) * a.window
        }
        Algorithm::SlidingLog(a) => {
            let v = lines(&["zrange", key, "-1", "-1", "withscores"]);
            num(&v[1]) + a.window
        }
        Algorithm::TokenBucket(_) => num(&server.cli(&["get", key])),
        Algorithm::SlidingWindow(a) => {
            let v = lines(&["hmget", key, "k", "c", "p"]);
            let (k, c, p) = (num(&v[0]), num(&v[1]), num(&v[2]));
            if c > 0 {
                (k + 2) * a.window
            } else {
                assert!(p > 0);
                (k + 1) * a.window
            }
        }
    }
}

/// The production script (Redis `TIME`): after decisions every key has an
/// expiry (never -1), and it is the moment its state becomes fresh, to the
/// millisecond; a state that is fresh again is deleted.
#[test]
fn every_key_expires_when_its_state_becomes_fresh() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = RedisStore::builder(server.url())
        .prefix("ttl")
        .deadline(Duration::from_secs(10))
        .build()
        .unwrap();
    let quota = Quota::new(
        "all",
        [
            Policy::fixed_window("fw", 100, Duration::from_secs(60)).unwrap(),
            Policy::sliding_log("sl", 100, Duration::from_secs(60)).unwrap(),
            Policy::token_bucket("tb", 20, 100, Duration::from_secs(60)).unwrap(),
            Policy::sliding_window("sw", 100, Duration::from_secs(60)).unwrap(),
        ],
    )
    .unwrap();
    let keys: Vec<Arc<str>> = (0..5).map(|i| Arc::from(format!("user{i}"))).collect();
    rt.block_on(async {
        for (i, key) in keys.iter().enumerate() {
            for cost in 1..=(i as u64 + 1) {
                assert!(store.decide(&quota, key, cost).await.unwrap().admitted);
            }
        }
    });
    let all_keys = server.cli(&["keys", "ttl:*"]);
    assert_eq!(all_keys.lines().count(), 20, "{all_keys}");
    for key in &keys {
        for (redis_key, policy) in store.keys(&quota, key).iter().zip(quota.policies()) {
            let pttl: i64 = server.cli(&["pttl", redis_key]).trim().parse().unwrap();
            assert!(pttl > 0, "{redis_key} has PTTL {pttl}");
            let expires_ms: u64 = server
                .cli(&["pexpiretime", redis_key])
                .trim()
                .parse()
                .unwrap();
            let fresh_at = fresh_at_from_redis(&server, redis_key, policy.algorithm());
            // The script sets PEXPIRE ceil((fresh_at - TIME) / 1 ms); PEXPIRE
            // adds its own clock read, a few µs after the script's TIME. So
            // the expiry is within 1 ms of fresh_at (plus those µs)...
            let diff = i128::from(expires_ms) * 1000 - i128::from(fresh_at);
            assert!(
                diff.abs() <= 1_100,
                "{redis_key}: expires at {expires_ms} ms, fresh at {fresh_at} µs"
            );
            // ...and never early: Redis drops a key only once its millisecond
            // clock is past the expiry, so the state lives until
            // (expires_ms + 1) ms, after fresh_at.
            assert!(
                (i128::from(expires_ms) + 1) * 1000 > i128::from(fresh_at),
                "{redis_key}: expires at {expires_ms} ms, before fresh at {fresh_at} µs"
            );
        }
    }
    // Refund everything: the states are fresh again and the keys are gone.
    rt.block_on(async {
        store.adjust(&quota, &keys[0], -1).await.unwrap();
    });
    let remaining: Vec<String> = store
        .keys(&quota, &keys[0])
        .into_iter()
        .filter(|k| server.cli(&["exists", k]).trim() == "1")
        .collect();
    assert_eq!(remaining, Vec::<String>::new());
}

/// The weighted window's products beyond 2^53 (here about 2^89) go through
/// the script's exact limb arithmetic and still match the u128 reference.
#[test]
fn sliding_window_products_beyond_2_53_are_exact() {
    let rig = Rig::new();
    let algorithm = Algorithm::SlidingWindow(SlidingWindow {
        limit: TWO45,
        window: YEAR_US,
    });
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
    let quota = Quota::new("big", [Policy::new("p", algorithm.clone()).unwrap()]).unwrap();
    let key = rig.keys()[0].clone();
    let mut state = algorithm.fresh_state();
    rig.rt.block_on(async {
        for (now, cost) in ops {
            rig.clock.set(Timestamp(now));
            let (next, expected) = algorithm.step(&state, Timestamp(now), cost);
            state = next;
            drop_if_fresh(&algorithm, &mut state, now);
            let got = rig.store.decide(&quota, &key, cost).await.unwrap();
            assert_eq!(got.decisions[0], expected, "cost {cost} at {now}");
        }
    });
}
