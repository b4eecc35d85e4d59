//! Ratios measured in alternating batches, so that the drift of a shared,
//! noisy machine falls on both sides of every ratio alike.
//!
//! ```text
//! cargo bench --bench paired
//! ```
//!
//! - **Decisions**: for each algorithm and thread count, 2 warm-up rounds,
//!   then `ROUNDS` rounds, each timing `BATCH` governor decisions and `BATCH`
//!   memory-store decisions back to back (the order alternating between
//!   rounds). Same quota, keys and threads as `benches/decisions.rs`.
//! - **HTTP in process**: the four stacks of `benches/http.rs`, each round
//!   timing `HTTP_BATCH` requests to each stack, the order rotating between
//!   rounds.
//!
//! Each table gives the median of the per-round ratios and their quartiles.
//!
//! `PAIRED=decisions` or `PAIRED=http` runs only that part; `PAIRED=layers`
//! times bare axum, tower_governor and the whole stack cut after each of its
//! layers, to give each layer's share of the time it adds, and bare axum
//! behind 6 and behind 1 layers that only pass through, for what nesting
//! and `Router::layer` cost before any layer's work;
//! `PAIRED_ONLY=token_bucket,free_plan` keeps the decision rows of those
//! quotas and skips the HTTP part, to rerun a few rows.

mod common;

use std::hint::black_box;

use std::time::{Duration, Instant};

use tower::ServiceExt;
use tower_admission::quota::MemoryStore;

use common::on_threads;

const ROUNDS: usize = 41;
const WARMUP_ROUNDS: usize = 2;
const BATCH: u64 = 200_000;
const HTTP_BATCH: usize = 20_000;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        // `cargo test --benches` asks for a list of tests: there are none.
        return;
    }
    let only = std::env::var("PAIRED_ONLY").ok();
    let part = std::env::var("PAIRED").unwrap_or_default();
    if part != "http" && part != "layers" {
        decisions(only.as_deref());
        println!();
    }
    if part == "layers" {
        layers();
    } else if part != "decisions" && only.is_none() {
        http();
    }
}

/// Median and quartiles of `ratios`, as table cells.
fn summary(mut ratios: Vec<f64>) -> String {
    ratios.sort_by(f64::total_cmp);
    let at = |q: usize| ratios[(ratios.len() - 1) * q / 4];
    format!("{:.2} | {:.2}-{:.2}", at(2), at(1), at(3))
}

fn decisions(only: Option<&str>) {
    let keys = common::keys();
    println!("| algorithm | threads | ours / governor (median) | quartiles |");
    println!("|---|---:|---:|---|");
    for threads in [1usize, 2] {
        let quotas = common::quotas().into_iter().filter(|quota| {
            only.is_none_or(|only| only.split(',').any(|name| name == quota.name()))
        });
        for quota in quotas {
            let governor = common::governor();
            let store = MemoryStore::new();
            let theirs = || {
                on_threads(threads, BATCH, &|k| {
                    black_box(governor.check_key(&keys[k]).is_ok());
                })
            };
            let ours = || {
                on_threads(threads, BATCH, &|k| {
                    black_box(common::decide(&store, &quota, &keys[k]));
                })
            };
            let ratios: Vec<f64> = (0..WARMUP_ROUNDS + ROUNDS)
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
            println!("| {} | {threads} | {} |", quota.name(), summary(ratios));
        }
    }
}

/// Seconds for `HTTP_BATCH` requests to each of `stacks`, per round after
/// the warm-up, the order rotating between rounds.
fn time_rounds(stacks: &[common::stacks::Stack]) -> Vec<Vec<f64>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let time = |stack: &common::stacks::Stack| -> Duration {
        rt.block_on(async {
            let start = Instant::now();
            for _ in 0..HTTP_BATCH {
                let response = stack.app.clone().oneshot(stack.request()).await;
                assert_eq!(response.unwrap().status(), 200);
            }
            start.elapsed()
        })
    };
    let mut rounds = Vec::with_capacity(ROUNDS);
    for round in 0..WARMUP_ROUNDS + ROUNDS {
        let mut times = vec![0.0; stacks.len()];
        for i in 0..stacks.len() {
            let s = (i + round) % stacks.len();
            times[s] = time(&stacks[s]).as_secs_f64();
        }
        if round >= WARMUP_ROUNDS {
            rounds.push(times);
        }
    }
    rounds
}

