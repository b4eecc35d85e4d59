//! Admissions over time for the four quota algorithms, on a memory store with
//! a manual clock: the data behind `docs/img/algorithms-burst.png` and
//! `docs/img/algorithms-overload.png`.
//!
//! ```text
//! cargo run --release --example algorithm_plots                  # into target/plots
//! cargo run --release --example algorithm_plots -- --out DIR
//! scripts/plots                                                  # this, then gnuplot
//! ```
//!
//! Every algorithm gets the same quota of 100 per minute (the token bucket: a
//! burst of 20 refilled at 100 per minute) and the same requests, each on a
//! fresh [`MemoryStore`] whose [`ManualClock`] is set to the request's time
//! before [`Store::decide`]: nothing sleeps, and every run gives the same
//! numbers. Times are wall times from 2026-12-01 12:00:00 UTC, so the fixed
//! window's clock-aligned minutes start at 12:00:00, 12:01:00 and so on.
//!
//! - **burst**: 100 requests at 12:00:59.999 and 100 at 12:01:00.000, then 5
//!   per second (one every 200 ms) until 12:03:00;
//! - **overload**: 5 per second for 3 minutes from 12:00:30, against 100 per
//!   minute.
//!
//! It writes into `--out` (default `target/plots`):
//!
//! | file | rows |
//! |---|---|
//! | `burst.csv` | one per 100 ms from 12:00:55 |
//! | `overload.csv` | one per second from 12:00:30 |
//! | `summary.md` | the tables: admitted, the most in any 60 s, the bound |
//!
//! Each CSV row is a bin `[t, t + step)`, `t` in seconds after 12:00:00:
//! `t_s, offered`, then for each algorithm (`fixed_window`, `sliding_log`,
//! `token_bucket`, `sliding_window`) three columns: admitted in the bin,
//! admitted up to the bin's end, and admitted in the 60 s before the bin's
//! end, `[t + step - 60 s, t + step)`.
//!
//! It checks the documented bounds on the admissions themselves and exits
//! with status 1, naming each one broken, if any is:
//!
//! - fixed window: at most 100 in each aligned minute, and all 200 of the
//!   burst admitted, 2 × 100 in 1 ms;
//! - sliding log: at most 100 in any 60 s, and exactly 100 of the burst;
//! - token bucket: at most `floor(20 + 100/60 s · T)` in any interval of
//!   length `T` (120 in 60 s), and exactly 20 of the burst;
//! - weighted window counter (`Policy::sliding_window`): an approximation,
//!   at most 2 × 100 in any 60 s (its documented worst case).

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use tower_admission::clock::ManualClock;
use tower_admission::quota::{MemoryStore, Policy, Quota, Store};

const MINUTE: Duration = Duration::from_secs(60);
/// µs in the quota's window.
const W: u64 = 60_000_000;
const LIMIT: u64 = 100;
const BURST: u64 = 20;
/// 2026-12-01 12:00:00 UTC, in µs since the epoch: a whole minute.
const NOON: u64 = 1_796_126_400 * 1_000_000;
/// µs per second and per millisecond.
const S: u64 = 1_000_000;
const MS: u64 = 1_000;

/// The four algorithms: the CSV's column prefix, the plot's title, the policy.
fn algorithms() -> Vec<(&'static str, &'static str, Policy)> {
    vec![
        (
            "fixed_window",
            "fixed window",
            Policy::fixed_window("fixed-window", LIMIT, MINUTE).expect("valid policy"),
        ),
        (
            "sliding_log",
            "sliding log",
            Policy::sliding_log("sliding-log", LIMIT, MINUTE).expect("valid policy"),
        ),
        (
            "token_bucket",
            "token bucket",
            Policy::token_bucket("token-bucket", BURST, LIMIT, MINUTE).expect("valid policy"),
        ),
        (
            "sliding_window",
            "weighted window counter",
            Policy::sliding_window("weighted-window", LIMIT, MINUTE).expect("valid policy"),
        ),
    ]
}

/// One scenario: its name, the offered request times (µs after 12:00:00, in
/// order), and the CSV's first bin and bin length.
struct Scenario {
    name: &'static str,
    offered: Vec<u64>,
    from: u64,
    to: u64,
    step: u64,
}

