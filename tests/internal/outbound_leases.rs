//! Rate leases against redis-servers started by the tests.
//!
//! These tests read the grant table back, which is crate-private, so they
//! are compiled into the crate as unit tests (`src/outbound/lease/mod.rs`)
//! rather than as an integration test.
//!
//! Simulated instances are `RateLease`s in one process, each with its own
//! `ManualClock` (some offset from Redis time by seconds). Most tests inject
//! the script's time from a `ManualClock` too (`test_clock`), so that every
//! grant, expiry and send is exact; the Redis-call ratio and the refresher
//! run the production script on Redis `TIME`.
//!
//! The bound checked (docs/leases.md): send starts in any closed interval of
//! length T are at most `n · max_cost + R · burst + R · T` (n instances,
//! `max_cost` 1, burst 25 ms), plus `k · R/N · T` while k instances spend the
//! fallback capacity. At every moment the rates the instances are spending
//! sum to at most R.
#![cfg(feature = "redis")]

#[path = "../support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Context;
use std::time::Duration;

use futures_util::future::join_all;
use futures_util::FutureExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::{RedisServer, StallProxy};
use tower::{Layer, Service, ServiceExt};
use tower_admission::clock::{Clock, ManualClock, Timestamp};
use tower_admission::outbound::{
    Attempt, BudgetError, DependencyBudgetLayer, LeaseError, LeaseStatus, LeaseStore, LeasedBudget,
    Rate, RateLease, RateLeaseBuilder, RetryAttempts,
};
use tracing_subscriber::layer::SubscriberExt;

/// A time since the Unix epoch in whole microseconds, the unit these
/// tests count in.
trait Micros {
    fn us(self) -> u64;
}

impl Micros for Duration {
    fn us(self) -> u64 {
        u64::try_from(self.as_micros()).expect("µs fit in u64")
    }
}

// Crate-private: the grant table as the script counts it.
use super::demand::{HELD_BACK_FLAG, HELD_ONCE, MEASURED};
use super::store::Args;
use super::{Asked, GrantTable};

/// The budget, per second.
const R: u64 = 240;
const R_MILLI: u64 = R * 1_000;
const BUDGET: &str = "dep";
/// Redis (injected) time at the start of every test, µs.
const START: u64 = 1_700_000_000_000_000;
const MS: u64 = 1_000;
const SEC: u64 = 1_000_000;
/// Default lease, refresh period and expiry margin.
const L: u64 = 5 * SEC;
const MARGIN: u64 = 5 * MS;

fn store(server: &RedisServer, redis_time: Option<&ManualClock>) -> LeaseStore {
    let deadline = Duration::from_secs(5);
    match redis_time {
        Some(clock) => LeaseStore::with_test_clock(&server.url(), "t", deadline, clock.clone()),
        None => LeaseStore::new(&server.url(), "t", deadline),
    }
    .expect("store settings")
}

type Builder = RateLeaseBuilder<ManualClock>;

/// Instance `id` of the budget on `store`, its first demand `demand` per
/// second, on `local` time.
fn instance(store: &LeaseStore, id: &str, demand: u64, local: &ManualClock) -> Builder {
    RateLease::builder(
        store.clone(),
        BUDGET,
        Rate::per_second(R),
        NonZeroU32::new(40).unwrap(),
    )
    .instance_id(id)
    .initial_demand(Rate::per_second(demand))
    .clock(local.clone())
}

/// The only instance, asking for the whole budget, on `local` time.
fn solo(store: LeaseStore, local: &ManualClock) -> RateLease<ManualClock> {
    instance(&store, "solo", R, local).build().unwrap()
}

/// One simulated instance.
struct Node {
    id: String,
    lease: RateLease<ManualClock>,
    clock: ManualClock,
    /// Local time minus fleet (Redis) time, µs.
    offset: i64,
    /// Send attempts per second.
    attempts: u64,
    /// Milli-attempts accumulated.
    acc: u64,
    /// When set, attempts arrive at random instead of evenly: in each
    /// millisecond one arrives with probability `attempts / 1000`.
    random: Option<StdRng>,
    /// Callers wait as the budget's layer makes them: in one queue whose
    /// head alone tries, again once the wait it was told has passed, instead
    /// of dropping a refused attempt.
    queued: bool,
    /// A queued attempt counts toward the demand when it arrives, as the
    /// budget's layer counts it, instead of at each look at the head.
    counted_on_arrival: bool,
    /// Queued attempts not sent yet.
    backlog: u64,
    /// The head of the queue tries again at this fleet time (µs).
    retry_at: u64,
    alive: bool,
    /// Fleet times (µs) of admitted sends.
    sends: Vec<u64>,
    /// Refreshes are skipped before this time (µs since the start).
    quiet_until: u64,
    /// The next refresh at or after this time (µs since the start) has its
    /// reply held this long.
    delay: Option<(u64, u64)>,
    pending: Option<(Pending, u64)>,
}

impl Node {
    fn local(&self, fleet: u64) -> u64 {
        fleet.checked_add_signed(self.offset).expect("local time")
    }

    fn fleet(&self, local: Duration) -> u64 {
        local
            .us()
            .checked_add_signed(-self.offset)
            .expect("fleet time")
    }

    fn status(&self) -> LeaseStatus {
        self.lease.status()
    }
}

type Pending = Pin<Box<dyn Future<Output = Result<LeaseStatus, LeaseError>>>>;

/// Starts a refresh and polls it once: the script call is queued with its
/// arguments (send instant and injected time) fixed, and the reply is taken
/// in only when the future is awaited later.
fn send_only(lease: &RateLease<ManualClock>) -> Pending {
    let lease = lease.clone();
    let mut fut: Pending = Box::pin(async move { lease.refresh().await });
    let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
    assert!(
        fut.as_mut().poll(&mut cx).is_pending(),
        "a refresh on a live connection cannot finish in one poll"
    );
    fut
}

/// The fleet: instances, the Redis time they share and the checks run on
/// every tick.
struct Fleet {
    redis: ManualClock,
    /// Fleet time since START, µs.
    t: u64,
    nodes: Vec<Node>,
    reader: LeaseStore,
    expected: u32,
    /// Ticks on which the grant table was read back and checked.
    tables_checked: u64,
    /// The highest sum of commitments seen in any table, milli/s.
    peak_seen: u64,
    /// The highest sum of rates being spent at once, milli/s.
    spend_peak: u64,
    refresh_errors: u64,
    /// Read the grant table back after every tick with a refresh (off while
    /// Redis is down, and when counting Redis calls).
    read_tables: bool,
}

impl Fleet {
    fn new(redis: ManualClock, reader: LeaseStore, expected: u32) -> Self {
        Fleet {
            redis,
            t: 0,
            nodes: Vec::new(),
            reader,
            expected,
            tables_checked: 0,
            peak_seen: 0,
            spend_peak: 0,
            refresh_errors: 0,
            read_tables: true,
        }
    }

    fn now(&self) -> u64 {
        START + self.t
    }

    /// A new instance with its own local clock `offset_s` seconds off Redis.
    fn join(
        &mut self,
        store: &LeaseStore,
        id: &str,
        attempts: u64,
        offset_s: i64,
        configure: impl FnOnce(Builder) -> Builder,
    ) -> usize {
        let offset = offset_s * 1_000_000;
        let clock = ManualClock::new(Duration::from_micros(
            self.now().checked_add_signed(offset).unwrap(),
        ));
        let builder = RateLease::builder(
            store.clone(),
            BUDGET,
            Rate::per_second(R),
            NonZeroU32::new(self.expected).unwrap(),
        )
        .instance_id(id)
        .clock(clock.clone());
        let lease = configure(builder).build().expect("lease settings");
        self.nodes.push(Node {
            id: id.to_owned(),
            lease,
            clock,
            offset,
            attempts,
            acc: 0,
            random: None,
            queued: false,
            counted_on_arrival: false,
            backlog: 0,
            retry_at: 0,
            alive: true,
            sends: Vec::new(),
            quiet_until: 0,
            delay: None,
            pending: None,
        });
        self.nodes.len() - 1
    }

    async fn table(&mut self) -> GrantTable {
        let table = self.reader.grants(BUDGET).await.expect("read grants");
        let peak = table.peak().as_milli();
        assert!(
            peak <= R_MILLI,
            "sum of unexpired grants {peak} milli/s > R = {R_MILLI} at t = {} ms: {table:#?}",
            self.t / MS
        );
        self.tables_checked += 1;
        self.peak_seen = self.peak_seen.max(peak);
        table
    }

    /// Advances every clock by `dt`, makes the attempts of that span at its
    /// end, refreshes the instances that are due, and checks the sums.
    async fn tick(&mut self, dt: u64) {
        self.t += dt;
        self.redis.advance(Duration::from_micros(dt));
        let now = self.now();
        for node in &mut self.nodes {
            node.clock.advance(Duration::from_micros(dt));
            if !node.alive {
                continue;
            }
            let arrived = match &mut node.random {
                None => {
                    node.acc += node.attempts * dt / 1_000;
                    let arrived = node.acc / 1_000;
                    node.acc %= 1_000;
                    arrived
                }
                Some(rng) => {
                    let p = u32::try_from(node.attempts.min(1_000)).unwrap_or(1_000);
                    (0..dt / MS).filter(|_| rng.random_ratio(p, 1_000)).count() as u64
                }
            };
            for _ in 0..arrived {
                if node.queued {
                    node.backlog += 1;
                    if node.counted_on_arrival {
                        node.lease.note_demand(Asked::Cost(1));
                    }
                } else if node.lease.try_acquire(1).is_ok() {
                    node.sends.push(now);
                }
            }
            while node.queued && node.backlog > 0 && node.retry_at <= now {
                let looked = if node.counted_on_arrival {
                    node.lease
                        .acquire_counting(1, Asked::Nothing, node.lease.now())
                } else {
                    node.lease.try_acquire(1)
                };
                match looked {
                    Ok(()) => {
                        node.backlog -= 1;
                        node.sends.push(now);
                    }
                    Err(wait) => {
                        let micros = u64::try_from(wait.as_micros()).unwrap_or(u64::MAX);
                        node.retry_at = now.saturating_add(micros);
                    }
                }
            }
        }
        let mut refreshed = false;
        // Replies held back arrive first.
        for i in 0..self.nodes.len() {
            if matches!(&self.nodes[i].pending, Some((_, at)) if *at <= now) {
                let (fut, _) = self.nodes[i].pending.take().unwrap();
                if fut.await.is_err() {
                    self.refresh_errors += 1;
                }
                refreshed = true;
            }
        }
        let mut due = Vec::new();
        for (i, node) in self.nodes.iter_mut().enumerate() {
            let status = node.status();
            if !node.alive
                || node.pending.is_some()
                || self.t < node.quiet_until
                || status.is_released()
                || node.fleet(status.next_refresh) > now
            {
                continue;
            }
            match node.delay {
                Some((from, hold)) if self.t >= from => {
                    node.delay = None;
                    node.pending = Some((send_only(&node.lease), now + hold));
                }
                _ => due.push(i),
            }
        }
        if !due.is_empty() {
            let results = join_all(due.iter().map(|&i| self.nodes[i].lease.refresh())).await;
            self.refresh_errors += results.iter().filter(|r| r.is_err()).count() as u64;
            refreshed = true;
        }
        self.check_spending();
        if refreshed && self.read_tables {
            self.table().await;
        }
    }

    /// The rates being spent right now sum to at most R, plus the fallback
    /// capacity of every instance spending it.
    fn check_spending(&mut self) {
        let mut granted = 0;
        let mut fallback = 0;
        for node in self.nodes.iter().filter(|n| n.alive) {
            let s = node.status();
            if s.is_fallback() {
                fallback += s.rate.as_milli();
            } else {
                granted += s.rate.as_milli();
            }
        }
        assert!(
            granted <= R_MILLI,
            "granted rates spent at once {granted} milli/s > R at t = {} ms",
            self.t / MS
        );
        self.spend_peak = self.spend_peak.max(granted + fallback);
    }

    /// Runs in 1 ms ticks until `until` (µs), reading `read` after every
    /// tick in which node `node` took in a reply (its next refresh moved).
    async fn at_refreshes<T>(
        &mut self,
        node: usize,
        until: u64,
        read: impl Fn(&Fleet) -> T,
    ) -> Vec<T> {
        let mut seen = Vec::new();
        let mut last_refresh = Duration::ZERO;
        while self.t < until {
            self.tick(MS).await;
            let next = self.nodes[node].status().next_refresh;
            if next != last_refresh {
                last_refresh = next;
                seen.push(read(self));
            }
        }
        seen
    }

    async fn run_until(&mut self, t: u64, dt: u64) {
        while self.t + dt <= t {
            self.tick(dt).await;
        }
    }

    fn all_sends(&self) -> Vec<u64> {
        let mut all: Vec<u64> = self.nodes.iter().flat_map(|n| n.sends.clone()).collect();
        all.sort_unstable();
        all
    }
}

/// The most sends in any closed window `[t, t + span]`.
fn max_in_window(sorted: &[u64], span: u64) -> usize {
    let mut best = 0;
    let mut i = 0;
    for j in 0..sorted.len() {
        while sorted[j] - sorted[i] > span {
            i += 1;
        }
        best = best.max(j - i + 1);
    }
    best
}

/// Asserts that the fleet's send starts in every window of 100 ms, 1 s and
/// 5 s stay within [`bound`] for all its instances; returns each span, the
/// most sends in a window of it and the bound. `context` leads the message.
fn assert_send_bounds(fleet: &Fleet, context: &str) -> Vec<(u64, u64, u64)> {
    let sends = fleet.all_sends();
    let n = fleet.nodes.len() as u64;
    [100 * MS, SEC, 5 * SEC]
        .into_iter()
        .map(|span| {
            let most = max_in_window(&sends, span) as u64;
            assert!(
                most <= bound(n, span),
                "{context}sends in a {} ms window: {most}, over n + R·burst + R·T = {}",
                span / MS,
                bound(n, span)
            );
            (span, most, bound(n, span))
        })
        .collect()
}

/// Sends of a node in the fleet-time interval `[from, to)`.
fn sends_between(node: &Node, from: u64, to: u64) -> usize {
    node.sends.iter().filter(|&&t| t >= from && t < to).count()
}

/// The derived bound on send starts in a closed window of `span` µs with
/// `n` instances: n · max_cost + R · burst + R · span (all in whole sends,
/// rounded up).
fn bound(n: u64, span: u64) -> u64 {
    n + (R * 25 * MS).div_ceil(SEC) + (R * span).div_ceil(SEC)
}

