use super::*;
use proptest::prelude::*;
use std::time::Duration;

const SECOND: u64 = 1_000_000;
const MINUTE: u64 = 60 * SECOND;
/// Some real-looking time, µs.
const T0: u64 = 1_700_000_000 * SECOND;

fn bucket(capacity: u64, refill: u64, period: u64) -> TokenBucket {
    TokenBucket::new(capacity, refill, period).unwrap()
}

fn wait_micros(d: &Decision) -> u64 {
    d.retry_after.map_or(0, |w| w.as_micros() as u64)
}

/// The general path (u128 units), bypassing the whole-µs one.
fn step_general(
    b: &TokenBucket,
    s: &mut TokenBucketState,
    now: u64,
    cost: u64,
) -> (Decision, Hold) {
    let tat = b.prepare(s, now);
    let (decision, next) = b.decide(tat, now, cost);
    if !decision.admitted {
        return (decision, Hold::default());
    }
    b.store(s, now, tat, next);
    (decision, b.hold_at(s, next, cost))
}

/// `floor(B + refill * t / period)`.
fn bound(capacity: u64, refill: u64, period: u64, t: u64) -> u128 {
    u128::from(capacity) + u128::from(t) * u128::from(refill) / u128::from(period)
}

/// Net events `(time, cost)` in time order: the most in any interval
/// `[t1, t2]` must stay within `floor(B + r (t2 - t1))`.
fn assert_interval_bound(events: &[(u64, i128)], capacity: u64, refill: u64, period: u64) {
    for i in 0..events.len() {
        let mut sum = 0i128;
        for e in &events[i..] {
            sum += e.1;
            let b = bound(capacity, refill, period, e.0 - events[i].0) as i128;
            assert!(
                sum <= b,
                "{sum} net in [{}, {}] ({} µs), bound {b}",
                events[i].0,
                e.0,
                e.0 - events[i].0
            );
        }
    }
}

#[test]
fn any_positive_rate_is_accepted() {
    for (capacity, refill, period) in [
        (10, 3, SECOND),
        (5, 7, MINUTE),
        (7, 6, 7 * SECOND),
        (20, 100, MINUTE),
        (1, u64::from(u32::MAX), 1),
        (1, 1, 1),
        (u64::MAX / 8, 1_000_000, SECOND),
    ] {
        let b = TokenBucket::new(capacity, refill, period).unwrap();
        assert_eq!(b.limit(), capacity);
    }
    let b = bucket(10, 3, SECOND);
    assert_eq!(b.interval_micros(), (1_000_000, 3));
    assert_eq!(b.window_micros(), 3_333_334);
    #[cfg(feature = "redis")]
    assert_eq!(b.script_args(), [10, 1_000_000, 3]);
    assert_eq!(bucket(20, 100, MINUTE).interval_micros(), (600_000, 1));
    assert_eq!(bucket(7, 6, 7 * SECOND).window_micros(), 8_166_667);
}

#[test]
fn unrepresentable_numbers_are_refused_with_their_field() {
    let field = |c, r, p| TokenBucket::new(c, r, p).unwrap_err().field();
    assert_eq!(field(0, 1, 1), "capacity");
    assert_eq!(field(1, 0, 1), "refill");
    assert_eq!(field(1, 1, 0), "period");
    // 1 µs / (2^32 + 1): the denominator does not fit in u32.
    assert_eq!(field(1, (1 << 32) + 1, 1), "refill");
    assert_eq!(field(1, u64::MAX, SECOND), "refill");
    // A common factor keeps it: 2^33 per 2^10 µs is 2^23 per µs.
    assert!(TokenBucket::new(1, 1 << 33, 1 << 10).is_ok());
    assert_eq!(field(u64::MAX, 1, 8), "capacity");
    assert_eq!(field(1, 1, u64::MAX), "capacity");
    // Through the policy constructor.
    let err = crate::quota::Policy::token_bucket("b", 1, 0, Duration::from_secs(1)).unwrap_err();
    assert_eq!(err.field(), "refill");
    assert!(crate::quota::Policy::token_bucket("b", 10, 3, Duration::from_secs(1)).is_ok());
    assert!(crate::quota::Policy::token_bucket("b", 5, 7, Duration::from_secs(60)).is_ok());
    assert!(crate::quota::Policy::token_bucket("b", 5, 6, Duration::from_secs(7)).is_ok());
}