fn burst() -> Scenario {
    let mut offered = vec![59 * S + 999 * MS; 100];
    offered.extend(std::iter::repeat_n(60 * S, 100));
    // Then one every 200 ms, 12:01:00.200 to 12:03:00.000.
    offered.extend((1..=600).map(|k| 60 * S + k * 200 * MS));
    Scenario {
        name: "burst",
        offered,
        from: 55 * S,
        to: 180 * S + 100 * MS,
        step: 100 * MS,
    }
}

fn overload() -> Scenario {
    // One every 200 ms for 180 s from 12:00:30.
    let offered = (0..900).map(|k| 30 * S + k * 200 * MS).collect();
    Scenario {
        name: "overload",
        offered,
        from: 30 * S,
        to: 210 * S,
        step: S,
    }
}

/// The times (µs after 12:00:00) at which `policy` admitted, deciding each
/// offered request at cost 1 on a fresh store with a manual clock.
fn admissions(policy: &Policy, offered: &[u64]) -> Vec<u64> {
    let clock = ManualClock::new(Duration::from_micros(NOON));
    let store = MemoryStore::with_clock(clock.clone());
    let quota = Quota::new("plots", [policy.clone()]).expect("valid quota");
    let key: Arc<str> = "user".into();
    let mut admitted = Vec::new();
    for &t in offered {
        clock.set(Duration::from_micros(NOON + t));
        let decision = store
            .decide(&quota, &key, 1)
            .into_inner()
            .expect("the memory store always decides");
        if decision.admitted {
            admitted.push(t);
        }
    }
    admitted
}

/// How many of the sorted `times` fall in `[from, to)`.
fn count_in(times: &[u64], from: u64, to: u64) -> u64 {
    (times.partition_point(|&t| t < to) - times.partition_point(|&t| t < from)) as u64
}

/// The most of the sorted `times` in any interval `[a, a + len)`: the
/// largest such count starts at one of the times.
fn most_in_any(times: &[u64], len: u64) -> u64 {
    times
        .iter()
        .map(|&a| count_in(times, a, a + len))
        .max()
        .unwrap_or(0)
}

/// The first interval `[t_i, t_j]` of the sorted `times` that holds more
/// than `floor(BURST + LIMIT · T / W)` admissions, `T = t_j - t_i`.
fn token_bucket_violation(times: &[u64]) -> Option<(u64, u64, u64)> {
    for i in 0..times.len() {
        for j in i..times.len() {
            let n = (j - i + 1) as u128;
            let span = u128::from(times[j] - times[i]);
            let allowed =
                (u128::from(BURST) * u128::from(W) + u128::from(LIMIT) * span) / u128::from(W);
            if n > allowed {
                return Some((times[i], times[j], n as u64));
            }
        }
    }
    None
}

/// 12:MM:SS.mmm for `t` µs after 12:00:00.
fn wall(t: u64) -> String {
    let ms = t / MS;
    format!(
        "12:{:02}:{:02}.{:03}",
        ms / 60_000,
        (ms / 1000) % 60,
        ms % 1000
    )
}

