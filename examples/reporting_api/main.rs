//! The sample reporting API: every layer of tower-admission on one service.
//!
//! ```text
//! cargo run --example reporting_api                       # in memory, 127.0.0.1:3000
//! cargo run --example reporting_api -- --listen 0.0.0.0:8080
//! ```
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
}

fn parse_args() -> Result<Args, String> {
    let mut listen: SocketAddr = "127.0.0.1:3000".parse().map_err(|e| format!("{e}"))?;
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
            "-h" | "--help" => {
                println!("usage: reporting_api [--listen ADDR]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(Args { listen })
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
    let store = MemoryStore::new();
    let _sweeper = store.spawn_sweeper(std::time::Duration::from_secs(30));
    let app = match app::app(store) {
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
    tracing::info!(addr = %args.listen, store = "memory", "reporting API listening; demo keys: demo-free, demo-pro, demo-globex");
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    if let Err(e) = axum::serve(listener, service).await {
        eprintln!("reporting_api: server error: {e}");
        std::process::exit(1);
    }
}
