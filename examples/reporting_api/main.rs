//! The sample reporting API: every layer of tower-admission on one service.
//!
//! ```text
//! cargo run --example reporting_api                       # in memory, 127.0.0.1:3000
//! cargo run --example reporting_api -- --listen 0.0.0.0:8080
//! cargo run --example reporting_api --features redis -- --redis redis://127.0.0.1:6379/
//! ```
//!
//! With `--redis URL` every quota lives in Redis, shared by every instance
//! started with the same URL; without it everything stays in memory.
//!
//! Try it:
//!
//! ```text
//! curl -i localhost:3000/healthz
//! curl -i -H 'Authorization: Bearer demo-free' 'localhost:3000/v1/reports?page_size=10'
//! for i in $(seq 25); do curl -s -o /dev/null -w '%{http_code} ' -H 'Authorization: Bearer demo-free' localhost:3000/v1/reports; done
//! ```

mod app;
mod config;
mod data;

use std::net::SocketAddr;

use tower_admission::quota::MemoryStore;

struct Args {
    listen: SocketAddr,
    redis: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut listen: SocketAddr = "127.0.0.1:3000".parse().map_err(|e| format!("{e}"))?;
    let mut redis = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => {
                let value = args
                    .next()
                    .ok_or("--listen needs an address, e.g. 127.0.0.1:3000")?;
                listen = value
                    .parse()
                    .map_err(|e| format!("--listen {value:?}: {e}"))?;
            }
            "--redis" => {
                redis = Some(
                    args.next()
                        .ok_or("--redis needs a URL, e.g. redis://127.0.0.1:6379/")?,
                );
            }
            "-h" | "--help" => {
                println!("usage: reporting_api [--listen ADDR] [--redis URL]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(Args { listen, redis })
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_admission=debug".into()),
        )
        .init();
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("reporting_api: {message}");
            std::process::exit(2);
        }
    };
    let (app, store_name) = match &args.redis {
        None => {
            let store = MemoryStore::new();
            // Reclaim idle keys; the sweeper stops when the store is dropped.
            store.spawn_sweeper(std::time::Duration::from_secs(30));
            (app::app(store), "memory")
        }
        Some(url) => (redis_app(url), "redis"),
    };
    let app = match app {
        Ok(app) => app,
        Err(e) => {
            eprintln!("reporting_api: bad configuration: {e}");
            std::process::exit(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("reporting_api: cannot listen on {}: {e}", args.listen);
            std::process::exit(1);
        }
    };
    tracing::info!(addr = %args.listen, store = store_name, "reporting API listening; demo keys: demo-free, demo-pro, demo-globex");
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    if let Err(e) = axum::serve(listener, service).await {
        eprintln!("reporting_api: server error: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "redis")]
fn redis_app(url: &str) -> Result<axum::Router, tower_admission::ConfigError> {
    let store = tower_admission::quota::RedisStore::builder(url)
        .prefix("reporting-api")
        .build()?;
    app::app(store)
}

#[cfg(not(feature = "redis"))]
fn redis_app(_url: &str) -> Result<axum::Router, tower_admission::ConfigError> {
    Err(tower_admission::ConfigError::new(
        "--redis",
        "this build has no Redis support; run with `cargo run --example reporting_api --features redis -- --redis URL`",
    ))
}
