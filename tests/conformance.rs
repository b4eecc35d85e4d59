//! The store conformance suite: every case is written once, generic over
//! [`Store`], and run against
//!
//! - `MemoryStore` on a `ManualClock`,
//! - `RedisStore` on one `redis-server` started by the test,
//! - `RedisStore` on a 3-master Redis Cluster started by the test
//!   (`redis-cli --cluster create`), all cases in one test so the cluster is
//!   created once.
//!
//! Time is a `ManualClock`; Redis stores get it through the test-only injected
//! clock, so every number below is exact. Requires `redis-server` and
//! `redis-cli` (the tests fail, never skip, without them).

mod support;

use std::sync::Arc;
use std::time::Duration;

use tower_admission::clock::ManualClock;
use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaDecision, Store};

/// 2024-01-01T12:00:00Z, the start of a minute.
const NOON: u64 = 1_704_110_400_000;
const MIN: Duration = Duration::from_secs(60);

/// A store, its clock, and a tag that keeps each case's keys apart.
struct Ctx<'a, S> {
    store: &'a S,
    clock: &'a ManualClock,
    tag: &'static str,
}

impl<S: Store> Ctx<'_, S> {
    fn key(&self, name: &str) -> Arc<str> {
        format!("{}-{name}", self.tag).into()
    }

    fn at_ms(&self, ms: u64) {
        self.clock.set(Duration::from_millis(ms));
    }

    async fn admitted(&self, quota: &Quota, key: &Arc<str>, cost: u64, n: u64) -> u64 {
        let mut admitted = 0;
        for _ in 0..n {
            if self.decide(quota, key, cost).await.admitted {
                admitted += 1;
            }
        }
        admitted
    }

    async fn decide(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> QuotaDecision {
        self.store
            .decide(quota, key, cost)
            .await
            .expect("store decision")
    }
}

fn quota(policy: Policy) -> Quota {
    Quota::new("q", [policy]).unwrap()
}

/// The four algorithms, each at `limit` per minute (the bucket refills one
/// token per hour, so it barely refills during a case).
fn all_algorithms(limit: u64) -> Vec<Quota> {
    vec![
        quota(Policy::fixed_window("fw", limit, MIN).unwrap()),
        quota(Policy::sliding_log("sl", limit, MIN).unwrap()),
        quota(Policy::token_bucket("tb", limit, 1, Duration::from_secs(3600)).unwrap()),
        quota(Policy::sliding_window("sw", limit, MIN).unwrap()),
    ]
}

async fn fixed_window_boundary_admits_200<S: Store>(c: Ctx<'_, S>) {
    let q = quota(Policy::fixed_window("per-minute", 100, MIN).unwrap());
    let k = c.key("fw");
    c.at_ms(NOON + 59_999);
    assert_eq!(c.admitted(&q, &k, 1, 100).await, 100);
    c.at_ms(NOON + 60_000);
    assert_eq!(c.admitted(&q, &k, 1, 100).await, 100);
    // 200 in 1 ms: the documented weakness. The next one is refused.
    assert_eq!(c.admitted(&q, &k, 1, 1).await, 0);
}

async fn sliding_log_boundary_admits_100<S: Store>(c: Ctx<'_, S>) {
    let q = quota(Policy::sliding_log("per-minute", 100, MIN).unwrap());
    let k = c.key("sl");
    c.at_ms(NOON + 59_999);
    assert_eq!(c.admitted(&q, &k, 1, 100).await, 100);
    c.at_ms(NOON + 60_000);
    assert_eq!(c.admitted(&q, &k, 1, 100).await, 0);
    let refused = c.decide(&q, &k, 1).await;
    assert_eq!(refused.retry_after(&q), Some(Duration::from_millis(59_999)));
    // When the first 100 leave the window, exactly 100 more fit.
    c.at_ms(NOON + 59_999 + 60_000);
    assert_eq!(c.admitted(&q, &k, 1, 150).await, 100);
}