#[cfg(feature = "redis")]
#[test]
fn lua_exact_limits() {
    assert!(bucket(20, 100, MINUTE).lua_exact().is_ok());
    assert!(bucket(10, 3, SECOND).lua_exact().is_ok());
    assert!(bucket(1 << 40, 1_000_000, SECOND).lua_exact().is_ok());
    // Whole µs: up to 2^50 µs to refill from empty.
    assert!(bucket(1 << 50, 1, 1).lua_exact().is_ok());
    assert_eq!(
        bucket((1 << 50) + 1, 1, 1).lua_exact().unwrap_err().field(),
        "capacity"
    );
    // Fractions: capacity <= 2^45, window < 2^45 µs.
    assert!(bucket(1 << 45, 3, 1).lua_exact().is_ok());
    assert_eq!(
        bucket((1 << 45) + 1, 3, 1).lua_exact().unwrap_err().field(),
        "capacity"
    );
    assert_eq!(
        bucket(1 << 21, 3, 1 << 26).lua_exact().unwrap_err().field(),
        "capacity"
    );
    assert_eq!(
        bucket(1, 3, (1 << 46) + 1).lua_exact().unwrap_err().field(),
        "period"
    );
}

#[test]
fn share_divides_capacity_and_rate_exactly() {
    let b = bucket(10, 3, SECOND).share(3);
    assert_eq!((b.limit(), b.interval_micros()), (3, (1_000_000, 1)));
    let b = bucket(20, 100, MINUTE).share(7);
    assert_eq!((b.limit(), b.interval_micros()), (2, (4_200_000, 1)));
    let b = bucket(1, 1, 1).share(u64::MAX);
    assert_eq!(b.limit(), 1);
    assert!(b.window_micros() <= MAX_WINDOW);
    let b = bucket(u64::MAX / 8, 1, 1).share(0);
    assert_eq!(b, bucket(u64::MAX / 8, 1, 1));
}

/// Saturating demand, one request of cost 1 every `every` µs from `start`
/// for `span` µs, both ends included; returns how many were admitted.
fn saturate(b: &TokenBucket, start: u64, span: u64, every: u64) -> u64 {
    let mut s = TokenBucketState::default();
    let mut admitted = 0;
    let mut t = start;
    while t <= start + span {
        admitted += u64::from(b.step_in_place(&mut s, t, 1).0.admitted);
        t += every;
    }
    admitted
}

#[test]
fn admits_23_in_2s_and_120_in_60s() {
    let b = bucket(20, 100, MINUTE);
    assert_eq!(saturate(&b, T0, 2 * SECOND, 1_000), 23);
    assert_eq!(saturate(&b, T0, 60 * SECOND, 1_000), 120);
    // The same with the check-then-record path.
    let mut s = TokenBucketState::default();
    let mut admitted = 0;
    for ms in 0..=60_000 {
        let now = T0 + ms * 1_000;
        if b.check(&mut s, now, 1).admitted {
            b.record(&mut s, now, 1);
            admitted += 1;
        }
    }
    assert_eq!(admitted, 120);
}

#[test]
fn fractional_rates_admit_exactly_floor_b_plus_rt() {
    // 10 per 3/s: 3 s later 10 + 9; 7 per minute: 60 s later 5 + 7.
    for (capacity, refill, period, span) in [
        (10, 3, SECOND, 3 * SECOND),
        (10, 3, SECOND, 3 * SECOND - 1),
        (5, 7, MINUTE, MINUTE),
        (5, 7, MINUTE, 17 * SECOND),
        (7, 6, 7 * SECOND, 7 * SECOND),
        (7, 6, 7 * SECOND, 7 * SECOND + 3_500_000),
    ] {
        let b = bucket(capacity, refill, period);
        assert_eq!(
            u128::from(saturate(&b, T0, span, 1)),
            bound(capacity, refill, period, span),
            "{capacity} per {refill}/{period} over {span}"
        );
    }
}

