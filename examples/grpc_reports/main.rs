//! The sample reporting service over gRPC: a tonic `reports.v1.Reports`
//! service behind the same admission layers as the HTTP reporting API.
//!
//! It needs the `tonic` feature:
//!
//! ```text
//! cargo run --example grpc_reports --features tonic                  # in memory, 127.0.0.1:50051
//! cargo run --example grpc_reports --features tonic -- --listen 127.0.0.1:50052
//! cargo run --example grpc_reports --features tonic,redis -- --redis redis://127.0.0.1:6379/
//! ```
//!
//! and, in another terminal, its own client: 25 immediate calls with the
//! free key, of which the burst of 20 is admitted and the rest are
//! `RESOURCE_EXHAUSTED` with the wait:
//!
//! ```text
//! cargo run --example grpc_reports --features tonic -- call --key demo-free --count 25
//! cargo run --example grpc_reports --features tonic -- call            # no key: UNAUTHENTICATED
//! ```
//!
//! `reports.proto` beside this file is the schema, for other clients:
//!
//! ```text
//! grpcurl -plaintext -proto examples/grpc_reports/reports.proto \
//!   -H 'authorization: Bearer demo-free' -d '{"page_size": 5}' \
//!   127.0.0.1:50051 reports.v1.Reports/ListReports
//! ```
//!
//! Demo keys: `demo-free` (alice, acme, free), `demo-pro` (bob, acme, pro),
//! `demo-globex` (carol, globex, free). Free is 100 calls per 60 s and
//! bursts of 20 refilled at 100 per minute; pro is ten times that.
//!
//! With `--redis URL` the quotas live in Redis and fail closed: while Redis
//! cannot answer, calls are `UNAVAILABLE` with `RetryInfo`.

mod client;
mod config;
mod proto;
mod server;

use std::net::SocketAddr;

use tonic_types::StatusExt;
use tower_admission::quota::MemoryStore;

enum Command {
    Serve {
        listen: SocketAddr,
        redis: Option<String>,
    },
    Call {
        url: String,
        key: Option<String>,
        count: u32,
    },
}

const USAGE: &str = "usage: grpc_reports [--listen ADDR] [--redis URL]\n       grpc_reports call [--url URL] [--key KEY] [--count N]";

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Command, String> {
    let mut listen: SocketAddr = config::DEFAULT_LISTEN.parse().map_err(|e| format!("{e}"))?;
    let mut redis = None;
    let mut call = false;
    let mut url = format!("http://{}", config::DEFAULT_LISTEN);
    let mut key = None;
    let mut count = 1;
    while let Some(arg) = args.next() {
        let mut value = |what: &str| args.next().ok_or(format!("{arg} needs {what}"));
        match arg.as_str() {
            "call" => call = true,
            "--listen" => {
                let v = value("an address, e.g. 127.0.0.1:50051")?;
                listen = v.parse().map_err(|e| format!("--listen {v:?}: {e}"))?;
            }
            "--redis" => redis = Some(value("a URL, e.g. redis://127.0.0.1:6379/")?),
            "--url" => url = value("a URL, e.g. http://127.0.0.1:50051")?,
            "--key" => key = Some(value("an API key, e.g. demo-free")?),
            "--count" => {
                let v = value("a number of calls")?;
                count = v.parse().map_err(|e| format!("--count {v:?}: {e}"))?;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(if call {
        Command::Call { url, key, count }
    } else {
        Command::Serve { listen, redis }
    })
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_admission=debug".into()),
        )
        .init();
    let result = match parse_args(std::env::args().skip(1)) {
        Ok(Command::Serve { listen, redis }) => serve(listen, redis).await,
        Ok(Command::Call { url, key, count }) => call(url, key, count).await,
        Err(message) => {
            eprintln!("grpc_reports: {message}");
            std::process::exit(2);
        }
    };
    if let Err(e) = result {
        eprintln!("grpc_reports: {e}");
        std::process::exit(1);
    }
}

async fn serve(listen: SocketAddr, redis: Option<String>) -> Result<(), server::Error> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    println!("reports.v1.Reports listening on {listen}; demo keys:");
    for k in &config::shared().keys {
        println!(
            "  authorization: Bearer {:<12} -> {}, {}, {}",
            k.key, k.subject, k.tenant, k.plan
        );
    }
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    match redis {
        None => {
            let store = MemoryStore::new();
            // Reclaim idle keys; the sweeper stops when the store is dropped.
            store.spawn_sweeper(std::time::Duration::from_secs(30));
            server::serve(store, listener, shutdown).await
        }
        Some(url) => serve_redis(&url, listener, shutdown).await,
    }
}

#[cfg(feature = "redis")]
async fn serve_redis(
    url: &str,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), server::Error> {
    let store = tower_admission::quota::RedisStore::builder(url)
        .prefix("grpc-reports")
        .build()?;
    server::serve(store, listener, shutdown).await
}

#[cfg(not(feature = "redis"))]
async fn serve_redis(
    _url: &str,
    _listener: tokio::net::TcpListener,
    _shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), server::Error> {
    Err("this build has no Redis support; run with `--features tonic,redis`".into())
}

/// Makes `count` immediate calls and prints what each got.
async fn call(url: String, key: Option<String>, count: u32) -> Result<(), server::Error> {
    let mut client = client::ReportsClient::connect(url).await?;
    if let Some(key) = &key {
        client = client.with_key(key)?;
    }
    for i in 1..=count {
        let request = proto::ListReportsRequest {
            page_size: 5,
            metric: String::new(),
        };
        match client.list_reports(request).await {
            Ok(response) => {
                let response = response.into_inner();
                println!(
                    "{i:>3} OK {} reports for {}",
                    response.reports.len(),
                    response.subject
                );
            }
            Err(status) => println!("{i:>3} {}", describe(&status)),
        }
    }
    Ok(())
}

/// A refusal's code, message and advice in one line.
fn describe(status: &tonic::Status) -> String {
    let mut line = format!("{:?}: {}", status.code(), status.message());
    let details = status.get_error_details();
    if let Some(delay) = details.retry_info().and_then(|r| r.retry_delay) {
        line += &format!("; RetryInfo {} s", delay.as_secs_f64());
    }
    if let Some(failure) = details.quota_failure() {
        let names: Vec<&str> = failure
            .violations
            .iter()
            .map(|v| v.subject.as_str())
            .collect();
        line += &format!("; QuotaFailure {}", names.join(", "));
    }
    if let Some(ms) = status.metadata().get("grpc-retry-pushback-ms") {
        line += &format!("; grpc-retry-pushback-ms {}", ms.to_str().unwrap_or("?"));
    }
    line
}