/// Max-min fair shares of `budget` over `demands` (milli/s), written
/// independently of the script: every demand that fits under the water
/// level is met, the rest get the level.
fn max_min(demands: &[u64], budget: u64) -> Vec<u64> {
    let mut order: Vec<usize> = (0..demands.len()).collect();
    order.sort_by_key(|&i| demands[i]);
    let mut remaining = budget;
    let mut level = None;
    for (k, &i) in order.iter().enumerate() {
        let share = remaining / (demands.len() - k) as u64;
        if demands[i] <= share {
            remaining -= demands[i];
        } else {
            level = Some(share);
            break;
        }
    }
    demands
        .iter()
        .map(|&d| level.map_or(d, |l| d.min(l)))
        .collect()
}

fn latest(table: &GrantTable, id: &str) -> u64 {
    table
        .instance(id)
        .and_then(|i| i.latest())
        .map_or(0, |s| s.rate.as_milli())
}

// ---------------------------------------------------------------------------
// (1) The sum of grants while instances join, refresh concurrently and leave.
// ---------------------------------------------------------------------------

#[tokio::test]
async fn grants_never_sum_above_r_while_10_then_40_instances_join_refresh_and_leave() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let mut fleet = Fleet::new(redis.clone(), store(&server, Some(&redis)), 40);
    let tick = 250 * MS;
    // Every instance has its own connection, so the refreshes of one tick
    // reach Redis concurrently; local clocks are off by -3 s to +3 s.
    let join = |fleet: &mut Fleet, id: String, demand: u64| {
        let offset = (fleet.nodes.len() % 7) as i64 - 3;
        let own = store(&server, Some(&redis));
        fleet.join(&own, &id, demand, offset, |b| b);
    };
    let check_targets = |fleet: &Fleet, table: &GrantTable, phase: &str| {
        let live: Vec<&Node> = fleet.nodes.iter().filter(|n| n.alive).collect();
        let demands: Vec<u64> = live.iter().map(|n| n.attempts * 1_000).collect();
        let targets = max_min(&demands, R_MILLI);
        for (node, target) in live.iter().zip(&targets) {
            assert_eq!(
                latest(table, &node.id),
                *target,
                "{phase}: {} (demand {}/s) holds its max-min share of {R}/s",
                node.id,
                node.attempts
            );
        }
        let sum: u64 = live.iter().map(|n| latest(table, &n.id)).sum();
        assert!(sum <= R_MILLI, "{phase}: grants sum {sum} <= R");
        targets
    };

    // Phase A: 10 instances.
    let demands_a = [8, 12, 16, 20, 24, 40, 60, 100, 200, 400];
    for (i, d) in demands_a.iter().enumerate() {
        join(&mut fleet, format!("a{i}"), *d);
    }
    fleet.tick(0).await;
    fleet.run_until(12 * SEC, tick).await;
    let table = fleet.table().await;
    let targets = check_targets(&fleet, &table, "10 instances");
    assert_eq!(
        targets.iter().sum::<u64>(),
        R_MILLI,
        "10 instances: 8+12+16+20+24 and five at the level 32 use all of 240/s"
    );
    assert_eq!(latest(&table, "a9"), 32_000, "the water level is 32/s");

    // Phase B: 30 more join at t = 12 s (40 in all).
    let demands_b = [4, 8, 20, 48, 400, 400];
    let joined_at = fleet.t;
    for i in 0..30 {
        join(&mut fleet, format!("b{i}"), demands_b[i % 6]);
    }
    fleet.tick(0).await;
    // Their first grants are zero while the others' older grants run out:
    // until a grant lets them measure, they keep asking for their guess,
    // 6/s. The free shares come one lease after their second refresh (1 s);
    // the ones whose demand is below the guess report it at the refresh
    // after their first grant, one period later.
    fleet.run_until(joined_at + SEC + L + 4 * SEC, tick).await;
    let table = fleet.table().await;
    let targets = check_targets(&fleet, &table, "40 instances, 1 s + L + P after joining");
    fleet.run_until(joined_at + 12 * SEC, tick).await;
    let table = fleet.table().await;
    assert_eq!(
        check_targets(&fleet, &table, "40 instances, settled"),
        targets
    );

    // Phase C: 10 leave cleanly (release), 10 are killed holding leases.
    let left_at = fleet.t;
    let mut killed = Vec::new();
    for (k, i) in (0..40).step_by(2).enumerate() {
        if k % 2 == 0 {
            fleet.nodes[i].lease.release().await.expect("release");
            fleet.nodes[i].alive = false;
        } else {
            fleet.nodes[i].alive = false;
            killed.push(i);
        }
    }
    let table = fleet.table().await;
    for (k, i) in (0..40).step_by(2).enumerate() {
        let node = &fleet.nodes[i];
        if k % 2 == 0 {
            assert!(
                table.instance(&node.id).is_none(),
                "a released instance's share returns at once"
            );
        } else {
            assert!(
                table.instance(&node.id).is_some(),
                "a killed one still counts"
            );
        }
    }
    let expiries: HashMap<usize, u64> = killed
        .iter()
        .map(|&i| {
            let s = table.instance(&fleet.nodes[i].id).unwrap();
            (i, s.steps.iter().map(|s| s.expires_at.0).max().unwrap())
        })
        .collect();
    while fleet.t < left_at + 12 * SEC {
        fleet.tick(tick).await;
        let table = fleet.table().await;
        for &i in &killed {
            let present = table.instance(&fleet.nodes[i].id).is_some();
            assert_eq!(
                present,
                fleet.now() < expiries[&i],
                "a killed instance's grant counts exactly until its expiry"
            );
        }
    }
    let table = fleet.table().await;
    check_targets(&fleet, &table, "20 instances after 10 left and 10 died");
    println!(
        "grants: {} tables read back, highest sum of unexpired grants {} milli/s (R = {R_MILLI})",
        fleet.tables_checked, fleet.peak_seen
    );
}

/// Sends of the fleet in each whole second `[k, k + 1)` from the start.
fn sends_per_second(fleet: &Fleet, seconds: u64) -> Vec<usize> {
    let all = fleet.all_sends();
    (0..seconds)
        .map(|k| {
            let (from, to) = (START + k * SEC, START + (k + 1) * SEC);
            all.iter().filter(|&&t| t >= from && t < to).count()
        })
        .collect()
}

#[tokio::test]
async fn queued_callers_held_back_by_small_first_grants_reach_their_fair_share_and_none_takes_more()
{
    // 8 instances start 100 ms apart, their callers queued and always
    // backlogged (as behind the budget's layer): each wants more than its
    // fair share of 30/s. The first grants are the 6/s guesses.
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, Some(&redis));
    let mut fleet = Fleet::new(redis.clone(), shared.clone(), 40);
    let n = 8;
    let fair = R_MILLI / n;
    for i in 0..n {
        fleet.run_until(i * 100 * MS, MS).await;
        let node = fleet.join(&shared, &format!("q{i}"), 1_000, 0, |b| b);
        fleet.nodes[node].queued = true;
        fleet.tick(0).await;
    }
    // The time from which every grant was its fair share, the highest
    // grant, and the lowest sum of the rates spent from 10 s on. From the
    // 6/s guess, each first asks its doubling, 12/s; held back twice in a
    // row, it asks 24/s and may take twice that from what no one asks,
    // shared with the other seven held back, at most the level where all
    // eight are unbounded: 30/s (it was 12, 24, then 30, settled at 9.7 s).
    let settled = 10 * SEC;
    let mut settled_at = None;
    let mut most = 0;
    let mut lowest_spent = u64::MAX;
    while fleet.t < 20 * SEC {
        fleet.tick(MS).await;
        let grants: Vec<u64> = fleet
            .nodes
            .iter()
            .map(|n| n.status().grant.as_milli())
            .collect();
        most = most.max(*grants.iter().max().unwrap());
        if grants.iter().all(|&g| g == fair) {
            settled_at.get_or_insert(fleet.t);
        } else {
            settled_at = None;
        }
        if fleet.t >= settled {
            let spent: u64 = fleet.nodes.iter().map(|n| n.status().rate.as_milli()).sum();
            lowest_spent = lowest_spent.min(spent);
        }
    }
    let per_second = sends_per_second(&fleet, 20);
    println!("held back: settled at {settled_at:?} µs, highest grant {most}, lowest sum spent {lowest_spent}; sends per second {per_second:?}");
    assert_eq!(
        (settled_at.map(|t| t / MS), most, lowest_spent),
        (Some(5_700), fair, R_MILLI),
        "(ms from which every grant is the fair 30/s, highest grant, lowest sum \
         spent from {} ms on, milli/s); sends per second {per_second:?}",
        settled / MS
    );
    for node in &fleet.nodes {
        let s = node.status();
        assert_eq!(
            s.demand,
            Rate::per_second(2 * R / n),
            "{} was held back by its fair grant: it reports twice it",
            node.id
        );
    }
}

#[tokio::test]
async fn an_instance_whose_demand_fits_its_grant_reports_its_measured_demand() {
    // "small" sends 8/s, never more, and its first grant (the guess, 12/s)
    // is above that; then it is granted exactly its need. "big" is held back.
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, Some(&redis));
    let mut fleet = Fleet::new(redis.clone(), shared.clone(), 40);
    let small = fleet.join(&shared, "small", 8, 0, |b| {
        b.initial_demand(Rate::per_second(12))
    });
    let big = fleet.join(&shared, "big", 1_000, 0, |b| b);
    fleet.nodes[small].queued = true;
    fleet.nodes[big].queued = true;
    fleet.tick(0).await;
    let reports = fleet
        .at_refreshes(small, 20 * SEC, |f| {
            let (s, b) = (f.nodes[small].status(), f.nodes[big].status());
            (
                f.t / MS,
                s.demand.as_milli(),
                s.grant.as_milli(),
                b.demand.as_milli(),
            )
        })
        .await;
    // (ms, small's demand, its grant, big's demand), at each of small's refreshes.
    assert_eq!(
        reports[1..],
        [
            (1_000, 8_000, 8_000, 12_000),
            (5_000, 8_000, 8_000, 24_250),
            (9_000, 8_000, 8_000, 97_000),
            (13_000, 8_000, 8_000, 240_000),
            (17_000, 8_000, 8_000, 240_000),
        ],
        "small reports what it measured, below and at its grant; big, held back, at least twice \
         its grant (its queue's head, told to wait at most until the next refresh, also looks \
         at each refresh: 24.25/s against 2 x 12/s); held back twice in a row from 5 s, it is \
         granted twice what it asks from what small leaves (48.5/s, then 194/s), so it asks \
         twice that"
    );
    let arrivals: Vec<u64> = (1..=8 * 20).map(|k| START + k * 125 * MS).collect();
    assert_eq!(
        fleet.nodes[small].sends, arrivals,
        "small sent each attempt as it came, every 125 ms"
    );
    assert_eq!(
        fleet.nodes[big].status().grant,
        Rate::from_milli(232_000),
        "big reached the rest, 232/s, in two refreshes held back twice in a row"
    );
}

#[tokio::test]
async fn a_guess_carried_over_a_zero_grant_is_measured_a_quarter_period_after_its_first_grant() {
    // "big" holds the whole budget, its callers always backlogged; "small"
    // joins at 100 ms with its guess (6/s) and a zero grant: its callers, a
    // batch of 8 then 2 a second, counted as they arrive (as the budget's
    // layer counts them), wait for its next refresh, which carries its ask
    // over (a count at a zero grant says nothing). Once granted, it
    // measures its 2/s a quarter period later, as a guess is, and gives the
    // surplus back.
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, Some(&redis));
    let mut fleet = Fleet::new(redis.clone(), shared.clone(), 40);
    let big = fleet.join(&shared, "big", 1_000, 0, |b| {
        b.initial_demand(Rate::per_second(R))
    });
    fleet.nodes[big].queued = true;
    fleet.tick(0).await;
    fleet.run_until(100 * MS, MS).await;
    let small = fleet.join(&shared, "small", 2, 0, |b| b);
    fleet.nodes[small].queued = true;
    fleet.nodes[small].counted_on_arrival = true;
    // A batch of 8 calls arrives with it.
    for _ in 0..8 {
        fleet.nodes[small].lease.note_demand(Asked::Cost(1));
    }
    fleet.nodes[small].backlog = 8;
    fleet.tick(0).await;
    let reports = fleet
        .at_refreshes(small, 9_500 * MS, |f| {
            let s = f.nodes[small].status();
            (f.t / MS, s.demand.as_milli(), s.grant.as_milli())
        })
        .await;
    // (ms, small's demand, its grant), at each of small's refreshes.
    assert_eq!(
        reports,
        [
            (101, 6_000, 0),
            (1_100, 10_000, 0),
            (5_000, 10_000, 10_000),
            (6_000, 2_000, 2_000)
        ],
        "small measures the batch and its arrivals (10/s) but is held back by a zero grant: \
         it asks the most of its guess and its count until granted, when big's first grant \
         expires; a second later it measures its 2/s and lowers its grant (it held 10/s until \
         9 s before)"
    );
    assert_eq!(
        fleet.nodes[big].status().grant,
        Rate::from_milli(R_MILLI - 2_500),
        "big, refreshed at 9 s, takes what small gave back: all but its measure and a quarter"
    );
}

#[tokio::test]
async fn a_window_held_back_once_does_not_lower_the_others_targets_until_it_is_held_back_again() {
    // "light" holds 9.6/s, its need, and one window of its bursts is held
    // back: it asks twice that, flagged held back once. "big", saturated,
    // keeps its target (others count light at half its ask, what it holds);
    // only light's second such window in a row takes room from big's.
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, Some(&redis));
    let key = shared.key(BUDGET);
    let call = |id: &'static str, life: u64, demand: u64, flag: u8| {
        let shared = shared.clone();
        let key = key.clone();
        async move {
            let args = Args {
                op: "g",
                life,
                demand: Rate::from_milli(demand),
                flag,
                budget: Rate::per_second(R),
                lease_us: L,
                held: (Rate::ZERO, 0),
                kept: (Rate::ZERO, 0),
                pushed: false,
                lowered: Rate::ZERO,
                number: 0,
            };
            let reply = shared.grant(&key, id, &args).await.expect("grant call");
            (reply.rate.as_milli(), reply.target.as_milli())
        }
    };
    assert_eq!(call("light", 1, 9_600, MEASURED).await, (9_600, 9_600));
    assert_eq!(call("big", 2, R_MILLI, MEASURED).await, (230_400, 230_400));
    assert_eq!(
        call("light", 1, 19_200, HELD_ONCE).await,
        (9_600, 19_200),
        "no room: big holds the rest"
    );
    assert_eq!(
        call("big", 2, R_MILLI, MEASURED).await,
        (230_400, 230_400),
        "light held back once counts at half its ask, 9.6/s, what it holds"
    );
    assert_eq!(
        call("light", 1, 19_200, HELD_BACK_FLAG).await,
        (9_600, 19_200)
    );
    assert_eq!(
        call("big", 2, R_MILLI, MEASURED).await,
        (R_MILLI - 38_400, R_MILLI - 38_400),
        "held back twice in a row, light counts as twice its ask: big is lowered (its older \
         step stays counted until it expires)"
    );
}