fn http() {
    let stacks = common::stacks::stacks();
    let rounds = time_rounds(&stacks);
    let ratio = |a: usize, b: usize| summary(rounds.iter().map(|t| t[a] / t[b]).collect());
    println!("| stack | ratio to bare axum (median) | quartiles |");
    println!("|---|---:|---|");
    for (i, stack) in stacks.iter().enumerate() {
        println!("| {} | {} |", stack.name, ratio(i, 0));
    }
    println!();
    println!("| ratio | median | quartiles |");
    println!("|---|---:|---|");
    println!("| quota_layer / tower_governor | {} |", ratio(2, 1));
    let per_request = |i: usize| {
        let mut t: Vec<f64> = rounds.iter().map(|t| t[i]).collect();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2] / HTTP_BATCH as f64 * 1e9
    };
    println!("| whole_stack / tower_governor | {} |", ratio(3, 1));
    let added = |i: usize| {
        // Per round, the time a stack adds over bare axum against what
        // tower_governor adds, so that drift falls on both.
        summary(
            rounds
                .iter()
                .map(|t| (t[i] - t[0]) / (t[1] - t[0]))
                .collect(),
        )
    };
    println!(
        "| added time: quota_layer / tower_governor | {} |",
        added(2)
    );
    println!(
        "| added time: whole_stack / tower_governor | {} |",
        added(3)
    );
    println!();
    println!(
        "medians per request: bare {:.0} ns, governor {:.0}, quota {:.0}, whole stack {:.0}",
        per_request(0),
        per_request(1),
        per_request(2),
        per_request(3)
    );
}

/// Bare axum, tower_governor and the whole stack cut after each of its
/// layers, timed as [`http`] times its stacks: the time each layer adds.
fn layers() {
    let [bare, governor, ..] = common::stacks::stacks();
    let mut stacks = vec![bare, governor];
    stacks.extend((1..=6).map(common::stacks::first_layers));
    stacks.push(common::stacks::passthrough(6));
    stacks.push(common::stacks::passthrough(1));
    let names = ["bare axum", "tower_governor"]
        .into_iter()
        .chain(common::inbound::LAYERS.iter().copied())
        .chain([
            "bare axum + 6 pass-through layers",
            "bare axum + 1 pass-through layer",
        ]);
    let rounds = time_rounds(&stacks);
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "| stack | ns per request (median) | added by this layer, ns | added / tower_governor's |"
    );
    println!("|---|---:|---:|---:|");
    let governor_added = median(rounds.iter().map(|t| t[1] - t[0]).collect());
    for (i, name) in names.enumerate() {
        let per_request = median(rounds.iter().map(|t| t[i]).collect()) / HTTP_BATCH as f64 * 1e9;
        // A layer's cut against the one before it; tower_governor against bare.
        // The pass-through stacks (from 8 on) against bare axum too.
        let before = if i <= 2 || i >= 8 { 0 } else { i - 1 };
        let added = median(rounds.iter().map(|t| t[i] - t[before]).collect());
        if i == 0 {
            println!("| {name} | {per_request:.0} | | |");
        } else {
            println!(
                "| {} | {per_request:.0} | {:.0} | {:.2} |",
                if i == 1 || i >= 8 {
                    name.to_string()
                } else {
                    format!("+ {name}")
                },
                added / HTTP_BATCH as f64 * 1e9,
                added / governor_added
            );
        }
    }
}
