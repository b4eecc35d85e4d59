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
//! Every item of a batch makes two calls to a shared dependency, through a
//! budget of 240 attempts per second: 200/s for first attempts, 40/s for
//! retries of 429 and 5xx answers.
//!
//! | flag | meaning |
//! |---|---|
//! | `--config PATH` | every other knob, as in `reporting.toml` beside this file (the built-in default) |
//! | `--listen ADDR` | default 127.0.0.1:3000 |
//! | `--redis URL` | quotas in Redis, and the dependency budget as one rate lease shared by the fleet |
//! | `--budget-redis URL` | the lease in another Redis (default: the `--redis` one) |
//! | `--dependency-url URL` | the dependency; without it a mock serves in this process |
//! | `--instance-id ID` | with `--redis`, this instance's name in the lease table (default random) |
//! | `--expected-instances N` | with `--redis`, the largest fleet: while the lease's Redis cannot be reached, each instance spends 240/N per second (default 40) |
//! | `--region NAME` | with `--redis`, run as one region of several (see `regions.rs`) |
//! | `--region-redis NAME=URL` | once per region: that region's own Redis |
//! | `--region-share NAME=N` | once per region: its initial allocation; the shares sum to 240 |
//!
//! SIGHUP, or a change of the `--config` file (also by atomic rename or a
//! swapped symlink), reloads it: quotas, caps and the in-memory budget
//! change at once, a bad file keeps the running configuration (see
//! `reload.rs`).
//!
//! `--help` prints the same. SIGINT or SIGTERM stops taking connections; the
//! requests in flight finish and the accepted jobs drain within
//! `shutdown.limit` of the signal (exit 0), or the process exits 1 at it;
//! with `--redis`, the fleet's rate lease is then released, so this
//! instance's share of the dependency's budget returns at once. A
//! second signal exits at once. A connection that has not sent a whole
//! request head within `server.header_read_timeout` (10 s) is closed. A bad
//! command line or configuration exits 2.
//!
//! Try it:
//!
//! ```text
//! curl -i localhost:3000/healthz
//! curl -s localhost:3000/metrics      # Prometheus text format, no key needed
//! curl -i -H 'Authorization: Bearer demo-free' 'localhost:3000/v1/reports?page_size=10'
//! for i in $(seq 25); do curl -s -o /dev/null -w '%{http_code} ' -H 'Authorization: Bearer demo-free' localhost:3000/v1/reports; done
//! ```

mod app;
mod args;
mod config;
mod data;
mod dependency;
mod metrics;
#[path = "../mock_dependency/mock.rs"]
mod mock;
mod overload;
mod regions;
mod reload;
mod serve;

use std::net::SocketAddr;

