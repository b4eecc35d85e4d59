//! Pushback through the rate lease, against redis-servers started by the
//! tests, with the script's time injected from a `ManualClock`: the
//! effective budget `E` is halved at most once per 2 s for the fleet, never
//! below a tenth of the budget, grows back after 3 s without pushback as
//! `base + R/60 per s² × t²`, never above `R`, and every grant and share
//! follows it (docs/leases.md, "Pushback").
#![cfg(feature = "redis")]

mod support;

use std::num::NonZeroU32;
use std::time::Duration;

use support::RedisServer;
use tower::{Layer, ServiceExt};
use tower_admission::clock::ManualClock;
use tower_admission::outbound::{
    Attempt, LeaseStore, LeasedBudget, PushbackLayer, Rate, RateLease,
};

const R: u64 = 240;
const START: u64 = 1_700_000_000_000_000;
const SEC: u64 = 1_000_000;
const MS: u64 = 1_000;

fn store(server: &RedisServer, redis_time: &ManualClock) -> LeaseStore {
    LeaseStore::with_test_clock(
        &server.url(),
        "pb",
        Duration::from_secs(5),
        redis_time.clone(),
    )
    .expect("store settings")
}

/// Instance `id`, asking for `demand` per second, on the fleet's one clock.
fn instance(
    store: &LeaseStore,
    id: &str,
    demand: u64,
    clock: &ManualClock,
) -> RateLease<ManualClock> {
    RateLease::builder(
        store.clone(),
        "dep",
        Rate::per_second(R),
        NonZeroU32::new(10).unwrap(),
    )
    .instance_id(id)
    .initial_demand(Rate::per_second(demand))
    .min_demand(Rate::per_second(demand))
    .clock(clock.clone())
    .build()
    .unwrap()
}

/// Moves the one clock (local and Redis) on by `micros`.
fn advance(clock: &ManualClock, micros: u64) {
    clock.advance(Duration::from_micros(micros));
}

/// The effective budget after a refresh of `lease`, milli-units per second.
async fn effective(lease: &RateLease<ManualClock>) -> u64 {
    lease.refresh().await.unwrap().effective.as_milli()
}

#[tokio::test]
async fn pushback_halves_the_budget_once_per_cooldown_to_a_floor_and_it_grows_back_after_quiet() {
    let server = RedisServer::start();
    let clock = ManualClock::new(Duration::from_micros(START));
    let lease = instance(&store(&server, &clock), "solo", R, &clock);
    assert_eq!(effective(&lease).await, 240_000, "no pushback: E = R");
    assert_eq!(lease.status().grant, Rate::per_second(R));

    // A pushback halves E; the grant follows at once.
    lease.record_pushback();
    let s = lease.refresh().await.unwrap();
    assert_eq!(
        (s.effective.as_milli(), s.grant.as_milli()),
        (120_000, 120_000)
    );
    assert_eq!(s.pushbacks, 1);
    // Another 1 s later: within the 2 s cooldown, no second halving.
    advance(&clock, SEC);
    lease.record_pushback();
    assert_eq!(
        effective(&lease).await,
        120_000,
        "cooldown: one halving per 2 s"
    );
    // 2 s after the first halving: halved again, then again, to the floor R/10.
    let mut seen = Vec::new();
    for _ in 0..4 {
        advance(&clock, 2 * SEC);
        lease.record_pushback();
        seen.push(effective(&lease).await);
    }
    assert_eq!(
        seen,
        [60_000, 30_000, 24_000, 24_000],
        "halvings, floor 24/s"
    );
    // Quiet: E stays for 3 s after the last pushback, then grows as
    // 24 + 240/60 × t² per second (t in s since growth began), up to R.
    let mut series = Vec::new();
    for _ in 0..12 {
        advance(&clock, SEC);
        series.push(effective(&lease).await / 1_000);
    }
    assert_eq!(
        series,
        [24, 24, 24, 28, 40, 60, 88, 124, 168, 220, 240, 240],
        "E per second after the last pushback"
    );
    assert_eq!(
        lease.status().grant,
        Rate::per_second(R),
        "back to the whole budget"
    );
}