async fn sliding_log_identical_timestamps_are_distinct<S: Store>(c: Ctx<'_, S>) {
    let q = quota(Policy::sliding_log("per-minute", 5, MIN).unwrap());
    let k = c.key("same-time");
    c.at_ms(NOON);
    for left in (0..5).rev() {
        let d = c.decide(&q, &k, 1).await;
        assert!(d.admitted);
        assert_eq!(d.decisions[0].remaining, left);
    }
    let refused = c.decide(&q, &k, 1).await;
    assert!(!refused.admitted);
    assert_eq!(refused.retry_after(&q), Some(MIN));
    // All five entries share one timestamp and leave together.
    c.at_ms(NOON + 59_999);
    assert_eq!(c.admitted(&q, &k, 1, 1).await, 0);
    c.at_ms(NOON + 60_000);
    assert_eq!(c.admitted(&q, &k, 1, 10).await, 5);
}

async fn token_bucket_admits_23_in_2s_and_120_in_60s<S: Store>(c: Ctx<'_, S>) {
    let q = quota(Policy::token_bucket("burst", 20, 100, MIN).unwrap());
    for (span_ms, expected) in [(2_000, 23), (60_000, 120)] {
        let k = c.key(&format!("tb-{span_ms}"));
        let mut admitted = 0;
        for ms in 0..=span_ms {
            c.at_ms(NOON + ms);
            if c.decide(&q, &k, 1).await.admitted {
                admitted += 1;
            }
        }
        assert_eq!(admitted, expected, "one request per ms over {span_ms} ms");
    }
}

async fn weighted_window_exact_numbers<S: Store>(c: Ctx<'_, S>) {
    let q = quota(Policy::sliding_window("per-minute", 100, MIN).unwrap());
    let k = c.key("sw");
    c.at_ms(NOON + 10_000);
    assert_eq!(c.admitted(&q, &k, 1, 80).await, 80);
    // 15 s into the next window the previous 80 weigh 80 * 45/60 = 60.
    c.at_ms(NOON + 75_000);
    let first = c.decide(&q, &k, 1).await;
    assert!(first.admitted);
    assert_eq!(first.decisions[0].remaining, 39);
    assert_eq!(first.decisions[0].reset, Duration::from_secs(105));
    assert_eq!(c.admitted(&q, &k, 1, 49).await, 39);
    let refused = c.decide(&q, &k, 1).await;
    assert!(!refused.admitted);
    assert_eq!(refused.decisions[0].remaining, 0);
    // 80 * (1 - 15.75/60) = 59, and 59 + 40 + 1 = 100.
    assert_eq!(refused.retry_after(&q), Some(Duration::from_millis(750)));
    c.at_ms(NOON + 75_750);
    assert_eq!(c.admitted(&q, &k, 1, 5).await, 1);
    // A full current window waits for the next one: 100 at 10 s, then
    // 50 s to the boundary plus 0.6 s until 100 * (1 - e/60) <= 99.
    let k = c.key("sw-full");
    c.at_ms(NOON + 10_000);
    assert_eq!(c.admitted(&q, &k, 1, 100).await, 100);
    let refused = c.decide(&q, &k, 1).await;
    assert_eq!(refused.retry_after(&q), Some(Duration::from_millis(50_600)));
    c.at_ms(NOON + 60_599);
    assert_eq!(c.admitted(&q, &k, 1, 1).await, 0);
    c.at_ms(NOON + 60_600);
    assert_eq!(c.admitted(&q, &k, 1, 5).await, 1);
}