// ---------------------------------------------------------------------------
// (2) The bound on send starts.
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_lowered_grant_stays_counted_while_its_reply_is_in_flight() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, Some(&redis));
    let mut fleet = Fleet::new(redis.clone(), shared.clone(), 40);
    let all = |b: Builder| b.initial_demand(Rate::per_second(R));
    let a = fleet.join(&shared, "a", 1_000, 0, all);
    fleet.tick(0).await;
    assert_eq!(
        fleet.nodes[a].status().grant,
        Rate::per_second(R),
        "alone, a gets all of R"
    );
    fleet.run_until(2 * SEC, MS).await;

    let b = fleet.join(&shared, "b", 1_000, 0, all);
    fleet.tick(0).await;
    let s = fleet.nodes[b].status();
    assert_eq!(
        (s.grant, s.target),
        (Rate::ZERO, Rate::per_second(120)),
        "b's fair share is 120/s, none is free"
    );
    // a's regular refresh at 5 s lowers it to 120/s; its reply takes 500 ms.
    fleet.nodes[a].delay = Some((5 * SEC, 500 * MS));
    fleet.run_until(5_200 * MS, MS).await;
    assert_eq!(
        fleet.nodes[a].status().grant,
        Rate::per_second(R),
        "a has no reply yet"
    );
    let table = fleet.table().await;
    let steps: Vec<(u64, u64)> = table
        .instance("a")
        .unwrap()
        .steps
        .iter()
        .map(|s| (s.rate.as_milli(), s.expires_at.0 - START))
        .collect();
    assert_eq!(
        steps,
        [(R_MILLI, 6 * SEC), (120_000, 10 * SEC)],
        "the script counts a's old 240/s until the old expiry (6 s) and the new 120/s after"
    );
    // b asks while a's reply is in flight: nothing is free.
    let s = fleet.nodes[b].lease.refresh().await.expect("refresh b");
    assert_eq!(
        s.grant,
        Rate::ZERO,
        "a's surplus is not handed out before a's old grant expires"
    );
    fleet.run_until(5_500 * MS, MS).await;
    let sa = fleet.nodes[a].status();
    assert_eq!(
        (sa.grant, sa.rate, sa.kept),
        (
            Rate::per_second(120),
            Rate::per_second(R),
            Rate::per_second(R)
        ),
        "once the reply arrived a keeps spending its old 240/s, which the script counts \
         until the old expiry anyway"
    );
    assert_eq!(
        sa.kept_expires_at.us() - START,
        6 * SEC - MARGIN,
        "until the old grant's local expiry"
    );
    fleet.run_until(6 * SEC, MS).await;
    let sends_a = sends_between(
        &fleet.nodes[a],
        START + 5_500 * MS,
        START + 6 * SEC - MARGIN,
    );
    assert!(
        (118..=121).contains(&sends_a),
        "a spent 240/s until its old grant's expiry: {sends_a} sends in 495 ms"
    );
    assert_eq!(
        fleet.nodes[a].status().rate,
        Rate::per_second(120),
        "then 120/s"
    );
    let in_flight = sends_between(&fleet.nodes[a], START + 5 * SEC, START + 5_500 * MS);
    assert!(
        (119..=121).contains(&in_flight),
        "a kept spending 240/s for the 500 ms in flight: {in_flight} sends, expected 120 ± 1"
    );
    assert_eq!(
        fleet.nodes[b].status().grant,
        Rate::per_second(120),
        "b gets its share at a's old expiry (6 s), told in advance"
    );
    fleet.run_until(10 * SEC, MS).await;

    let sends = fleet.all_sends();
    let most = max_in_window(&sends, SEC) as u64;
    assert!(
        most <= bound(2, SEC),
        "sends in any 1 s window {most} <= 2 + 6 + 240 = {}",
        bound(2, SEC)
    );
    let in_6_to_10 = sends
        .iter()
        .filter(|&&t| (START + 6 * SEC..START + 10 * SEC).contains(&t))
        .count();
    assert!(
        (958..=961).contains(&in_6_to_10),
        "6 s to 10 s: a and b at 120/s each send 960 ± 2, got {in_6_to_10}"
    );
    println!(
        "in flight: a sent {in_flight} in 500 ms at its old 240/s; most in 1 s: {most} (bound {})",
        bound(2, SEC)
    );
}

#[tokio::test]
async fn a_lowered_grant_whose_reply_is_lost_stays_counted_until_the_old_expiry() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, Some(&redis));
    let mut fleet = Fleet::new(redis.clone(), shared.clone(), 40);
    // a reaches Redis through a proxy that can cut a reply.
    let proxy = support::ReplyCutProxy::start(server.port()).await;
    let via_proxy =
        LeaseStore::with_test_clock(&proxy.url(), "t", Duration::from_secs(5), redis.clone())
            .unwrap();
    let all = |b: Builder| b.initial_demand(Rate::per_second(R));
    let a = fleet.join(&via_proxy, "a", 1_000, 0, all);
    fleet.tick(0).await;
    fleet.run_until(2 * SEC, MS).await;
    let b = fleet.join(&shared, "b", 1_000, 0, all);
    fleet.tick(0).await;
    // a's grant from its refresh at 1 s lasts until 6 s on Redis, 5.995 s locally.
    assert_eq!(
        fleet.nodes[a].status().expires_at.us(),
        START + 6 * SEC - MARGIN
    );
    // At 5 s a's refresh runs in Redis but its reply is lost, and a sends
    // no other until its old grant has run out.
    fleet.run_until(5 * SEC - MS, MS).await;
    proxy.cut_next_reply();
    fleet.tick(MS).await;
    assert_eq!((proxy.cuts(), fleet.refresh_errors), (1, 1));
    fleet.nodes[a].quiet_until = 6 * SEC - MARGIN;
    let table = fleet.table().await;
    let steps: Vec<(u64, u64)> = table
        .instance("a")
        .unwrap()
        .steps
        .iter()
        .map(|s| (s.rate.as_milli(), s.expires_at.0))
        .collect();
    assert_eq!(
        steps,
        [(R_MILLI, START + 6 * SEC), (120_000, START + 10 * SEC)],
        "the script lowered a to 120/s, and counts its old 240/s until 6 s"
    );
    let s = fleet.nodes[b].lease.refresh().await.unwrap();
    assert_eq!(s.grant, Rate::ZERO, "a's old 240/s is still counted");
    fleet.run_until(5_990 * MS, MS).await;
    assert_eq!(
        fleet.nodes[a].status().rate,
        Rate::per_second(R),
        "a still spends its old grant"
    );
    assert_eq!(
        fleet.nodes[b].status().grant,
        Rate::ZERO,
        "b waits for a's old expiry"
    );
    fleet.run_until(8 * SEC, MS).await;
    assert_eq!(fleet.nodes[a].status().grant, Rate::per_second(120));
    assert_eq!(
        fleet.nodes[b].status().grant,
        Rate::per_second(120),
        "b got a's surplus at 6 s"
    );
    let old = sends_between(&fleet.nodes[a], START + 5 * SEC, START + 5_995 * MS);
    assert!(
        (238..=240).contains(&old),
        "a spent its old 240/s until its local expiry: {old} sends in 995 ms, expected 239 ± 1"
    );
    let sends = fleet.all_sends();
    let most = max_in_window(&sends, SEC) as u64;
    assert!(
        most <= bound(2, SEC) + 1,
        "1 s windows: {most} <= 248 + one fallback send"
    );
}

#[tokio::test]
async fn send_starts_stay_within_the_bound_with_lowered_killed_offset_and_new_instances() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, Some(&redis));
    let mut fleet = Fleet::new(redis.clone(), shared.clone(), 40);
    let a = fleet.join(&shared, "a", 400, 0, |b| b);
    let k = fleet.join(&shared, "k", 400, 0, |b| b);
    let o = fleet.join(&shared, "o", 400, 7, |b| b);
    let m = fleet.join(&shared, "m", 8, -3, |b| b);
    fleet.tick(0).await;
    fleet.run_until(10 * SEC, MS).await;
    let table = fleet.table().await;
    for id in ["a", "k", "o"] {
        assert_eq!(latest(&table, id), 77_333, "{id}: (240 - 8) / 3 = 77.333/s");
    }
    assert_eq!(latest(&table, "m"), 8_000, "m gets its demand of 8/s");

    // Five newcomers at 10 s; a's lowering refresh at 13 s waits 400 ms for its reply.
    let newcomers: Vec<usize> = (0..5)
        .map(|i| fleet.join(&shared, &format!("n{i}"), 400, 0, |b| b))
        .collect();
    fleet.nodes[a].delay = Some((13 * SEC, 400 * MS));
    fleet.tick(0).await;
    fleet.run_until(13 * SEC, MS).await;
    let table = fleet.table().await;
    assert_eq!(
        latest(&table, "k"),
        29_000,
        "k lowered to (240 - 8) / 8 = 29/s"
    );
    assert_eq!(
        table
            .instance("k")
            .unwrap()
            .committed_at(table.now)
            .as_milli(),
        77_333,
        "k's old 77.333/s still counts until 14 s"
    );
    let o_status = fleet.nodes[o].status();
    assert_eq!(
        o_status.expires_at.us(),
        fleet.nodes[o].local(START + 13 * SEC) + L - MARGIN,
        "o (local clock 7 s ahead) uses its grant for L - margin from its send instant"
    );
    fleet.run_until(13_400 * MS, MS).await;
    let in_flight = sends_between(&fleet.nodes[a], START + 13 * SEC, START + 13_400 * MS);
    assert!(
        (30..=32).contains(&in_flight),
        "a kept its old 77.333/s while in flight: {in_flight} sends in 400 ms, expected 31 ± 1"
    );
    fleet.run_until(15 * SEC, MS).await;
    let table = fleet.table().await;
    for &n in &newcomers {
        assert_eq!(
            latest(&table, &fleet.nodes[n].id),
            29_000,
            "a newcomer holds its fair share within 1 s + L of joining (at 14 s)"
        );
    }

    // k dies at 15 s holding 29/s until 18 s.
    fleet.nodes[k].alive = false;
    let k_expiry = table.instance("k").unwrap().latest().unwrap().expires_at.0;
    assert_eq!(k_expiry, START + 18 * SEC);
    while fleet.t < 18 * SEC - MS {
        fleet.tick(MS).await;
        if fleet.t.is_multiple_of(250 * MS) {
            let table = fleet.table().await;
            let others: u64 = fleet
                .nodes
                .iter()
                .filter(|n| n.alive)
                .map(|n| latest(&table, &n.id))
                .sum();
            assert!(table.instance("k").is_some(), "k counts until 18 s");
            assert!(
                others <= R_MILLI - 29_000,
                "nobody gets k's 29/s before it expires: others {others}"
            );
        }
    }
    fleet.run_until(26 * SEC, MS).await;
    let table = fleet.table().await;
    assert!(table.instance("k").is_none(), "k is gone after its expiry");
    for node in fleet.nodes.iter().filter(|n| n.alive && n.id != "m") {
        assert_eq!(
            latest(&table, &node.id),
            33_142,
            "{}: (240 - 8) / 7 = 33.142/s after k's share returned",
            node.id
        );
    }
    assert_eq!(latest(&table, "m"), 8_000);
    let _ = m;

    for (span, most, bound) in assert_send_bounds(&fleet, "") {
        println!("window {} ms: most {most}, bound {bound}", span / MS);
    }
    println!(
        "spent at once at most {} milli/s; {} tables checked, highest sum {}",
        fleet.spend_peak, fleet.tables_checked, fleet.peak_seen
    );
}

/// One change to a random fleet, at a fleet time.
#[derive(Debug, Clone, Copy)]
enum Change {
    Join,
    Kill,
    Release,
    Demand(u64),
    /// The instance's next refresh reply is held this long.
    SlowReply(u64),
}

/// Ticks 1 ms, then notes each live instance spending the fallback.
async fn tick_noting_fallbacks(fleet: &mut Fleet, fell_back: &mut Vec<String>) {
    fleet.tick(MS).await;
    fell_back.extend(
        fleet
            .nodes
            .iter()
            .filter(|n| n.alive && n.status().is_fallback())
            .map(|n| n.id.clone()),
    );
}

/// What a random fleet did, for the printout.
struct RandomRun {
    seed: u64,
    instances: usize,
    changes: usize,
    /// Most sends in any 1 s window and its bound.
    most_1s: u64,
    bound_1s: u64,
    /// Sends in the last 4 s over what the fleet could use there:
    /// `min(R, the live instances' demands) · 4 s`.
    used: f64,
}

