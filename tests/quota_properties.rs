//! Properties of every store under features that touch the same state:
//!
//! - **Settlement.** Random interleavings of admissions of random costs and
//!   settlements (refunds and extra charges, of any earlier admission, in any
//!   order) never exceed the algorithm's bound in any interval. Each
//!   admission counts its net cost at its own time: charged minus what its
//!   refunds gave back. Extra charges only take capacity away, so counting
//!   them as nothing keeps the check sound.
//!   - fixed window: at most L per aligned window;
//!   - sliding log: at most L in every `(t - W, t]`;
//!   - token bucket: at most `floor(B + r·T)` in every interval of length T.
//! - **Several policies on one key, one of them a shadow.** Random
//!   interleavings of admissions and settlements on a quota of two enforcing
//!   policies and a shadow one keep each enforcing policy's bound, as above,
//!   with each policy's net cost (what each gave back is read from that
//!   policy). And the shadow policy is invisible: at every step, on a key of
//!   its own, the same quota without it gives the same admissions, waits and
//!   enforcing decisions, before and after every settlement.
//! - **Changed policies.** Random changes of every number between decisions
//!   never panic, and no wait is longer than the new policy's own window
//!   (twice it for the weighted window) or time to refill from empty.
//!
//! Each runs on the memory store and on a Redis store of its own, both on a
//! manual clock.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tower_admission::clock::ManualClock;
use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaDecision, Store};

use support::runner;

const START: u64 = 1_800_000_000_000_000;

#[derive(Debug, Clone, Copy)]
enum Kind {
    Fixed,
    Log,
    Bucket,
}

/// A policy of `kind`: limit or capacity `limit`; window `window` µs, or for
/// the bucket `refill` tokens per `window` µs.
fn policy(kind: Kind, limit: u64, refill: u64, window: u64) -> Policy {
    named("p", (kind, limit, refill, window))
}

/// [`policy`] named `name`.
fn named(name: &str, (kind, limit, refill, window): Spec) -> Policy {
    let w = Duration::from_micros(window);
    match kind {
        Kind::Fixed => Policy::fixed_window(name, limit, w),
        Kind::Log => Policy::sliding_log(name, limit, w),
        Kind::Bucket => Policy::token_bucket(name, limit, refill, w),
    }
    .unwrap()
}

/// A policy's kind, limit, refill and window, as [`policy`] takes them.
type Spec = (Kind, u64, u64, u64);

#[derive(Debug, Clone)]
enum Op {
    Admit { gap: u64, cost: u64 },
    Settle { gap: u64, which: usize, delta: i64 },
}

fn ops(limit: u64, window: u64) -> impl Strategy<Value = Vec<Op>> {
    let gap = prop_oneof![
        3 => Just(0u64),
        3 => 1..=window / 4 + 1,
        1 => 0..=2 * window,
    ];
    let op = prop_oneof![
        3 => (gap.clone(), 1..=limit).prop_map(|(gap, cost)| Op::Admit { gap, cost }),
        2 => (gap, any::<usize>(), -(limit as i64)..=(limit as i64))
            .prop_map(|(gap, which, delta)| Op::Settle { gap, which, delta }),
    ];
    proptest::collection::vec(op, 1..60)
}

/// One admission: when, what it charged, its decision holding what it
/// still holds.
struct Charge {
    at: u64,
    net: u64,
    decision: QuotaDecision,
}

