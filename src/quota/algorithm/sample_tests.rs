//! The sample API's numbers on the pure state machines and the memory store,
//! all on a manual clock (moved from `tests/quota_algorithms.rs`: the state
//! machines are crate-private).

use std::sync::Arc;
use std::time::Duration;

use crate::clock::{ManualClock, Timestamp};
use crate::quota::algorithm::Algorithm;
use crate::quota::{Limiter, MemoryStore, Policy, Quota, Store};
use proptest::prelude::*;

const MINUTE: Duration = Duration::from_secs(60);
/// 12:00:00 on some day, in whole minutes since the epoch.
const NOON: u64 = 29_000_000 * 60;

fn algorithm(policy: Policy) -> Algorithm {
    policy.algorithm().clone()
}

/// Steps `times` (µs) through `alg` at cost 1; returns how many were admitted.
fn admitted_at(alg: &Algorithm, times: impl IntoIterator<Item = u64>) -> u64 {
    let mut state = alg.fresh_state();
    let mut admitted = 0;
    for t in times {
        let (next, d) = alg.step(&state, Timestamp(t), 1);
        state = next;
        admitted += u64::from(d.admitted);
    }
    admitted
}

fn boundary_burst() -> Vec<u64> {
    let last_ms = Timestamp::from_secs(NOON + 59).as_micros() + 999_000; // 12:00:59.999
    let next_min = Timestamp::from_secs(NOON + 60).as_micros(); // 12:01:00.000
    let mut times = vec![last_ms; 100];
    times.extend(std::iter::repeat_n(next_min, 100));
    times
}

#[test]
fn fixed_window_admits_200_across_the_boundary() {
    let alg = algorithm(Policy::fixed_window("m", 100, MINUTE).unwrap());
    assert_eq!(admitted_at(&alg, boundary_burst()), 200);
}

#[test]
fn sliding_log_admits_exactly_100_across_the_boundary() {
    let alg = algorithm(Policy::sliding_log("m", 100, MINUTE).unwrap());
    assert_eq!(admitted_at(&alg, boundary_burst()), 100);
}

#[test]
fn sliding_log_identical_timestamps_are_distinct_entries() {
    let alg = algorithm(Policy::sliding_log("m", 100, MINUTE).unwrap());
    let t = Timestamp::from_secs(NOON).as_micros();
    let mut state = alg.fresh_state();
    for _ in 0..100 {
        state = alg.step(&state, Timestamp(t), 1).0;
    }
    assert_eq!(alg.check(&mut state.clone(), Timestamp(t), 0).remaining, 0);
    // The first admission leaves the window exactly W later: (t - W, t].
    let (_, before) = alg.step(&state, Timestamp(t + 60_000_000 - 1), 1);
    assert!(!before.admitted);
    assert_eq!(before.retry_after, Some(Duration::from_micros(1)));
    let (_, at) = alg.step(&state, Timestamp(t + 60_000_000), 100);
    assert!(at.admitted);
}

#[test]
fn token_bucket_admits_23_in_2s_and_120_in_60s() {
    let alg = algorithm(Policy::token_bucket("b", 20, 100, MINUTE).unwrap());
    let start = Timestamp::from_secs(NOON).as_micros();
    // Saturating demand: one request every millisecond, both ends included.
    assert_eq!(
        admitted_at(&alg, (0..=2_000).map(|ms| start + ms * 1_000)),
        23
    );
    assert_eq!(
        admitted_at(&alg, (0..=60_000).map(|ms| start + ms * 1_000)),
        120
    );
}

#[test]
fn weighted_window_estimates_from_the_previous_window() {
    let alg = algorithm(Policy::sliding_window("w", 100, MINUTE).unwrap());
    let start = Timestamp::from_secs(NOON).as_micros();
    let mut state = alg.fresh_state();
    for _ in 0..100 {
        state = alg.step(&state, Timestamp(start + 30_000_000), 1).0;
    }
    // 15 s into the next window the previous 100 weigh 75: 25 more fit.
    let t = start + 75_000_000;
    let mut admitted = 0;
    for _ in 0..40 {
        let (next, d) = alg.step(&state, Timestamp(t), 1);
        state = next;
        admitted += u64::from(d.admitted);
    }
    assert_eq!(admitted, 25);
    // Refused now; the exact wait is until the previous window weighs 74.
    let (_, d) = alg.step(&state, Timestamp(t), 1);
    assert_eq!(d.retry_after, Some(Duration::from_millis(600)));
    let (_, d) = alg.step(&state, Timestamp(t + 600_000), 1);
    assert!(d.admitted);
    let (_, d) = alg.step(&state, Timestamp(t + 599_999), 1);
    assert!(!d.admitted);
}