/// A fleet drawn from `seed`: 2 to 10 instances with demands of 1 to 300/s
/// arriving at random, clocks off by up to 3 s, callers queued as behind the
/// budget's layer; until 10 s, 1 to 3 newcomers join, instances are killed
/// or released, demands change and refresh replies are held up to 800 ms.
/// Checked on every tick: grants and the rates spent at once sum to at most
/// R. At the end: send starts in every window of 100 ms, 1 s and 5 s within
/// the bound, no instance ever on the fallback (there is no fault), and from
/// 28 s to 32 s, after three leases without change, the fleet sends at least
/// 90% of what it could use, the fleet target (docs/leases.md, "Random
/// arrivals", says why not all). With `guessing`, demands are 1 to 60/s
/// and every instance's first demand is a guess of 1 to 240/s drawn apart
/// from its real one, so that grants asked on guesses are given back, or
/// doublings asked, while the rest goes on.
async fn random_fleet(seed: u64, guessing: bool) -> RandomRun {
    let mut rng = StdRng::seed_from_u64(seed);
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let mut fleet = Fleet::new(redis.clone(), store(&server, Some(&redis)), 40);
    let most = if guessing { 60 } else { 300 };
    let join = |fleet: &mut Fleet, rng: &mut StdRng| {
        let id = format!("r{}", fleet.nodes.len());
        let own = store(&server, Some(&redis));
        let guess = guessing.then(|| Rate::per_second(rng.random_range(1..=R)));
        let node = fleet.join(
            &own,
            &id,
            rng.random_range(1..=most),
            rng.random_range(-3..=3),
            |b| match guess {
                Some(guess) => b.initial_demand(guess),
                None => b,
            },
        );
        fleet.nodes[node].queued = true;
        fleet.nodes[node].random = Some(StdRng::seed_from_u64(rng.random()));
    };
    for _ in 0..rng.random_range(2..=10) {
        join(&mut fleet, &mut rng);
    }
    let mut changes = Vec::new();
    for _ in 0..rng.random_range(1..=3) {
        changes.push(Change::Join);
    }
    for change in [Change::Kill, Change::Release] {
        if rng.random_bool(0.5) {
            changes.push(change);
        }
    }
    for _ in 0..rng.random_range(1..=3) {
        changes.push(Change::Demand(rng.random_range(1..=most)));
    }
    for _ in 0..rng.random_range(1..=3) {
        changes.push(Change::SlowReply(rng.random_range(50..=800)));
    }
    let mut changes: Vec<(u64, Change)> = changes
        .into_iter()
        .map(|change| (rng.random_range(1..10_000) * MS, change))
        .collect();
    changes.sort_by_key(|&(t, _)| t);
    let count = changes.len();
    fleet.tick(0).await;
    let mut fell_back = Vec::new();
    for (at, change) in changes {
        while fleet.t < at {
            tick_noting_fallbacks(&mut fleet, &mut fell_back).await;
        }
        let live: Vec<usize> = (0..fleet.nodes.len())
            .filter(|&i| fleet.nodes[i].alive)
            .collect();
        let node = live[rng.random_range(0..live.len())];
        match change {
            Change::Join => {
                join(&mut fleet, &mut rng);
                fleet.tick(0).await;
            }
            // The last live instance stays: the fleet keeps a demand.
            Change::Kill if live.len() > 1 => fleet.nodes[node].alive = false,
            Change::Release if live.len() > 1 => {
                fleet.nodes[node].lease.release().await.expect("release");
                fleet.nodes[node].alive = false;
            }
            Change::Kill | Change::Release => {}
            Change::Demand(d) => fleet.nodes[node].attempts = d,
            Change::SlowReply(hold) => fleet.nodes[node].delay = Some((fleet.t, hold * MS)),
        }
    }
    let (from, to) = (28 * SEC, 32 * SEC);
    while fleet.t < to {
        tick_noting_fallbacks(&mut fleet, &mut fell_back).await;
    }
    assert_eq!(
        fell_back,
        Vec::<String>::new(),
        "seed {seed}: no fault, so no instance spends the fallback"
    );
    assert_eq!(
        fleet.refresh_errors, 0,
        "seed {seed}: every refresh answered"
    );
    let bounds = assert_send_bounds(&fleet, &format!("seed {seed}: "));
    let sends = fleet.all_sends();
    let demand: u64 = fleet
        .nodes
        .iter()
        .filter(|n| n.alive)
        .map(|n| n.attempts)
        .sum();
    let usable = R.min(demand) * (to - from) / SEC;
    let sent = sends
        .iter()
        .filter(|&&t| t > START + from && t <= START + to)
        .count() as u64;
    let used = sent as f64 / usable as f64;
    assert!(
        guessing || sent * 10 >= usable * 9,
        "seed {seed}: {sent} sends from {} s to {} s, under 90% of min(R, live demand {demand}/s) · 4 s = {usable}",
        from / SEC,
        to / SEC
    );
    RandomRun {
        seed,
        instances: fleet.nodes.len(),
        changes: count,
        most_1s: bounds[1].1,
        bound_1s: bounds[1].2,
        used,
    }
}

/// Seeds 1 to 24 (`SEEDS=4,17` runs those only). Seed 17 fails if a
/// held-back demand counts as `R` in the others' targets (84.6% sent), and
/// seed 4 if a wait may run past the next refresh (85.5%).
#[tokio::test]
async fn random_fleets_keep_every_bound_through_joins_deaths_releases_and_slow_replies() {
    let seeds: Vec<u64> = match std::env::var("SEEDS") {
        Ok(list) => list
            .split(',')
            .map(|s| {
                s.trim()
                    .parse()
                    .expect("SEEDS: numbers separated by commas")
            })
            .collect(),
        Err(_) => (1..=24).collect(),
    };
    random_fleets(seeds, false).await;
}

/// Runs `random_fleet` for each of `seeds`, printing each run and the
/// lowest and median share used.
async fn random_fleets(seeds: impl IntoIterator<Item = u64>, guessing: bool) {
    let mut used = Vec::new();
    for seed in seeds {
        let run = random_fleet(seed, guessing).await;
        println!(
            "seed {}: {} instances, {} changes, most sends in 1 s {} (bound {}), used {:.3}",
            run.seed, run.instances, run.changes, run.most_1s, run.bound_1s, run.used
        );
        used.push(run.used);
    }
    used.sort_by(f64::total_cmp);
    println!(
        "share of what the fleet could use, 28 s to 32 s: lowest {:.3}, median {:.3}",
        used[0],
        used[used.len() / 2]
    );
}

/// As above, with every first demand a guess drawn apart from the real one
/// (seeds 101 to 112): grants asked on guesses that the first measure finds
/// too large are given back at once, interleaved with joins, deaths,
/// releases, demand changes and replies held in flight, and every bound
/// still holds on every tick and in every window. The share used is
/// printed, not asserted: wrong guesses in a contended fleet leave some
/// seeds under 90% with or without giving back (docs/leases.md, "Random
/// arrivals").
#[tokio::test]
async fn random_fleets_whose_guesses_are_wrong_keep_every_bound_while_grants_are_given_back() {
    random_fleets(101..=112, true).await;
}

/// A grant of 0.005/s fills one unit in 200 s, but the refresh due in 1 s
/// may raise it: the wait told never runs past that refresh. Once the
/// refresh is overdue (or in flight), its reply may come at any moment: the
/// wait is at most `retry_every` (250 ms). It was the rate's own 198.9 s: a
/// queue's head told so while its lease's first reply to a raised grant was
/// held up sent nothing for the rest of a random fleet's run.
#[tokio::test]
async fn no_wait_runs_past_the_next_refresh() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let local = ManualClock::new(Duration::from_micros(START));
    let lease = RateLease::builder(
        store(&server, Some(&redis)),
        BUDGET,
        Rate::from_milli(5),
        NonZeroU32::new(1).unwrap(),
    )
    .instance_id("slow")
    .clock(local.clone())
    .build()
    .unwrap();
    let s = lease.refresh().await.unwrap();
    assert_eq!(s.grant, Rate::from_milli(5));
    // The first refresh reports a guess; the next is due a quarter period
    // (1 s) later.
    assert_eq!(s.next_refresh.us(), START + SEC);
    local.advance(Duration::from_millis(200));
    assert_eq!(
        lease.try_acquire(1),
        Err(Duration::from_millis(800)),
        "until the refresh due at 1 s, not the 199.8 s that one unit takes at 0.005/s"
    );
    local.advance(Duration::from_millis(900));
    assert_eq!(
        lease.try_acquire(1),
        Err(Duration::from_millis(250)),
        "the refresh is overdue: at most retry_every, not the rate's own 198.9 s"
    );
}

#[tokio::test]
async fn the_local_bucket_is_exact_and_the_expiry_ignores_clock_offset() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, Some(&redis));
    // A local clock 42 s behind Redis.
    let local = ManualClock::new(Duration::from_micros(START - 42 * SEC));
    let lease = solo(shared, &local);
    assert!(lease.status().is_starting());
    assert!(
        lease.try_acquire(1).is_err(),
        "nothing is spent before the first grant"
    );
    let sent = local.now();
    let s = lease.refresh().await.unwrap();
    assert!(s.is_granted());
    assert_eq!(
        s.expires_at.us(),
        sent.us() + L - MARGIN,
        "local expiry = send instant + (expiry - now) - margin"
    );
    assert_eq!(s.capacity, 6, "burst: 240/s × 25 ms = 6");
    local.advance(Duration::from_millis(25));
    for i in 0..6 {
        assert_eq!(lease.try_acquire(1), Ok(()), "send {i} of the full bucket");
    }
    assert_eq!(
        lease.try_acquire(1),
        Err(Duration::from_micros(4_167)),
        "the 7th waits 1/240 s, rounded up"
    );
    assert_eq!(
        lease.try_acquire(2),
        Err(Duration::MAX),
        "a cost above max_cost never passes"
    );
    // Until the local expiry, exactly 240/s; then the fallback 240/40 = 6/s.
    let mut admitted = 0;
    while local.now().us() < sent.us() + L - MARGIN {
        local.advance(Duration::from_millis(1));
        while lease.try_acquire(1).is_ok() {
            admitted += 1;
        }
    }
    // 4.970 s at 240/s after the 25 ms above: 1192.8.
    assert!(
        (1192..=1193).contains(&admitted),
        "admitted {admitted}, expected floor(240 × 4.970) = 1192 (+1)"
    );
    assert!(lease.status().is_fallback());
    let mut fallback = 0;
    for _ in 0..10_000 {
        local.advance(Duration::from_millis(1));
        while lease.try_acquire(1).is_ok() {
            fallback += 1;
        }
    }
    assert!(
        (59..=61).contains(&fallback),
        "fallback 6/s over 10 s: {fallback}, expected 60 ± 1"
    );
}

// ---------------------------------------------------------------------------
// (3) Redis calls per admitted send at saturation.
// ---------------------------------------------------------------------------

async fn calls_per_send(instances: usize) -> (u64, u64, f64) {
    let server = RedisServer::start();
    // Production script on Redis TIME; local clocks are manual.
    let shared = store(&server, None);
    let redis = ManualClock::new(Duration::from_micros(START));
    let mut fleet = Fleet::new(redis, shared.clone(), 40);
    fleet.read_tables = false;
    server.cli(&["CONFIG", "RESETSTAT"]);
    for i in 0..instances {
        fleet.join(&shared, &format!("i{i}"), 1_000, (i % 5) as i64, |b| b);
    }
    let duration = 100 * SEC;
    fleet.tick(0).await;
    fleet.run_until(duration, MS).await;
    let calls = support::client_command_calls(&server);
    let admitted = fleet.all_sends().len() as u64;
    assert!(
        admitted >= R * 95,
        "{instances} instances at saturation use the budget: {admitted} sends in 100 s (≥ 240/s for 95 s)"
    );
    assert!(
        admitted <= bound(instances as u64, duration),
        "and never exceed it"
    );
    (calls, admitted, calls as f64 / admitted as f64)
}

#[tokio::test]
async fn redis_calls_per_admitted_send_stay_below_5_percent_with_10_and_40_instances() {
    for instances in [10, 40] {
        let (calls, admitted, ratio) = calls_per_send(instances).await;
        println!("{instances} instances: {calls} Redis calls for {admitted} admitted sends = {ratio:.4} per send");
        assert!(
            ratio <= 0.05,
            "{instances} instances: {calls} calls / {admitted} sends = {ratio:.4} > 0.05 (expected about n / (P · R) = {:.4})",
            instances as f64 / (4.0 * R as f64)
        );
    }
}

// ---------------------------------------------------------------------------
// (4) Redis killed: the grant until expiry, then the fallback, then recovery.
// ---------------------------------------------------------------------------

#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<(tracing::Level, String)>>>);

impl Events {
    /// The events logged on this thread until the guard drops. A bare
    /// registry is first made the global default, once: a log call first
    /// reached on a thread with no subscriber (another test's) would
    /// otherwise be cached as of interest to none, in every thread, and
    /// this capture would miss it under parallel tests.
    fn capture() -> (Self, tracing::subscriber::DefaultGuard) {
        static GLOBAL: std::sync::Once = std::sync::Once::new();
        GLOBAL.call_once(|| {
            let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry());
        });
        let events = Events::default();
        let guard =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(events.clone()));
        (events, guard)
    }

    fn count(&self, level: tracing::Level, text: &str) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(l, m)| *l == level && m.contains(text))
            .count()
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Events {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        self.0
            .lock()
            .unwrap()
            .push((*event.metadata().level(), message.0));
    }
}