use args::{Args, HELP, USAGE};
use config::Config;
use dependency::Dependency;
use tower_admission::quota::MemoryStore;

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_admission=debug".into()),
        )
        .init();
    let args = match args::parse(std::env::args().skip(1)) {
        Ok(None) => {
            println!("{HELP}");
            std::process::exit(0);
        }
        Ok(Some(args)) => args,
        Err(message) => {
            eprintln!("reporting_api: {message}\n{USAGE}");
            std::process::exit(2);
        }
    };
    let config = match &args.config {
        None => Config::builtin(),
        Some(path) => match Config::load(path) {
            Ok(config) => config,
            Err(message) => {
                eprintln!("reporting_api: bad configuration: {message}");
                std::process::exit(2);
            }
        },
    };
    let dependency_url = match &args.dependency_url {
        Some(url) => url.clone(),
        None => match start_mock().await {
            Ok(url) => url,
            Err(e) => {
                eprintln!("reporting_api: cannot start the in-process mock dependency: {e}");
                std::process::exit(1);
            }
        },
    };
    let exporter = match metrics::Exporter::install() {
        Ok(exporter) => exporter,
        Err(e) => {
            eprintln!("reporting_api: cannot install the Prometheus recorder: {e}");
            std::process::exit(1);
        }
    };
    // The command line wins over the file's `server` table.
    let listen = match (args.listen_given, config.server.listen) {
        (false, Some(listen)) => listen,
        _ => args.listen,
    };
    let redis = args.redis.clone().or(config.server.redis.clone());
    let app = match &redis {
        None => memory_app(&config, &dependency_url, exporter),
        Some(url) => redis_app(&config, url, &args, &dependency_url, exporter),
    };
    let app = match app {
        Ok(app) => app,
        Err(e) => {
            eprintln!("reporting_api: bad configuration: {e}");
            std::process::exit(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("reporting_api: cannot listen on {listen}: {e}");
            std::process::exit(1);
        }
    };
    // The address bound, which differs from `--listen` for port 0.
    let addr = listener.local_addr().unwrap_or(listen);
    let mut app = app;
    match (&args.config, app.reload.take()) {
        (Some(path), Some(handles)) => {
            let fixed = reload::Fixed {
                listen: addr,
                redis: redis.clone(),
                started: config.clone(),
            };
            reload::Reloader::new(path.clone(), handles, fixed).spawn();
        }
        _ => tracing::info!("no --config file: SIGHUP reloads nothing"),
    }
    let store = if redis.is_some() { "redis" } else { "memory" };
    tracing::info!(
        %addr,
        store,
        dependency = %dependency_url,
        "reporting API listening"
    );
    print_banner(&config, addr);
    // After the signal no connection is taken, requests in flight finish
    // and accepted jobs drain, all within `shutdown.limit` of the signal.
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let mut stopping = stop_rx.clone();
    let server = serve::serve(
        listener,
        app.router.clone(),
        config.server.header_read_timeout.0,
        async move {
            let _ = stopping.wait_for(|stop| *stop).await;
        },
    );
    let mut server = std::pin::pin!(server);
    let limit = config.shutdown.limit.0;
    let deadline = tokio::select! {
        () = &mut server => {
            // The server stopped on its own: a signal that every connection
            // had already answered by the time it was seen.
            tokio::time::Instant::now() + limit
        }
        _ = stop_rx.wait_for(|stop| *stop) => {
            let deadline = tokio::time::Instant::now() + limit;
            if tokio::time::timeout_at(deadline, &mut server).await.is_err() {
                tracing::warn!(
                    ?limit,
                    "requests still in flight at the shutdown limit; exiting"
                );
                std::process::exit(1);
            }
            deadline
        }
    };
    tracing::info!("stopped taking requests; draining accepted jobs");
    if tokio::time::timeout_at(deadline, app.drain())
        .await
        .is_err()
    {
        tracing::warn!(?limit, "jobs still running at the shutdown limit; exiting");
        std::process::exit(1);
    }
    if let Some(release) = app.release.take() {
        if tokio::time::timeout_at(deadline, release).await.is_err() {
            tracing::warn!(?limit, "rate lease not released by the shutdown limit");
        }
    }
    tracing::info!("all accepted jobs finished; bye");
}

/// The first SIGINT (Ctrl-C) or SIGTERM starts the graceful shutdown. Once
/// Tokio listens for them they no longer end the process, so a second one
/// ends it at once, without waiting for requests or jobs.
async fn shutdown_signal() {
    signal().await;
    tracing::info!(
        "shutdown signal received; finishing in-flight requests (a second signal exits at once)"
    );
    tokio::spawn(async {
        signal().await;
        tracing::warn!("second shutdown signal; exiting without waiting");
        std::process::exit(1);
    });
}

/// SIGINT (Ctrl-C) or SIGTERM.
async fn signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

/// The demo keys and three requests to try.
fn print_banner(config: &Config, listen: SocketAddr) {
    println!("reporting API on http://{listen}");
    println!("demo keys:");
    for k in &config.keys {
        println!(
            "  {:<12} user {}, tenant {}, plan {}",
            k.key, k.subject, k.tenant, k.plan
        );
    }
    let item = r#"{"metric":"latency","from":"2026-01-01T00:00:00Z","to":"2026-01-02T00:00:00Z"}"#;
    println!("try:");
    println!(
        "  curl -i -H 'Authorization: Bearer demo-free' 'http://{listen}/v1/reports?page_size=10'"
    );
    println!(
        "  for i in $(seq 25); do curl -s -o /dev/null -w '%{{http_code}} ' -H 'Authorization: Bearer demo-free' 'http://{listen}/v1/reports?page_size=1'; done; echo"
    );
    println!(
        "  curl -i -H 'Authorization: Bearer demo-pro' -H 'content-type: application/json' -d '{{\"items\":[{item},{item}]}}' http://{listen}/v1/reports/batch"
    );
}

