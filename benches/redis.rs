//! Decisions per second through `RedisStore` against the Redis ceiling for
//! the same script, side by side in one run.
//!
//! For each algorithm, on one `redis-server` started here:
//!
//! - **store**: 50 concurrent tokio tasks call `RedisStore::decide` (one
//!   shared multiplexed connection, production script reading `TIME`);
//! - **redis-benchmark**: `redis-benchmark -c 50 EVALSHA <sha> <n> <keys>
//!   ...` with exactly the keys (the policy's, and the quota's expiry key
//!   for a log or weighted window) and arguments the store sends.
//!
//! The store's 50 callers share one multiplexed connection, so their
//! requests reach Redis pipelined; the same command through redis-benchmark
//! with `-P 16` (16 requests in flight per connection) is the pipelined
//! ceiling, reported beside the plain `-c 50` one.
//!
//! Rounds alternate the runs, each on a fresh key, and the median of each is
//! reported with the ratio. Round trips per decision are counted by the
//! server: `cmdstat_evalsha` calls (and any other command) per decision.
//!
//! Run: `cargo bench --bench redis --features redis`. `BENCH_N` sets the
//! requests per run (default 100000), `BENCH_ROUNDS` the rounds (default 3).

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tower_admission::quota::{Policy, Quota, RedisStore, Store};

use support::{require, RedisServer};

const CALLERS: usize = 50;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Policies that admit every request of a run, so both sides do the same
/// work on every call.
fn quotas() -> Vec<(&'static str, Quota)> {
    let hour = Duration::from_secs(3600);
    let big = 1u64 << 40;
    vec![
        (
            "token bucket",
            // One token per µs: always full, every request admitted.
            Policy::token_bucket("p", big, 1_000_000, Duration::from_secs(1)).unwrap(),
        ),
        (
            "fixed window",
            Policy::fixed_window("p", big, hour).unwrap(),
        ),
        (
            "weighted window",
            Policy::sliding_window("p", big, hour).unwrap(),
        ),
        (
            "sliding log",
            Policy::sliding_log("p", 1_000_000, hour).unwrap(),
        ),
    ]
    .into_iter()
    .map(|(name, p)| (name, Quota::new("bench", [p]).unwrap()))
    .collect()
}

/// The arguments the store sends for a decision of cost 1.
fn script_args(quota: &Quota) -> Vec<String> {
    RedisStore::decision_args(quota, 1)
}

/// `(evalsha calls, all calls)` from INFO commandstats.
fn command_calls(server: &RedisServer) -> (u64, u64) {
    let stats = server.cli(&["info", "commandstats"]);
    let mut evalsha = 0;
    let mut all = 0;
    for line in stats.lines() {
        let Some((name, rest)) = line.split_once(':') else {
            continue;
        };
        let calls: u64 = rest
            .split(',')
            .find_map(|f| f.strip_prefix("calls="))
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        if name == "cmdstat_evalsha" {
            evalsha = calls;
        }
        // Commands run inside the script are counted too; only top-level
        // client commands are round trips.
        if matches!(
            name,
            "cmdstat_evalsha" | "cmdstat_eval" | "cmdstat_script|load" | "cmdstat_hello"
        ) || name.starts_with("cmdstat_client")
        {
            all += calls;
        }
    }
    (evalsha, all)
}

async fn store_run(store: &RedisStore, quota: &Quota, key: &str, n: usize) -> f64 {
    let key: Arc<str> = key.into();
    let per_caller = n / CALLERS;
    let started = Instant::now();
    let tasks: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (store, quota, key) = (store.clone(), quota.clone(), key.clone());
            tokio::spawn(async move {
                for _ in 0..per_caller {
                    let d = store.decide(&quota, &key, 1).await.expect("decision");
                    assert!(d.admitted);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    (per_caller * CALLERS) as f64 / started.elapsed().as_secs_f64()
}

fn redis_benchmark_run(
    pipeline: usize,
    server: &RedisServer,
    sha: &str,
    keys: &[String],
    args: &[String],
    n: usize,
) -> f64 {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &server.port().to_string()])
        .args(["-n", &n.to_string(), "-c", &CALLERS.to_string(), "--csv"])
        .args(["-P", &pipeline.to_string()])
        .args(["EVALSHA", sha, &keys.len().to_string()])
        .args(keys)
        .args(args)
        .output()
        .expect("run redis-benchmark");
    let csv = String::from_utf8_lossy(&out.stdout);
    let line = csv
        .lines()
        .find(|l| l.starts_with("\"EVALSHA"))
        .unwrap_or_else(|| panic!("no result from redis-benchmark:\n{csv}"));
    let rps = line.split("\",\"").nth(1).expect("rps field");
    rps.trim_matches('"').parse().expect("rps number")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    require("redis-benchmark");
    let n = env_or("BENCH_N", 100_000);
    let rounds = env_or("BENCH_ROUNDS", 3);
    let workers = env_or("BENCH_WORKERS", 2);
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap();
    let store = rt.block_on(async {
        RedisStore::builder(server.url())
            .prefix("bench")
            .deadline(Duration::from_secs(5))
            .build()
            .unwrap()
    });
    let sha = store.script_sha().to_owned();
    println!(
        "redis-server {}, {n} requests per run, {CALLERS} concurrent callers, {rounds} rounds, {workers} tokio workers",
        server.cli(&["info", "server"]).lines().find_map(|l| l.strip_prefix("redis_version:")).unwrap_or("?").trim()
    );
    println!();
    println!(
        "| algorithm | RedisStore decisions/s | redis-benchmark -c 50 EVALSHA/s | ratio | redis-benchmark -c 50 -P 16 EVALSHA/s | ratio | round trips per decision |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (name, quota) in quotas() {
        // Warm up: loads the script (NOSCRIPT -> SCRIPT LOAD) and connects.
        rt.block_on(store_run(
            &store,
            &quota,
            &format!("warm-{name}"),
            CALLERS * 20,
        ));
        let args = script_args(&quota);
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        let mut piped = Vec::new();
        let mut trips = Vec::new();
        for round in 0..rounds {
            let key = format!("s{round}-{}", name.replace(' ', "-"));
            let (e0, a0) = command_calls(&server);
            ours.push(rt.block_on(store_run(&store, &quota, &key, n)));
            let (e1, a1) = command_calls(&server);
            let decisions = (n / CALLERS * CALLERS) as f64;
            assert_eq!(e1 - e0, n as u64 / CALLERS as u64 * CALLERS as u64);
            trips.push((a1 - a0) as f64 / decisions);
            // The keys the store sends: the policy's, then the quota's
            // expiry key for a log or weighted window.
            let script_keys = |run: &str| {
                let key = format!("{run}{round}-{}", name.replace(' ', "-"));
                let mut keys = store.keys(&quota, &key);
                keys.extend(store.expiry_key(&quota, &key));
                keys
            };
            let run = |pipeline, name| {
                redis_benchmark_run(pipeline, &server, &sha, &script_keys(name), &args, n)
            };
            theirs.push(run(1, "b"));
            piped.push(run(16, "p"));
        }
        let (ours, theirs, piped) = (median(ours), median(theirs), median(piped));
        println!(
            "| {name} | {ours:.0} | {theirs:.0} | {:.2} | {piped:.0} | {:.2} | {:.3} |",
            ours / theirs,
            ours / piped,
            trips.iter().copied().fold(0.0, f64::max)
        );
    }
}
