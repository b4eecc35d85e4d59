//! Live reconfiguration of the dependency budget, on a manual clock: a
//! budget lowered from 240/s to 120/s halves the attempts that go out from
//! the next attempt on, the shares' state carries over, and a bad change is
//! refused whole. With Redis, a leased budget's `R` lowered on one
//! instance binds the fleet's grants within one lease length.

mod support;

use std::time::Duration;

use tower_admission::clock::ManualClock;
use tower_admission::outbound::{Attempt, BudgetShares, DependencyBudget};
use tower_admission::quota::{MemoryStore, Policy};

const SECOND: Duration = Duration::from_secs(1);

/// `per_second` in all: 5/6 for first attempts, 1/6 for retries, each with
/// a burst of 1/10 s of its rate.
fn shares(per_second: u64) -> BudgetShares {
    let (normal, retry) = (per_second * 5 / 6, per_second / 6);
    BudgetShares::new(
        Policy::token_bucket("normal", normal / 10, normal, SECOND).unwrap(),
        Policy::token_bucket("retry", retry / 10, retry, SECOND).unwrap(),
    )
}

/// First attempts offered every millisecond for `ms` milliseconds (far more
/// than either budget admits): how many the budget let out.
async fn offered_every_ms(
    budget: &DependencyBudget<MemoryStore<ManualClock>>,
    clock: &ManualClock,
    ms: u64,
) -> u64 {
    let mut admitted = 0;
    for _ in 0..ms {
        clock.advance(Duration::from_millis(1));
        for _ in 0..4 {
            if budget.try_acquire(Attempt::FIRST, 1).await.is_ok() {
                admitted += 1;
            }
        }
    }
    admitted
}

#[tokio::test]
async fn lowering_the_budget_from_240_to_120_halves_the_attempts_from_the_next_one_on() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock.clone());
    let budget = DependencyBudget::builder(store, "reports-db")
        .shares(shares(240))
        .build()
        .unwrap();
    let reload = budget.reload_handle();
    // 200/s of first attempts, after the burst of 20 the bucket starts with:
    // floor(20 + 200 x 0.999 s) from the first millisecond to the last.
    assert_eq!(offered_every_ms(&budget, &clock, 1_000).await, 20 + 199);
    assert_eq!(offered_every_ms(&budget, &clock, 1_000).await, 200);

    reload.apply(shares(120)).unwrap();
    // The bucket was empty and stays so under the new numbers: 100/s from
    // the first millisecond, no burst handed out by the change.
    assert_eq!(offered_every_ms(&budget, &clock, 1_000).await, 100);
    assert_eq!(offered_every_ms(&budget, &clock, 1_000).await, 100);
    let stats = budget.stats();
    assert_eq!(stats.normal, 619);

    // Raised again: the new rate from the next attempt on.
    reload.apply(shares(240)).unwrap();
    assert_eq!(offered_every_ms(&budget, &clock, 1_000).await, 200);
    assert_eq!(reload.generation(), 2);
}

#[tokio::test]
async fn a_lowered_budget_keeps_a_full_bucket_within_its_new_burst() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock.clone());
    let budget = DependencyBudget::builder(store, "reports-db")
        .shares(shares(240))
        .build()
        .unwrap();
    // Idle: the normal bucket holds its whole burst of 20.
    budget.try_acquire(Attempt::FIRST, 1).await.unwrap();
    clock.advance(SECOND);
    budget.reload_handle().apply(shares(120)).unwrap();
    // At most the new burst of 10 at once, then 100/s.
    let mut at_once = 0;
    while budget.try_acquire(Attempt::FIRST, 1).await.is_ok() {
        at_once += 1;
    }
    assert_eq!(at_once, 10);
}