#[test]
fn cost_over_capacity_is_refused_forever() {
    for policy in all_policies(20) {
        let alg = algorithm(policy);
        let (state, d) = alg.step(&alg.fresh_state(), Timestamp::from_secs(NOON), 21);
        assert!(!d.admitted);
        assert!(d.cost_exceeds_limit());
        assert_eq!(d.retry_after, None);
        // A refusal consumes nothing: the whole limit is still available.
        let mut state = state;
        assert!(
            alg.check(&mut state, Timestamp::from_secs(NOON), 20)
                .admitted
        );
    }
}

fn all_policies(limit: u64) -> Vec<Policy> {
    vec![
        Policy::fixed_window("fixed", limit, MINUTE).unwrap(),
        Policy::sliding_log("log", limit, MINUTE).unwrap(),
        Policy::token_bucket("bucket", limit, limit, MINUTE).unwrap(),
        Policy::sliding_window("weighted", limit, MINUTE).unwrap(),
    ]
}

#[test]
fn retry_after_is_exact_and_a_retry_then_succeeds() {
    for policy in all_policies(10) {
        let alg = algorithm(policy.clone());
        let mut state = alg.fresh_state();
        let mut t = Timestamp::from_secs(NOON).as_micros() + 12_345_678;
        for _ in 0..10 {
            state = alg.step(&state, Timestamp(t), 1).0;
            t += 1_000;
        }
        let (same, refused) = alg.step(&state, Timestamp(t), 1);
        assert!(!refused.admitted, "{}", policy.name());
        assert_eq!(same, state, "{}: refusal recorded state", policy.name());
        let wait = refused.retry_after.unwrap().as_micros() as u64;
        assert!(wait >= 1);
        let (_, early) = alg.step(&state, Timestamp(t + wait - 1), 1);
        assert!(
            !early.admitted,
            "{}: admitted before retry_after",
            policy.name()
        );
        let (_, on_time) = alg.step(&state, Timestamp(t + wait), 1);
        assert!(
            on_time.admitted,
            "{}: refused at retry_after",
            policy.name()
        );
    }
}

#[test]
fn clock_set_backwards_inflates_no_quota() {
    for policy in all_policies(10) {
        let alg = algorithm(policy.clone());
        let t = Timestamp::from_secs(NOON + 59).as_micros();
        let mut state = alg.fresh_state();
        let mut admitted = 0;
        for _ in 0..10 {
            let (next, d) = alg.step(&state, Timestamp(t), 1);
            state = next;
            admitted += u64::from(d.admitted);
        }
        // The clock jumps back an hour and then forward only to t.
        for back in [t - 3_600_000_000, t - 1, t] {
            let (next, d) = alg.step(&state, Timestamp(back), 1);
            state = next;
            admitted += u64::from(d.admitted);
        }
        assert_eq!(admitted, 10, "{}", policy.name());
    }
}

#[test]
fn memory_store_clock_rollback_inflates_nothing() {
    let clock = ManualClock::new(Duration::from_secs(NOON + 30));
    let store = MemoryStore::with_clock(clock.clone());
    let quota = Quota::new("q", [Policy::fixed_window("fixed", 5, MINUTE).unwrap()]).unwrap();
    let key: Arc<str> = "alice".into();
    let mut admitted = 0;
    for _ in 0..5 {
        admitted += u64::from(store.decide(&quota, &key, 1).into_inner().unwrap().admitted);
    }
    clock.set(Duration::from_secs(NOON - 120));
    for _ in 0..5 {
        admitted += u64::from(store.decide(&quota, &key, 1).into_inner().unwrap().admitted);
    }
    assert_eq!(admitted, 5);
}