async fn multi_policy_refusal_consumes_nothing<S: Store>(c: Ctx<'_, S>) {
    // Bucket refuses, log would admit: the log keeps nothing of the refusals.
    let q = Quota::new(
        "plan",
        [
            Policy::sliding_log("per-minute", 100, MIN).unwrap(),
            Policy::token_bucket("burst", 20, 100, MIN).unwrap(),
        ],
    )
    .unwrap();
    let k = c.key("bucket-refuses");
    c.at_ms(NOON);
    assert_eq!(c.admitted(&q, &k, 1, 25).await, 20);
    let refused = c.decide(&q, &k, 1).await;
    assert!(!refused.admitted);
    assert!(refused.decisions[0].admitted);
    assert!(!refused.decisions[1].admitted);
    assert_eq!(refused.retry_after(&q), Some(Duration::from_millis(600)));
    c.at_ms(NOON + 600);
    let next = c.decide(&q, &k, 1).await;
    assert!(next.admitted);
    // 21 admitted in the log: the 6 refusals took nothing from it.
    assert_eq!(next.decisions[0].remaining, 79);
    assert_eq!(next.decisions[1].remaining, 0);

    // Log refuses, bucket would admit: the bucket keeps nothing.
    let q = Quota::new(
        "plan2",
        [
            Policy::sliding_log("per-minute", 3, MIN).unwrap(),
            Policy::token_bucket("burst", 20, 1, Duration::from_secs(3600)).unwrap(),
        ],
    )
    .unwrap();
    let k = c.key("log-refuses");
    c.at_ms(NOON);
    assert_eq!(c.admitted(&q, &k, 1, 13).await, 3);
    c.at_ms(NOON + 60_000);
    let next = c.decide(&q, &k, 1).await;
    assert!(next.admitted);
    assert_eq!(next.decisions[1].remaining, 16);
}

async fn a_refusal_reports_each_policy_as_it_stands<S: Store>(c: Ctx<'_, S>) {
    // The bucket refuses at 30 s. The log, which would admit, reports what
    // it holds: 9 remaining, and whole again in 30 s, when its one entry
    // leaves (not in 60 s, as if this request had been recorded).
    let q = Quota::new(
        "as-it-stands",
        [
            Policy::sliding_log("per-minute", 10, MIN).unwrap(),
            Policy::token_bucket("burst", 1, 1, MIN).unwrap(),
        ],
    )
    .unwrap();
    let k = c.key("k");
    c.at_ms(NOON);
    assert!(c.decide(&q, &k, 1).await.admitted);
    c.at_ms(NOON + 30_000);
    let refused = c.decide(&q, &k, 1).await;
    assert!(!refused.admitted);
    let (log, bucket) = (&refused.decisions[0], &refused.decisions[1]);
    assert!(log.admitted);
    assert_eq!((log.remaining, log.reset), (9, Duration::from_secs(30)));
    assert_eq!(
        (bucket.remaining, bucket.retry_after),
        (0, Some(Duration::from_secs(30)))
    );
}

async fn a_refund_never_reaches_a_window_of_another_length<S: Store>(c: Ctx<'_, S>) {
    // A is charged 5 in the minute [0, 60). Redeployed to 7 s windows
    // (aligned to the epoch: [43, 50), [50, 57), [57, 64) of this minute),
    // A's count carries into [43, 50) and rolls away; B is charged 5 in
    // [57, 64). Rolled back to a minute at 58 s, the window is [0, 60)
    // again, holding B's 5: A's refund must give nothing back, since A's
    // window is gone, or the minute would admit 10 of 5.
    let fixed = |w| Policy::fixed_window("w", 5, w).unwrap();
    let weighted = |w| Policy::sliding_window("w", 5, w).unwrap();
    for (name, policy) in [
        ("fixed", &fixed as &dyn Fn(Duration) -> Policy),
        ("weighted", &weighted),
    ] {
        let minute = Quota::new(name, [policy(MIN)]).unwrap();
        let seven = Quota::new(name, [policy(Duration::from_secs(7))]).unwrap();
        let k = c.key(name);
        c.at_ms(NOON);
        let a = c.decide(&minute, &k, 5).await;
        assert!(a.admitted, "{name}");
        c.at_ms(NOON + 45_000);
        assert!(!c.decide(&seven, &k, 1).await.admitted, "{name}");
        c.at_ms(NOON + 57_000);
        assert!(c.decide(&seven, &k, 5).await.admitted, "{name}");
        c.at_ms(NOON + 58_000);
        c.store.settle(&minute, &k, &a, -5).await.unwrap();
        assert_eq!(
            c.decide(&minute, &k, 0).await.decisions[0].remaining,
            0,
            "{name}"
        );
        assert!(!c.decide(&minute, &k, 1).await.admitted, "{name}");
    }
}

