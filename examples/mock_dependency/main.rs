//! A counting stand-in for a shared external service: the dependency that a
//! fleet of API instances must never overrun.
//!
//! ```text
//! cargo run --example mock_dependency      # 127.0.0.1:3300, limit 300/s, 5 ms, unlimited capacity
//! cargo run --example mock_dependency -- --listen ADDR --limit N --latency-ms MS [--capacity C] [--fail-every K]
//! ```
//!
//! Every path except the control paths below is an *arrival*, counted the
//! moment it arrives and answered when its work, `--latency-ms`, is done:
//!
//! - 429 with `Retry-After: 1` when the arrivals in the last second, the window
//!   `(t - 1 s, t]` with this one included, exceed `--limit`;
//! - otherwise, with `--fail-every K` (K > 0), 503 for every K-th accepted arrival;
//! - otherwise 200 with `{"ok":true}`.
//!
//! `--capacity C` (0, the default, is unlimited) is how many arrivals are
//! served at full speed at once. Above it they share it equally (processor
//! sharing, exact at every arrival and departure): with n in flight each
//! progresses at `C / n` of full speed, so n arrivals together each take
//! `latency × n / C`. Refused arrivals take their share too.
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
//! | `p50_ms`, `p99_ms` | latency percentiles (nearest rank) of the answered arrivals, every status, in whole ms rounded down; `null` before the first answer |
//!
//! The percentiles come from a fixed histogram of 1 ms buckets up to 10 s
//! plus one overflow bucket (reported as the largest latency seen), so memory
//! stays the same however long the mock runs.
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
//! clears everything, the series and the latencies included, and answers 204.
//!
//! `GET /config` shows the settings, `{"limit":300,"latency_ms":5,"capacity":0,"fail_every":0}`,
//! and `POST /config` with a JSON object of any of them changes them at once
//! (204). A new `limit` applies from the next arrival on, against the
//! arrivals already in the last second: lowered below what the window holds,
//! it refuses every arrival until enough have left it. A new `latency_ms` is
//! the work of later arrivals only; a new `capacity` changes the speed of
//! those in flight too. An unknown field or a bad value changes nothing and is
//! answered 400 `application/problem+json` naming each refused field.
//!
//! ```text
//! curl -s localhost:3300/v1/anything
//! curl -s localhost:3300/stats
//! curl -s localhost:3300/stats/series
//! curl -s -X POST -o /dev/null -w '%{http_code}\n' localhost:3300/stats/reset
//! curl -s localhost:3300/config
//! curl -s -X POST -d '{"limit":150,"capacity":8}' -o /dev/null -w '%{http_code}\n' localhost:3300/config
//! ```
//!
//! A bad flag or value exits with status 2 and names the flag. Ctrl-C stops the
//! server gracefully and prints the final stats.

// By path, so that `mock.rs` is a module root as it is in the targets that
// include it: its modules are the files beside it.
#[path = "mock.rs"]
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
    println!(
        "mock_dependency listening on http://{addr} (settings {})",
        mock::config::to_json(&config)
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