/// Greedy demand: a request of cost 1 at `t`, and after a refusal the
/// next one exactly `retry_after` later (checking the wait is exact).
/// Returns the count admitted in `[start, start + span]`.
fn greedy(b: &TokenBucket, s: &mut TokenBucketState, start: u64, span: u64) -> u64 {
    let mut t = start;
    let mut admitted = 0;
    while t <= start + span {
        let (d, _) = b.step_in_place(s, t, 1);
        if d.admitted {
            admitted += 1;
        } else {
            let wait = wait_micros(&d);
            assert!(wait >= 1);
            assert!(!b.check(&mut s.clone(), t + wait - 1, 1).admitted);
            t += wait;
        }
    }
    admitted
}

#[test]
fn no_drift_over_a_million_periods() {
    for (capacity, refill, period) in [(10, 3, SECOND), (5, 7, MINUTE), (7, 6, 7 * SECOND)] {
        let b = bucket(capacity, refill, period);
        let mut s = TokenBucketState::default();
        // Empty the bucket, then a long idle of 10^6 periods.
        for _ in 0..capacity {
            assert!(b.step_in_place(&mut s, T0, 1).0.admitted);
        }
        let start = T0 + 1_000_000 * period;
        // A steady stream of 10^6 periods, then a bit more.
        let span = 1_000_000 * period;
        let admitted = greedy(&b, &mut s, start, span);
        assert_eq!(u128::from(admitted), bound(capacity, refill, period, span));
        // The TAT is exactly where the count says: the next token comes
        // at start + (admitted - capacity + 1) intervals.
        let (p, q) = b.interval_micros();
        let next =
            u128::from(start) * u128::from(q) + u128::from(admitted - capacity + 1) * u128::from(p);
        let at = next.div_ceil(u128::from(q)) as u64;
        assert!(!b.check(&mut s.clone(), at - 1, 1).admitted);
        assert!(b.check(&mut s.clone(), at, 1).admitted);
        let more = greedy(&b, &mut s, start + span + 1, period * 3 + 17);
        assert_eq!(
            u128::from(admitted + more),
            bound(capacity, refill, period, span + 1 + period * 3 + 17)
        );
    }
}

#[test]
fn refund_gives_nothing_back_once_the_tokens_refilled() {
    // B = 10, 1 token/s.
    let b = bucket(10, 1, SECOND);
    let mut s = TokenBucketState::default();
    let (d, a) = b.step_in_place(&mut s, T0, 10);
    assert!(d.admitted);
    assert_eq!(a.amount, 10);
    let t = T0 + 9_900_000;
    let (d, _) = b.step_in_place(&mut s, t, 9);
    assert!(d.admitted);
    let after = b.settle(&mut s, t, a, -10);
    assert_eq!(after, a, "A's tokens have refilled: nothing to give back");
    assert!(!b.check(&mut s, t, 10).admitted);
    // The same through check then record.
    let mut s = TokenBucketState::default();
    assert!(b.check(&mut s, T0, 10).admitted);
    let a = b.record(&mut s, T0, 10);
    assert!(b.check(&mut s, t, 9).admitted);
    b.record(&mut s, t, 9);
    assert_eq!(b.settle(&mut s, t, a, -10).amount, 10);
    assert!(!b.check(&mut s, t, 10).admitted);
}

#[test]
fn refund_gives_back_what_the_charge_still_holds() {
    let b = bucket(10, 1, SECOND);
    let mut s = TokenBucketState::default();
    let (_, a) = b.step_in_place(&mut s, T0, 10);
    // 2.5 s later 7 of A's tokens are still ahead (7.5, rounded down).
    let t = T0 + 2_500_000;
    let a = b.settle(&mut s, t, a, -4);
    assert_eq!(a.amount, 6);
    let a2 = b.settle(&mut s, t, a, -100);
    assert_eq!(a2.amount, 3, "7 in all, never 4 + 6");
    assert_eq!(b.settle(&mut s, t, a2, -100), a2);
    assert_eq!(b.check(&mut s, t, 0).remaining, 9);
    // An extra charge is capped at what is left and not refundable.
    let h = b.settle(&mut s, t, a2, 50);
    assert_eq!(h, a2);
    assert_eq!(b.check(&mut s, t, 0).remaining, 0);
    let d = b.check(&mut s, t, 1);
    assert_eq!(d.retry_after, Some(Duration::from_millis(500)));
}