async fn a_settle_from_before_a_longer_window_drops_nothing<S: Store>(c: Ctx<'_, S>) {
    // A charge made under 10 per minute settles, under those numbers as a
    // settlement does, after a redeploy to 10 per hour has counted 5 more.
    // The settle must not trim what the hour still holds nor shorten its
    // life: A's entry has left the minute, so nothing comes back, and the
    // extra 3 are capped by what the minute holds (B's 5). Before, on
    // Redis, the settle trimmed the log to its minute and the hour admitted
    // 7 more: 17 in an hour of 10.
    let minute = quota(Policy::sliding_log("p", 10, MIN).unwrap());
    let hour = quota(Policy::sliding_log("p", 10, Duration::from_secs(3600)).unwrap());
    let k = c.key("log");
    c.at_ms(NOON);
    let a = c.decide(&minute, &k, 5).await;
    assert!(a.admitted);
    c.at_ms(NOON + 30_000);
    assert_eq!(c.admitted(&hour, &k, 5, 1).await, 1);
    c.at_ms(NOON + 90_000);
    c.store.settle(&minute, &k, &a, -5).await.unwrap();
    c.store.settle(&minute, &k, &a, 3).await.unwrap();
    c.at_ms(NOON + 100_000);
    assert_eq!(c.decide(&hour, &k, 0).await.decisions[0].remaining, 0);
    assert_eq!(c.admitted(&hour, &k, 1, 10).await, 0);
    // A's entry leaves the hour at 3,600 s; the hour still holds B's 5 and
    // the settle's 3.
    c.at_ms(NOON + 3_599_999);
    assert_eq!(c.admitted(&hour, &k, 1, 10).await, 0);
    c.at_ms(NOON + 3_600_000);
    assert_eq!(c.admitted(&hour, &k, 1, 10).await, 2);
}

async fn a_settle_under_a_smaller_bucket_refills_nothing<S: Store>(c: Ctx<'_, S>) {
    // A bucket of 1 refilling 1/s is redeployed to a capacity of 100 at the
    // same rate. The old quota's charge settles (-1) after the new one has
    // emptied the bucket: it gives back its own token only. Before, the
    // settle clamped the bucket to its old capacity of 1, refilling it.
    let second =
        |capacity| quota(Policy::token_bucket("p", capacity, 1, Duration::from_secs(1)).unwrap());
    let (old, new) = (second(1), second(100));
    let k = c.key("bucket");
    c.at_ms(NOON);
    let a = c.decide(&old, &k, 1).await;
    assert!(a.admitted);
    assert_eq!(c.admitted(&new, &k, 1, 100).await, 99);
    c.store.settle(&old, &k, &a, -1).await.unwrap();
    assert_eq!(c.admitted(&new, &k, 1, 100).await, 1);
}

async fn a_renamed_policy_keeps_its_state<S: Store>(c: Ctx<'_, S>) {
    // A redeploy that only renames a policy shares its state (same quota
    // name, same kinds): 10 of 10 spent under "a" stay spent under "b".
    let policies = |name: &str| {
        [
            Policy::fixed_window(name, 10, MIN).unwrap(),
            Policy::sliding_log(name, 10, MIN).unwrap(),
            Policy::token_bucket(name, 10, 10, MIN).unwrap(),
            Policy::sliding_window(name, 10, MIN).unwrap(),
        ]
    };
    for (i, (old, new)) in policies("a").into_iter().zip(policies("b")).enumerate() {
        let before = Quota::new("renamed", [old]).unwrap();
        let after = Quota::new("renamed", [new]).unwrap();
        let k = c.key(&format!("kind{i}"));
        c.at_ms(NOON);
        assert_eq!(c.admitted(&before, &k, 1, 10).await, 10, "kind {i}");
        assert_eq!(c.admitted(&after, &k, 1, 10).await, 0, "kind {i}");
    }
}