#[tokio::test]
async fn redis_killed_grants_last_until_expiry_then_the_fallback_applies_then_recovery() {
    let (events, _log) = Events::capture();
    let mut server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = LeaseStore::with_test_clock(
        &server.url(),
        "t",
        Duration::from_millis(500),
        redis.clone(),
    )
    .unwrap();
    // 10 instances, fallback R / 20 = 12/s each.
    let mut fleet = Fleet::new(redis.clone(), shared.clone(), 20);
    for i in 0..10 {
        fleet.join(&shared, &format!("i{i}"), 1_000, (i % 4) as i64 - 1, |b| b);
    }
    let tick = MS;
    fleet.tick(0).await;
    fleet.run_until(10 * SEC, tick).await;
    let table = fleet.table().await;
    for node in &fleet.nodes {
        assert_eq!(latest(&table, &node.id), 24_000, "{}: 240 / 10", node.id);
    }

    server.kill();
    fleet.read_tables = false;
    let killed_at = START + fleet.t;
    let expiries: Vec<u64> = fleet
        .nodes
        .iter()
        .map(|n| n.fleet(n.status().expires_at))
        .collect();
    let last_expiry = *expiries.iter().max().unwrap();
    assert!(
        last_expiry <= killed_at + L,
        "every grant ends within L of the last refresh"
    );
    fleet.run_until(20 * SEC, tick).await;
    assert!(
        fleet.refresh_errors >= 10 * 4,
        "refreshes failed while Redis was down: {}",
        fleet.refresh_errors
    );
    let end = START + fleet.t;
    for (node, &expiry) in fleet.nodes.iter().zip(&expiries) {
        let granted = sends_between(node, killed_at, expiry) as u64;
        let expect = 24 * (expiry - killed_at) / SEC;
        assert!(
            granted + 1 >= expect && granted <= expect + 2,
            "{}: kept spending its 24/s until its expiry: {granted} sends, expected {expect} (+1 burst)",
            node.id
        );
        let fallback = sends_between(node, last_expiry, end) as u64;
        let expect = 12 * (end - last_expiry) / SEC;
        assert!(
            fallback + 1 >= expect && fallback <= expect + 2,
            "{}: fallback 12/s after expiry: {fallback} sends, expected {expect} (+1 burst)",
            node.id
        );
        assert!(node.status().is_fallback());
    }
    let fallback_sends: Vec<u64> = fleet
        .all_sends()
        .into_iter()
        .filter(|&t| t >= last_expiry)
        .collect();
    let most = max_in_window(&fallback_sends, SEC) as u64;
    assert!(
        most <= 10 + 120,
        "fallback: 1 s windows {most} <= n · 1 + n · R/N = 10 + 10 × 12 = 130"
    );
    let outage: Vec<u64> = fleet
        .all_sends()
        .into_iter()
        .filter(|&t| t >= killed_at)
        .collect();
    let most_outage = max_in_window(&outage, SEC) as u64;
    assert!(
        most_outage <= bound(10, SEC),
        "the whole outage: 1 s windows {most_outage} <= {}",
        bound(10, SEC)
    );
    assert_eq!(
        events.count(tracing::Level::WARN, "spending the fallback capacity"),
        10,
        "one warning per instance entering the fallback, not one per failed refresh"
    );

    let failed = fleet.refresh_errors;
    server.restart();
    fleet.read_tables = true;
    let restarted = fleet.t;
    fleet.refresh_errors = 0;
    fleet.run_until(restarted + 500 * MS, tick).await;
    for node in &fleet.nodes {
        assert!(
            node.status().is_granted(),
            "{} renewed within two retries",
            node.id
        );
    }
    assert_eq!(
        events.count(tracing::Level::INFO, "rate lease renewed"),
        10,
        "one notice per instance leaving the fallback"
    );
    // Back from the fallback, each reports its initial demand (12/s) as a
    // guess, then a quarter period later its measured one: no instance
    // back first takes the empty Redis's whole budget.
    fleet.run_until(restarted + 1_500 * MS, tick).await;
    let table = fleet.table().await;
    for node in &fleet.nodes {
        let steps: Vec<u64> = table
            .instance(&node.id)
            .unwrap()
            .steps
            .iter()
            .map(|s| s.rate.as_milli())
            .collect();
        assert_eq!(
            steps,
            [24_000],
            "{}: its fair share 1.5 s after the restart, and never more",
            node.id
        );
    }
    fleet.run_until(restarted + 12 * SEC, tick).await;
    let table = fleet.table().await;
    for node in &fleet.nodes {
        assert_eq!(
            latest(&table, &node.id),
            24_000,
            "{}: fair shares again after the restart",
            node.id
        );
    }
    let after: Vec<u64> = fleet
        .all_sends()
        .into_iter()
        .filter(|&t| t >= START + restarted)
        .collect();
    let most_after = max_in_window(&after, SEC) as u64;
    // n·c + τ·(R + k·R/N) + (R + k·R/N)·T with k = n = 10, R/N = 12/s.
    let transition = bound(10, SEC) + 3 + 120;
    assert!(
        most_after <= transition,
        "recovery (some renewed, some still in fallback): {most_after} <= n + τ·(R + n·R/N) + R + n·R/N = {transition}"
    );
    println!(
        "outage: {failed} failed refreshes, most in 1 s {most_outage}, in fallback {most} (bound 130); after restart {most_after} (bound {transition})"
    );
}

/// A refresh dropped by its caller after its call was sent (an outer
/// timeout, a cancelled task) counts as the call's own timeout does: the
/// connection it used, perhaps hung, is dropped, so the next refresh
/// reconnects instead of being sent into it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_dropped_unanswered_replaces_a_hung_connection() {
    let server = RedisServer::start();
    let proxy = StallProxy::start(server.port()).await;
    let redis = ManualClock::new(Duration::from_micros(START));
    let store =
        LeaseStore::with_test_clock(&proxy.url(), "t", Duration::from_secs(2), redis).unwrap();
    let lease = solo(store, &ManualClock::new(Duration::from_micros(START)));
    assert_eq!(lease.refresh().await.map(|s| s.is_granted()), Ok(true));

    proxy.stall_open_connections();
    // Sent on the hung connection, then dropped unanswered.
    drop(send_only(&lease));
    assert_eq!(
        lease.refresh().await.map(|s| s.is_granted()),
        Ok(true),
        "a new connection, not a Timeout on the hung one"
    );
}

// ---------------------------------------------------------------------------
// The background refresher, configuration.
// ---------------------------------------------------------------------------

#[tokio::test]
async fn the_refresher_grants_in_the_background_and_stops_on_release_or_drop() {
    let server = RedisServer::start();
    let shared = store(&server, None);
    let fast = |id: &str| {
        RateLease::builder(
            shared.clone(),
            BUDGET,
            Rate::per_second(R),
            NonZeroU32::new(2).unwrap(),
        )
        .instance_id(id)
        .lease(Duration::from_millis(400))
        .refresh_every(Duration::from_millis(200))
        .build()
        .unwrap()
    };
    let lease = fast("bg1");
    let handle = lease.spawn_refresher();
    tokio::time::timeout(Duration::from_secs(10), lease.ready())
        .await
        .expect("first refresh");
    let s = lease.status();
    assert_eq!(
        (s.is_granted(), s.grant),
        (true, Rate::per_second(120)),
        "initial demand R / 2"
    );
    lease.release().await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), handle)
        .await
        .expect("stops on release")
        .unwrap();
    assert_eq!(lease.try_acquire(1), Err(Duration::MAX));
    let table = shared.grants(BUDGET).await.unwrap();
    assert!(table.instance("bg1").is_none(), "released");

    let lease = fast("bg2");
    let handle = lease.spawn_refresher();
    tokio::time::timeout(Duration::from_secs(10), lease.ready())
        .await
        .expect("first refresh");
    drop(lease);
    tokio::time::timeout(Duration::from_secs(5), handle)
        .await
        .expect("stops when dropped")
        .unwrap();
}

/// A first refresh dropped before its reply (an outer timeout, an aborted
/// refresher) has finished without success, as a failed one has: `ready`
/// returns, and the lease has left `Starting` for the fallback, never a
/// grant, with the next refresh due after `retry_every`.
#[tokio::test]
async fn a_dropped_first_refresh_finishes_as_a_failed_one() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, Some(&redis));
    let lease = solo(
        shared.clone(),
        &ManualClock::new(Duration::from_micros(START)),
    );
    // A live connection, so the refresh's call is sent on its first poll.
    shared.grants(BUDGET).await.unwrap();
    drop(send_only(&lease));
    assert_eq!(
        lease.ready().now_or_never(),
        Some(()),
        "the dropped first refresh has finished"
    );
    let s = lease.status();
    assert_eq!(
        (s.is_fallback(), s.grant, s.rate, s.failures, s.next_refresh),
        (
            true,
            Rate::ZERO,
            Rate::per_second(R / 40),
            1,
            Duration::from_micros(START + 250 * MS)
        )
    );
    assert_eq!(lease.refresh().await.map(|s| s.is_granted()), Ok(true));
}

#[test]
fn bad_settings_name_their_field() {
    let shared = LeaseStore::new(
        "redis://127.0.0.1:1/",
        "admission",
        Duration::from_millis(100),
    )
    .unwrap();
    let one = NonZeroU32::MIN;
    let err = |b: RateLeaseBuilder| b.build().unwrap_err().field();
    let lease = |budget: &str, rate: u64| {
        RateLease::builder(shared.clone(), budget, Rate::per_second(rate), one)
    };
    assert_eq!(err(lease("a{b}", 1)), "budget");
    assert_eq!(err(lease("dep", 0)), "rate");
    assert_eq!(err(lease("dep", 1).instance_id("")), "instance_id");
    assert_eq!(
        err(lease("dep", 1).refresh_every(Duration::from_secs(5))),
        "refresh_every"
    );
    assert_eq!(err(lease("dep", 1).lease(Duration::ZERO)), "lease");
    // A margin that leaves no lifetime is the margin's fault.
    for margin in [5, 6] {
        assert_eq!(
            err(lease("dep", 1).expiry_margin(Duration::from_secs(margin))),
            "expiry_margin"
        );
    }
    assert_eq!(
        LeaseStore::new("redis://127.0.0.1:1/", "x y", Duration::from_millis(100))
            .unwrap_err()
            .field(),
        "prefix"
    );
    assert_eq!(
        LeaseStore::new("nope", "admission", Duration::from_millis(100))
            .unwrap_err()
            .field(),
        "url"
    );
    for deadline in [Duration::ZERO, Duration::from_secs(61)] {
        assert_eq!(
            LeaseStore::new("redis://127.0.0.1:1/", "admission", deadline)
                .unwrap_err()
                .field(),
            "deadline"
        );
    }
    assert_eq!(shared.key("dep"), "admission:{lease:dep}");
    assert!(LeaseStore::script_source().contains("redis.call('TIME')"));
}

// ---------------------------------------------------------------------------
// (6) A dependency budget spent from one lease: shares within the grant.
// ---------------------------------------------------------------------------

/// A solo instance's lease on 240/s, granted in full, on a local clock.
async fn granted_solo(
    server: &RedisServer,
    redis: &ManualClock,
) -> (RateLease<ManualClock>, ManualClock) {
    let local = ManualClock::new(Duration::from_micros(START + 7 * SEC));
    let lease = solo(store(server, Some(redis)), &local);
    assert_eq!(lease.refresh().await.unwrap().grant, Rate::per_second(R));
    (lease, local)
}

/// Admissions of each of `shares` over the next `ms` when callers wait as
/// told: the clock moves to the earliest wait a refusal returned.
fn saturate(
    budget: &LeasedBudget<ManualClock>,
    clock: &ManualClock,
    ms: u64,
    shares: &[Attempt],
) -> [u64; 2] {
    let end = clock.now().us() + ms * MS;
    let mut admitted = [0; 2];
    loop {
        let mut wait = Duration::MAX;
        for (i, share) in [Attempt::FIRST, Attempt::FIRST.next()]
            .into_iter()
            .enumerate()
        {
            if !shares.contains(&share) {
                continue;
            }
            loop {
                match budget.try_acquire_now(share, 1) {
                    Ok(()) => admitted[i] += 1,
                    Err(refusal) => {
                        wait = wait.min(refusal.wait().expect("a wait"));
                        break;
                    }
                }
            }
        }
        let micros = u64::try_from(wait.as_micros()).unwrap();
        if clock.now().us() + micros > end {
            clock.set(Duration::from_micros(end));
            return admitted;
        }
        clock.advance(wait);
    }
}

#[tokio::test]
async fn a_leased_budget_holds_each_share_to_its_part_of_the_grant() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let (lease, local) = granted_solo(&server, &redis).await;
    let budget = LeasedBudget::new(lease, Rate::per_second(40)).unwrap();
    assert_eq!(budget.share_rate(Attempt::FIRST), Rate::per_second(200));
    // Both shares saturated for 2 s: exactly 200/s and 40/s, 240/s in all.
    let both = saturate(
        &budget,
        &local,
        2_000,
        &[Attempt::FIRST, Attempt::FIRST.next()],
    );
    assert_eq!(both, [400, 80], "normal, retry over 2 s");
    // Retries alone cannot take what first attempts leave: still 40/s
    // (plus the retry bucket's burst of one, refilled while normal ran).
    let retry_only = saturate(&budget, &local, 1_000, &[Attempt::FIRST.next()]);
    assert_eq!(retry_only, [0, 40]);
    let normal_only = saturate(&budget, &local, 1_000, &[Attempt::FIRST]);
    // The normal bucket is full (5 = 200/s × 25 ms), then fills at 200/s.
    assert_eq!(normal_only, [205, 0], "the burst plus 200/s");
    let stats = budget.stats();
    assert_eq!((stats.normal, stats.retry), (605, 120));
    assert_eq!(
        budget.try_acquire_now(Attempt::FIRST.next(), 2),
        Err(BudgetError::CostExceedsBudget {
            retry: true,
            cost: 2
        }),
        "a cost above the lease's max_cost never passes"
    );
}

#[tokio::test]
async fn a_leased_budget_through_the_layer_refuses_an_exhausted_retry_share_with_its_wait() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let (lease, local) = granted_solo(&server, &redis).await;
    let budget = LeasedBudget::new(lease, Rate::per_second(40)).unwrap();
    local.advance(Duration::from_secs(1));
    let client = tower::service_fn(|_req: http::Request<String>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    });
    let mut service = DependencyBudgetLayer::new(budget.clone())
        .fail_fast()
        .layer(client);
    let retry = || {
        let mut req = http::Request::new(String::new());
        req.extensions_mut().insert(Attempt::FIRST);
        // The second attempt of a request, as RetryAttempts marks it.
        let mut policy = RetryAttempts::new(3);
        let mut failed: Result<http::Response<String>, BudgetError<std::convert::Infallible>> =
            Ok(http::Response::builder()
                .status(503)
                .body(String::new())
                .unwrap());
        let _ = tower::retry::Policy::retry(&mut policy, &mut req, &mut failed);
        assert!(req.extensions().get::<Attempt>().unwrap().is_retry());
        req
    };
    // The retry bucket holds two attempts (its least), so two retries pass.
    for _ in 0..2 {
        assert!(service.ready().await.unwrap().call(retry()).await.is_ok());
    }
    match service.ready().await.unwrap().call(retry()).await {
        Err(BudgetError::Exhausted { retry: true, wait }) => {
            assert_eq!(wait, Duration::from_millis(25), "1/40 s");
        }
        other => panic!("expected the retry share's refusal, got {other:?}"),
    }
    // First attempts are untouched by the spent retry share.
    assert!(service
        .ready()
        .await
        .unwrap()
        .call(http::Request::new(String::new()))
        .await
        .is_ok());
    assert_eq!(
        (
            budget.stats().normal,
            budget.stats().retry,
            budget.stats().refused
        ),
        (1, 2, 1)
    );
}