/// Runs `ops` against `store` and checks the bound of `kind` in every interval.
async fn settle_run<S: Store>(
    store: &S,
    clock: &ManualClock,
    key: Arc<str>,
    (kind, limit, refill, window): (Kind, u64, u64, u64),
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let quota = Quota::new("q", [policy(kind, limit, refill, window)]).unwrap();
    let probe = Quota::new("q", [policy(kind, limit, refill, window)]).unwrap();
    let mut now = START;
    let mut charges: Vec<Charge> = Vec::new();
    for op in ops {
        match op {
            Op::Admit { gap, cost } => {
                now += gap;
                clock.set(Duration::from_micros(now));
                let d = store.decide(&quota, &key, cost).await.unwrap();
                if d.admitted {
                    charges.push(Charge {
                        at: now,
                        net: cost,
                        decision: d,
                    });
                }
            }
            Op::Settle { gap, which, delta } => {
                if charges.is_empty() {
                    continue;
                }
                now += gap;
                clock.set(Duration::from_micros(now));
                let c = which % charges.len();
                // What a refund gave back shows as capacity regained now.
                let before = store.decide(&probe, &key, 0).await.unwrap().decisions[0].remaining;
                let settled = store
                    .settle(&quota, &key, &charges[c].decision, delta)
                    .await
                    .unwrap();
                let after = store.decide(&probe, &key, 0).await.unwrap().decisions[0].remaining;
                if delta < 0 {
                    let back = after.saturating_sub(before);
                    prop_assert!(back <= delta.unsigned_abs());
                    prop_assert!(
                        back <= charges[c].net,
                        "gave back {} of {}",
                        back,
                        charges[c].net
                    );
                    charges[c].net -= back;
                }
                charges[c].decision = settled;
            }
        }
        check_bound(kind, limit, refill, window, &charges)?;
    }
    Ok(())
}

fn check_bound(
    kind: Kind,
    limit: u64,
    refill: u64,
    window: u64,
    charges: &[Charge],
) -> Result<(), TestCaseError> {
    for (i, first) in charges.iter().enumerate() {
        let mut sum = 0u64;
        for last in &charges[i..] {
            let span = last.at - first.at;
            let in_scope = match kind {
                Kind::Fixed => first.at / window == last.at / window,
                Kind::Log => span < window,
                Kind::Bucket => true,
            };
            if !in_scope {
                continue;
            }
            sum += last.net;
            let bound = match kind {
                Kind::Fixed | Kind::Log => u128::from(limit),
                Kind::Bucket => {
                    u128::from(limit) + u128::from(refill) * u128::from(span) / u128::from(window)
                }
            };
            prop_assert!(
                u128::from(sum) <= bound,
                "{:?}: {} net in [{}, {}] over the bound {}",
                kind,
                sum,
                first.at,
                last.at,
                bound
            );
        }
    }
    Ok(())
}

/// Each enforcing policy's remaining capacity on `key`, from a decision of
/// cost 0.
async fn remaining<S: Store>(store: &S, quota: &Quota, key: &Arc<str>) -> [u64; 2] {
    let d = store.decide(quota, key, 0).await.unwrap();
    [d.decisions[0].remaining, d.decisions[1].remaining]
}