#[test]
fn a_bad_budget_is_refused_whole_with_the_error_build_gives() {
    let budget = DependencyBudget::builder(MemoryStore::new(), "reports-db")
        .shares(shares(240))
        .partitions_home(4, 0)
        .build()
        .unwrap();
    let reload = budget.reload_handle();
    // A retry share of capacity 1 cannot be split into 4 partitions.
    let tiny = BudgetShares::new(
        Policy::token_bucket("normal", 20, 200, SECOND).unwrap(),
        Policy::token_bucket("retry", 1, 40, SECOND).unwrap(),
    );
    let built = DependencyBudget::builder(MemoryStore::new(), "reports-db")
        .shares(tiny.clone())
        .partitions_home(4, 0)
        .build()
        .unwrap_err();
    assert_eq!(reload.apply(tiny), Err(built.clone()));
    assert_eq!(built.field(), "partitions");
    let shadow = BudgetShares::new(
        Policy::token_bucket("normal", 20, 200, SECOND)
            .unwrap()
            .shadow(),
        Policy::token_bucket("retry", 4, 40, SECOND).unwrap(),
    );
    assert_eq!(reload.apply(shadow).unwrap_err().field(), "normal");
    assert_eq!(reload.generation(), 0);
    // Each partition still holds a quarter of the first numbers.
    let normal = budget.quota(Attempt::FIRST);
    assert_eq!(normal.policies()[0].limit(), 5);
}

#[cfg(feature = "redis")]
mod lease {
    use std::num::NonZeroU32;
    use std::time::Duration;

    use tower_admission::clock::ManualClock;
    use tower_admission::outbound::{
        Attempt, BudgetShares, LeaseStore, LeasedBudget, Rate, RateLease,
    };

    use crate::support::RedisServer;

    const START: u64 = 1_700_000_000_000_000;
    /// The lease length, the builder's default.
    const LEASE: Duration = Duration::from_secs(5);

    fn lease(store: &LeaseStore, clock: &ManualClock, id: &str) -> RateLease<ManualClock> {
        RateLease::builder(
            store.clone(),
            "dep",
            Rate::per_second(240),
            NonZeroU32::new(40).unwrap(),
        )
        .instance_id(id)
        .initial_demand(Rate::per_second(240))
        .min_demand(Rate::per_second(240))
        .clock(clock.clone())
        .build()
        .unwrap()
    }

    /// Two instances share 240/s; one reloads to 120/s. From its next
    /// refresh every grant is bound by 120/s in all, so the fleet's grants
    /// sum to at most 120/s one lease length later, while the other
    /// instance still runs with 240/s.
    #[tokio::test]
    async fn an_r_lowered_on_one_instance_halves_the_fleet_within_one_lease_length() {
        let server = RedisServer::start();
        let clock = ManualClock::new(Duration::from_micros(START));
        let store =
            LeaseStore::with_test_clock(&server.url(), "t", Duration::from_secs(5), clock.clone())
                .unwrap();
        let (a, b) = (lease(&store, &clock, "a"), lease(&store, &clock, "b"));
        let budget = LeasedBudget::new(a.clone(), Rate::per_second(40)).unwrap();
        let reload = budget.reload_handle();
        let peak = || async { store.peak("dep").await.unwrap() };
        for _ in 0..3 {
            a.refresh().await.unwrap();
            b.refresh().await.unwrap();
            clock.advance(Duration::from_secs(1));
        }
        assert_eq!(peak().await, Rate::per_second(240));

        // Bad rates change nothing.
        let err = reload
            .apply(BudgetShares::new(Rate::ZERO, Rate::per_second(120)))
            .unwrap_err();
        assert_eq!(err.field(), "retry");
        let err = reload
            .apply(BudgetShares::new(Rate::ZERO, Rate::ZERO))
            .unwrap_err();
        assert_eq!(err.field(), "rate");
        assert_eq!(a.rate(), Rate::per_second(240));

        reload
            .apply(BudgetShares::new(
                Rate::per_second(100),
                Rate::per_second(20),
            ))
            .unwrap();
        assert_eq!(a.rate(), Rate::per_second(120));
        assert_eq!(a.fallback_rate(), Rate::per_second(3));
        assert_eq!(budget.share_rate(Attempt::FIRST), Rate::per_second(100));
        assert_eq!(
            budget.share_rate(Attempt::FIRST.next()),
            Rate::per_second(20)
        );
        // b keeps 240/s; refreshes every second, as the refresher would.
        a.refresh().await.unwrap();
        let mut after_one_lease = None;
        for step in 1..=10u64 {
            clock.advance(Duration::from_secs(1));
            a.refresh().await.unwrap();
            b.refresh().await.unwrap();
            if Duration::from_secs(step) > LEASE {
                let now = peak().await;
                assert!(now <= Rate::per_second(120), "{now} at {step} s");
                after_one_lease.get_or_insert(now);
            }
        }
        assert_eq!(after_one_lease, Some(Rate::per_second(120)));
        assert_eq!(b.rate(), Rate::per_second(240));
    }
}
