//! A tiny HTTP server for the over-the-socket load comparison in
//! `benches/wrk/run.sh`: `GET /` answers `ok` behind one of five stacks.
//!
//! ```text
//! cargo run --release --example bench_server -- --mode quota --listen 127.0.0.1:8080
//! wrk -t1 -c50 -d10s http://127.0.0.1:8080/
//! ```
//!
//! Modes:
//!
//! - `bare`: plain axum;
//! - `governor`: axum + `tower_governor` with a global key and a huge quota;
//! - `quota`: axum + [`QuotaLayer`] over a [`MemoryStore`], [`aggregate`](tower_admission::quota::QuotaLayerBuilder::aggregate),
//!   a huge token bucket;
//! - `stack`: the whole inbound stack of the reporting API, defined once in
//!   `benches/common/inbound.rs` (included here): authenticate (API key
//!   `bench`, so requests need `Authorization: Bearer bench`), body limits,
//!   query validation (requests need `from`, `to` and `page_size`, as
//!   `benches/wrk/auth.lua` sends them), a per-user quota of a sliding log and
//!   a token bucket, an aggregate quota and concurrency caps, all in a
//!   [`MemoryStore`];
//! - `stack-1` to `stack-5`: the in-memory stack cut after its first N
//!   layers, for the cost of each layer;
//! - `stack-no-fields`: the in-memory stack whose per-user quota adds no
//!   `RateLimit` fields to admitted responses, for what those fields cost;
//! - `stack-redis`: the same stack with both quotas on a `RedisStore`
//!   (`--redis redis://127.0.0.1:PORT`; needs the `redis` feature). Each
//!   request makes one round trip per quota, two in all.
//!
//! `bench_server --redis-commands` prints, one line per quota, the
//! `EVALSHA` command (SHA, keys and arguments) that `stack-redis` sends to
//! Redis for every request, for `redis-benchmark` to run as the Redis
//! ceiling; `benches/wrk/run.sh` does that.
//!
//! Every quota and cap admits every request at the load the script offers, so
//! this measures the admitted path, which every served request pays.
//!
//! The server runs a multi-thread tokio runtime with **one** worker thread, so
//! that on a 2-core machine the load generator (wrk, one thread) gets the
//! other core. Every mode runs on the same runtime and the same listener code.

#[allow(dead_code)]
#[path = "../benches/common/inbound.rs"]
mod inbound;

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;

use axum::Router;
use tower_admission::quota::{MemoryStore, Quota, QuotaLayer};
use tower_admission::ConfigError;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::GlobalKeyExtractor;
use tower_governor::GovernorLayer;

use inbound::{base, huge_bucket};

const MODES: &str =
    "bare, governor, quota, stack, stack-1 to stack-5, stack-no-fields, or stack-redis";

/// Which stack serves `GET /`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Bare,
    Governor,
    Quota,
    Stack,
    /// The stack's first N layers, N in 1 to 5.
    FirstLayers(usize),
    /// The stack without `RateLimit` fields on admitted responses.
    StackNoFields,
    StackRedis,
}

impl Mode {
    fn parse(value: &str) -> Result<Mode, String> {
        match value {
            "bare" => Ok(Mode::Bare),
            "governor" => Ok(Mode::Governor),
            "quota" => Ok(Mode::Quota),
            "stack" => Ok(Mode::Stack),
            "stack-redis" => Ok(Mode::StackRedis),
            "stack-no-fields" => Ok(Mode::StackNoFields),
            other => match other.strip_prefix("stack-").and_then(|n| n.parse().ok()) {
                Some(n @ 1..=5) => Ok(Mode::FirstLayers(n)),
                _ => Err(format!("--mode {other:?}: expected {MODES}")),
            },
        }
    }
}