#[test]
fn holds_behind_an_earlier_refund_claim_nothing_twice() {
    // B = 10, 1 token/s. A1 and A2 take 5 each, A1 is refunded in full,
    // A3 takes 5: A2's tokens moved to where A1's were, A3 sits where A2
    // was. Later A2 and A3 are refunded: only A3's tokens can come back.
    let b = bucket(10, 1, SECOND);
    let mut s = TokenBucketState::default();
    let (_, a1) = b.step_in_place(&mut s, T0, 5);
    let (_, a2) = b.step_in_place(&mut s, T0, 5);
    assert_eq!(b.settle(&mut s, T0, a1, -5).amount, 0);
    let (d, a3) = b.step_in_place(&mut s, T0, 5);
    assert!(d.admitted);
    let t = T0 + 6 * SECOND;
    let (d, _) = b.step_in_place(&mut s, t, 4);
    assert!(d.admitted);
    assert_eq!(
        b.settle(&mut s, t, a2, -5).amount,
        5,
        "A2's tokens have refilled"
    );
    assert_eq!(b.settle(&mut s, t, a3, -5).amount, 1, "4 of A3's are ahead");
    // Net admitted at t: 4, plus what is left now: never more than B.
    assert_eq!(b.check(&mut s, t, 0).remaining, 6);
}

#[test]
fn a_refund_of_another_life_gives_nothing_back() {
    let b = bucket(10, 10, MINUTE);
    let mut lost = TokenBucketState::default();
    let (d, a) = b.step_in_place(&mut lost, T0, 10);
    assert!(d.admitted);
    // The store lost the state; B's charge 1 ms later begins a new life.
    let t = T0 + 1_000;
    let mut s = TokenBucketState::default();
    let (d, h) = b.step_in_place(&mut s, t, 10);
    assert!(d.admitted);
    assert_eq!((a.life, h.life), (T0, t));
    assert_eq!(b.settle(&mut s, t, a, -10), a);
    assert_eq!(b.check(&mut s, t, 0).remaining, 0);
    // B's own refund reaches its charge.
    assert_eq!(b.settle(&mut s, t, h, -10).amount, 0);
    assert_eq!(b.check(&mut s, t, 0).remaining, 10);
}

#[test]
fn a_life_survives_changed_numbers_and_ends_when_fresh() {
    let small = bucket(10, 1, SECOND);
    let big = bucket(20, 1, SECOND);
    let mut s = TokenBucketState::default();
    let (_, h) = small.step_in_place(&mut s, T0, 5);
    // Redeployed with a larger capacity: the state is converted.
    let (d, later) = big.step_in_place(&mut s, T0, 1);
    assert!(d.admitted);
    assert_eq!((h.life, later.life), (T0, T0));
    assert_eq!(big.settle(&mut s, T0, h, -5).amount, 0);
    assert_eq!(big.check(&mut s, T0, 0).remaining, 19);
    // And with a smaller one: clamped, same life.
    big.step_in_place(&mut s, T0, 19);
    let tiny = bucket(5, 1, SECOND);
    assert_eq!(tiny.check(&mut s, T0, 0).remaining, 0);
    assert_eq!(s.born, T0);
    // Read as fresh and written again: a new life.
    let fresh = s.fresh_at();
    s.read_fresh(fresh);
    let (_, next) = tiny.step_in_place(&mut s, fresh, 1);
    assert_eq!(next.life, fresh);
}

