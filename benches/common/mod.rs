//! What the benches share: the keys, the quotas, the rival and the HTTP
//! stacks.
//!
//! Same quota for both sides: 100 per minute with a burst of 20 for
//! governor's keyed GCRA, and each of the four algorithms at 100 per minute
//! in the memory store. 10k keys, visited round robin.

#![allow(dead_code)]

pub(crate) mod inbound;
pub(crate) mod stacks;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use governor::clock::DefaultClock;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota as GQuota, RateLimiter};
use tower_admission::quota::{MemoryStore, Policy, Quota, Store};

pub(crate) const KEYS: usize = 10_000;
const MINUTE: Duration = Duration::from_secs(60);

pub(crate) type Governor = RateLimiter<Arc<str>, DefaultKeyedStateStore<Arc<str>>, DefaultClock>;

pub(crate) fn keys() -> Arc<Vec<Arc<str>>> {
    Arc::new((0..KEYS).map(|i| Arc::from(format!("user-{i}"))).collect())
}

/// governor's keyed limiter: 100 per minute, burst 20.
pub(crate) fn governor() -> Governor {
    RateLimiter::keyed(
        GQuota::per_minute(NonZeroU32::new(100).unwrap()).allow_burst(NonZeroU32::new(20).unwrap()),
    )
}

/// One quota of one policy for each algorithm, named after it, then the
/// sample API's free plan: a sliding log of 100 per minute **and** a bucket of
/// 20 refilled at 100 per minute, decided together.
pub(crate) fn quotas() -> Vec<Quota> {
    let mut quotas: Vec<Quota> = [
        Policy::token_bucket("token_bucket", 20, 100, MINUTE),
        Policy::sliding_log("sliding_log", 100, MINUTE),
        Policy::fixed_window("fixed_window", 100, MINUTE),
        Policy::sliding_window("sliding_window", 100, MINUTE),
    ]
    .into_iter()
    .map(|policy| {
        let policy = policy.unwrap();
        let name = policy.name().to_owned();
        Quota::new(&name, [policy]).unwrap()
    })
    .collect();
    let free_plan = [
        Policy::sliding_log("per-minute", 100, MINUTE).unwrap(),
        Policy::token_bucket("burst", 20, 100, MINUTE).unwrap(),
    ];
    quotas.push(Quota::new("free_plan", free_plan).unwrap());
    quotas
}

/// Runs `iters` calls of `f` over the keys, split over `threads` threads;
/// returns the wall time.
pub(crate) fn on_threads(threads: usize, iters: u64, f: &(dyn Fn(usize) + Sync)) -> Duration {
    let per_thread = iters / threads as u64;
    let start = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..threads {
            scope.spawn(move || {
                let mut k = t * 7919;
                for _ in 0..per_thread {
                    k = (k + 1) % KEYS;
                    f(k);
                }
            });
        }
    });
    start.elapsed()
}

/// One memory-store decision, as the benches make it: cost 1, only the
/// admission kept.
#[inline]
pub(crate) fn decide(store: &MemoryStore, quota: &Quota, key: &Arc<str>) -> Option<bool> {
    store
        .decide(quota, key, 1)
        .into_inner()
        .map(|d| d.admitted)
        .ok()
}
