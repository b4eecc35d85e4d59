//! Redis server time of refusing a big cost on a big sliding log: the one
//! decision whose work used to grow with the log (a walk of every entry
//! inside the script, blocking Redis for every client).
//!
//! On a `redis-server` started here, a log of 100,000 entries of cost 1
//! (limit 100,000 per hour) is filled through `RedisStore`. Then refusals of
//! cost 100,000, 50,000 and 2 each run 21 times, and the server's own time
//! for each `EVALSHA` is read back from `SLOWLOG` (with
//! `slowlog-log-slower-than 0`). Medians are printed in µs.
//!
//! Run: `cargo bench --bench sliding_log_refusal --features redis`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use tower_admission::quota::{Policy, Quota, RedisStore, Store};

use support::RedisServer;

const ENTRIES: u64 = 100_000;

/// Server time of the last `EVALSHA`, in µs, from `SLOWLOG GET 1`.
fn last_evalsha_micros(server: &RedisServer) -> u64 {
    let log = server.cli(&["slowlog", "get", "1"]);
    // redis-cli prints: id, timestamp, duration in µs, then the arguments.
    let lines: Vec<&str> = log.lines().map(str::trim).collect();
    assert!(
        lines.iter().any(|l| l.eq_ignore_ascii_case("evalsha")),
        "{log}"
    );
    lines[2].parse().expect("slowlog duration")
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn main() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = RedisStore::builder(server.url())
        .deadline(Duration::from_secs(10))
        .build()
        .unwrap();
    let quota = Quota::new(
        "big",
        [Policy::sliding_log("hourly", ENTRIES, Duration::from_secs(3600)).unwrap()],
    )
    .unwrap();
    let key: Arc<str> = "one-key".into();
    rt.block_on(async {
        let tasks: Vec<_> = (0..50)
            .map(|_| {
                let (store, quota, key) = (store.clone(), quota.clone(), key.clone());
                tokio::spawn(async move {
                    for _ in 0..ENTRIES / 50 {
                        assert!(store.decide(&quota, &key, 1).await.unwrap().admitted);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    server.cli(&["config", "set", "slowlog-log-slower-than", "0"]);
    println!(
        "sliding log of {ENTRIES} entries; Redis server time per refusal (SLOWLOG, median of 21):"
    );
    for cost in [ENTRIES, ENTRIES / 2, 2] {
        let times: Vec<u64> = (0..21)
            .map(|_| {
                server.cli(&["slowlog", "reset"]);
                let d = rt.block_on(store.decide(&quota, &key, cost)).unwrap();
                assert!(!d.admitted);
                last_evalsha_micros(&server)
            })
            .collect();
        println!("  refuse cost {cost:>7}: {:>6} µs", median(times));
    }
}