#[tokio::test]
async fn one_instance_s_pushback_lowers_every_instance_s_grant_and_they_look_again_every_quarter_period(
) {
    let server = RedisServer::start();
    let clock = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, &clock);
    let fleet: Vec<_> = (0..10)
        .map(|i| instance(&shared, &format!("i{i}"), R / 10, &clock))
        .collect();
    for lease in &fleet {
        lease.refresh().await.unwrap();
    }
    // Steady: every grant is the fair 24/s, the next refresh a period away.
    advance(&clock, 4 * SEC);
    for lease in &fleet {
        let s = lease.refresh().await.unwrap();
        assert_eq!(
            (s.grant.as_milli(), s.effective.as_milli()),
            (24_000, 240_000)
        );
        assert_eq!(lease.until_next_refresh(), Duration::from_secs(4));
    }
    // Only i0 sees the dependency push back.
    advance(&clock, 100 * MS);
    fleet[0].record_pushback();
    let s = fleet[0].refresh().await.unwrap();
    assert_eq!(
        (s.grant.as_milli(), s.effective.as_milli()),
        (12_000, 120_000)
    );
    assert_eq!(
        (s.rate.as_milli(), s.kept),
        (12_000, Rate::ZERO),
        "under pushback a lowered grant applies at once: the older 24/s is not kept"
    );
    assert_eq!(
        fleet[0].until_next_refresh(),
        Duration::from_secs(1),
        "while E < R every instance refreshes every quarter period"
    );
    // Every other instance's next refresh gets its share of E, and no more.
    for lease in &fleet[1..] {
        let s = lease.refresh().await.unwrap();
        assert_eq!(
            (
                s.grant.as_milli(),
                s.target.as_milli(),
                s.effective.as_milli()
            ),
            (12_000, 12_000, 120_000),
            "{}",
            lease.instance_id()
        );
        assert_eq!(lease.until_next_refresh(), Duration::from_secs(1));
        assert_eq!(lease.status().pushbacks, 0, "only i0 saw the pushback");
    }
}

#[tokio::test]
async fn the_retry_share_is_cut_with_the_budget_so_retries_never_amplify_a_refusal_storm() {
    let server = RedisServer::start();
    let clock = ManualClock::new(Duration::from_micros(START));
    let lease = instance(&store(&server, &clock), "solo", R, &clock);
    let budget = LeasedBudget::new(lease.clone(), Rate::per_second(40)).unwrap();
    lease.refresh().await.unwrap();
    // Every retry the budget admits is refused by the dependency and
    // reported; the lease refreshes once a second. The retry share gets its
    // sixth of the rate in force, so the storm shrinks with E.
    let mut in_force = Vec::new();
    let mut retries = Vec::new();
    for _ in 0..10 {
        in_force.push(lease.status().grant.as_milli() / 1_000);
        let mut admitted = 0;
        for _ in 0..1_000 {
            advance(&clock, MS);
            if budget.try_acquire_now(Attempt::FIRST.next(), 1).is_ok() {
                admitted += 1;
                lease.record_pushback();
            }
        }
        retries.push(admitted);
        lease.refresh().await.unwrap();
    }
    assert_eq!(
        in_force,
        [240, 120, 120, 60, 60, 30, 30, 24, 24, 24],
        "the rate in force each second: halved every 2 s down to the floor"
    );
    for (second, (&sent, &rate)) in retries.iter().zip(&in_force).enumerate() {
        let share = 40 * rate / R;
        assert!(
            sent <= share + 1 && sent + 2 >= share,
            "second {second}: {sent} retries, the share is {share}/s (retries {retries:?})"
        );
    }
}

#[tokio::test]
async fn the_pushback_layer_reports_refusals_to_the_budget_and_nothing_else() {
    let server = RedisServer::start();
    let clock = ManualClock::new(Duration::from_micros(START));
    let lease = instance(&store(&server, &clock), "solo", R, &clock);
    let budget = LeasedBudget::new(lease.clone(), Rate::per_second(40)).unwrap();
    let answers = ["200", "429", "503", "503+retry-after", "200+ratelimit"];
    for answer in answers {
        let client = tower::service_fn(move |_req: http::Request<()>| async move {
            let mut response = http::Response::new(());
            let (status, header) = match answer {
                "429" => (429, None),
                "503" => (503, None),
                "503+retry-after" => (503, Some(("retry-after", "1"))),
                "200+ratelimit" => (200, Some(("ratelimit", "\"q\";r=0;t=1"))),
                _ => (200, None),
            };
            *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
            if let Some((name, value)) = header {
                response.headers_mut().insert(name, value.parse().unwrap());
            }
            Ok::<_, std::convert::Infallible>(response)
        });
        let service = PushbackLayer::new(budget.clone()).layer(client);
        service.oneshot(http::Request::new(())).await.unwrap();
    }
    assert_eq!(
        lease.status().pushbacks,
        3,
        "429, 503 with Retry-After and r=0 push back; 200 and a bare 503 do not"
    );
}