#[derive(Debug)]
struct Args {
    mode: Mode,
    listen: SocketAddr,
    redis: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut mode = None;
    let mut redis = None;
    let mut listen: SocketAddr = "127.0.0.1:8080".parse().map_err(|e| format!("{e}"))?;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--redis-commands" => {
                print_redis_commands();
                std::process::exit(0);
            }
            "--mode" => {
                let value = args.next().ok_or_else(|| format!("--mode needs {MODES}"))?;
                mode = Some(Mode::parse(&value)?);
            }
            "--listen" => {
                let value = args
                    .next()
                    .ok_or("--listen needs an address, e.g. 127.0.0.1:8080")?;
                listen = value
                    .parse()
                    .map_err(|e| format!("--listen {value:?}: {e}"))?;
            }
            "--redis" => {
                redis = Some(
                    args.next()
                        .ok_or("--redis needs a URL, e.g. redis://127.0.0.1:6390/")?,
                );
            }
            "-h" | "--help" => {
                println!(
                    "usage: bench_server --mode bare|governor|quota|stack|stack-1..stack-5|stack-no-fields|stack-redis [--listen ADDR] [--redis URL]\n       bench_server --redis-commands"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    let mode = mode.ok_or_else(|| format!("--mode is required: {MODES}"))?;
    if (mode == Mode::StackRedis) != redis.is_some() {
        return Err("--redis URL goes with --mode stack-redis, and only with it".to_owned());
    }
    Ok(Args {
        mode,
        listen,
        redis,
    })
}

/// The stack on Redis. Built inside the runtime: the store's connection
/// manager spawns its tasks there.
#[cfg(feature = "redis")]
fn redis_stack(url: &str) -> Result<Router, ConfigError> {
    let store = tower_admission::quota::RedisStore::builder(url)
        .prefix("bench")
        .build()?;
    inbound::whole_stack(store)
}

/// Prints the `EVALSHA` command of each quota of the stack, as
/// `stack-redis` sends it for the user `alice` (the identity of the API key).
#[cfg(feature = "redis")]
fn print_redis_commands() {
    use tower_admission::quota::RedisStore;
    let built = RedisStore::builder("redis://127.0.0.1:1/")
        .prefix("bench")
        .build()
        .and_then(|store| {
            let quotas = [
                (inbound::per_user_quota()?, "alice"),
                (inbound::aggregate_quota()?, "*"),
            ];
            Ok((store, quotas))
        });
    let (store, quotas) = match built {
        Ok(built) => built,
        Err(e) => {
            eprintln!("bench_server: {e}");
            std::process::exit(2);
        }
    };
    for (quota, key) in quotas {
        let mut keys = store.keys(&quota, key);
        keys.extend(store.expiry_key(&quota, key));
        let mut words = vec!["EVALSHA".to_owned(), store.script_sha().to_owned()];
        words.push(keys.len().to_string());
        words.extend(keys);
        words.extend(RedisStore::decision_args(&quota, 1));
        println!("{}", words.join(" "));
    }
}

#[cfg(not(feature = "redis"))]
fn print_redis_commands() {
    eprintln!("bench_server: --redis-commands needs the redis feature");
    std::process::exit(2);
}

#[cfg(not(feature = "redis"))]
fn redis_stack(_url: &str) -> Result<Router, ConfigError> {
    Err(ConfigError::new(
        "mode",
        "stack-redis needs the redis feature: cargo build --release --features redis --example bench_server",
    ))
}

fn app(args: &Args) -> Result<Router, ConfigError> {
    let bucket = || Quota::new("bench", [huge_bucket("bucket")?]);
    Ok(match args.mode {
        Mode::Bare => base(),
        Mode::Governor => {
            let config = GovernorConfigBuilder::default()
                .per_nanosecond(1)
                .burst_size(NonZeroU32::MAX.get())
                .key_extractor(GlobalKeyExtractor)
                .finish()
                .ok_or_else(|| ConfigError::new("governor", "rejected the quota"))?;
            base().layer(GovernorLayer::new(Arc::new(config)))
        }
        Mode::Quota => base().layer(
            QuotaLayer::builder(MemoryStore::new())
                .quota(bucket()?)
                .aggregate()
                .build()?,
        ),
        Mode::Stack => inbound::whole_stack(MemoryStore::new())?,
        Mode::FirstLayers(n) => inbound::first_layers(MemoryStore::new(), n)?,
        Mode::StackNoFields => inbound::whole_stack_without_fields(MemoryStore::new())?,
        Mode::StackRedis => redis_stack(args.redis.as_deref().unwrap_or_default())?,
    })
}

fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("bench_server: {message}");
            std::process::exit(2);
        }
    };
    // One worker: wrk gets the other core of a 2-core machine.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench_server: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    runtime.block_on(async move {
        let app = match app(&args) {
            Ok(app) => app,
            Err(e) => {
                eprintln!("bench_server: bad configuration: {e}");
                std::process::exit(2);
            }
        };
        let listener = match tokio::net::TcpListener::bind(args.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("bench_server: cannot listen on {}: {e}", args.listen);
                std::process::exit(1);
            }
        };
        eprintln!(
            "bench_server: mode {:?} listening on {}",
            args.mode, args.listen
        );
        let service = app.into_make_service_with_connect_info::<SocketAddr>();
        if let Err(e) = axum::serve(listener, service).await {
            eprintln!("bench_server: server error: {e}");
            std::process::exit(1);
        }
    });
}