/// Runs `ops` on a quota of policies `a` and `b` and the shadow `s` on
/// `key`, and on the quota of `a` and `b` alone on a key of its own; checks
/// that both answer alike and that `a` and `b` keep their bounds.
async fn stacked_run<S: Store>(
    store: &S,
    clock: &ManualClock,
    key: Arc<str>,
    [a, b, s]: [Spec; 3],
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let shadowed = Quota::new("q", [named("a", a), named("b", b), named("s", s).shadow()]).unwrap();
    let bare = Quota::new("q", [named("a", a), named("b", b)]).unwrap();
    let bare_key: Arc<str> = format!("{key}-bare").into();
    let mut now = START;
    // Per charge: time, net cost in `a` and in `b`, and each quota's
    // decision, holding what the admission still holds.
    let mut charges: Vec<(u64, [u64; 2], QuotaDecision, QuotaDecision)> = Vec::new();
    for op in ops {
        match op {
            Op::Admit { gap, cost } => {
                now += gap;
                clock.set(Duration::from_micros(now));
                let with = store.decide(&shadowed, &key, cost).await.unwrap();
                let without = store.decide(&bare, &bare_key, cost).await.unwrap();
                prop_assert_eq!(with.admitted, without.admitted, "admitted at {}", now);
                prop_assert_eq!(with.retry_after(&shadowed), without.retry_after(&bare));
                prop_assert_eq!(&with.decisions[..2], &without.decisions[..]);
                if with.admitted {
                    charges.push((now, [cost, cost], with, without));
                }
            }
            Op::Settle { gap, which, delta } => {
                if charges.is_empty() {
                    continue;
                }
                now += gap;
                clock.set(Duration::from_micros(now));
                let c = which % charges.len();
                let before = remaining(store, &shadowed, &key).await;
                prop_assert_eq!(before, remaining(store, &bare, &bare_key).await);
                let (_, net, with, without) = &mut charges[c];
                *with = store.settle(&shadowed, &key, with, delta).await.unwrap();
                *without = store
                    .settle(&bare, &bare_key, without, delta)
                    .await
                    .unwrap();
                let after = remaining(store, &shadowed, &key).await;
                prop_assert_eq!(
                    after,
                    remaining(store, &bare, &bare_key).await,
                    "after a settle of {}",
                    delta
                );
                if delta < 0 {
                    for k in 0..2 {
                        let back = after[k].saturating_sub(before[k]);
                        prop_assert!(
                            back <= delta.unsigned_abs() && back <= net[k],
                            "policy {} gave back {} of {}",
                            k,
                            back,
                            net[k]
                        );
                        net[k] -= back;
                    }
                }
            }
        }
        for (k, &(kind, limit, refill, window)) in [a, b].iter().enumerate() {
            let view: Vec<Charge> = charges
                .iter()
                .map(|&(at, net, ..)| Charge {
                    at,
                    net: net[k],
                    decision: QuotaDecision::new(true, []),
                })
                .collect();
            check_bound(kind, limit, refill, window, &view)?;
        }
    }
    Ok(())
}

/// Two enforcing policies and a shadow one, of any kinds and numbers; the
/// operations' costs and gaps follow the first.
fn stacked_case() -> impl Strategy<Value = ([Spec; 3], Vec<Op>)> {
    let spec = || {
        (
            prop_oneof![Just(Kind::Fixed), Just(Kind::Log), Just(Kind::Bucket)],
            1u64..=20,
            1u64..=7,
            prop_oneof![Just(10_000u64), Just(60_000_000u64), 1_000u64..=5_000_000],
        )
    };
    [spec(), spec(), spec()].prop_flat_map(|specs| {
        let (_, limit, _, window) = specs[0];
        (Just(specs), ops(limit, window))
    })
}

fn settlement_case() -> impl Strategy<Value = ((Kind, u64, u64, u64), Vec<Op>)> {
    let kind = prop_oneof![Just(Kind::Fixed), Just(Kind::Log), Just(Kind::Bucket)];
    (
        kind,
        1u64..=20,
        1u64..=7,
        prop_oneof![Just(10_000u64), Just(60_000_000u64), 1_000u64..=5_000_000],
    )
        .prop_flat_map(|(kind, limit, refill, window)| {
            (Just((kind, limit, refill, window)), ops(limit, window))
        })
}

/// A policy with random numbers, of one of the four kinds.
fn changed_policy(kind: u8) -> impl Strategy<Value = Policy> {
    (
        1u64..=50,
        1u64..=9,
        prop_oneof![1u64..=1_000, 1_000u64..=100_000_000],
    )
        .prop_map(move |(limit, refill, window)| {
            let w = Duration::from_micros(window);
            // Named by kind, the same name for every step of a case.
            match kind {
                0 => Policy::fixed_window("fixed", limit, w),
                1 => Policy::sliding_log("log", limit, w),
                2 => Policy::token_bucket("bucket", limit, refill, w),
                _ => Policy::sliding_window("weighted", limit, w),
            }
            .unwrap()
        })
}