#[tokio::test]
async fn an_unreachable_limiter_gives_the_fallback_unless_fail_open_was_chosen() {
    let mut server = RedisServer::start();
    let url = server.url();
    server.kill();
    for fail_open in [false, true] {
        let local = ManualClock::new(Duration::from_micros(START));
        let store = LeaseStore::new(&url, "admission", Duration::from_millis(200)).unwrap();
        let mut builder = RateLease::builder(
            store,
            BUDGET,
            Rate::per_second(R),
            NonZeroU32::new(40).unwrap(),
        )
        .clock(local.clone());
        if fail_open {
            builder = builder.fail_open();
        }
        let lease = builder.build().unwrap();
        assert!(lease.refresh().await.is_err(), "Redis is down");
        assert!(lease.status().is_fallback());
        let budget = LeasedBudget::new(lease, Rate::per_second(40)).unwrap();
        if fail_open {
            // No limit at all: 10,000 attempts at one instant pass.
            for share in [Attempt::FIRST, Attempt::FIRST.next()] {
                for _ in 0..5_000 {
                    assert_eq!(budget.try_acquire_now(share, 1), Ok(()));
                }
            }
            assert_eq!(
                (budget.stats().normal, budget.stats().retry),
                (5_000, 5_000)
            );
        } else {
            let admitted = saturate(
                &budget,
                &local,
                10_000,
                &[Attempt::FIRST, Attempt::FIRST.next()],
            );
            // The fallback 240/40 = 6/s for 10 s, split 5 + 1. The lease's
            // bucket holds one attempt, so while it is full and neither share
            // has a whole one its accrual is lost: 58 of 60 (52 when the
            // share buckets held one attempt too).
            let [normal, retry] = admitted;
            assert!(normal <= 50 && retry <= 10, "{admitted:?}");
            assert_eq!(normal + retry, 58, "{admitted:?}");
        }
    }
}

/// A released lease never admits again, and a budget over it says so at
/// once, whatever its share buckets hold: `Unavailable` with
/// `Duration::MAX`, never a finite wait. Through the layer the attempt is
/// refused at its first look instead of looking again until its deadline.
#[tokio::test]
async fn a_leased_budget_over_a_released_lease_refuses_at_once_for_good() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let (lease, local) = granted_solo(&server, &redis).await;
    let budget = LeasedBudget::new(lease.clone(), Rate::per_second(40)).unwrap();
    // Both share buckets fill for 1 s, then the lease is released.
    local.advance(Duration::from_secs(1));
    lease.release().await.unwrap();
    let released = Err(BudgetError::Unavailable {
        wait: Duration::MAX,
    });
    for share in [Attempt::FIRST, Attempt::FIRST.next()] {
        assert_eq!(budget.try_acquire_now(share, 1), released);
        local.advance(Duration::from_millis(300));
        assert_eq!(budget.try_acquire_now(share, 1), released);
    }
    tokio::time::pause();
    let started = tokio::time::Instant::now();
    let client = tower::service_fn(|_req: http::Request<String>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    });
    let refused = DependencyBudgetLayer::new(budget.clone())
        .layer(client)
        .oneshot(http::Request::new(String::new()))
        .await
        .unwrap_err();
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert!(
        matches!(refused, BudgetError::Unavailable { wait } if wait == Duration::MAX),
        "{refused:?}"
    );
    assert_eq!((budget.stats().normal, budget.stats().refused), (0, 5));
}

/// Before the first refresh there is no rate to spend: the budget gives the
/// lease's own wait, the time to the next refresh (`retry_every`, 250 ms,
/// when one is due), not a 1 ms wait to poll on.
#[tokio::test]
async fn a_leased_budget_with_no_rate_yet_waits_as_its_lease_says() {
    let server = RedisServer::start();
    let local = ManualClock::new(Duration::from_micros(START));
    let lease = solo(store(&server, None), &local);
    let budget = LeasedBudget::new(lease.clone(), Rate::per_second(40)).unwrap();
    assert!(lease.status().is_starting());
    let retry_every = Duration::from_millis(250);
    assert_eq!(lease.try_acquire(1), Err(retry_every));
    for attempt in [Attempt::FIRST, Attempt::FIRST.next()] {
        assert_eq!(
            budget.try_acquire_now(attempt, 1),
            Err(BudgetError::Exhausted {
                retry: attempt.is_retry(),
                wait: retry_every
            })
        );
    }
}

/// A share's bucket fills at the rate of the time it fills, so a grant
/// never fills the time before it. B holds a zero grant for 5 s beside A,
/// then, A gone, the whole rate: its retry share (40/s, a burst of 1 s)
/// starts empty and sends 7 in the next 177 ms, not its whole burst of 40
/// on top of what A may have sent from its own full bucket.
#[tokio::test]
async fn a_share_fills_from_its_grant_not_from_the_time_before_it() {
    let server = RedisServer::start();
    let clock = ManualClock::new(Duration::from_micros(START));
    let store = store(&server, Some(&clock));
    let lease = |id: &str| {
        instance(&store, id, R, &clock)
            .burst(Duration::from_secs(1))
            .build()
            .unwrap()
    };
    let (a, b) = (lease("a"), lease("b"));
    assert_eq!(a.refresh().await.unwrap().grant, Rate::per_second(R));
    assert_eq!(b.refresh().await.unwrap().grant, Rate::ZERO);
    let budget = LeasedBudget::new(b.clone(), Rate::per_second(40)).unwrap();
    clock.advance(Duration::from_micros(L + MARGIN));
    assert_eq!(b.refresh().await.unwrap().grant, Rate::per_second(R));
    let mut sent = 0;
    for _ in 0..177 {
        clock.advance(Duration::from_millis(1));
        while budget.try_acquire_now(Attempt::FIRST.next(), 1).is_ok() {
            sent += 1;
        }
    }
    assert_eq!(sent, 7);
}

/// Two stores on one server with the script's time injected from `redis`
/// (deadline 200 ms): `via_proxy` through a proxy whose open connections
/// can be stalled, `direct` without it; instances run on `local` time.
struct Stallable {
    proxy: StallProxy,
    redis: ManualClock,
    local: ManualClock,
    via_proxy: LeaseStore,
    direct: LeaseStore,
}

impl Stallable {
    async fn start(server: &RedisServer) -> Self {
        let proxy = StallProxy::start(server.port()).await;
        let redis = ManualClock::new(Duration::from_micros(START));
        let store = |url: String| {
            LeaseStore::with_test_clock(&url, "t", Duration::from_millis(200), redis.clone())
                .unwrap()
        };
        let (via_proxy, direct) = (store(proxy.url()), store(server.url()));
        Stallable {
            proxy,
            local: ManualClock::new(Duration::from_micros(START)),
            redis,
            via_proxy,
            direct,
        }
    }
}