/// Serves the mock dependency on a free loopback port, in this process.
async fn start_mock() -> std::io::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let (router, _stats) = mock::router(mock::MockConfig::default());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(%e, "the in-process mock dependency stopped");
        }
    });
    Ok(url)
}

fn memory_app(
    config: &Config,
    dependency_url: &str,
    exporter: metrics::Exporter,
) -> Result<app::Api, tower_admission::ConfigError> {
    let store = MemoryStore::new();
    // Reclaim idle keys; the sweeper stops when the store is dropped.
    store.spawn_sweeper(std::time::Duration::from_secs(30));
    let budget = dependency::memory_budget(&config.dependency)?;
    let exporter = exporter
        .memory_store("quotas", &store)
        .memory_store("dependency-budget", budget.limiter().store());
    let budget_reload = budget.reload_handle();
    let dependency = Dependency::new(
        dependency_url,
        budget,
        &config.dependency,
        config.batch.active_items,
    )?;
    let mut api = app::app(config, store, dependency)?;
    if let Some(handles) = &mut api.reload {
        handles.budget = Some(reload::Budget::Memory(budget_reload));
    }
    api.router = api.router.merge(exporter.router());
    Ok(api)
}

/// Quotas in Redis at `url`; the dependency budget is one rate lease on
/// 240/s for the whole fleet, in `--budget-redis` (default: the same Redis).
#[cfg(feature = "redis")]
fn redis_app(
    config: &Config,
    url: &str,
    args: &Args,
    dependency_url: &str,
    exporter: metrics::Exporter,
) -> Result<app::Api, tower_admission::ConfigError> {
    use tower_admission::outbound::{LeaseStore, LeasedBudget, Rate, RateLease};
    let store = tower_admission::quota::RedisStore::builder(url)
        .prefix("reporting-api")
        .build()?;
    let leases = LeaseStore::new(
        args.budget_redis.as_deref().unwrap_or(url),
        "reporting-api",
        std::time::Duration::from_millis(100),
    )?;
    let settings = &config.dependency;
    let total = settings.normal_per_second + settings.retry_per_second;
    let lease = if let Some(region) = &args.regions.name {
        regions::region_lease(
            &args.regions,
            region,
            total,
            args.instance_id.as_deref(),
            args.expected_instances,
        )?
    } else {
        let mut lease = RateLease::builder(
            leases,
            "dependency",
            Rate::per_second(total),
            args.expected_instances,
        );
        if let Some(id) = &args.instance_id {
            lease = lease.instance_id(id);
        }
        let lease = lease.build()?;
        // Runs for the life of the process.
        drop(lease.spawn_refresher());
        lease
    };
    let releasing = lease.clone();
    let budget = LeasedBudget::new(lease, Rate::per_second(settings.retry_per_second))?;
    let budget_reload = budget.reload_handle();
    let dependency = Dependency::new_with(
        dependency_url,
        budget,
        settings,
        config.batch.active_items,
        args.pushback,
    )?;
    // Redis keys expire on their own; no key count is read from Redis.
    let mut api = app::app(config, store, dependency)?;
    if let Some(handles) = &mut api.reload {
        handles.budget = Some(reload::Budget::Leased(budget_reload));
    }
    api.release = Some(Box::pin(async move {
        match releasing.release().await {
            Ok(()) => tracing::info!("rate lease released: its share returns to the fleet at once"),
            Err(e) => tracing::warn!(
                error = %e,
                "rate lease not released; its share returns when its grants expire"
            ),
        }
    }));
    api.router = api.router.merge(exporter.router());
    Ok(api)
}

#[cfg(not(feature = "redis"))]
fn redis_app(
    _config: &Config,
    _url: &str,
    _args: &Args,
    _dependency_url: &str,
    _exporter: metrics::Exporter,
) -> Result<app::Api, tower_admission::ConfigError> {
    Err(tower_admission::ConfigError::new(
        "--redis",
        "this build has no Redis support; run with `cargo run --example reporting_api --features redis -- --redis URL`",
    ))
}