/// The CSV of one scenario, with `runs[i]` the admissions of algorithm `i`.
fn csv(scenario: &Scenario, names: &[&str], runs: &[Vec<u64>]) -> String {
    let mut out = String::from("t_s,offered");
    for name in names {
        write!(out, ",{name}_admitted,{name}_cumulative,{name}_last_60s").expect("write");
    }
    out.push('\n');
    let mut t = scenario.from;
    while t < scenario.to {
        let end = t + scenario.step;
        write!(
            out,
            "{:.1},{}",
            t as f64 / S as f64,
            count_in(&scenario.offered, t, end)
        )
        .expect("write");
        for run in runs {
            write!(
                out,
                ",{},{},{}",
                count_in(run, t, end),
                count_in(run, 0, end),
                count_in(run, end.saturating_sub(W), end)
            )
            .expect("write");
        }
        out.push('\n');
        t = end;
    }
    out
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut out = std::path::PathBuf::from("target/plots");
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => match args.next() {
                Some(dir) => out = dir.into(),
                None => {
                    eprintln!("algorithm_plots: --out needs a directory");
                    std::process::exit(2);
                }
            },
            "-h" | "--help" => {
                println!("usage: algorithm_plots [--out DIR]   (default target/plots)");
                return;
            }
            _ => {
                eprintln!(
                    "algorithm_plots: unknown argument {arg:?}; usage: algorithm_plots [--out DIR]"
                );
                std::process::exit(2);
            }
        }
    }
    if let Err(e) = std::fs::create_dir_all(&out) {
        eprintln!("algorithm_plots: cannot create {}: {e}", out.display());
        std::process::exit(1);
    }

    let algorithms = algorithms();
    let names: Vec<&str> = algorithms.iter().map(|(name, _, _)| *name).collect();
    let mut failures = Vec::new();
    let mut summary = String::from(
        "# Admissions of the four algorithms, 100 per minute (token bucket: burst 20, \
         refill 100 per minute)\n",
    );

    for scenario in [burst(), overload()] {
        let runs: Vec<Vec<u64>> = algorithms
            .iter()
            .map(|(_, _, policy)| admissions(policy, &scenario.offered))
            .collect();
        let path = out.join(format!("{}.csv", scenario.name));
        if let Err(e) = std::fs::write(&path, csv(&scenario, &names, &runs)) {
            eprintln!("algorithm_plots: cannot write {}: {e}", path.display());
            std::process::exit(1);
        }

        let offered = scenario.offered.len();
        let (first, last) = (scenario.offered[0], scenario.offered[offered - 1]);
        writeln!(
            summary,
            "\n## {}: {offered} requests offered, {} to {}\n",
            scenario.name,
            wall(first),
            wall(last)
        )
        .expect("write");
        let burst = scenario.name == "burst";
        if burst {
            summary.push_str(
                "| algorithm | admitted at 12:00:59.999 + 12:01:00.000 | admitted in all | \
                 most in any 60 s | documented bound |\n|---|---:|---:|---:|---|\n",
            );
        } else {
            summary.push_str(
                "| algorithm | admitted in all | most in any 60 s | documented bound |\n\
                 |---|---:|---:|---|\n",
            );
        }
        for ((name, title, _), run) in algorithms.iter().zip(&runs) {
            let in_burst = count_in(run, 59 * S + 999 * MS, 60 * S + 1);
            let most_60 = most_in_any(run, W);
            let mut fail =
                |what: String| failures.push(format!("{}: {title}: {what}", scenario.name));
            let bound = match *name {
                "fixed_window" => {
                    for minute in 0..4 {
                        let n = count_in(run, minute * W, (minute + 1) * W);
                        if n > LIMIT {
                            fail(format!(
                                "{n} admitted in the minute from {}",
                                wall(minute * W)
                            ));
                        }
                    }
                    if burst && in_burst != 2 * LIMIT {
                        fail(format!(
                            "{in_burst} of the 200 burst requests admitted, not 200"
                        ));
                    }
                    "≤ 100 per aligned minute; so 2 × 100 in 1 ms across a boundary"
                }
                "sliding_log" => {
                    if most_60 > LIMIT {
                        fail(format!("{most_60} admitted in some 60 s"));
                    }
                    if burst && in_burst != LIMIT {
                        fail(format!("{in_burst} of the burst admitted, not 100"));
                    }
                    "≤ 100 in any 60 s"
                }
                "token_bucket" => {
                    if let Some((a, b, n)) = token_bucket_violation(run) {
                        fail(format!("{n} admitted from {} to {}", wall(a), wall(b)));
                    }
                    if burst && in_burst != BURST {
                        fail(format!("{in_burst} of the burst admitted, not 20"));
                    }
                    "≤ ⌊20 + 100/60 s · T⌋ over any T: 120 in 60 s"
                }
                _ => {
                    if most_60 > 2 * LIMIT {
                        fail(format!("{most_60} admitted in some 60 s"));
                    }
                    "approximation; worst case ≤ 2 × 100 in any 60 s"
                }
            };
            if burst {
                writeln!(
                    summary,
                    "| {title} | {in_burst} | {} | {most_60} | {bound} |",
                    run.len()
                )
            } else {
                writeln!(summary, "| {title} | {} | {most_60} | {bound} |", run.len())
            }
            .expect("write");
        }
    }

    let path = out.join("summary.md");
    if let Err(e) = std::fs::write(&path, &summary) {
        eprintln!("algorithm_plots: cannot write {}: {e}", path.display());
        std::process::exit(1);
    }
    print!("{summary}");
    if !failures.is_empty() {
        eprintln!(
            "algorithm_plots: documented bounds broken:\n  {}",
            failures.join("\n  ")
        );
        std::process::exit(1);
    }
    println!(
        "\nalgorithm_plots: every bound holds; CSV and summary in {}",
        out.display()
    );
}
