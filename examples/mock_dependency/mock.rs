//! The mock dependency's router and shared state.
//!
//! It is one module tree rooted in this file, so other targets can mount the
//! same mock in-process:
//!
//! ```text
//! #[path = "../mock_dependency/mock.rs"]
//! mod mock_dependency;
//!
//! let (router, handle) = mock_dependency::router(mock_dependency::MockConfig::default());
//! ```
//!
//! Every request to a path other than the control paths (`/stats`,
//! `/stats/series`, `/stats/reset`, `/config`) is an *arrival*, counted at the
//! moment it arrives, before the latency. The mock keeps the arrivals of the
//! last second, the window `(t - 1 s, t]` including the one at `t`. An arrival
//! that makes that count exceed the limit is refused with 429 and
//! `Retry-After: 1`. Refused arrivals stay in the log, so the limit bounds
//! arrivals, as a real dependency sees them, and not only the requests it
//! accepted. With `fail_every = K`, every K-th accepted arrival answers 503.
//! The others answer 200 with `{"ok":true}`.
//!
//! Every arrival, refused or not, brings the configured latency as work and is
//! answered when that work is done. Up to `capacity` arrivals in flight are
//! served at full speed; above it they share the capacity (processor
//! sharing, see `capacity.rs`), so n in flight each progress at `capacity / n`
//! of full speed. The arrivals are also counted per whole second since start
//! or the last reset (the last [`SERIES_SECONDS`] seconds are kept), for
//! `GET /stats/series`, and the answered latencies feed the percentiles of
//! `GET /stats` (see `stats.rs`).
//!
//! `POST /config` changes any setting at once (see [`router`]).
//!
//! Time is tokio's [`Instant`], so tests can drive it with `tokio::time::pause`.
//!
//! Files: `args.rs` the command line, `config.rs` the settings,
//! `arrivals.rs` the limit, the series and the counts, `capacity.rs` the
//! sharing model, `stats.rs` the reports and the latency histogram.

// Each target that includes this file uses a different part of it.
#![allow(
    dead_code,
    unused_imports,
    reason = "included by several targets via #[path]"
)]

mod args;
mod arrivals;
pub(crate) mod capacity;
pub(crate) mod config;
pub(crate) mod stats;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

pub(crate) use args::{parse_args, ArgError, Command, DEFAULT_LISTEN, USAGE};
use arrivals::{Arrivals, Outcome};
use capacity::{Nanos, Sharing, Ticket};
pub(crate) use config::MockConfig;
use stats::Latencies;
pub(crate) use stats::{Series, Stats};

/// The length of the window the limit applies to.
pub(crate) const WINDOW: Duration = Duration::from_secs(1);

/// How many seconds of arrivals per second `GET /stats/series` keeps: the
/// last hour.
pub(crate) const SERIES_SECONDS: u64 = 3_600;

/// Reads and clears the counters of a mounted mock, and reads its settings.
/// Clones share the same mock.
#[derive(Debug, Clone)]
pub(crate) struct MockHandle {
    shared: Arc<Shared>,
}

impl MockHandle {
    /// The counters now; the same numbers as `GET /stats`.
    pub(crate) fn stats(&self) -> Stats {
        self.shared.state.lock().stats()
    }

    /// Arrivals per second until now; the same numbers as `GET /stats/series`.
    pub(crate) fn series(&self) -> Series {
        self.shared.state.lock().arrivals.series(Instant::now())
    }

    /// Clears the counters, the arrival log and the latencies, as
    /// `POST /stats/reset` does.
    ///
    /// Requests still in flight stay counted as in flight, so they are released
    /// correctly, but `max_concurrent` starts again from 0.
    pub(crate) fn reset(&self) {
        self.shared.state.lock().reset(Instant::now());
    }

    /// The settings now; the same as `GET /config`.
    pub(crate) fn config(&self) -> MockConfig {
        self.shared.state.lock().config
    }
}

/// Builds the mock's router and a handle on its counters.
///
/// Routes:
///
/// - `GET /stats`, `GET /stats/series`, `POST /stats/reset` (204);
/// - `GET /config`: every setting as a JSON object
///   (`{"limit":300,"latency_ms":5,"capacity":0,"fail_every":0}`);
/// - `POST /config` with a JSON object of any of those settings: changes them
///   at once and answers 204. A new `limit` applies from the next arrival on,
///   against the arrivals already in the window `(t - 1 s, t]`, so lowering it
///   below what the window holds refuses every arrival until enough have left
///   it. A new `latency_ms` is the work of the arrivals from then on; those in
///   flight keep theirs. A new `capacity` changes the speed of those in flight
///   too, from that instant. A new `fail_every` K fails the accepted arrivals
///   whose count since start or the last reset is a multiple of K. An unknown
///   setting or a bad value changes nothing and answers 400
///   `application/problem+json` naming each refused field in `errors`;
/// - every other path and method: an arrival.
pub(crate) fn router(config: MockConfig) -> (Router, MockHandle) {
    let now = Instant::now();
    let shared = Arc::new(Shared {
        origin: now,
        state: Mutex::new(MockState {
            config,
            arrivals: Arrivals::new(now),
            sharing: Sharing::new(config.capacity, 0),
            latencies: Latencies::default(),
        }),
        sped_up: Notify::new(),
    });
    let router = Router::new()
        .route("/stats", get(stats))
        .route("/stats/series", get(series))
        .route("/stats/reset", post(reset))
        .route("/config", get(get_config).post(post_config))
        .fallback(arrival)
        .with_state(shared.clone());
    (router, MockHandle { shared })
}