#[test]
fn changed_capacity_takes_effect_at_once_and_waits_stay_bounded() {
    let big = bucket(1_000, 1, SECOND);
    let small = bucket(10, 1, SECOND);
    let mut s = TokenBucketState::default();
    assert!(big.step_in_place(&mut s, T0, 1_000).0.admitted);
    // Under the small bucket the state is more than empty: clamped.
    let d = small.check(&mut s, T0, 1);
    assert_eq!(d.retry_after, Some(Duration::from_secs(1)));
    assert_eq!(d.reset, Duration::from_secs(10));
    assert!(small.check(&mut s, T0 + SECOND, 1).admitted);
    // Back to the big one: the TAT kept is the small one's.
    assert_eq!(big.check(&mut s, T0 + SECOND, 0).remaining, 991);
}

#[test]
fn changed_denominator_rounds_the_tat_up() {
    let thirds = bucket(10, 3, SECOND);
    let whole = bucket(10, 1, SECOND);
    let mut s = TokenBucketState::default();
    thirds.step_in_place(&mut s, T0, 1); // TAT = T0 + 333,333 1/3 µs
    assert_eq!((s.tat, s.frac, s.den), (T0 + 333_333, 1, 3));
    let d = whole.check(&mut s, T0, 10);
    assert_eq!(d.retry_after, Some(Duration::from_micros(333_334)));
    assert_eq!((s.tat, s.frac, s.den), (T0 + 333_334, 0, 0));
    assert_eq!(s.off, 1);
}

#[test]
fn clock_set_back_admits_and_refunds_nothing_extra() {
    let b = bucket(10, 1, 6 * SECOND);
    let mut s = TokenBucketState::default();
    let t = T0 + 59 * SECOND;
    let mut holds = Vec::new();
    for _ in 0..10 {
        let (d, h) = b.step_in_place(&mut s, t, 1);
        assert!(d.admitted);
        holds.push(h);
    }
    let back = t - 3_600 * SECOND;
    let d = b.check(&mut s, back, 1);
    assert!(!d.admitted);
    for now in [back, t - 1, t] {
        assert!(!b.step_in_place(&mut s, now, 1).0.admitted);
    }
    // A refund at the earlier time counts from the state's own time:
    // the same as at `t`.
    let mut at_t = s.clone();
    let h = b.settle(&mut s, back, holds[9], -5);
    assert_eq!(h, b.settle(&mut at_t, t, holds[9], -5));
    assert_eq!(s, at_t);
    assert_eq!(h.amount, 0);
    assert_eq!(b.check(&mut s, t, 0).remaining, 1);
}

#[test]
fn extreme_numbers_never_overflow() {
    let buckets = [
        bucket(1, 1, 1),
        bucket(MAX_WINDOW, 1, 1),
        bucket(1, 1, MAX_WINDOW),
        bucket(u64::MAX, u64::from(u32::MAX), 1),
        bucket(u64::MAX / 8, 3, 1),
        bucket(3, u64::from(u32::MAX) - 4, u64::MAX / 4),
    ];
    let times = [0, 1, T0, u64::MAX / 2, u64::MAX - 1, u64::MAX];
    let costs = [0, 1, 3, u64::MAX / 3, u64::MAX - 1, u64::MAX];
    let deltas = [i64::MIN, -1, 0, 1, i64::MAX];
    for a in &buckets {
        for b in &buckets {
            for &t in &times {
                for &c in &costs {
                    let mut s = TokenBucketState::default();
                    let (_, h) = a.step_in_place(&mut s, t, c);
                    a.record(&mut s, t, c);
                    for &t2 in &times {
                        let mut s2 = s.clone();
                        b.check(&mut s2, t2, c);
                        b.step_in_place(&mut s2, t2, c);
                        for &delta in &deltas {
                            let mut s3 = s2.clone();
                            b.settle(&mut s3, t2, h, delta);
                            b.settle(
                                &mut s3,
                                t2,
                                Hold {
                                    mark: u64::MAX,
                                    frac: u64::MAX,
                                    amount: u64::MAX,
                                    life: u64::MAX,
                                },
                                delta,
                            );
                            let _ = b.fresh_at(&s3);
                        }
                    }
                }
            }
        }
    }
}

fn rate() -> impl Strategy<Value = (u64, u64, u64)> {
    prop_oneof![
        Just((20, 100, MINUTE)),
        Just((10, 3, SECOND)),
        Just((5, 7, MINUTE)),
        Just((7, 6, 7 * SECOND)),
        Just((4, 3, 2)), // 2/3 µs per token
        (1u64..30, 1u64..20, 1u64..5_000_000),
    ]
}

