//! A fleet shares one quota: 10 and then 40 independent `RedisStore`
//! instances, each with its own connection, decide concurrently against one
//! quota of L = 500 in one `redis-server` started by the test. Exactly L are
//! admitted in total, for every algorithm: Redis runs each decision as one
//! atomic script, so no instance can read a stale count.
//!
//! The clock is a shared `ManualClock` injected into the test-only script,
//! so no window boundary or refill can fall inside the run. One more test
//! uses the production script (Redis `TIME`) with a sliding log of one hour,
//! which is exact in real time too.
#![cfg(feature = "redis")]

mod support;

use std::sync::Arc;
use std::time::Duration;

use tower_admission::clock::ManualClock;
use tower_admission::quota::{Policy, Quota, RedisStore, Store};

use support::RedisServer;

const LIMIT: u64 = 500;
/// Requests per run, four times the limit.
const REQUESTS: usize = 2000;

fn quotas() -> Vec<Quota> {
    let hour = Duration::from_secs(3600);
    [
        Policy::fixed_window("fw", LIMIT, hour).unwrap(),
        Policy::sliding_log("sl", LIMIT, hour).unwrap(),
        Policy::token_bucket("tb", LIMIT, 1, hour).unwrap(),
        Policy::sliding_window("sw", LIMIT, hour).unwrap(),
    ]
    .into_iter()
    .map(|p| Quota::new(&format!("shared-{}", p.name()), [p]).unwrap())
    .collect()
}

/// `instances` stores, each with its own connection, `REQUESTS / instances`
/// concurrent callers spread over them; returns the admitted count.
async fn run_fleet(stores: &[RedisStore], quota: &Quota) -> u64 {
    let key: Arc<str> = "tenant-1".into();
    let per_caller = 10;
    let callers = REQUESTS / per_caller;
    let tasks: Vec<_> = (0..callers)
        .map(|i| {
            let store = stores[i % stores.len()].clone();
            let (quota, key) = (quota.clone(), key.clone());
            tokio::spawn(async move {
                let mut admitted = 0u64;
                for _ in 0..per_caller {
                    if store.decide(&quota, &key, 1).await.unwrap().admitted {
                        admitted += 1;
                    }
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    admitted
}

async fn fleet_admits_exactly_the_limit(instances: usize) {
    let server = RedisServer::start();
    let clock = ManualClock::new(Duration::from_secs(1_704_110_400));
    let stores: Vec<RedisStore> = (0..instances)
        .map(|_| {
            RedisStore::builder(server.url())
                .test_clock(clock.clone())
                .deadline(Duration::from_secs(10))
                .build()
                .unwrap()
        })
        .collect();
    for quota in quotas() {
        let admitted = run_fleet(&stores, &quota).await;
        assert_eq!(admitted, LIMIT, "{} instances, {}", instances, quota.name());
    }
    // Every instance holds its own connection, and each one decided.
    let clients = server.cli(&["client", "list"]);
    let store_connections = clients
        .lines()
        .filter(|l| l.contains("cmd=evalsha"))
        .count();
    assert_eq!(store_connections, instances, "clients:\n{clients}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_instances_admit_exactly_the_limit() {
    fleet_admits_exactly_the_limit(10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_instances_admit_exactly_the_limit() {
    fleet_admits_exactly_the_limit(40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_instances_on_redis_time_admit_exactly_the_limit() {
    let server = RedisServer::start();
    let stores: Vec<RedisStore> = (0..40)
        .map(|_| {
            RedisStore::builder(server.url())
                .deadline(Duration::from_secs(10))
                .build()
                .unwrap()
        })
        .collect();
    let quota = Quota::new(
        "shared-time",
        [Policy::sliding_log("sl", LIMIT, Duration::from_secs(3600)).unwrap()],
    )
    .unwrap();
    assert_eq!(run_fleet(&stores, &quota).await, LIMIT);
}