fn change_case() -> impl Strategy<Value = Vec<(Policy, u64, u64)>> {
    (0u8..4).prop_flat_map(|kind| {
        proptest::collection::vec((changed_policy(kind), 0u64..=200_000_000, 0u64..=60), 1..50)
    })
}

/// Decides each step under its own numbers; every wait stays within the
/// policy's own horizon.
async fn change_run<S: Store>(
    store: &S,
    clock: &ManualClock,
    key: Arc<str>,
    steps: Vec<(Policy, u64, u64)>,
) -> Result<(), TestCaseError> {
    let mut now = START;
    for (policy, gap, cost) in steps {
        now += gap;
        clock.set(Duration::from_micros(now));
        // The weighted window still counts the previous window.
        let horizon = match policy.name() {
            "weighted" => 2 * policy.window(),
            _ => policy.window(),
        };
        let quota = Quota::new("q", [policy]).unwrap();
        let d = store.decide(&quota, &key, cost).await.unwrap();
        if let Some(wait) = d.retry_after(&quota) {
            prop_assert!(wait <= horizon, "wait {:?} over {:?}", wait, horizon);
            prop_assert!(wait > Duration::ZERO);
        }
    }
    Ok(())
}

struct Keys(AtomicU64);

impl Keys {
    fn next(&self) -> Arc<str> {
        format!("case{}", self.0.fetch_add(1, Ordering::Relaxed)).into()
    }
}