#[derive(Debug, Clone)]
enum Op {
    Take {
        gap: u64,
        cost: u64,
    },
    Refund {
        gap: u64,
        which: prop::sample::Index,
        amount: u64,
    },
    Extra {
        gap: u64,
        which: prop::sample::Index,
        amount: u64,
    },
}

/// A gap in units of a tenth of the interval, often zero.
fn gap() -> impl Strategy<Value = u64> {
    prop_oneof![2 => Just(0u64), 6 => 0u64..30, 1 => 0u64..300]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (gap(), 0u64..8).prop_map(|(gap, cost)| Op::Take { gap, cost }),
        3 => (gap(), any::<prop::sample::Index>(), 1u64..12)
            .prop_map(|(gap, which, amount)| Op::Refund { gap, which, amount }),
        1 => (gap(), any::<prop::sample::Index>(), 1u64..6)
            .prop_map(|(gap, which, amount)| Op::Extra { gap, which, amount }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Admissions, refunds of any earlier charge in any order, and extra
    /// charges: the net cost in every interval stays within
    /// floor(B + r * T), each charge counted at its own time.
    #[test]
    fn net_admitted_stays_within_the_bound_with_settlements(
        (capacity, refill, period) in rate(),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let b = bucket(capacity, refill, period);
        let tenth = (period / refill / 10).max(1);
        let mut s = TokenBucketState::default();
        let mut now = T0;
        // (time, net cost) per event; the hold and event index per charge.
        let mut events: Vec<(u64, i128)> = Vec::new();
        let mut charges: Vec<(usize, Hold)> = Vec::new();
        for op in ops {
            match op {
                Op::Take { gap, cost } => {
                    now += gap * tenth;
                    let (d, h) = b.step_in_place(&mut s, now, cost);
                    if d.admitted {
                        prop_assert_eq!(h.amount, cost);
                        events.push((now, i128::from(cost)));
                        charges.push((events.len() - 1, h));
                    }
                }
                Op::Refund { gap, which, amount } => {
                    now += gap * tenth;
                    if charges.is_empty() { continue; }
                    let i = which.index(charges.len());
                    let (e, h) = charges[i];
                    let after = b.settle(&mut s, now, h, -(amount as i64));
                    prop_assert!(after.amount <= h.amount);
                    events[e].1 -= i128::from(h.amount - after.amount);
                    prop_assert!(events[e].1 >= 0);
                    charges[i].1 = after;
                }
                Op::Extra { gap, which, amount } => {
                    now += gap * tenth;
                    if charges.is_empty() { continue; }
                    let h = charges[which.index(charges.len())].1;
                    let before = b.check(&mut s.clone(), now, 0).remaining;
                    prop_assert_eq!(b.settle(&mut s, now, h, amount as i64), h);
                    let after = b.check(&mut s.clone(), now, 0).remaining;
                    prop_assert_eq!(before - after, amount.min(before));
                    events.push((now, i128::from(before - after)));
                }
            }
        }
        assert_interval_bound(&events, capacity, refill, period);
    }

    /// Every rate, every demand: never more than floor(B + r * T) in any
    /// interval, and each refusal's wait is exact.
    #[test]
    fn admitted_stays_within_the_bound_and_waits_are_exact(
        (capacity, refill, period) in rate(),
        steps in prop::collection::vec((gap(), 0u64..6), 1..300),
    ) {
        let b = bucket(capacity, refill, period);
        let tenth = (period / refill / 10).max(1);
        let mut s = TokenBucketState::default();
        let mut now = T0;
        let mut events = Vec::new();
        for (gap, cost) in steps {
            now += gap * tenth;
            let before = s.clone();
            let (d, _) = b.step_in_place(&mut s, now, cost);
            if d.admitted {
                events.push((now, i128::from(cost)));
            } else if let Some(wait) = d.retry_after {
                prop_assert_eq!(&s, &before);
                let wait = wait.as_micros() as u64;
                prop_assert!(wait >= 1 && wait <= b.window_micros());
                prop_assert!(!b.check(&mut s.clone(), now + wait - 1, cost).admitted);
                prop_assert!(b.check(&mut s.clone(), now + wait, cost).admitted);
            } else {
                prop_assert!(cost > capacity);
            }
        }
        assert_interval_bound(&events, capacity, refill, period);
    }

    /// The one-pass whole-µs path and the general path agree: decisions,
    /// holds and states.
    #[test]
    fn whole_micros_path_equals_the_general_path(
        capacity in prop_oneof![1u64..50, 1u64..(1 << 40)],
        interval in prop_oneof![1u64..10, 1u64..10_000_000],
        steps in prop::collection::vec((0u64..30_000_000, 0u64..60, -40i64..40, any::<bool>()), 1..200),
    ) {
        let interval = interval.min(MAX_WINDOW / capacity).max(1);
        let b = bucket(capacity, 1, interval);
        let mut fast = TokenBucketState::default();
        let mut general = TokenBucketState::default();
        let mut now = T0;
        let mut holds = Vec::new();
        for (gap, cost, delta, checked) in steps {
            now += gap % (interval * 3 + 1);
            let (df, hf) = if checked {
                let d = b.check(&mut fast, now, cost);
                let h = if d.admitted { b.record(&mut fast, now, cost) } else { Hold::default() };
                (d, h)
            } else {
                b.step_in_place(&mut fast, now, cost)
            };
            let (dg, hg) = step_general(&b, &mut general, now, cost);
            prop_assert_eq!(&df, &dg);
            prop_assert_eq!(hf, hg);
            prop_assert_eq!(&fast, &general);
            if df.admitted { holds.push(hf); }
            if delta != 0 && !holds.is_empty() {
                let h = holds[(gap as usize) % holds.len()];
                let a = b.settle(&mut fast, now, h, delta);
                let c = b.settle(&mut general, now, h, delta);
                prop_assert_eq!(a, c);
            }
        }
    }

    /// Random changes of numbers between decisions: never a panic, never
    /// a wait (or reset) longer than the new policy's time to refill from
    /// empty, and each wait exact under the new numbers.
    #[test]
    fn changed_numbers_never_wait_longer_than_a_refill(
        policies in prop::collection::vec(
            (prop_oneof![1u64..40, 1u64..1_000_000], 1u64..1_000, prop_oneof![1u64..100, 1u64..100_000_000]),
            1..5,
        ),
        steps in prop::collection::vec(
            (any::<prop::sample::Index>(), 0u64..20_000_000, 0u64..50, -30i64..30, any::<prop::sample::Index>()),
            1..150,
        ),
    ) {
        let buckets: Vec<TokenBucket> = policies
            .iter()
            .filter_map(|&(c, r, p)| TokenBucket::new(c, r, p).ok())
            .collect();
        prop_assume!(!buckets.is_empty());
        let mut s = TokenBucketState::default();
        let mut now = T0;
        let mut holds: Vec<Hold> = Vec::new();
        for (which, gap, cost, delta, hold) in steps {
            let b = &buckets[which.index(buckets.len())];
            now += gap % (b.window_micros().saturating_mul(2) + 1);
            let (d, h) = b.step_in_place(&mut s, now, cost);
            prop_assert!(d.reset.as_micros() <= u128::from(b.window_micros()));
            if d.admitted {
                holds.push(h);
            } else if let Some(wait) = d.retry_after {
                let wait = wait.as_micros() as u64;
                prop_assert!(wait >= 1 && wait <= b.window_micros(), "wait {} window {}", wait, b.window_micros());
                prop_assert!(!b.check(&mut s.clone(), now + wait - 1, cost).admitted);
                prop_assert!(b.check(&mut s.clone(), now + wait, cost).admitted);
            }
            if !holds.is_empty() {
                let i = hold.index(holds.len());
                holds[i] = b.settle(&mut s, now, holds[i], delta);
            }
            let d = b.check(&mut s, now, 0);
            prop_assert!(d.reset.as_micros() <= u128::from(b.window_micros()));
        }
    }
}
