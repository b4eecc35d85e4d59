//! A counting stand-in for a shared external service: the dependency that a
//! fleet of API instances must never overrun.
//!
//! ```text
//! cargo run --example mock_dependency                     # 127.0.0.1:3300, limit 300/s, 5 ms
//! cargo run --example mock_dependency -- --listen ADDR --limit N --latency-ms MS [--fail-every K]
//! ```
//!
//! Every path except `/stats`, `/stats/series` and `/stats/reset` is an
//! *arrival*, counted the moment it arrives and answered after `--latency-ms`:
//!
//! - 429 with `Retry-After: 1` when the arrivals in the last second, the window
//!   `(t - 1 s, t]` with this one included, exceed `--limit`;
//! - otherwise, with `--fail-every K` (K > 0), 503 for every K-th accepted arrival;
//! - otherwise 200 with `{"ok":true}`.
//!
//! `GET /stats` reports, since start or the last reset:
//!
//! | field | meaning |
//! |---|---|
//! | `total` | arrivals, refused ones included |
//! | `max_in_any_1s` | the most **arrivals** (refused ones included) in any 1 s window |
//! | `max_concurrent` | the most arrivals in flight (arrived, not yet answered) at once |
//! | `rejected` | arrivals answered 429 |
//! | `failed` | injected 503s |
//!
//! `max_in_any_1s` counts what reached the dependency, not what it accepted: a
//! fleet that kept within its budget shows `max_in_any_1s <= limit` and
//! `rejected == 0`.
//!
//! `GET /stats/series` reports the arrivals per whole second, since start or
//! the last reset too (the last hour of them):
//!
//! | field | meaning |
//! |---|---|
//! | `first_second` | the second `arrivals[0]` counts, in whole seconds since start or the last reset (0 for the first hour) |
//! | `arrivals` | `arrivals[i]`: the arrivals, refused ones included, in the second `[first_second + i, first_second + i + 1)`; the last entry is the second in progress |
//!
//! A second's count is never more than `max_in_any_1s`. `POST /stats/reset`
//! clears everything, the series included, and answers 204.
//!
//! ```text
//! curl -s localhost:3300/v1/anything
//! curl -s localhost:3300/stats
//! curl -s localhost:3300/stats/series
//! curl -s -X POST -o /dev/null -w '%{http_code}\n' localhost:3300/stats/reset
//! ```
//!
//! A bad flag or value exits with status 2 and names the flag. Ctrl-C stops the
//! server gracefully and prints the final stats.

mod mock;

use mock::Command;

#[tokio::main]
async fn main() {
    let (listen, config) = match mock::parse_args(std::env::args().skip(1)) {
        Ok(Command::Serve { listen, config }) => (listen, config),
        Ok(Command::Help) => {
            println!("{}", mock::USAGE);
            return;
        }
        Err(e) => {
            eprintln!("mock_dependency: {e}\n{}", mock::USAGE);
            std::process::exit(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("mock_dependency: cannot listen on {listen}: {e}");
            std::process::exit(1);
        }
    };
    let addr = listener.local_addr().unwrap_or(listen);
    let (app, handle) = mock::router(config);
    let fail_every = match config.fail_every {
        Some(k) => format!("{k}"),
        None => "never".to_owned(),
    };
    println!(
        "mock_dependency listening on http://{addr} (limit {}/s, latency {} ms, fail-every {fail_every})",
        config.limit,
        config.latency.as_millis(),
    );
    let shutdown = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            eprintln!("mock_dependency: cannot wait for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
    {
        eprintln!("mock_dependency: server error: {e}");
        std::process::exit(1);
    }
    match serde_json::to_string(&handle.stats()) {
        Ok(stats) => println!("mock_dependency stopped; stats {stats}"),
        Err(e) => eprintln!("mock_dependency: cannot print stats: {e}"),
    }
}
