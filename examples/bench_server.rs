//! A tiny HTTP server for the over-the-socket load comparison in
//! `benches/wrk/run.sh`: `GET /` answers `ok` behind one of four stacks.
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
//! - `quota`: axum + [`QuotaLayer`] over a [`MemoryStore`], [`Scope::Aggregate`],
//!   a huge token bucket;
//! - `stack`: the full inbound stack of the reporting API: authenticate
//!   (API key `bench`, so requests need `Authorization: Bearer bench`), body
//!   limits, query validation, per-user quota, aggregate quota and
//!   concurrency caps.
//!
//! Every quota and cap admits every request at the load the script offers, so
//! this measures the admitted path, which every served request pays.
//!
//! The server runs a multi-thread tokio runtime with **one** worker thread, so
//! that on a 2-core machine the load generator (wrk, one thread) gets the
//! other core. Every mode runs on the same runtime and the same listener code.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use tower::ServiceBuilder;
use tower_admission::bounds::{BodyLimitsLayer, QueryRules, ValidateQueryLayer};
use tower_admission::concurrency::ConcurrencyLayer;
use tower_admission::identity::{ApiKeys, AuthenticateLayer, Identity};
use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer, Scope};
use tower_admission::ConfigError;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::GlobalKeyExtractor;
use tower_governor::GovernorLayer;

/// Which stack serves `GET /`.
#[derive(Debug, Clone, Copy)]
enum Mode {
    Bare,
    Governor,
    Quota,
    Stack,
}

impl Mode {
    fn parse(value: &str) -> Result<Mode, String> {
        match value {
            "bare" => Ok(Mode::Bare),
            "governor" => Ok(Mode::Governor),
            "quota" => Ok(Mode::Quota),
            "stack" => Ok(Mode::Stack),
            other => Err(format!(
                "--mode {other:?}: expected bare, governor, quota or stack"
            )),
        }
    }
}

#[derive(Debug)]
struct Args {
    mode: Mode,
    listen: SocketAddr,
}

fn parse_args() -> Result<Args, String> {
    let mut mode = None;
    let mut listen: SocketAddr = "127.0.0.1:8080".parse().map_err(|e| format!("{e}"))?;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--mode" => {
                let value = args
                    .next()
                    .ok_or("--mode needs bare, governor, quota or stack")?;
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
            "-h" | "--help" => {
                println!("usage: bench_server --mode bare|governor|quota|stack [--listen ADDR]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    let mode = mode.ok_or("--mode is required: bare, governor, quota or stack")?;
    Ok(Args { mode, listen })
}

fn base() -> Router {
    Router::new().route("/", get(|| async { "ok" }))
}

/// A token bucket that never runs dry at any load one machine can offer:
/// a burst of 10^9 refilled at 10^6 per second.
fn huge_bucket() -> Result<Quota, ConfigError> {
    Quota::new(
        "bench",
        [Policy::token_bucket(
            "bucket",
            1_000_000_000,
            1_000_000,
            Duration::from_secs(1),
        )?],
    )
}

fn app(mode: Mode) -> Result<Router, ConfigError> {
    Ok(match mode {
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
                .quota(huge_bucket()?)
                .scope(Scope::Aggregate)
                .build()?,
        ),
        Mode::Stack => {
            let store = MemoryStore::new();
            let keys = ApiKeys::new().with_key("bench", Identity::new("bench", "bench", "free"));
            let per_user = QuotaLayer::builder(store.clone())
                .quota(huge_bucket()?)
                .build()?;
            let aggregate = QuotaLayer::builder(store)
                .quota(huge_bucket()?)
                .scope(Scope::Aggregate)
                .build()?;
            let concurrency = ConcurrencyLayer::builder()
                .global(1024, 1024, Duration::from_secs(1))
                .per_identity(1024, 0, Duration::from_secs(1))
                .build()?;
            let rules = QueryRules::builder().build()?;
            base().layer(
                ServiceBuilder::new()
                    .layer(AuthenticateLayer::new(keys))
                    .layer(BodyLimitsLayer::new(1 << 20, 8 << 20))
                    .layer(ValidateQueryLayer::new(rules))
                    .layer(per_user)
                    .layer(aggregate)
                    .layer(concurrency),
            )
        }
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
    let app = match app(args.mode) {
        Ok(app) => app,
        Err(e) => {
            eprintln!("bench_server: bad configuration: {e}");
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