async fn cost_over_capacity_is_never_admitted<S: Store>(c: Ctx<'_, S>) {
    for q in all_algorithms(10) {
        let k = c.key(q.policies()[0].name());
        c.at_ms(NOON);
        let d = c.decide(&q, &k, 11).await;
        assert!(!d.admitted);
        assert!(
            d.decisions[0].cost_exceeds_limit(),
            "{}",
            q.policies()[0].name()
        );
        assert_eq!(d.decisions[0].retry_after, None);
        assert_eq!(d.decisions[0].remaining, 10);
        c.at_ms(NOON + 86_400_000);
        assert_eq!(c.admitted(&q, &k, 11, 3).await, 0);
        // Nothing was consumed: the full capacity is still there.
        assert_eq!(c.admitted(&q, &k, 10, 1).await, 1);
    }
}

async fn clock_set_backwards_inflates_nothing<S: Store>(c: Ctx<'_, S>) {
    for q in all_algorithms(10) {
        let name = q.policies()[0].name();
        let k = c.key(name);
        c.at_ms(NOON + 30_000);
        assert_eq!(c.admitted(&q, &k, 1, 10).await, 10, "{name}");
        for back in [NOON + 29_000, NOON - 3_600_000, NOON - 86_400_000] {
            c.at_ms(back);
            assert_eq!(c.admitted(&q, &k, 1, 5).await, 0, "{name} at {back}");
        }
        c.at_ms(NOON + 30_000);
        assert_eq!(
            c.admitted(&q, &k, 1, 5).await,
            0,
            "{name} back at the start"
        );
    }
}

async fn retry_after_is_exact<S: Store>(c: Ctx<'_, S>) {
    let fw = quota(Policy::fixed_window("fw", 100, MIN).unwrap());
    let k = c.key("fw");
    c.at_ms(NOON + 59_999);
    assert_eq!(c.admitted(&fw, &k, 1, 100).await, 100);
    let d = c.decide(&fw, &k, 1).await;
    assert_eq!(d.retry_after(&fw), Some(Duration::from_millis(1)));
    assert_eq!(d.decisions[0].reset, Duration::from_millis(1));

    let sl = quota(Policy::sliding_log("sl", 100, MIN).unwrap());
    let k = c.key("sl");
    c.at_ms(NOON);
    assert_eq!(c.admitted(&sl, &k, 1, 50).await, 50);
    c.at_ms(NOON + 10_000);
    assert_eq!(c.admitted(&sl, &k, 1, 50).await, 50);
    c.at_ms(NOON + 20_000);
    let d = c.decide(&sl, &k, 1).await;
    assert_eq!(d.retry_after(&sl), Some(Duration::from_secs(40)));
    assert_eq!(d.decisions[0].reset, Duration::from_secs(50));
    let d = c.decide(&sl, &k, 60).await;
    assert_eq!(d.retry_after(&sl), Some(Duration::from_secs(50)));

    let tb = quota(Policy::token_bucket("tb", 20, 100, MIN).unwrap());
    let k = c.key("tb");
    c.at_ms(NOON);
    assert_eq!(c.admitted(&tb, &k, 1, 20).await, 20);
    let d = c.decide(&tb, &k, 1).await;
    assert_eq!(d.retry_after(&tb), Some(Duration::from_millis(600)));
    assert_eq!(d.decisions[0].reset, Duration::from_secs(12));
    c.at_ms(NOON + 100);
    let d = c.decide(&tb, &k, 1).await;
    assert_eq!(d.retry_after(&tb), Some(Duration::from_millis(500)));
    let d = c.decide(&tb, &k, 5).await;
    assert_eq!(d.retry_after(&tb), Some(Duration::from_millis(2_900)));
}

async fn settle_refunds_and_charges<S: Store>(c: Ctx<'_, S>) {
    for q in all_algorithms(10) {
        let name = q.policies()[0].name();
        let k = c.key(name);
        c.at_ms(NOON + 1_000);
        let first = c.decide(&q, &k, 6).await;
        assert!(first.admitted, "{name}");
        let settled = c.store.settle(&q, &k, &first, -4).await.unwrap();
        // The same decision, holding less.
        assert_eq!(settled.admitted, first.admitted, "{name}");
        assert_eq!(settled.decisions, first.decisions, "{name}");
        assert_ne!(settled, first, "{name}");
        // 2 held, 8 left.
        assert_eq!(c.admitted(&q, &k, 9, 1).await, 0, "{name}");
        assert_eq!(c.admitted(&q, &k, 8, 1).await, 1, "{name}");
        // The first charge holds 2: a refund of 3 gives back 2.
        let settled = c.store.settle(&q, &k, &settled, -3).await.unwrap();
        assert_eq!(c.admitted(&q, &k, 3, 1).await, 0, "{name}");
        assert_eq!(c.admitted(&q, &k, 2, 1).await, 1, "{name}");
        c.store.settle(&q, &k, &settled, 1_000).await.unwrap();
        // A charge never drives a policy past empty, and it is empty now.
        assert_eq!(c.admitted(&q, &k, 1, 1).await, 0, "{name}");
    }
}

