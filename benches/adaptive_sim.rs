//! Adaptive limits side by side, in virtual time: this crate's
//! [`AdaptiveLimitLayer`] and tower-resilience-adaptive's AIMD, Vegas and
//! Gradient2, each deciding the same open-loop arrivals to the same
//! simulated dependency.
//!
//! ```text
//! cargo bench --bench adaptive_sim
//! ```
//!
//! - **Dependency.** Processor sharing with capacity C: up to C requests in
//!   flight each take the base latency (20 ms); above C each progresses at
//!   C / in-flight of the rate, so each takes `20 ms × in_flight / C`.
//!   Simulated in 1 ms ticks.
//! - **Load.** Poisson arrivals (seeded) at 2 × capacity, C = 100 (so 10,000
//!   requests per second), for 60 s; C halves at 20 s and returns at 40 s
//!   (the arrival rate stays).
//! - **Limiters.** Each with its documented defaults and the same floor (1)
//!   and ceiling (1000); a request over the limit is refused at once (no
//!   queue). The anchors' algorithms are driven through their
//!   `ConcurrencyAlgorithm` trait with latencies measured in virtual time
//!   (their service reads the wall clock, which `tokio::time::pause` does
//!   not move), exactly as their service feeds them: success with the
//!   latency and the requests in flight counting itself.
//! - **Figures.** Goodput (completions per second over capacity) and the p50
//!   and p99 latency of admitted requests, over the steady part of the
//!   first phase (5 s to 20 s); the time to follow each change: from the
//!   change to the start of the first full second of 100 ms buckets that
//!   each have goodput ≥ 95 % of the new capacity and p99 ≤ 2 × base.
//!
//! The scenario runs twice: with every request's work exactly the base
//! latency, and with it drawn uniformly within ± 25 % (seeded).
//! `SIM_TRACE=1` prints this crate's limit, requests in flight and
//! latencies every 100 ms.
//!
//! Everything runs on one thread with the clock paused: the figures are the
//! same on every run.

use std::cell::{Cell, RefCell};
use std::convert::Infallible;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use rand::{rngs::StdRng, Rng, SeedableRng};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};
use tower_admission::concurrency::{AdaptiveLimit, AdaptiveLimitLayer};
use tower_resilience_adaptive::{Aimd, ConcurrencyAlgorithm, Gradient2, Vegas};

const BASE: Duration = Duration::from_millis(20);
const CAPACITY: usize = 100;
const FLOOR: usize = 1;
const CEILING: usize = 1000;
const RUN: Duration = Duration::from_secs(60);
const HALVE_AT: Duration = Duration::from_secs(20);
const RETURN_AT: Duration = Duration::from_secs(40);
const STEADY_FROM: Duration = Duration::from_secs(5);
const BUCKET: Duration = Duration::from_millis(100);
const SEED: u64 = 0x5eed;

/// Capacity at `t` since the start.
fn capacity_at(t: Duration) -> usize {
    if t >= HALVE_AT && t < RETURN_AT {
        CAPACITY / 2
    } else {
        CAPACITY
    }
}

/// The simulated dependency: jobs with work left (in ms at full rate).
struct Dependency {
    jobs: RefCell<Vec<(f64, oneshot::Sender<()>)>>,
    /// Each job's work is the base latency times a uniform factor in
    /// `1 ± jitter`.
    jitter: f64,
    rng: RefCell<StdRng>,
}

impl Dependency {
    fn new(jitter: f64) -> Self {
        Dependency {
            jobs: RefCell::default(),
            jitter,
            rng: RefCell::new(StdRng::seed_from_u64(SEED + 1)),
        }
    }

    fn submit(&self) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let factor = if self.jitter > 0.0 {
            1.0 + self.jitter * (2.0 * self.rng.borrow_mut().random::<f64>() - 1.0)
        } else {
            1.0
        };
        self.jobs
            .borrow_mut()
            .push((BASE.as_secs_f64() * 1000.0 * factor, tx));
        rx
    }

    /// One ms of processor sharing at `capacity` units of work per ms, at
    /// most 1 per job: shared equally, and what a finishing job leaves goes
    /// to the others (water-filling, shortest first), so no capacity is lost
    /// to the ticks.
    fn tick(&self, capacity: usize) {
        let mut jobs = self.jobs.borrow_mut();
        if jobs.is_empty() {
            return;
        }
        jobs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut left = capacity as f64;
        let n = jobs.len();
        for (i, job) in jobs.iter_mut().enumerate() {
            let share = (left / (n - i) as f64).min(1.0);
            let work = job.0.min(share);
            job.0 -= work;
            left -= work;
        }
        let mut i = 0;
        while i < jobs.len() {
            if jobs[i].0 <= 1e-9 {
                let (_, tx) = jobs.remove(i);
                let _ = tx.send(());
            } else {
                i += 1;
            }
        }
    }
}

/// Completions: (time since start, latency).
#[derive(Default)]
struct Record {
    done: Vec<(Duration, Duration)>,
    refused: usize,
}