#[tokio::test]
async fn multiple_policies_refusal_consumes_nothing() {
    let clock = ManualClock::new(Duration::from_secs(NOON));
    let store = MemoryStore::with_clock(clock.clone());
    let quota = Quota::new(
        "free",
        [
            Policy::sliding_log("per-minute", 100, MINUTE).unwrap(),
            Policy::token_bucket("burst", 20, 100, MINUTE).unwrap(),
        ],
    )
    .unwrap();
    let key: Arc<str> = "alice".into();
    let mut admitted = 0;
    // One request every 10 ms for 60 s, [0, 60 s): the bucket alone would
    // allow 120, the log allows exactly 100.
    for _ in 0..6_000 {
        admitted += u64::from(store.decide(&quota, &key, 1).into_inner().unwrap().admitted);
        clock.advance(Duration::from_millis(10));
    }
    assert_eq!(admitted, 100);

    // A refusal by one policy takes nothing from the other: 10 per minute
    // fixed plus a bucket of 20; 20 requests at once leave the bucket at 10.
    let quota = Quota::new(
        "tight",
        [
            Policy::fixed_window("per-minute", 10, MINUTE).unwrap(),
            Policy::token_bucket("burst", 20, 100, MINUTE).unwrap(),
        ],
    )
    .unwrap();
    let limiter = Limiter::new(store);
    let mut verdicts = Vec::new();
    for _ in 0..20 {
        verdicts.push(limiter.check(&quota, &key, 1).await);
    }
    assert_eq!(verdicts.iter().filter(|v| v.is_admitted()).count(), 10);
    // The refused request reports the bucket as it is: 10 left, not 9.
    let last = verdicts.last().unwrap();
    assert_eq!(last.decisions()[1].remaining, 10);
}

#[tokio::test]
async fn shadow_policy_never_refuses_but_reports() {
    let clock = ManualClock::new(Duration::from_secs(NOON));
    let limiter = Limiter::new(MemoryStore::with_clock(clock));
    let quota = Quota::new(
        "q",
        [
            Policy::fixed_window("enforced", 10, MINUTE).unwrap(),
            Policy::fixed_window("trial", 3, MINUTE).unwrap().shadow(),
        ],
    )
    .unwrap();
    let key: Arc<str> = "k".into();
    let mut verdicts = Vec::new();
    for _ in 0..12 {
        verdicts.push(limiter.check(&quota, &key, 1).await);
    }
    assert_eq!(verdicts.iter().filter(|v| v.is_admitted()).count(), 10);
    // The trial policy would have refused from the 4th request on.
    assert_eq!(
        verdicts
            .iter()
            .filter(|v| !v.decisions()[1].admitted)
            .count(),
        9
    );
    let stats = limiter.stats();
    assert_eq!(
        (stats.admitted, stats.refused, stats.shadow_refusals),
        (10, 2, 9)
    );
    // Refusals name only the enforcing policy.
    assert_eq!(
        verdicts[11].refusing_policies(),
        [Arc::<str>::from("enforced")]
    );
    assert!(verdicts[11].retry_after().is_some());
}