/// A redeploy that changes a window (or a bucket's numbers) reads the
/// stored state under the new numbers: a key at its limit waits at most the
/// new window, never a wait computed in units of the old one.
async fn changed_numbers_never_lock_a_key_out<S: Store>(c: Ctx<'_, S>) {
    let hour = Duration::from_secs(3600);
    let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
    // Fixed window: 10 per minute, full at 12:00:30.
    let minute = quota(Policy::fixed_window("p", 10, MIN).unwrap());
    let hourly = quota(Policy::fixed_window("p", 10, hour).unwrap());
    let k = c.key("fw");
    c.at_ms(NOON + 30_000);
    assert_eq!(c.admitted(&minute, &k, 1, 11).await, 10);
    // Longer window: the count carries into the hour [12:00, 13:00).
    let d = c.decide(&hourly, &k, 1).await;
    assert!(!d.admitted);
    assert_eq!(secs(d.retry_after(&hourly)), Some(3570.0));
    // Shorter again: the count carries into the minute [12:00, 12:01).
    c.at_ms(NOON + 40_000);
    let d = c.decide(&minute, &k, 1).await;
    assert_eq!(secs(d.retry_after(&minute)), Some(20.0));
    c.at_ms(NOON + 60_000);
    assert_eq!(c.admitted(&minute, &k, 1, 11).await, 10);

    // Weighted window: at most twice the new window.
    let minute = quota(Policy::sliding_window("p", 10, MIN).unwrap());
    let hourly = quota(Policy::sliding_window("p", 10, hour).unwrap());
    let k = c.key("sw");
    c.at_ms(NOON + 30_000);
    assert_eq!(c.admitted(&hourly, &k, 1, 11).await, 10);
    let d = c.decide(&minute, &k, 1).await;
    assert!(!d.admitted);
    let wait = d.retry_after(&minute).unwrap();
    assert!(wait <= 2 * MIN, "{wait:?}");

    // Sliding log: entries keep their times; at most the new window.
    let hourly = quota(Policy::sliding_log("p", 10, hour).unwrap());
    let minute = quota(Policy::sliding_log("p", 10, MIN).unwrap());
    let k = c.key("sl");
    c.at_ms(NOON);
    assert_eq!(c.admitted(&hourly, &k, 1, 11).await, 10);
    c.at_ms(NOON + 30_000);
    let d = c.decide(&minute, &k, 1).await;
    assert_eq!(secs(d.retry_after(&minute)), Some(30.0));

    // Token bucket: a slower refill never waits longer than the new bucket
    // takes to refill from empty, and a lower capacity applies at once.
    let slow = quota(Policy::token_bucket("p", 10, 1, hour).unwrap());
    let fast = quota(Policy::token_bucket("p", 5, 1, Duration::from_secs(1)).unwrap());
    let k = c.key("tb");
    c.at_ms(NOON);
    assert_eq!(c.admitted(&slow, &k, 1, 11).await, 10);
    let d = c.decide(&fast, &k, 1).await;
    assert!(!d.admitted);
    assert!(d.retry_after(&fast).unwrap() <= Duration::from_secs(5));
    c.at_ms(NOON + 5_000);
    assert_eq!(c.admitted(&fast, &k, 1, 6).await, 5);
}