/// Waits (up to 5 s) until `server` has run more than `calls` scripts:
/// a call held on a stalled connection reaches it once the proxy resumes.
async fn wait_for_scripts(server: &RedisServer, calls: u64) {
    for _ in 0..500 {
        if support::command_calls(server, &["evalsha"]) > calls {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A refresh held on a hung connection that reaches Redis after the lease
/// was released changes nothing: the release stays the last word, and the
/// other instance is granted the whole budget. A new lease under the same
/// id is not shut out. Before, the late refresh put `x` back with its
/// grant, and `y` got half.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_reaching_redis_after_the_release_changes_nothing() {
    let server = RedisServer::start();
    let Stallable {
        proxy,
        redis,
        local,
        via_proxy,
        direct,
    } = Stallable::start(&server).await;
    let lease = |store: &LeaseStore, id: &str, demand: u64| {
        instance(store, id, demand, &local).build().unwrap()
    };
    let (x, y) = (lease(&via_proxy, "x", R / 2), lease(&direct, "y", R));
    assert_eq!(x.refresh().await.unwrap().grant, Rate::per_second(R / 2));
    assert_eq!(y.refresh().await.unwrap().grant, Rate::per_second(R / 2));

    proxy.stall_open_connections();
    // Sent on the hung connection, where it waits out its deadline; the
    // release waits for it, then goes out on a new connection.
    let held = tokio::spawn({
        let x = x.clone();
        async move { x.refresh().await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(x.release().await, Ok(()));
    assert_eq!(
        held.await.unwrap().map(|s| s.is_granted()),
        Err(LeaseError::Released)
    );
    let calls = support::command_calls(&server, &["evalsha"]);
    proxy.resume();
    // The held refresh runs once its bytes reach Redis.
    wait_for_scripts(&server, calls).await;
    assert_eq!(support::command_calls(&server, &["evalsha"]), calls + 1);
    assert!(direct.grants(BUDGET).await.unwrap().instance("x").is_none());
    // y's callers now want the whole budget, and get it.
    for _ in 0..1_000 {
        let _ = y.try_acquire(1);
    }
    local.advance(Duration::from_secs(1));
    redis.advance(Duration::from_secs(1));
    assert_eq!(y.refresh().await.unwrap().grant, Rate::per_second(R));

    // A new lease under the same id (a restarted process) is counted.
    let again = lease(&direct, "x", R);
    assert_eq!(again.refresh().await.unwrap().grant, Rate::ZERO);
    assert!(direct.grants(BUDGET).await.unwrap().instance("x").is_some());
}

/// The commitment of instance `id` now, as the script counts it.
async fn committed(store: &LeaseStore, id: &str) -> Rate {
    let table = store.grants(BUDGET).await.expect("read grants");
    table
        .instance(id)
        .map_or(Rate::ZERO, |i| i.committed_at(table.now))
}

#[tokio::test]
async fn a_grant_asked_on_a_guess_that_the_first_measure_finds_too_large_is_given_back_at_once() {
    // x guesses the whole budget and is granted it; its callers then make
    // 10 attempts in a second. Its next refresh stops spending above
    // 12.5/s (the measure and a quarter) before it is sent, and says so:
    // the script lowers x's old step to 12.5/s and grants it its 10/s, and
    // y, waiting with a zero grant, is granted the other 227.5/s at its
    // next call instead of at x's old expiry 5 s later.
    let server = RedisServer::start();
    let (redis, local) = (
        ManualClock::new(Duration::from_micros(START)),
        ManualClock::new(Duration::from_micros(START)),
    );
    let shared = store(&server, Some(&redis));
    let x = instance(&shared, "x", R, &local).build().unwrap();
    let y = instance(&shared, "y", R, &local).build().unwrap();
    assert_eq!(x.refresh().await.unwrap().grant, Rate::per_second(R));
    assert_eq!(y.refresh().await.unwrap().grant, Rate::ZERO);
    // y's callers wait for its next refresh: it keeps asking its guess.
    assert!(y.try_acquire(1).is_err());
    for _ in 0..10 {
        local.advance(Duration::from_millis(100));
        redis.advance(Duration::from_millis(100));
        assert_eq!(x.try_acquire(1), Ok(()));
    }

    let sx = x.refresh().await.unwrap();
    let kept = Rate::from_milli(12_500);
    assert_eq!(
        (sx.demand, sx.grant, sx.kept, sx.rate),
        (Rate::per_second(10), Rate::per_second(10), kept, kept),
        "x measured 10/s and spends no more than 12.5/s until its old grant's expiry"
    );
    assert_eq!(committed(&shared, "x").await, kept);
    let sy = y.refresh().await.unwrap();
    assert_eq!(
        sy.grant,
        Rate::from_milli(R_MILLI - 12_500),
        "y is granted x's surplus at once"
    );
    let table = shared.grants(BUDGET).await.unwrap();
    assert_eq!(table.peak(), Rate::per_second(R), "{table:#?}");
}

#[tokio::test]
async fn a_lowering_call_reaching_redis_after_a_newer_one_changes_nothing() {
    // x lowers itself to 12.5/s and sends the call on a connection that
    // hangs; the call times out, y is released, and x's next call (on a new
    // connection) is granted the whole budget, which x spends. When the
    // hung call reaches Redis at last, it must not lower x's steps to
    // 12.5/s while x spends 240/s: a numbered call older than one already run
    // writes nothing.
    let server = RedisServer::start();
    let Stallable {
        proxy,
        redis,
        local,
        via_proxy,
        direct,
    } = Stallable::start(&server).await;
    let x = instance(&via_proxy, "x", R / 2, &local).build().unwrap();
    let y = instance(&direct, "y", R / 2, &local).build().unwrap();
    assert_eq!(x.refresh().await.unwrap().grant, Rate::per_second(R / 2));
    assert_eq!(y.refresh().await.unwrap().grant, Rate::per_second(R / 2));
    for _ in 0..10 {
        local.advance(Duration::from_millis(100));
        redis.advance(Duration::from_millis(100));
        assert_eq!(x.try_acquire(1), Ok(()));
    }

    proxy.stall_open_connections();
    let hung = x.refresh().await;
    assert!(hung.is_err(), "the call times out: {hung:?}");
    let sx = x.status();
    assert_eq!(
        (sx.grant, sx.rate),
        (Rate::from_milli(12_500), Rate::from_milli(12_500)),
        "x stopped spending above 12.5/s before it sent the call"
    );
    let calls = support::command_calls(&server, &["evalsha"]);
    assert_eq!(y.release().await, Ok(()));
    for _ in 0..300 {
        let _ = x.try_acquire(1);
    }
    local.advance(Duration::from_secs(1));
    redis.advance(Duration::from_secs(1));
    let sx = x.refresh().await.unwrap();
    assert_eq!(sx.grant, Rate::per_second(R), "x alone is granted all of R");
    assert_eq!(committed(&direct, "x").await, Rate::per_second(R));

    proxy.resume();
    wait_for_scripts(&server, calls + 3).await;
    assert_eq!(
        support::command_calls(&server, &["evalsha"]),
        calls + 4,
        "the release, x's new call, the read of the table and the hung call ran"
    );
    assert_eq!(
        committed(&direct, "x").await,
        Rate::per_second(R),
        "the hung call did not lower the grant x spends"
    );
    let z = instance(&direct, "z", R, &local).build().unwrap();
    assert_eq!(
        z.refresh().await.unwrap().grant,
        Rate::ZERO,
        "nothing is free"
    );
}

/// One share's sends walked through grant → fallback → grant, tick by tick
/// (1 ms), with the share bound of `docs/leases.md` ("Each share is bounded
/// by its own buckets", Claim 3 applied to a share's bucket) checked in
/// every window: the sends at ticks `a..=b` are at most the share's
/// capacity at `a` plus what its part of the lease's rate fills over the
/// window. A share idle across the fallback must not come back holding
/// what its grant would have filled meanwhile.
#[tokio::test]
async fn a_share_idle_across_the_fallback_keeps_only_what_the_fallback_fills() {
    let mut server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let local = ManualClock::new(Duration::from_micros(START + 7 * SEC));
    let store = LeaseStore::with_test_clock(
        &server.url(),
        "t",
        Duration::from_millis(500),
        redis.clone(),
    )
    .unwrap();
    // 4 expected instances: the fallback is 60/s, its bucket 60 (1 s).
    let lease = RateLease::builder(
        store,
        BUDGET,
        Rate::per_second(R),
        NonZeroU32::new(4).unwrap(),
    )
    .instance_id("solo")
    .initial_demand(Rate::per_second(R))
    .burst(Duration::from_secs(1))
    .clock(local.clone())
    .build()
    .unwrap();
    assert_eq!(lease.refresh().await.unwrap().grant, Rate::per_second(R));
    let budget = LeasedBudget::new(lease.clone(), Rate::per_second(40)).unwrap();
    let (part, total) = (200_000u128, u128::from(R_MILLI));

    // Per tick: the normal share's sends, its capacity and fill rate then.
    let mut sends = Vec::new();
    let mut capacity = Vec::new();
    let mut rate = Vec::new();
    let mut modes = Vec::new();
    for tick in 0..10_000u64 {
        if tick > 0 {
            redis.advance(Duration::from_millis(1));
            local.advance(Duration::from_millis(1));
        }
        match tick {
            // Redis goes away while the grant (until 4.995 s) runs.
            1_000 => server.kill(),
            4_000 => assert!(lease.refresh().await.is_err(), "Redis is down"),
            // Back, empty: the next refresh grants the whole rate again.
            8_000 => {
                server.restart();
                assert_eq!(lease.refresh().await.unwrap().grant, Rate::per_second(R));
            }
            _ => {}
        }
        let status = lease.status();
        modes.push(status);
        // A share's bucket: its part of the lease's, at least two attempts.
        capacity.push((u128::from(status.capacity) * part / total).max(2));
        rate.push(u128::from(status.rate.as_milli()) * part / total);
        // First attempts as fast as they pass, except from 1 s to 8 s.
        let mut sent = 0u64;
        if !(1_000..8_000).contains(&tick) {
            while budget.try_acquire_now(Attempt::FIRST, 1).is_ok() {
                sent += 1;
            }
        }
        sends.push(sent);
    }
    assert!(modes[4_990].is_granted());
    assert!(modes[5_000].is_fallback());
    assert!(modes[8_000].is_granted());

    let mut worst = (0i128, 0, 0, 0, 0);
    for span in [1usize, 10, 50, 100, 250, 1_000, 3_000] {
        for a in 1..sends.len() - span {
            let b = a + span;
            let sent: u64 = sends[a..=b].iter().sum();
            // Capacity at the window's start (either side of tick a), and the
            // fill over (a-1, b], each millisecond at the higher rate of its
            // two ends: looser than exact, never tighter.
            let start = capacity[a - 1].max(capacity[a]) * NANO_PER;
            let fill: u128 = (a..=b).map(|t| rate[t - 1].max(rate[t]) * 1_000).sum();
            let bound = ((start + fill) / NANO_PER) as u64;
            let over = i128::from(sent) - i128::from(bound);
            if over > worst.0 {
                worst = (over, a, b, sent, bound);
            }
        }
    }
    assert!(
        worst.0 <= 0,
        "normal share: {} sends at ticks {}..={} ms, bound {} ({} over)",
        worst.3,
        worst.1,
        worst.2,
        worst.4,
        worst.0
    );
    // Sends after the regrant: the share's fallback bucket (50) plus its
    // part of the grant (200/s), 0.25 s after it.
    let after: u64 = sends[8_000..=8_250].iter().sum();
    assert_eq!(after, 50 + 50, "{after}");
}

/// Nano-tokens per token: a rate in milli-units per second times µs.
const NANO_PER: u128 = 1_000_000_000;

/// A share's bucket keeps only the schedule of its last fill. When the
/// lease changed once while the share was idle it replays that schedule up
/// to the change; when it changed twice or more (every refresh reply that
/// moves the expiry is a change), the time before the latest change fills
/// nothing and the share keeps at most two attempts. Solo instances at
/// 240/s with a burst of 1 s (normal share: 200/s, 200 at most), whose
/// normal share took one attempt at 1 s: 100 ms after a refresh at 8 s it
/// holds 200 after one change, and 2 + 200/s × 100 ms = 22 after two (4 s
/// and 8 s). The loss is made up a burst (1 s) after the latest change.
#[tokio::test]
async fn a_share_idle_across_two_lease_changes_fills_only_from_the_latest() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let mut held = Vec::new();
    for (budget, refreshes) in [("one-change", &[8u64][..]), ("two-changes", &[4, 8])] {
        let local = ManualClock::new(Duration::from_micros(START + 7 * SEC));
        let lease = RateLease::builder(
            store(&server, Some(&redis)),
            budget,
            Rate::per_second(R),
            NonZeroU32::new(4).unwrap(),
        )
        .instance_id("solo")
        .initial_demand(Rate::per_second(R))
        .min_demand(Rate::per_second(R))
        .lease(Duration::from_secs(20))
        .refresh_every(Duration::from_secs(10))
        .burst(Duration::from_secs(1))
        .clock(local.clone())
        .build()
        .unwrap();
        let start = local.now().us();
        assert_eq!(lease.refresh().await.unwrap().grant, Rate::per_second(R));
        let shares = LeasedBudget::new(lease.clone(), Rate::per_second(40)).unwrap();
        local.set(Duration::from_micros(start + SEC));
        assert_eq!(shares.try_acquire_now(Attempt::FIRST, 1), Ok(()));
        for &at in refreshes {
            local.set(Duration::from_micros(start + at * SEC));
            assert_eq!(lease.refresh().await.unwrap().grant, Rate::per_second(R));
        }
        local.set(Duration::from_micros(start + 8 * SEC + 100 * MS));
        let mut sent = 0;
        while shares.try_acquire_now(Attempt::FIRST, 1).is_ok() {
            sent += 1;
        }
        // A burst after the latest change, the share is full again.
        local.set(Duration::from_micros(start + 9 * SEC + 100 * MS));
        let mut refilled = 0;
        while shares.try_acquire_now(Attempt::FIRST, 1).is_ok() {
            refilled += 1;
        }
        held.push((sent, refilled));
    }
    assert_eq!(held, [(200, 200), (22, 200)]);
}

/// A fill at a stale local time (a `now` read before a refresh reply that
/// changed the lease) fills the time up to the change on the schedule that
/// was in force then, not on the new one. Solo at 240/s, 4 expected
/// instances (fallback 60/s), burst 1 s: the retry share is 40/s, 40 at
/// most under the grant and 10/s, 10 at most in the fallback. The grant
/// runs out at 4.995 s; a refresh at 6 s grants 240/s again. An attempt
/// stamped 5.5 s leaves the retry share 9 (its fallback bucket of 10, one
/// spent); at 6 s it holds the fallback's 10 again, and sends 10. Before,
/// the half second from 5.5 s filled at the grant's 40/s, and it sent 29.
#[tokio::test]
async fn a_stale_now_fills_up_to_the_lease_change_on_the_old_schedule() {
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let local = ManualClock::new(Duration::from_micros(START + 7 * SEC));
    let lease = RateLease::builder(
        store(&server, Some(&redis)),
        BUDGET,
        Rate::per_second(R),
        NonZeroU32::new(4).unwrap(),
    )
    .instance_id("solo")
    .initial_demand(Rate::per_second(R))
    .burst(Duration::from_secs(1))
    .clock(local.clone())
    .build()
    .unwrap();
    let start = local.now().us();
    assert_eq!(lease.refresh().await.unwrap().grant, Rate::per_second(R));
    let shares = LeasedBudget::new(lease.clone(), Rate::per_second(40)).unwrap();
    local.set(Duration::from_micros(start + 6 * SEC));
    redis.advance(Duration::from_secs(6));
    assert!(lease.status().is_fallback());
    assert_eq!(lease.refresh().await.unwrap().grant, Rate::per_second(R));
    // Read before the reply landed.
    let stale = Duration::from_micros(start + 5 * SEC + 500 * MS);
    assert_eq!(
        shares.try_acquire_at(Attempt::FIRST.next(), 1, stale),
        Ok(())
    );
    let mut sent = 0;
    while shares.try_acquire_now(Attempt::FIRST.next(), 1).is_ok() {
        sent += 1;
    }
    assert_eq!(sent, 10);
    // From the change on, the share fills at the grant's 40/s.
    local.advance(Duration::from_millis(500));
    let mut refilled = 0;
    while shares.try_acquire_now(Attempt::FIRST.next(), 1).is_ok() {
        refilled += 1;
    }
    assert_eq!(refilled, 20);
}

/// The lease's schedule in force from a local time on, as the test read it
/// from [`LeaseStatus`] after each step: no rate while starting or
/// released, else the grant until its local expiry, the fallback after.
#[derive(Debug, Clone, Copy)]
struct Read {
    from: u64,
    active: bool,
    grant: u64,
    until: u64,
    /// An older, higher grant still spent until `kept_until`.
    kept: u64,
    kept_until: u64,
}

impl Read {
    fn rate(&self, t: u64, fallback: u64) -> u64 {
        let base = match (self.active, t < self.until) {
            (false, _) => 0,
            (true, true) => self.grant,
            (true, false) => fallback,
        };
        if self.active && t < self.kept_until {
            base.max(self.kept)
        } else {
            base
        }
    }
}

/// One random run of one instance's [`LeasedBudget`] beside a rival that
/// takes part of the budget: attempts of both shares and of random costs,
/// bursts, refreshes answered at once, held in flight across other steps or
/// dropped unanswered (a failed refresh, so the grant runs out into the
/// fallback), all at random times. Returns the first window that breaks the
/// bound of `docs/leases.md`, if any: in every closed interval `[a, b]`, a
/// share's sends are at most `K_s(a) + (R_s/R)·∫ r`, and all sends at most
/// `K(a) + ∫ r`, where `r` is the lease's rate over time and the
/// capacities are `K(r) = max(c, τ·r)` and `K_s(r) = max(2c, (R_s/R)·K(r))`.
async fn random_share_run(server: &RedisServer, seed: u64) -> Result<(u64, u64), String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let redis = ManualClock::new(Duration::from_micros(START));
    let offset = rng.random_range(0..10 * SEC);
    let local = ManualClock::new(Duration::from_micros(START + offset));
    let budget = format!("shares-{seed}");
    let burst_us = [25 * MS, 250 * MS, SEC][rng.random_range(0..3)];
    let max_cost = [1u64, 3][rng.random_range(0..2)];
    let expected = [2u32, 4, 40][rng.random_range(0..3)];
    let retry_milli = [40_000u64, 1_000, 120_000][rng.random_range(0..3)];
    let build = |id: &str, demand: u64, clock: &ManualClock| {
        RateLease::builder(
            store(server, Some(&redis)),
            &budget,
            Rate::per_second(R),
            NonZeroU32::new(expected).unwrap(),
        )
        .instance_id(id)
        .initial_demand(Rate::per_second(demand))
        .burst(Duration::from_micros(burst_us))
        .max_cost(NonZeroU32::new(max_cost as u32).unwrap())
        .clock(clock.clone())
        .build()
        .unwrap()
    };
    let me = build("me", rng.random_range(1..=R), &local);
    let rival_clock = ManualClock::new(Duration::from_micros(START));
    let rival = build("rival", rng.random_range(1..=R), &rival_clock);
    let shares = LeasedBudget::new(me.clone(), Rate::from_milli(retry_milli)).unwrap();
    let fallback = me.fallback_rate().as_milli();
    let part = [R_MILLI - retry_milli, retry_milli];

    let read = |t: u64| {
        let status = me.status();
        Read {
            from: t,
            active: status.is_granted() || status.is_fallback(),
            grant: status.grant.as_milli(),
            until: status.expires_at.us(),
            kept: status.kept.as_milli(),
            kept_until: status.kept_expires_at.us(),
        }
    };
    let start = local.now().us();
    let mut reads = vec![read(start)];
    // (local time, share index, cost) of every admitted attempt.
    let mut sends: Vec<(u64, usize, u64)> = Vec::new();
    let mut pending: Option<Pending> = None;
    let mut changes = 0u64;
    for _ in 0..300 {
        let step = rng.random_range(0..100);
        match step {
            0..=29 => {
                let advance = match rng.random_range(0..10) {
                    0..=5 => rng.random_range(0..=10 * MS),
                    6..=8 => rng.random_range(0..=500 * MS),
                    _ => rng.random_range(0..=3 * SEC),
                };
                local.advance(Duration::from_micros(advance));
                redis.advance(Duration::from_micros(advance));
                rival_clock.advance(Duration::from_micros(advance));
            }
            30..=59 => {
                let share = usize::from(rng.random_bool(0.3));
                let cost = rng.random_range(1..=max_cost);
                let burst = rng.random_bool(0.3);
                for _ in 0..if burst { 1_000 } else { 1 } {
                    let which = [Attempt::FIRST, Attempt::FIRST.next()][share];
                    if shares.try_acquire_now(which, cost).is_err() {
                        break;
                    }
                    sends.push((local.now().us(), share, cost));
                }
            }
            60..=71 => {
                if pending.is_none() {
                    let _ = me.refresh().await;
                }
            }
            72..=79 => {
                if pending.is_none() {
                    pending = Some(send_only(&me));
                }
            }
            80..=87 => {
                if let Some(refresh) = pending.take() {
                    let _ = refresh.await;
                }
            }
            88..=91 => {
                // Dropped before its reply: a failed refresh.
                pending = None;
            }
            _ => {
                // The rival asks for a random part of the budget.
                for _ in 0..rng.random_range(0..300) {
                    let _ = rival.try_acquire(1);
                }
                let _ = rival.refresh().await;
            }
        }
        let now = local.now().us();
        let next = read(now);
        let last = *reads.last().unwrap();
        if (
            next.active,
            next.grant,
            next.until,
            next.kept,
            next.kept_until,
        ) != (
            last.active,
            last.grant,
            last.until,
            last.kept,
            last.kept_until,
        ) {
            changes += 1;
            if last.from == now {
                reads.pop();
            }
            reads.push(next);
        }
    }
    drop(pending);

    // The lease's fill over [start, t], rate × µs, for any t.
    let fill_to = |t: u64| -> u128 {
        let mut sum = 0u128;
        for (i, r) in reads.iter().enumerate() {
            let end = reads.get(i + 1).map_or(u64::MAX, |n| n.from).min(t);
            if end <= r.from {
                break;
            }
            if r.active {
                // Constant between the read, the two expiries and the end.
                let mut cuts = [
                    r.from,
                    r.kept_until.clamp(r.from, end),
                    r.until.clamp(r.from, end),
                    end,
                ];
                cuts.sort_unstable();
                for w in cuts.windows(2) {
                    sum += u128::from(r.rate(w[0], fallback)) * u128::from(w[1] - w[0]);
                }
            }
        }
        sum
    };
    // The highest rate in force at t or just before it.
    let rate_near = |t: u64| -> u64 {
        reads
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                let end = reads.get(i + 1).map_or(u64::MAX, |n| n.from);
                r.from <= t && t <= end
            })
            .map(|(_, r)| {
                r.rate(t, fallback)
                    .max(r.rate(t.saturating_sub(1), fallback))
            })
            .max()
            .unwrap_or(0)
    };
    let c = u128::from(max_cost) * NANO_PER;
    let lease_capacity = |rate: u64| c.max(u128::from(rate) * u128::from(burst_us));
    let mut times: Vec<u64> = sends.iter().map(|s| s.0).collect();
    times.dedup();
    let fills: Vec<u128> = times.iter().map(|&t| fill_to(t)).collect();
    for (i, &a) in times.iter().enumerate() {
        let rate = rate_near(a);
        let k = lease_capacity(rate);
        let mut sent = [0u128; 3];
        for (j, &b) in times.iter().enumerate().skip(i) {
            for &(_, share, cost) in sends.iter().filter(|s| s.0 == b) {
                sent[share] += u128::from(cost);
                sent[2] += u128::from(cost);
            }
            let fill = fills[j] - fills[i];
            for (what, index) in [("normal", 0), ("retry", 1), ("total", 2)] {
                let bound = if index == 2 {
                    k + fill
                } else {
                    let p = u128::from(part[index]);
                    (2 * c).max(p * k / u128::from(R_MILLI)) + p * fill / u128::from(R_MILLI)
                };
                if sent[index] * NANO_PER > bound {
                    return Err(format!(
                        "seed {seed}: {what} sent {} in [{a}, {b}] (local µs, {} after the start), \
                         bound {:.3} (burst {burst_us} µs, max_cost {max_cost}, N {expected}, \
                         retry {retry_milli}); schedules {reads:?}",
                        sent[index],
                        a - start,
                        bound as f64 / NANO_PER as f64,
                    ));
                }
            }
        }
    }
    Ok((sends.len() as u64, changes))
}

/// Random runs of a [`LeasedBudget`] through grants, regrants, fallbacks,
/// refreshes in flight and dropped ones (see [`random_share_run`]): every
/// share and the total stay within their bound in every interval.
#[tokio::test]
async fn random_share_runs_keep_every_share_within_its_bound_across_lease_changes() {
    let server = RedisServer::start();
    let seeds = std::env::var("SHARE_SEEDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(48u64);
    let mut failures = Vec::new();
    let (mut sent, mut changes) = (0, 0);
    for seed in 0..seeds {
        match random_share_run(&server, seed).await {
            Ok((s, c)) => {
                sent += s;
                changes += c;
            }
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    eprintln!("{sent} sends, {changes} changes");
    assert!(
        sent > 1_000 && changes > 100,
        "{sent} sends, {changes} changes"
    );
}

/// A rolling deploy that lowers the budget from 300/s to 240/s: old
/// instances keep calling with 300/s while new ones call with 240/s. Once
/// a new instance has called, no instance is granted past the lowest budget
/// of the live instances, so the grants sum to at most 240/s once the
/// grants made before then have expired. Before, the old instance `a` went
/// on being granted 300/s minus the others (290/s beside the new `b` asking
/// 10/s), for as long as it ran, and `b` got nothing.
#[tokio::test]
async fn a_lowered_budget_binds_the_instances_still_running_the_old_one() {
    let server = RedisServer::start();
    let clock = ManualClock::new(Duration::from_micros(START));
    let store = store(&server, Some(&clock));
    let lease = |id: &str, budget: u64, demand: u64| {
        RateLease::builder(
            store.clone(),
            BUDGET,
            Rate::per_second(budget),
            NonZeroU32::new(40).unwrap(),
        )
        .instance_id(id)
        .initial_demand(Rate::per_second(demand))
        .min_demand(Rate::per_second(demand))
        .clock(clock.clone())
        .build()
        .unwrap()
    };
    let old = lease("a", 300, 300);
    assert_eq!(old.refresh().await.unwrap().grant, Rate::per_second(300));
    // The first instance of the new deploy: nothing is free yet.
    let new = lease("b", R, 10);
    assert_eq!(new.refresh().await.unwrap().grant, Rate::ZERO);
    clock.advance(Duration::from_secs(1));
    assert_eq!(new.refresh().await.unwrap().grant, Rate::ZERO);
    // The old instance renews: the new budget binds it.
    clock.advance(Duration::from_secs(3));
    assert_eq!(old.refresh().await.unwrap().grant, Rate::per_second(230));
    // Its grant of 300/s has expired: b gets its 10/s.
    clock.advance(Duration::from_millis(1_001));
    assert_eq!(new.refresh().await.unwrap().grant, Rate::per_second(10));
    let mut peak = Rate::ZERO;
    for _ in 0..20 {
        clock.advance(Duration::from_secs(2));
        for lease in [&old, &new] {
            lease.refresh().await.unwrap();
            peak = peak.max(store.grants(BUDGET).await.unwrap().peak());
        }
    }
    assert_eq!(peak, Rate::per_second(R));
    // Once the old instance is gone, the new budget is the only one.
    old.release().await.unwrap();
    let last = lease("c", R, R);
    assert_eq!(last.refresh().await.unwrap().grant, Rate::per_second(230));
}

/// A record written before the script kept each instance's budget (no
/// trailing `R`) still counts its grant, and binds nobody's budget.
#[tokio::test]
async fn a_record_without_a_budget_still_counts_its_grant() {
    let server = RedisServer::start();
    let clock = ManualClock::new(Duration::from_micros(START));
    let store = store(&server, Some(&clock));
    let expiry = (START + L).to_string();
    server.cli(&[
        "HSET",
        "t:{lease:dep}",
        "i:old",
        &format!("100000,0,100000,{expiry}"),
    ]);
    let lease = instance(&store, "new", R, &clock).build().unwrap();
    assert_eq!(
        lease.refresh().await.unwrap().grant,
        Rate::per_second(R - 100)
    );
    let table = store.grants(BUDGET).await.unwrap();
    assert_eq!(table.committed_at(Timestamp(START)), Rate::per_second(R));
    assert_eq!(table.instance("old").unwrap().steps.len(), 1);
}

// ---------------------------------------------------------------------------
// One instance id in two live processes (a copied config).
// ---------------------------------------------------------------------------

/// Sends of `node` in each whole second `[s, s + 1)` of fleet time, for
/// `seconds` in `from..to`.
fn per_second(node: &Node, from: u64, to: u64) -> Vec<usize> {
    (from..to)
        .map(|s| sends_between(node, START + s * SEC, START + (s + 1) * SEC))
        .collect()
}

/// Two live processes configured with one instance id share one Redis: the
/// first to call holds the id's grants, the other is refused with
/// `InstanceIdInUse` and spends the fallback share, `R / N`. Together they
/// send at most one grant plus one fallback share (`docs/leases.md`, "One
/// instance id in two processes"): with `R` = 240/s and `N` = 40, exactly
/// 240 + 6 = 246 in every second once running, and at most
/// `K(240/s) + K_f + 246·T` = 6 + 1 + 246 = 253 in any closed 1 s window.
/// Before, both were granted the whole 240/s, and sent 480 a second.
#[tokio::test]
async fn two_live_processes_with_one_instance_id_send_at_most_one_grant_plus_one_fallback_share() {
    let (events, _log) = Events::capture();
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, Some(&redis));
    // N = 40: the fallback share is 6/s.
    let mut fleet = Fleet::new(redis.clone(), shared.clone(), 40);
    let whole = |b: Builder| b.initial_demand(Rate::per_second(R));
    let first = fleet.join(&shared, "pod", 1_000, 0, whole);
    // Its twin's local clock is 2 s ahead of Redis's.
    let twin = fleet.join(&shared, "pod", 1_000, 2, whole);
    fleet.tick(0).await;
    fleet.run_until(12 * SEC, MS).await;

    let (a, b) = (&fleet.nodes[first], &fleet.nodes[twin]);
    let together: Vec<usize> = per_second(a, 1, 12)
        .iter()
        .zip(per_second(b, 1, 12))
        .map(|(x, y)| x + y)
        .collect();
    assert_eq!(
        (per_second(a, 1, 12), per_second(b, 1, 12)),
        (vec![240; 11], vec![6; 11]),
        "the holder spends its grant, its twin the fallback share"
    );
    assert_eq!(together, vec![246; 11]);
    let most = max_in_window(&fleet.all_sends(), SEC);
    assert!(most <= 253, "{most} sends in a 1 s window, bound 253");
    let (sa, sb) = (a.status(), b.status());
    assert_eq!(
        (sa.is_granted(), sa.grant, sb.is_fallback(), sb.rate),
        (true, Rate::per_second(R), true, Rate::per_second(R / 40))
    );
    // Refused at 0, 5 and 10 s, each time until the holder's latest expiry
    // (its refreshes at 0, 1, 5 and 9 s), never every `retry_every`.
    assert_eq!((sa.id_in_use, sb.id_in_use), (0, 3));
    assert_eq!(fleet.refresh_errors, 3);
    let table = fleet.table().await;
    assert_eq!(table.instances.len(), 1);
    assert_eq!(latest(&table, "pod"), R_MILLI);
    // The answer names the id and when it is free: the holder's grant of
    // 9 s lasts until 14 s.
    assert_eq!(
        fleet.nodes[twin]
            .lease
            .refresh()
            .await
            .map(|s| s.is_granted()),
        Err(LeaseError::InstanceIdInUse {
            id: "pod".to_owned(),
            free_in: Duration::from_secs(2)
        })
    );
    assert_eq!(
        events.count(
            tracing::Level::ERROR,
            "instance id \"pod\" is held by another"
        ),
        1,
        "one error, not one per refused refresh"
    );
    assert_eq!(events.count(tracing::Level::WARN, ""), 0);
}

/// A process restarted under its old instance id (a new lease, the old one
/// died without a release) is refused only while the old grants last: at
/// most one lease length, here exactly the 4 s left of the grant its
/// previous run renewed at 9 s. Meanwhile it spends the fallback share,
/// 6/s; at 14 s its own refresh, due then, takes the id and is granted the
/// whole 240/s, with no one's help.
#[tokio::test]
async fn a_restarted_process_waits_only_for_its_previous_runs_grant_to_expire() {
    let (events, _log) = Events::capture();
    let server = RedisServer::start();
    let redis = ManualClock::new(Duration::from_micros(START));
    let shared = store(&server, Some(&redis));
    let mut fleet = Fleet::new(redis.clone(), shared.clone(), 40);
    let whole = |b: Builder| b.initial_demand(Rate::per_second(R));
    let old = fleet.join(&shared, "pod", 1_000, 0, whole);
    fleet.tick(0).await;
    fleet.run_until(10 * SEC, MS).await;
    // Its last refresh was at 9 s: the grant lasts until 14 s.
    assert_eq!(
        fleet.nodes[old].fleet(fleet.nodes[old].status().next_refresh),
        START + 13 * SEC
    );
    fleet.nodes[old].alive = false;

    let new = fleet.join(&shared, "pod", 1_000, -3, whole);
    fleet.tick(0).await;
    let s = fleet.nodes[new].status();
    assert_eq!(
        (
            s.is_fallback(),
            s.rate,
            s.id_in_use,
            fleet.nodes[new].fleet(s.next_refresh)
        ),
        (true, Rate::per_second(R / 40), 1, START + 14 * SEC),
        "refused, in the fallback, and due again when the old grant expires"
    );
    fleet.run_until(14 * SEC - MS, MS).await;
    assert!(fleet.nodes[new].status().is_fallback());
    fleet.tick(MS).await;
    let s = fleet.nodes[new].status();
    assert_eq!(
        (s.is_granted(), s.grant, s.id_in_use),
        (true, Rate::per_second(R), 1)
    );
    fleet.run_until(20 * SEC, MS).await;
    let node = &fleet.nodes[new];
    assert_eq!(
        sends_between(node, START + 10 * SEC, START + 14 * SEC),
        23,
        "6/s for 4 s; the 24th token fills at 14 s"
    );
    assert_eq!(per_second(node, 15, 20), vec![240; 5]);
    assert_eq!(fleet.refresh_errors, 1);
    assert_eq!(
        events.count(
            tracing::Level::ERROR,
            "instance id \"pod\" is held by another"
        ),
        1
    );
    assert_eq!(events.count(tracing::Level::INFO, "rate lease renewed"), 1);
}

/// The refused lease of a shared id changes nothing of the holder's: its
/// release leaves the holder's grant counted, and even when it was built
/// to fail open it spends the fallback share (Redis is reachable and said
/// no), not without limit. A record written before the script kept its
/// holder's life is taken by its next caller, as before.
#[tokio::test]
async fn a_refused_lease_neither_frees_the_holders_grant_nor_fails_open() {
    let server = RedisServer::start();
    let clock = ManualClock::new(Duration::from_micros(START));
    let store = store(&server, Some(&clock));
    let holder = instance(&store, "pod", R, &clock).build().unwrap();
    let twin = instance(&store, "pod", R, &clock)
        .fail_open()
        .build()
        .unwrap();
    assert_eq!(holder.refresh().await.unwrap().grant, Rate::per_second(R));
    assert!(matches!(
        twin.refresh().await,
        Err(LeaseError::InstanceIdInUse { .. })
    ));
    let admitted = (0..1_000)
        .filter(|_| {
            clock.advance(Duration::from_millis(1));
            twin.try_acquire(1).is_ok()
        })
        .count();
    // One attempt a millisecond, 1,000 if it failed open: the fallback
    // share of 6/s in a bucket of one unit admits one every 167 ms.
    assert_eq!(admitted, 5, "a second of the fallback share, 6/s");
    assert_eq!(twin.release().await, Ok(()));
    let table = store.grants(BUDGET).await.unwrap();
    assert_eq!(latest(&table, "pod"), R_MILLI);
    assert_eq!(table.committed_at(table.now), Rate::per_second(R));
    // The holder renews, at its measured demand (none: the least, 0.15/s).
    assert_eq!(holder.refresh().await.unwrap().grant, Rate::from_milli(150));

    // A record with no holder's life: the next caller takes it.
    holder.release().await.unwrap();
    let expiry = (START + SEC + L).to_string();
    server.cli(&[
        "HSET",
        "t:{lease:dep}",
        "i:legacy",
        &format!("100000,0,100000,{expiry},240000"),
    ]);
    let legacy = instance(&store, "legacy", R, &clock).build().unwrap();
    assert_eq!(legacy.refresh().await.unwrap().grant, Rate::per_second(R));
    let other = instance(&store, "legacy", R, &clock).build().unwrap();
    assert!(matches!(
        other.refresh().await,
        Err(LeaseError::InstanceIdInUse { .. })
    ));
}
