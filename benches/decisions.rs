//! Per-decision cost of each algorithm in the memory store against governor's
//! keyed limiter: same quota (100 per minute, burst 20), 10k keys, 1 and 2 threads.
//!
//! ```text
//! cargo bench --bench decisions
//! ```

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use governor::{Quota as GQuota, RateLimiter};
use tower_admission::quota::{MemoryStore, Policy, Quota};

const KEYS: usize = 10_000;
const MINUTE: Duration = Duration::from_secs(60);

fn keys() -> Arc<Vec<Arc<str>>> {
    Arc::new((0..KEYS).map(|i| Arc::from(format!("user-{i}"))).collect())
}

/// Runs `iters` calls of `f` split over `threads` threads; returns the wall time.
fn on_threads(threads: usize, iters: u64, f: &(dyn Fn(usize) + Sync)) -> Duration {
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

fn bench(c: &mut Criterion) {
    let keys = keys();
    for threads in [1usize, 2] {
        let mut group = c.benchmark_group(format!("decide/{threads}-thread"));
        group.throughput(Throughput::Elements(1));

        let governor = RateLimiter::keyed(
            GQuota::per_minute(NonZeroU32::new(100).unwrap())
                .allow_burst(NonZeroU32::new(20).unwrap()),
        );
        {
            let keys = keys.clone();
            group.bench_function("governor", |b| {
                b.iter_custom(|iters| {
                    on_threads(threads, iters, &|k| {
                        black_box(governor.check_key(&keys[k]).is_ok());
                    })
                })
            });
        }

        let policies = [
            Policy::token_bucket("token_bucket", 20, 100, MINUTE).unwrap(),
            Policy::sliding_log("sliding_log", 100, MINUTE).unwrap(),
            Policy::fixed_window("fixed_window", 100, MINUTE).unwrap(),
            Policy::sliding_window("sliding_window", 100, MINUTE).unwrap(),
        ];
        for policy in policies {
            let name = policy.name().to_owned();
            let quota = Quota::new(&name, [policy]).unwrap();
            let store = MemoryStore::new();
            let keys = keys.clone();
            group.bench_function(&name, |b| {
                b.iter_custom(|iters| {
                    on_threads(threads, iters, &|k| {
                        black_box(
                            store
                                .decide_now(&quota, &keys[k], 1)
                                .map(|d| d.admitted)
                                .ok(),
                        );
                    })
                })
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