#[test]
fn settle_charges_and_refunds_within_bounds() {
    for policy in all_policies(100) {
        let clock = ManualClock::new(Duration::from_secs(NOON));
        let store = MemoryStore::with_clock(clock);
        let quota = Quota::new("q", [policy.clone()]).unwrap();
        let key: Arc<str> = "k".into();
        let remaining = || {
            store
                .decide(&quota, &key, 0)
                .into_inner()
                .unwrap()
                .decisions[0]
                .remaining
        };
        let d = store.decide(&quota, &key, 50).into_inner().unwrap();
        assert_eq!(d.decisions[0].remaining, 50, "{}", policy.name());
        let settled = store.settle(&quota, &key, &d, -20).into_inner().unwrap();
        assert_eq!(remaining(), 70, "{}", policy.name());
        let settled = store
            .settle(&quota, &key, &settled, 500)
            .into_inner()
            .unwrap();
        assert_eq!(remaining(), 0, "{}: charge capped at empty", policy.name());
        store
            .settle(&quota, &key, &settled, -1_000)
            .into_inner()
            .unwrap();
        assert_eq!(
            remaining(),
            30,
            "{}: a refund gives back only what the charge still holds (30), not the extra charge",
            policy.name()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Token bucket: no interval of length T admits more than floor(B + r*T).
    #[test]
    fn token_bucket_never_exceeds_capacity_plus_refill(
        gaps in prop::collection::vec(0u64..2_000_000, 1..300),
        costs in prop::collection::vec(1u64..4, 300),
    ) {
        let alg = algorithm(Policy::token_bucket("b", 20, 100, MINUTE).unwrap());
        let interval = 600_000u64; // µs per token
        let mut state = alg.fresh_state();
        let mut t = Timestamp::from_secs(NOON).as_micros();
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (gap, cost) in gaps.iter().zip(&costs) {
            t += gap;
            let (next, d) = alg.step(&state, Timestamp(t), *cost);
            state = next;
            if d.admitted { admitted.push((t, *cost)); }
        }
        for (i, &(start, _)) in admitted.iter().enumerate() {
            let mut sum = 0;
            for &(end, cost) in &admitted[i..] {
                sum += cost;
                let bound = 20 + (end - start) / interval;
                prop_assert!(sum <= bound, "{} admitted in {} µs, bound {}", sum, end - start, bound);
            }
        }
    }

    /// Sliding log: no window (t - W, t] ever holds more than L.
    #[test]
    fn sliding_log_never_exceeds_limit_in_any_window(
        gaps in prop::collection::vec(0u64..3_000_000, 1..400),
        costs in prop::collection::vec(1u64..5, 400),
    ) {
        let alg = algorithm(Policy::sliding_log("l", 30, Duration::from_secs(10)).unwrap());
        let w = 10_000_000u64;
        let mut state = alg.fresh_state();
        let mut t = Timestamp::from_secs(NOON).as_micros();
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (gap, cost) in gaps.iter().zip(&costs) {
            t += gap;
            let (next, d) = alg.step(&state, Timestamp(t), *cost);
            state = next;
            if d.admitted { admitted.push((t, *cost)); }
        }
        for &(end, _) in &admitted {
            let in_window: u64 = admitted.iter().filter(|(s, _)| *s + w > end && *s <= end).map(|(_, c)| c).sum();
            prop_assert!(in_window <= 30, "window ending {} holds {}", end, in_window);
        }
    }

    /// Token bucket against governor: the same decision for every request,
    /// from the pure state machine and from the memory store's compact
    /// bucket table (whose one-pass step must equal check then record).
    /// Rates of whole and of fractional µs: 100/min, 3/s, 7/min, 6 per 7 s
    /// (governor keeps the interval in whole ns, which stays exact enough
    /// at millisecond request times over these runs).
    #[test]
    fn token_bucket_matches_governor(
        (refill, period) in prop_oneof![
            Just((100u32, MINUTE)),
            Just((3, Duration::from_secs(1))),
            Just((7, MINUTE)),
            Just((6, Duration::from_secs(7))),
        ],
        gaps in prop::collection::vec(0u64..1_500, 1..400),
        costs in prop::collection::vec(1u32..6, 400),
    ) {
        use governor::clock::FakeRelativeClock;
        use governor::{Quota as GQuota, RateLimiter};
        use std::num::NonZeroU32;

        let gclock = FakeRelativeClock::default();
        let quota = GQuota::with_period(period / refill).unwrap().allow_burst(NonZeroU32::new(20).unwrap());
        let governor = RateLimiter::direct_with_clock(quota, gclock.clone());
        let policy = Policy::token_bucket("b", 20, u64::from(refill), period).unwrap();
        let alg = algorithm(policy.clone());
        let clock = ManualClock::new(Duration::ZERO);
        let store = MemoryStore::with_clock(clock.clone());
        let quota = Quota::new("q", [policy]).unwrap();
        let key: Arc<str> = "k".into();
        let mut state = alg.fresh_state();
        let mut t = 0u64; // ms since both clocks' start
        for (gap, cost) in gaps.iter().zip(&costs) {
            t += gap;
            gclock.advance(Duration::from_millis(*gap));
            clock.set(Duration::from_millis(t));
            let theirs = matches!(governor.check_n(NonZeroU32::new(*cost).unwrap()), Ok(Ok(())));
            let (next, ours) = alg.step(&state, Timestamp(t * 1_000), u64::from(*cost));
            state = next;
            prop_assert_eq!(ours.admitted, theirs, "at {} ms cost {}", t, cost);
            let stored = store.decide(&quota, &key, u64::from(*cost)).into_inner().unwrap();
            prop_assert_eq!(&stored.decisions[..], &[ours][..], "at {} ms cost {}", t, cost);
        }
    }
}