/// A refund gives back only what its own charge still holds.
async fn refunds_are_bound_to_their_charge<S: Store>(c: Ctx<'_, S>) {
    // Token bucket B = 10, 1 token/s: A's tokens have refilled by 9.9 s, so
    // refunding A gives nothing, and C cannot take 10 beside B's 9.
    let q = quota(Policy::token_bucket("tb", 10, 1, Duration::from_secs(1)).unwrap());
    let k = c.key("tb");
    c.at_ms(NOON);
    let a = c.decide(&q, &k, 10).await;
    assert!(a.admitted);
    c.at_ms(NOON + 9_900);
    assert!(c.decide(&q, &k, 9).await.admitted);
    c.store.settle(&q, &k, &a, -10).await.unwrap();
    assert!(!c.decide(&q, &k, 10).await.admitted);

    // Sliding log 20 per 10 s: refunding A removes A's entry, not B's, so C
    // at 10 s sees B's 10 still in (0, 10].
    let q = quota(Policy::sliding_log("sl", 20, Duration::from_secs(10)).unwrap());
    let k = c.key("sl");
    c.at_ms(NOON);
    let a = c.decide(&q, &k, 10).await;
    c.at_ms(NOON + 4_000);
    assert!(c.decide(&q, &k, 10).await.admitted);
    c.at_ms(NOON + 5_000);
    c.store.settle(&q, &k, &a, -10).await.unwrap();
    c.at_ms(NOON + 10_000);
    assert!(!c.decide(&q, &k, 20).await.admitted);
    assert!(c.decide(&q, &k, 10).await.admitted);

    // Fixed window 100 per minute: A's window is over, so its refund makes
    // no room in the new one.
    let q = quota(Policy::fixed_window("fw", 100, MIN).unwrap());
    let k = c.key("fw");
    c.at_ms(NOON + 59_000);
    let a = c.decide(&q, &k, 100).await;
    assert!(a.admitted);
    c.at_ms(NOON + 60_000);
    assert!(c.decide(&q, &k, 100).await.admitted);
    c.at_ms(NOON + 61_000);
    c.store.settle(&q, &k, &a, -100).await.unwrap();
    assert_eq!(c.admitted(&q, &k, 1, 1).await, 0);
}

