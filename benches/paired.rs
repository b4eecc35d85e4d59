//! Ratios to governor measured in alternating batches, so that the drift of
//! a shared, noisy machine falls on both sides of every ratio alike.
//!
//! ```text
//! cargo bench --bench paired
//! ```
//!
//! For each algorithm and thread count: 2 warm-up rounds, then `ROUNDS`
//! rounds, each timing `BATCH` governor decisions and `BATCH` memory-store
//! decisions back to back (the order alternating between rounds). It prints
//! the median of the per-round ratios (ours / governor) and their quartiles.
//! Same quota, keys and threads as `benches/decisions.rs`.

mod common;

use std::hint::black_box;

use tower_admission::quota::MemoryStore;

use common::on_threads;

const ROUNDS: usize = 41;
const WARMUP_ROUNDS: usize = 2;
const BATCH: u64 = 200_000;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        // `cargo test --benches` asks for a list of tests: there are none.
        return;
    }
    let keys = common::keys();
    println!("| algorithm | threads | ours / governor (median) | quartiles |");
    println!("|---|---:|---:|---|");
    for threads in [1usize, 2] {
        for quota in common::quotas() {
            let governor = common::governor();
            let store = MemoryStore::new();
            let theirs = || {
                on_threads(threads, BATCH, &|k| {
                    black_box(governor.check_key(&keys[k]).is_ok());
                })
            };
            let ours = || {
                on_threads(threads, BATCH, &|k| {
                    black_box(
                        store
                            .decide_now(&quota, &keys[k], 1)
                            .map(|d| d.admitted)
                            .ok(),
                    );
                })
            };
            let mut ratios: Vec<f64> = (0..WARMUP_ROUNDS + ROUNDS)
                .map(|round| {
                    let (us, them) = if round % 2 == 0 {
                        let them = theirs();
                        (ours(), them)
                    } else {
                        let us = ours();
                        (us, theirs())
                    };
                    us.as_secs_f64() / them.as_secs_f64()
                })
                .skip(WARMUP_ROUNDS)
                .collect();
            ratios.sort_by(f64::total_cmp);
            let at = |q: usize| ratios[(ratios.len() - 1) * q / 4];
            println!(
                "| {} | {threads} | {:.2} | {:.2}-{:.2} |",
                quota.name(),
                at(2),
                at(1),
                at(3)
            );
        }
    }
}
