//! Per-decision cost of each algorithm in the memory store against governor's
//! keyed limiter: same quota (100 per minute, burst 20), 10k keys, 1 and 2 threads.
//!
//! ```text
//! cargo bench --bench decisions
//! ```
//!
//! Each variant is timed on its own, seconds apart, so on a shared machine
//! the ratio of two of them carries the machine's drift; `benches/paired.rs`
//! measures the ratios in alternating batches instead.

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tower_admission::quota::MemoryStore;

use common::on_threads;

fn bench(c: &mut Criterion) {
    let keys = common::keys();
    for threads in [1usize, 2] {
        let mut group = c.benchmark_group(format!("decide/{threads}-thread"));
        group.throughput(Throughput::Elements(1));

        let governor = common::governor();
        group.bench_function("governor", |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, &|k| {
                    black_box(governor.check_key(&keys[k]).is_ok());
                })
            })
        });

        for quota in common::quotas() {
            let store = MemoryStore::new();
            group.bench_function(quota.name(), |b| {
                b.iter_custom(|iters| {
                    on_threads(threads, iters, &|k| {
                        black_box(common::decide(&store, &quota, &keys[k]));
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