async fn exactly_limit_of_1000_concurrent<S: Store>(c: Ctx<'_, S>) {
    c.at_ms(NOON + 5_000);
    for q in all_algorithms(100) {
        let k = c.key(q.policies()[0].name());
        let tasks: Vec<_> = (0..1000)
            .map(|_| {
                let store = c.store.clone();
                let (q, k) = (q.clone(), k.clone());
                tokio::spawn(async move { store.decide(&q, &k, 1).await.unwrap().admitted })
            })
            .collect();
        let mut admitted = 0;
        for task in tasks {
            if task.await.unwrap() {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 100, "{}", q.policies()[0].name());
    }
}

async fn keys_with_braces_decide_every_policy<S: Store>(c: Ctx<'_, S>) {
    // Request keys may hold hash-tag braces: all of a decision's Redis keys
    // still share one hash tag (no CROSSSLOT on a cluster), and each request
    // key keeps its own state.
    let q = Quota::new(
        "braces",
        [
            Policy::fixed_window("fw", 3, MIN).unwrap(),
            Policy::sliding_log("sl", 3, MIN).unwrap(),
            Policy::token_bucket("tb", 3, 1, Duration::from_secs(3600)).unwrap(),
            Policy::sliding_window("sw", 3, MIN).unwrap(),
        ],
    )
    .unwrap();
    c.at_ms(NOON);
    for name in ["}", "{", "{}", "a}b{c", "}{", "{x}:0:fw", ""] {
        let k = c.key(name);
        assert_eq!(c.admitted(&q, &k, 1, 4).await, 3, "{name:?}");
    }
}

/// A peek answers exactly as the decision made right after it, and a
/// thousand peeks (admitted or refused, of any cost) consume nothing: each
/// algorithm still admits exactly its limit, and a two-policy quota with a
/// shadow bucket exactly the enforcing limit.
async fn peek_answers_as_decide_and_consumes_nothing<S: Store>(c: Ctx<'_, S>) {
    let mut quotas = all_algorithms(5);
    quotas.push(
        Quota::new(
            "two",
            [
                Policy::sliding_log("sl", 5, MIN).unwrap(),
                Policy::token_bucket("tb", 3, 1, Duration::from_secs(3600))
                    .unwrap()
                    .shadow(),
            ],
        )
        .unwrap(),
    );
    for (i, quota) in quotas.iter().enumerate() {
        let key = c.key(&format!("{i}"));
        let mut admitted = 0;
        for step in 0..8 {
            c.at_ms(NOON + 1_000 + step * 10);
            for cost in [1, 2, 6] {
                for _ in 0..40 {
                    let peeked = c.store.peek(quota, &key, cost).await.expect("peek");
                    // Holding nothing.
                    let nothing = QuotaDecision::new(peeked.admitted, peeked.decisions.clone());
                    assert_eq!(peeked, nothing, "{}", quota.name());
                }
            }
            let peeked = c.store.peek(quota, &key, 1).await.expect("peek");
            let decided = c.decide(quota, &key, 1).await;
            assert_eq!(
                peeked.admitted,
                decided.admitted,
                "{} step {step}",
                quota.name()
            );
            assert_eq!(
                peeked.decisions,
                decided.decisions,
                "{} step {step}",
                quota.name()
            );
            admitted += u64::from(decided.admitted);
        }
        assert_eq!(admitted, 5, "{}", quota.name());
    }
    // A key no decision has seen reads as fresh.
    let unseen = c.key("unseen");
    let peeked = c.store.peek(&quotas[0], &unseen, 5).await.expect("peek");
    assert!(peeked.admitted);
    assert_eq!(peeked.decisions[0].remaining, 0);
}

fn memory_store(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::with_clock(clock.clone())
}

#[cfg(feature = "redis")]
fn redis_store(url: String, clock: &ManualClock) -> tower_admission::quota::RedisStore {
    // A long deadline: these cases test semantics, not latency, on a busy CI box.
    tower_admission::quota::RedisStore::builder(url)
        .test_clock(clock.clone())
        .deadline(Duration::from_secs(10))
        .build()
        .unwrap()
}

macro_rules! suite {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let clock = tower_admission::clock::ManualClock::default();
                    let store = super::memory_store(&clock);
                    super::$case(super::Ctx { store: &store, clock: &clock, tag: stringify!($case) }).await;
                }
            )*
        }

        #[cfg(feature = "redis")]
        mod redis_single {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let server = crate::support::RedisServer::start();
                    let clock = tower_admission::clock::ManualClock::default();
                    let store = super::redis_store(server.url(), &clock);
                    super::$case(super::Ctx { store: &store, clock: &clock, tag: stringify!($case) }).await;
                }
            )*
        }

        /// Every case on one 3-master cluster, created once.
        #[cfg(feature = "redis")]
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn redis_cluster_every_case() {
            let cluster = support::RedisCluster::start();
            let clock = ManualClock::default();
            let store = tower_admission::quota::RedisStore::cluster_builder(cluster.urls())
                .test_clock(clock.clone())
                .deadline(Duration::from_secs(10))
                .build()
                .unwrap();
            $(
                eprintln!("cluster case {}", stringify!($case));
                $case(Ctx { store: &store, clock: &clock, tag: stringify!($case) }).await;
            )*
        }
    };
}

suite!(
    fixed_window_boundary_admits_200,
    sliding_log_boundary_admits_100,
    sliding_log_identical_timestamps_are_distinct,
    token_bucket_admits_23_in_2s_and_120_in_60s,
    weighted_window_exact_numbers,
    multi_policy_refusal_consumes_nothing,
    a_refusal_reports_each_policy_as_it_stands,
    a_refund_never_reaches_a_window_of_another_length,
    a_settle_from_before_a_longer_window_drops_nothing,
    a_settle_under_a_smaller_bucket_refills_nothing,
    a_renamed_policy_keeps_its_state,
    cost_over_capacity_is_never_admitted,
    clock_set_backwards_inflates_nothing,
    retry_after_is_exact,
    settle_refunds_and_charges,
    changed_numbers_never_lock_a_key_out,
    refunds_are_bound_to_their_charge,
    exactly_limit_of_1000_concurrent,
    keys_with_braces_decide_every_policy,
    peek_answers_as_decide_and_consumes_nothing,
);