/// A limiter's name and how to build a fresh one.
type Named = (&'static str, fn() -> Limiter);

enum Limiter {
    Ours(AdaptiveLimitLayer<()>),
    Anchor(Arc<dyn ConcurrencyAlgorithm>),
}

struct Row {
    name: &'static str,
    goodput: f64,
    p50: Duration,
    p99: Duration,
    follow_halving: Option<Duration>,
    follow_return: Option<Duration>,
    refused: f64,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[rank]
}

async fn simulate(name: &'static str, limiter: Limiter, jitter: f64) -> Row {
    let dep = Rc::new(Dependency::new(jitter));
    let record = Rc::new(RefCell::new(Record::default()));
    let start = Instant::now();
    let in_flight = Rc::new(Cell::new(0usize));

    let ticker = {
        let dep = Rc::clone(&dep);
        tokio::task::spawn_local(async move {
            let mut at = start;
            loop {
                at += Duration::from_millis(1);
                tokio::time::sleep_until(at).await;
                dep.tick(capacity_at(at - start));
            }
        })
    };

    let ours = match &limiter {
        Limiter::Ours(layer) => {
            let dep = Rc::clone(&dep);
            // The simulated dependency is single-threaded: hand its receiver
            // to a `Send` future through a channel per call.
            let (calls_tx, mut calls_rx) =
                tokio::sync::mpsc::unbounded_channel::<oneshot::Sender<oneshot::Receiver<()>>>();
            tokio::task::spawn_local(async move {
                while let Some(reply) = calls_rx.recv().await {
                    let _ = reply.send(dep.submit());
                }
            });
            let svc = tower::service_fn(move |()| {
                let calls_tx = calls_tx.clone();
                async move {
                    let (tx, rx) = oneshot::channel();
                    let _ = calls_tx.send(tx);
                    let done = rx.await.expect("dependency gone");
                    let _ = done.await;
                    Ok::<_, Infallible>(())
                }
            });
            Some(layer.layer(svc))
        }
        Limiter::Anchor(_) => None,
    };

    if let (Limiter::Ours(layer), Ok(_)) = (&limiter, std::env::var("SIM_TRACE")) {
        let layer = layer.clone();
        tokio::task::spawn_local(async move {
            let mut at = start;
            loop {
                at += BUCKET;
                tokio::time::sleep_until(at).await;
                let s = layer.stats();
                eprintln!(
                    "{:>6.1} s limit {:>4} in flight {:>4} latency {:?} baseline {:?}",
                    (at - start).as_secs_f64(),
                    s.limit.unwrap_or(0),
                    s.global_in_flight,
                    s.latency,
                    s.baseline_latency
                );
            }
        });
    }
    let mut rng = StdRng::seed_from_u64(SEED);
    let rate_per_s = 2.0 * CAPACITY as f64 / BASE.as_secs_f64();
    let mut t = 0.0f64;
    loop {
        let u: f64 = rng.random::<f64>();
        t += -(1.0 - u).ln() / rate_per_s;
        let offset = Duration::from_secs_f64(t);
        if offset >= RUN {
            break;
        }
        tokio::time::sleep_until(start + offset).await;
        let arrived = Instant::now();
        let record = Rc::clone(&record);
        match (&limiter, &ours) {
            (Limiter::Ours(_), Some(svc)) => {
                let mut svc = svc.clone();
                tokio::task::spawn_local(async move {
                    let ready = svc.ready().await.is_ok();
                    let result = if ready {
                        svc.call(()).await.is_ok()
                    } else {
                        false
                    };
                    let now = Instant::now();
                    let mut r = record.borrow_mut();
                    if result {
                        r.done.push((now - start, now - arrived));
                    } else {
                        r.refused += 1;
                    }
                });
            }
            (Limiter::Anchor(algo), _) => {
                if in_flight.get() >= algo.limit() {
                    record.borrow_mut().refused += 1;
                    continue;
                }
                in_flight.set(in_flight.get() + 1);
                let algo = Arc::clone(algo);
                let in_flight = Rc::clone(&in_flight);
                let done = dep.submit();
                tokio::task::spawn_local(async move {
                    let _ = done.await;
                    let now = Instant::now();
                    let latency = now - arrived;
                    algo.record_success_with_load(latency, in_flight.get());
                    in_flight.set(in_flight.get() - 1);
                    record.borrow_mut().done.push((now - start, latency));
                });
            }
            _ => unreachable!(),
        }
    }
    // Let the last admitted requests finish.
    tokio::time::sleep(Duration::from_secs(2)).await;
    ticker.abort();
    let record = record.borrow();
    summarise(name, &record)
}

fn summarise(name: &'static str, record: &Record) -> Row {
    let steady: Vec<Duration> = {
        let mut v: Vec<_> = record
            .done
            .iter()
            .filter(|(at, _)| *at >= STEADY_FROM && *at < HALVE_AT)
            .map(|(_, l)| *l)
            .collect();
        v.sort();
        v
    };
    let steady_secs = (HALVE_AT - STEADY_FROM).as_secs_f64();
    let capacity_per_s = CAPACITY as f64 / BASE.as_secs_f64();
    let goodput = steady.len() as f64 / steady_secs / capacity_per_s;

    // 100 ms buckets over the whole run.
    let buckets = (RUN.as_millis() / BUCKET.as_millis()) as usize;
    let mut per_bucket: Vec<Vec<Duration>> = vec![Vec::new(); buckets];
    for (at, latency) in &record.done {
        let i = (at.as_millis() / BUCKET.as_millis()) as usize;
        if i < buckets {
            per_bucket[i].push(*latency);
        }
    }
    // Per bucket: completions, expected completions at full capacity, and
    // whether its p99 is within 2 × base.
    let bucket: Vec<(f64, f64, bool)> = per_bucket
        .iter_mut()
        .enumerate()
        .map(|(i, lat)| {
            lat.sort();
            let at = BUCKET * i as u32;
            let expected = capacity_at(at) as f64 / BASE.as_secs_f64() * BUCKET.as_secs_f64();
            (
                lat.len() as f64,
                expected,
                percentile(lat, 0.99) <= 2 * BASE,
            )
        })
        .collect();
    // Followed from bucket i: over the next second, goodput ≥ 95 % of
    // capacity and every bucket's p99 within 2 × base.
    let run = (Duration::from_secs(1).as_millis() / BUCKET.as_millis()) as usize;
    let followed = |i: usize| {
        let span = &bucket[i..i + run];
        let done: f64 = span.iter().map(|b| b.0).sum();
        let expected: f64 = span.iter().map(|b| b.1).sum();
        done >= 0.95 * expected && span.iter().all(|b| b.2)
    };
    let follow = |from: Duration, until: Duration| -> Option<Duration> {
        let first = (from.as_millis() / BUCKET.as_millis()) as usize;
        let last = (until.as_millis() / BUCKET.as_millis()) as usize;
        (first..=last - run)
            .find(|&i| followed(i))
            .map(|i| BUCKET * (i - first) as u32)
    };
    let arrivals = record.done.len() + record.refused;
    Row {
        name,
        goodput,
        p50: percentile(&steady, 0.5),
        p99: percentile(&steady, 0.99),
        follow_halving: follow(HALVE_AT, RETURN_AT),
        follow_return: follow(RETURN_AT, RUN),
        refused: record.refused as f64 / arrivals as f64,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

fn follow(d: Option<Duration>) -> String {
    match d {
        Some(d) => format!("{:.1} s", d.as_secs_f64()),
        None => "not within 20 s".into(),
    }
}

fn run(name: &'static str, make: fn() -> Limiter, jitter: f64) -> Row {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, simulate(name, make(), jitter))
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let limiters: [Named; 5] = [
        ("tower-admission adaptive (gradient + AIMD)", || {
            let limit = AdaptiveLimit::default().bounds(FLOOR, CEILING);
            Limiter::Ours(
                AdaptiveLimitLayer::builder(limit)
                    .build()
                    .expect("valid limit"),
            )
        }),
        ("tower-admission adaptive, tolerance 0.05", || {
            let limit = AdaptiveLimit::default()
                .bounds(FLOOR, CEILING)
                .tolerance(0.05);
            Limiter::Ours(
                AdaptiveLimitLayer::builder(limit)
                    .build()
                    .expect("valid limit"),
            )
        }),
        ("tower-resilience-adaptive AIMD", || {
            Limiter::Anchor(Arc::new(
                Aimd::builder()
                    .min_limit(FLOOR)
                    .max_limit(CEILING)
                    .build()
                    .expect("valid AIMD"),
            ))
        }),
        ("tower-resilience-adaptive Vegas", || {
            Limiter::Anchor(Arc::new(
                Vegas::builder()
                    .min_limit(FLOOR)
                    .max_limit(CEILING)
                    .build()
                    .expect("valid Vegas"),
            ))
        }),
        ("tower-resilience-adaptive Gradient2", || {
            Limiter::Anchor(Arc::new(
                Gradient2::builder()
                    .min_limit(FLOOR)
                    .max_limit(CEILING)
                    .build()
                    .expect("valid Gradient2"),
            ))
        }),
    ];
    for jitter in [0.0, 0.25] {
        println!();
        println!(
            "C = {CAPACITY} at {} ms (each request's work × 1 ± {jitter}), arrivals 2 × C, floor {FLOOR}, ceiling {CEILING}; steady = 5-20 s",
            BASE.as_millis()
        );
        println!();
        table(&limiters, jitter);
    }
}

fn table(limiters: &[Named], jitter: f64) {
    println!("| limiter | goodput (share of C) | p50 ms | p99 ms | refused | follows C/2 | follows C again |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for &(name, make) in limiters {
        let row = run(name, make, jitter);
        println!(
            "| {} | {:.1} % | {} | {} | {:.1} % | {} | {} |",
            row.name,
            row.goodput * 100.0,
            ms(row.p50),
            ms(row.p99),
            row.refused * 100.0,
            follow(row.follow_halving),
            follow(row.follow_return),
        );
    }
}