fn memory(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::with_clock(clock.clone())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Runs `cases` cases of `strategy` through `case`, each on a key of its
/// own, on one runtime.
fn run_cases<T: Strategy, F: std::future::Future<Output = Result<(), TestCaseError>>>(
    cases: u32,
    strategy: T,
    case: impl Fn(Arc<str>, T::Value) -> F,
) {
    let keys = Keys(AtomicU64::new(0));
    let rt = runtime();
    runner(cases)
        .run(&strategy, |value| rt.block_on(case(keys.next(), value)))
        .unwrap();
}

#[test]
fn settlement_never_breaks_the_bounds_in_memory() {
    let clock = ManualClock::default();
    let store = memory(&clock);
    run_cases(512, settlement_case(), |key, (case, ops)| {
        settle_run(&store, &clock, key, case, ops)
    });
}

#[test]
fn shadowed_policies_on_one_key_keep_their_bounds_through_settlement_in_memory() {
    let clock = ManualClock::default();
    let store = memory(&clock);
    run_cases(512, stacked_case(), |key, (specs, ops)| {
        stacked_run(&store, &clock, key, specs, ops)
    });
}

#[test]
fn changed_policies_never_lock_out_in_memory() {
    let clock = ManualClock::default();
    let store = memory(&clock);
    run_cases(512, change_case(), |key, steps| {
        change_run(&store, &clock, key, steps)
    });
}

/// One step of a [`redeploy_run`].
#[derive(Debug, Clone)]
enum DeployOp {
    /// An admission of `cost` on victim key `key` under the current deploy.
    Admit { gap: u64, key: usize, cost: u64 },
    /// A settle of an earlier admission, under the quota that admitted it.
    Settle { gap: u64, which: usize, delta: i64 },
    /// The next deploy: the same quota name and kinds, new numbers.
    Deploy { gap: u64 },
    /// `count` new keys of another quota, competing for the store's room.
    Flood { gap: u64, count: usize },
    /// A sweep of the store.
    Sweep { gap: u64 },
}

/// The numbers of one deploy: a sliding log, a token bucket and a fixed
/// window, in that order.
type Deploy = [Spec; 3];

/// A charge of a [`redeploy_run`]: the deploy and key it was admitted
/// under, when, its net cost in each policy, and its decision holding what
/// it still holds.
struct DeployCharge {
    deploy: usize,
    key: usize,
    at: u64,
    net: [u64; 3],
    decision: QuotaDecision,
}

fn deploy_quota(deploy: &Deploy) -> Quota {
    Quota::new(
        "q",
        [
            named("log", deploy[0]),
            named("bucket", deploy[1]),
            named("fixed", deploy[2]),
        ],
    )
    .unwrap()
}

/// Two victim keys of a quota of three policies, redeployed with new
/// numbers between admissions, on a store of 4 keys in 2 shards flooded by
/// another quota's keys and swept. Charges settle under the quota that
/// admitted them, also after a redeploy. In every deploy, every policy keeps
/// its bound over the admissions that deploy made, in every interval:
/// neither a settle under older numbers, nor the store's full outcome, nor
/// its sweeps, give a key more than its current numbers allow.
async fn redeploy_run(deploys: Vec<Deploy>, ops: Vec<DeployOp>) -> Result<(), TestCaseError> {
    use std::num::NonZeroUsize;
    let clock = ManualClock::new(Duration::from_micros(START));
    let store = MemoryStore::with_clock(clock.clone())
        .max_keys(NonZeroUsize::new(4).unwrap())
        .shards(NonZeroUsize::new(2).unwrap())
        .unwrap();
    let quotas: Vec<Quota> = deploys.iter().map(deploy_quota).collect();
    let flood = Quota::new(
        "flood",
        [Policy::fixed_window("f", 1, Duration::from_secs(3600)).unwrap()],
    )
    .unwrap();
    let victims: [Arc<str>; 2] = ["a".into(), "b".into()];
    let mut current = 0;
    let mut flooded = 0u64;
    let mut now = START;
    let mut charges: Vec<DeployCharge> = Vec::new();
    for op in ops {
        let gap = match op {
            DeployOp::Admit { gap, .. }
            | DeployOp::Settle { gap, .. }
            | DeployOp::Deploy { gap }
            | DeployOp::Flood { gap, .. }
            | DeployOp::Sweep { gap } => gap,
        };
        now += gap;
        clock.set(Duration::from_micros(now));
        let quota = &quotas[current];
        match op {
            DeployOp::Admit { key, cost, .. } => {
                // A full store refuses a victim that lost its state: as
                // closed, nothing is admitted.
                if let Ok(d) = store.decide(quota, &victims[key], cost).await {
                    if d.admitted {
                        charges.push(DeployCharge {
                            deploy: current,
                            key,
                            at: now,
                            net: [cost; 3],
                            decision: d,
                        });
                    }
                }
            }
            DeployOp::Settle { which, delta, .. } => {
                if charges.is_empty() {
                    continue;
                }
                let c = which % charges.len();
                let key = &victims[charges[c].key];
                let remaining = |d: QuotaDecision| [0, 1, 2].map(|i| d.decisions[i].remaining);
                let before = remaining(store.decide(quota, key, 0).await.unwrap());
                let admitted_under = &quotas[charges[c].deploy];
                let Ok(settled) = store
                    .settle(admitted_under, key, &charges[c].decision, delta)
                    .await
                else {
                    // A full store has no room for a key it dropped.
                    continue;
                };
                charges[c].decision = settled;
                let after = remaining(store.decide(quota, key, 0).await.unwrap());
                // What a refund gave back shows as capacity regained now.
                // It is counted only against a charge of this deploy: an
                // older one counts in no interval of this deploy.
                if delta < 0 && charges[c].deploy == current {
                    for k in 0..3 {
                        let back = after[k].saturating_sub(before[k]);
                        prop_assert!(
                            back <= delta.unsigned_abs() && back <= charges[c].net[k],
                            "policy {} gave back {} of {}",
                            k,
                            back,
                            charges[c].net[k]
                        );
                        charges[c].net[k] -= back;
                    }
                }
            }
            DeployOp::Deploy { .. } => current = (current + 1).min(quotas.len() - 1),
            DeployOp::Flood { count, .. } => {
                for _ in 0..count {
                    flooded += 1;
                    let key: Arc<str> = format!("flood-{flooded}").into();
                    let _ = store.decide(&flood, &key, 1).await;
                }
                prop_assert!(store.len() <= 4);
            }
            DeployOp::Sweep { .. } => {
                store.sweep();
            }
        }
        for (deploy, numbers) in deploys.iter().enumerate() {
            for key in 0..victims.len() {
                for (k, &(kind, limit, refill, window)) in numbers.iter().enumerate() {
                    let view: Vec<Charge> = charges
                        .iter()
                        .filter(|c| c.deploy == deploy && c.key == key)
                        .map(|c| Charge {
                            at: c.at,
                            net: c.net[k],
                            decision: QuotaDecision::new(true, []),
                        })
                        .collect();
                    check_bound(kind, limit, refill, window, &view)?;
                }
            }
        }
    }
    Ok(())
}

/// Up to four deploys of a log, a bucket and a fixed window, each of its own
/// numbers, and the operations between them.
fn redeploy_case() -> impl Strategy<Value = (Vec<Deploy>, Vec<DeployOp>)> {
    let spec = |kind: Kind| {
        (
            Just(kind),
            1u64..=20,
            1u64..=7,
            prop_oneof![Just(10_000u64), Just(60_000_000u64), 1_000u64..=5_000_000],
        )
    };
    let deploy = (spec(Kind::Log), spec(Kind::Bucket), spec(Kind::Fixed))
        .prop_map(|(log, bucket, fixed)| [log, bucket, fixed]);
    let gap = prop_oneof![
        3 => Just(0u64),
        3 => 1u64..=1_000_000,
        1 => 0u64..=120_000_000,
    ];
    let op = prop_oneof![
        6 => (gap.clone(), 0usize..2, 0u64..=22)
            .prop_map(|(gap, key, cost)| DeployOp::Admit { gap, key, cost }),
        4 => (gap.clone(), any::<usize>(), -22i64..=22)
            .prop_map(|(gap, which, delta)| DeployOp::Settle { gap, which, delta }),
        1 => gap.clone().prop_map(|gap| DeployOp::Deploy { gap }),
        1 => (gap.clone(), 1usize..8).prop_map(|(gap, count)| DeployOp::Flood { gap, count }),
        1 => gap.prop_map(|gap| DeployOp::Sweep { gap }),
    ];
    (
        proptest::collection::vec(deploy, 1..=4),
        proptest::collection::vec(op, 1..80),
    )
}

#[test]
fn redeploys_with_pending_settlements_keep_each_deploys_bounds_in_memory() {
    let rt = runtime();
    runner(4096)
        .run(&redeploy_case(), |(deploys, ops)| {
            rt.block_on(redeploy_run(deploys, ops))
        })
        .unwrap();
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use tower_admission::quota::RedisStore;

    fn store(server: &support::RedisServer, clock: &ManualClock) -> RedisStore {
        RedisStore::builder(server.url())
            .test_clock(clock.clone())
            .deadline(Duration::from_secs(10))
            .build()
            .unwrap()
    }

    #[test]
    fn settlement_never_breaks_the_bounds_in_redis() {
        let server = support::RedisServer::start();
        let clock = ManualClock::default();
        let store = store(&server, &clock);
        run_cases(128, settlement_case(), |key, (case, ops)| {
            settle_run(&store, &clock, key, case, ops)
        });
    }

    #[test]
    fn shadowed_policies_on_one_key_keep_their_bounds_through_settlement_in_redis() {
        let server = support::RedisServer::start();
        let clock = ManualClock::default();
        let store = store(&server, &clock);
        run_cases(128, stacked_case(), |key, (specs, ops)| {
            stacked_run(&store, &clock, key, specs, ops)
        });
    }

    #[test]
    fn changed_policies_never_lock_out_in_redis() {
        let server = support::RedisServer::start();
        let clock = ManualClock::default();
        let store = store(&server, &clock);
        run_cases(128, change_case(), |key, steps| {
            change_run(&store, &clock, key, steps)
        });
    }
}
