//! The demand a rate lease reports, and how fast shares follow it, against
//! redis-servers started by the tests with the script's time injected from
//! one `ManualClock` (local and Redis time are the same here).
#![cfg(feature = "redis")]

mod support;

use std::num::NonZeroU32;
use std::time::Duration;

use support::RedisServer;
use tower_admission::clock::{ManualClock, Timestamp};
use tower_admission::outbound::{AttemptBudget, LeaseStore, LeasedBudget, Rate, RateLease, Share};

const R: u64 = 240;
const START: u64 = 1_700_000_000_000_000;
const MS: u64 = 1_000;

fn store(server: &RedisServer, clock: &ManualClock) -> LeaseStore {
    LeaseStore::builder(server.url())
        .prefix("dm")
        .deadline(Duration::from_secs(5))
        .test_clock(clock.clone())
        .build()
        .expect("store settings")
}

fn advance(clock: &ManualClock, micros: u64) {
    clock.advance(Duration::from_micros(micros));
}

#[tokio::test]
async fn an_attempt_that_looks_again_after_its_wait_counts_once_toward_the_demand() {
    // 20 attempts a second, in pairs every 100 ms, through the normal share
    // of a 24/s grant (20/s): the second of each pair waits for the lease's
    // one-attempt bucket and looks again. The demand is 20/s, not 30/s.
    let server = RedisServer::start();
    let clock = ManualClock::new(Timestamp(START));
    let lease = RateLease::builder(
        store(&server, &clock),
        "dep",
        Rate::per_second(R),
        NonZeroU32::new(10).unwrap(),
    )
    .instance_id("pairs")
    .initial_demand(Rate::per_second(24))
    .min_demand(Rate::per_second(1))
    .clock(clock.clone())
    .build()
    .unwrap();
    let budget = LeasedBudget::new(lease.clone(), Rate::per_second(40)).unwrap();
    assert_eq!(lease.refresh().await.unwrap().grant, Rate::per_second(24));
    let (mut sent, mut looks) = (0, 0);
    // (attempt waiting, look again at µs since the start)
    let mut waiting: Option<u64> = None;
    for ms in 1..=1_000u64 {
        advance(&clock, MS);
        let t = ms * MS;
        if let Some(at) = waiting {
            if t >= at {
                looks += 1;
                match budget.charge_again(Share::Normal, 1).await {
                    Ok(()) => {
                        sent += 1;
                        waiting = None;
                    }
                    Err(refusal) => waiting = Some(t + refusal.wait().unwrap().as_micros() as u64),
                }
            }
        }
        if ms % 100 == 0 {
            for _ in 0..2 {
                looks += 1;
                match budget.charge(Share::Normal, 1).await {
                    Ok(()) => sent += 1,
                    Err(refusal) => {
                        assert!(waiting.is_none(), "one waits at a time");
                        waiting = Some(t + refusal.wait().unwrap().as_micros() as u64);
                    }
                }
            }
        }
    }
    let s = lease.refresh().await.unwrap();
    assert_eq!((sent, looks), (19, 29), "sent, and looks at the budget");
    assert_eq!(
        s.demand,
        Rate::per_second(20),
        "20 attempts in 1 s, each counted once"
    );
}