#[derive(Debug)]
struct Shared {
    /// The instant the sharing model counts its nanoseconds from.
    origin: Instant,
    state: Mutex<MockState>,
    /// Wakes the arrivals in flight when they may be done sooner than they
    /// planned: the capacity changed or one of them left before it was done.
    sped_up: Notify,
}

#[derive(Debug)]
struct MockState {
    config: MockConfig,
    arrivals: Arrivals,
    sharing: Sharing,
    latencies: Latencies,
}

impl MockState {
    fn stats(&self) -> Stats {
        Stats {
            p50_ms: self.latencies.percentile(50),
            p99_ms: self.latencies.percentile(99),
            ..self.arrivals.counts()
        }
    }

    fn reset(&mut self, now: Instant) {
        self.arrivals.reset(now);
        self.latencies = Latencies::default();
    }
}

impl Shared {
    fn nanos(&self, at: Instant) -> Nanos {
        Nanos::try_from(at.duration_since(self.origin).as_nanos()).unwrap_or(Nanos::MAX)
    }

    fn instant(&self, nanos: Nanos) -> Instant {
        self.origin + Duration::from_nanos(nanos)
    }

    /// Records one arrival now and decides its answer.
    ///
    /// The clock is read under the lock, so the log is in time order.
    fn arrive(self: &Arc<Self>) -> (Outcome, InFlight) {
        let mut s = self.state.lock();
        let now = Instant::now();
        let (limit, fail_every, latency) = (s.config.limit, s.config.fail_every, s.config.latency);
        let outcome = s.arrivals.arrive(now, limit, fail_every);
        let work = Nanos::try_from(latency.as_nanos()).unwrap_or(Nanos::MAX);
        let ticket = s.sharing.arrive(work, self.nanos(now));
        drop(s);
        let in_flight = InFlight {
            shared: self.clone(),
            ticket,
            arrived: now,
            done: false,
        };
        (outcome, in_flight)
    }
}

/// One arrival in flight, from its arrival until it is answered or dropped.
struct InFlight {
    shared: Arc<Shared>,
    ticket: Ticket,
    arrived: Instant,
    done: bool,
}

impl InFlight {
    /// Waits until the sharing model has done this arrival's work, then
    /// records its latency.
    async fn served(&mut self) {
        let shared = self.shared.clone();
        loop {
            let sped_up = shared.sped_up.notified();
            let mut sped_up = std::pin::pin!(sped_up);
            sped_up.as_mut().enable();
            let done_at = {
                let mut s = shared.state.lock();
                let now = Instant::now();
                s.sharing.advance(shared.nanos(now));
                if s.sharing.is_done(self.ticket) {
                    s.latencies.record(now.duration_since(self.arrived));
                    self.done = true;
                    return;
                }
                s.sharing.done_at(self.ticket)
            };
            // Arrivals meanwhile only delay it: it then wakes early and
            // plans again. What speeds it up wakes it through `sped_up`.
            tokio::select! {
                () = tokio::time::sleep_until(shared.instant(done_at)) => {}
                () = sped_up => {}
            }
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut s = self.shared.state.lock();
        s.arrivals.leave();
        if !self.done {
            let now = self.shared.nanos(Instant::now());
            let sped_up = s.sharing.cancel(self.ticket, now);
            drop(s);
            if sped_up {
                self.shared.sped_up.notify_waiters();
            }
        }
    }
}

async fn arrival(State(shared): State<Arc<Shared>>) -> Response {
    let (outcome, mut in_flight) = shared.arrive();
    in_flight.served().await;
    match outcome {
        Outcome::Ok => (StatusCode::OK, Json(serde_json::json!({ "ok": true }))).into_response(),
        Outcome::Rejected => (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, HeaderValue::from_static("1"))],
            Json(serde_json::json!({ "ok": false, "error": "over the limit" })),
        )
            .into_response(),
        Outcome::Failed => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "ok": false, "error": "injected failure" })),
        )
            .into_response(),
    }
}

async fn stats(State(shared): State<Arc<Shared>>) -> Json<Stats> {
    Json(shared.state.lock().stats())
}

async fn series(State(shared): State<Arc<Shared>>) -> Json<Series> {
    Json(shared.state.lock().arrivals.series(Instant::now()))
}

async fn reset(State(shared): State<Arc<Shared>>) -> StatusCode {
    shared.state.lock().reset(Instant::now());
    StatusCode::NO_CONTENT
}

async fn get_config(State(shared): State<Arc<Shared>>) -> Json<serde_json::Value> {
    Json(config::to_json(&shared.state.lock().config))
}

async fn post_config(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let mut s = shared.state.lock();
    let next = match config::patch(&s.config, &body) {
        Ok(next) => next,
        Err(e) => {
            drop(s);
            let mut response = (StatusCode::BAD_REQUEST, Json(e.problem())).into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            );
            return response;
        }
    };
    let capacity_changed = next.capacity != s.config.capacity;
    if capacity_changed {
        let now = shared.nanos(Instant::now());
        s.sharing.set_capacity(next.capacity, now);
    }
    s.config = next;
    drop(s);
    if capacity_changed {
        shared.sped_up.notify_waiters();
    }
    StatusCode::NO_CONTENT.into_response()
}
