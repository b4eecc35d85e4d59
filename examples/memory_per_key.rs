//! Memory per tracked key of the memory store, read from the resident set
//! size (`VmRSS`, Linux only), for a quota of one policy of each algorithm.
//!
//! ```text
//! cargo run --release --example memory_per_key            # the whole table
//! cargo run --release --example memory_per_key -- token_bucket 1000000 1
//! ```
//!
//! Each row runs in a process of its own (the example starts itself), so
//! no row inherits another's heap. A row decides `keys` distinct 16-byte keys
//! (`key-000000000042`), each `entries` times with cost 1, on a clock that
//! stands still so nothing expires; every key is an `Arc<str>` made for its
//! request and dropped after it, as a server's would be. The figure is
//! (RSS after - RSS before) / keys: the store's tables, its copies of the
//! keys and each key's state, with the allocator's overhead. A row of the
//! sliding log at 100 entries also gives the bytes per entry beyond the
//! first, against the row of 1 entry at the same number of keys.

use std::num::NonZeroUsize;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use tower_admission::clock::ManualClock;
use tower_admission::quota::{MemoryStore, Policy, Quota, Store};

const MINUTE: Duration = Duration::from_secs(60);

/// The resident set size in bytes, from `/proc/self/status`.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// A quota of one policy of `algorithm` that admits `entries` decisions of
/// cost 1 per key in one minute.
fn quota(algorithm: &str, entries: u64) -> Quota {
    let limit = entries.max(100);
    let policy = match algorithm {
        "token_bucket" => Policy::token_bucket(algorithm, limit, 100, MINUTE),
        "fixed_window" => Policy::fixed_window(algorithm, limit, MINUTE),
        "sliding_window" => Policy::sliding_window(algorithm, limit, MINUTE),
        "sliding_log" => Policy::sliding_log(algorithm, limit, MINUTE),
        other => panic!("unknown algorithm {other}"),
    };
    Quota::new(algorithm, [policy.unwrap()]).unwrap()
}

/// Bytes per key of one row, measured in this process.
fn measure(algorithm: &str, keys: usize, entries: u64) -> f64 {
    let quota = quota(algorithm, entries);
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let store = MemoryStore::with_clock(clock).max_keys(NonZeroUsize::new(keys).unwrap());
    let before = rss_bytes();
    for i in 0..keys {
        let key: Arc<str> = format!("key-{i:012}").into();
        for _ in 0..entries {
            let decision = store.decide(&quota, &key, 1).into_inner().unwrap();
            assert!(decision.admitted, "{algorithm}: key {i} refused");
        }
    }
    assert_eq!(store.len(), keys);
    let after = rss_bytes();
    (after - before) as f64 / keys as f64
}

/// Runs one row in a child process and reads its figure.
fn row(algorithm: &str, keys: usize, entries: u64) -> f64 {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([algorithm, &keys.to_string(), &entries.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [algorithm, keys, entries] = &args[..] {
        let per_key = measure(algorithm, keys.parse().unwrap(), entries.parse().unwrap());
        println!("{per_key:.1}");
        return;
    }
    const MILLION: usize = 1_000_000;
    println!("| quota (one policy) | keys | decisions per key | bytes per key (RSS) |");
    println!("|---|---:|---:|---:|");
    let mut one = 0.0;
    for algorithm in [
        "token_bucket",
        "fixed_window",
        "sliding_window",
        "sliding_log",
    ] {
        one = row(algorithm, MILLION, 1);
        println!("| {algorithm} | {MILLION} | 1 | {one:.0} |");
    }
    let hundred = row("sliding_log", MILLION, 100);
    println!("| sliding_log | {MILLION} | 100 | {hundred:.0} |");
    println!();
    println!(
        "sliding log, bytes per entry beyond the first: {:.1}",
        (hundred - one) / 99.0
    );
}
