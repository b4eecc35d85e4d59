//! The mock dependency's router, counters and argument parser.
//!
//! It is one module, so other targets can mount the same mock in-process:
//!
//! ```text
//! #[path = "../mock_dependency/mock.rs"]
//! mod mock_dependency;
//!
//! let (router, handle) = mock_dependency::router(mock_dependency::MockConfig::default());
//! ```
//!
//! Every request to a path other than `/stats`, `/stats/series` and
//! `/stats/reset` is an *arrival*,
//! counted at the moment it arrives, before the latency. The mock keeps the
//! arrivals of the last second, the window `(t - 1 s, t]` including the one at
//! `t`. An arrival that makes that count exceed the limit is refused with 429 and
//! `Retry-After: 1`. Refused arrivals stay in the log, so the limit bounds
//! arrivals, as a real dependency sees them, and not only the requests it
//! accepted. With `fail_every = K`, every K-th accepted arrival answers 503. The
//! others answer 200 with `{"ok":true}`. Every arrival, refused or not, answers
//! after the configured latency. The arrivals are also counted per whole second
//! since start or the last reset (the last [`SERIES_SECONDS`] seconds are kept),
//! for `GET /stats/series`.
//!
//! Time is tokio's [`Instant`], so tests can drive it with `tokio::time::pause`.

// Each target that includes this file uses a different part of it.
#![allow(dead_code, reason = "included by several targets via #[path]")]

use std::collections::VecDeque;
use std::fmt;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use parking_lot::Mutex;
use serde::Serialize;
use tokio::time::Instant;

/// The length of the window the limit applies to.
pub(crate) const WINDOW: Duration = Duration::from_secs(1);

/// How many seconds of arrivals per second `GET /stats/series` keeps: the
/// last hour.
pub(crate) const SERIES_SECONDS: u64 = 3_600;

/// How the mock behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MockConfig {
    /// The most arrivals allowed in any 1 s window; the one over it gets 429.
    pub(crate) limit: NonZeroU32,
    /// How long every arrival waits before it is answered.
    pub(crate) latency: Duration,
    /// Every K-th accepted arrival answers 503; `None` never fails.
    pub(crate) fail_every: Option<NonZeroU64>,
}

impl Default for MockConfig {
    /// Limit 300 per second, 5 ms latency, no injected failures.
    fn default() -> Self {
        Self {
            limit: NonZeroU32::new(300).expect("300 is not zero"),
            latency: Duration::from_millis(5),
            fail_every: None,
        }
    }
}

/// What `GET /stats` reports. Every field counts since start or the last reset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Stats {
    /// Arrivals: every request to a path other than `/stats`, refused ones included.
    pub(crate) total: u64,
    /// The most arrivals, refused ones included, in any window `(t - 1 s, t]`.
    pub(crate) max_in_any_1s: u64,
    /// The most arrivals in flight (arrived, not yet answered) at once.
    pub(crate) max_concurrent: u64,
    /// Arrivals answered 429 because the window was over the limit.
    pub(crate) rejected: u64,
    /// Accepted arrivals answered 503 by `fail_every`.
    pub(crate) failed: u64,
}

/// What `GET /stats/series` reports: arrivals per whole second since start or
/// the last reset.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Series {
    /// The second `arrivals[0]` counts, in whole seconds since start or the
    /// last reset: 0 until more than [`SERIES_SECONDS`] have passed.
    pub(crate) first_second: u64,
    /// `arrivals[i]`: the arrivals, refused ones included, in the second
    /// `[first_second + i, first_second + i + 1)`. The last entry is the
    /// second in progress.
    pub(crate) arrivals: Vec<u64>,
}

/// Reads and clears the counters of a mounted mock. Clones share the same counters.
#[derive(Debug, Clone)]
pub(crate) struct MockHandle {
    shared: Arc<Shared>,
}

impl MockHandle {
    /// The counters now; the same numbers as `GET /stats`.
    pub(crate) fn stats(&self) -> Stats {
        self.shared.counters.lock().stats
    }

    /// Arrivals per second until now; the same numbers as `GET /stats/series`.
    pub(crate) fn series(&self) -> Series {
        self.shared.counters.lock().series(Instant::now())
    }

    /// Clears the counters and the arrival log, as `POST /stats/reset` does.
    ///
    /// Requests still in flight stay counted as in flight, so they are released
    /// correctly, but `max_concurrent` starts again from 0.
    pub(crate) fn reset(&self) {
        self.shared.counters.lock().reset();
    }
}

/// Builds the mock's router and a handle on its counters.
///
/// Routes: `GET /stats`, `GET /stats/series`, `POST /stats/reset` (204), and
/// every other path and method as an arrival.
pub(crate) fn router(config: MockConfig) -> (Router, MockHandle) {
    let shared = Arc::new(Shared {
        config,
        counters: Mutex::new(Counters::new(Instant::now())),
    });
    let router = Router::new()
        .route("/stats", get(stats))
        .route("/stats/series", get(series))
        .route("/stats/reset", post(reset))
        .fallback(arrival)
        .with_state(shared.clone());
    (router, MockHandle { shared })
}

#[derive(Debug)]
struct Shared {
    config: MockConfig,
    counters: Mutex<Counters>,
}

#[derive(Debug)]
struct Counters {
    stats: Stats,
    /// When the counters started: the start or the last reset.
    origin: Instant,
    /// Arrivals per whole second since `origin`, the oldest counting the
    /// second `series_first`; at most [`SERIES_SECONDS`] entries.
    series: VecDeque<u64>,
    series_first: u64,
    /// Arrivals of the last second, oldest first, equal instants merged into one count.
    window: VecDeque<(Instant, u64)>,
    /// The sum of the counts in `window`.
    in_window: u64,
    /// Accepted arrivals, for `fail_every`.
    accepted: u64,
    in_flight: u64,
}

impl Counters {
    fn new(origin: Instant) -> Self {
        Counters {
            stats: Stats::default(),
            origin,
            series: VecDeque::new(),
            series_first: 0,
            window: VecDeque::new(),
            in_window: 0,
            accepted: 0,
            in_flight: 0,
        }
    }

    fn reset(&mut self) {
        let in_flight = self.in_flight;
        *self = Self {
            in_flight,
            ..Self::new(Instant::now())
        };
    }

    /// Extends the series with zeros up to the second that holds `now`,
    /// dropping the oldest beyond [`SERIES_SECONDS`]; returns that second's
    /// index in `series`.
    fn series_to(&mut self, now: Instant) -> usize {
        let second = now.duration_since(self.origin).as_secs();
        let end = self.series_first + self.series.len() as u64;
        if second >= end {
            let mut missing = second + 1 - end;
            if missing > SERIES_SECONDS {
                self.series.clear();
                self.series_first = second + 1 - SERIES_SECONDS;
                missing = SERIES_SECONDS;
            }
            self.series.extend(std::iter::repeat_n(0, missing as usize));
            while self.series.len() as u64 > SERIES_SECONDS {
                self.series.pop_front();
                self.series_first += 1;
            }
        }
        // The clock is read under the lock, so `second` never goes back.
        (second.max(self.series_first) - self.series_first) as usize
    }

    fn series(&mut self, now: Instant) -> Series {
        self.series_to(now);
        Series {
            first_second: self.series_first,
            arrivals: self.series.iter().copied().collect(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    Rejected,
    Failed,
}

impl Shared {
    /// Records one arrival now and decides its answer.
    ///
    /// The clock is read under the lock, so the log is in time order. Each call
    /// pops what left the window and pushes at most one entry: O(1) amortized,
    /// with at most one entry per distinct instant of the last second.
    fn arrive(self: &Arc<Self>) -> (Outcome, InFlight) {
        let mut c = self.counters.lock();
        let now = Instant::now();
        while let Some(&(at, count)) = c.window.front() {
            if now.duration_since(at) < WINDOW {
                break;
            }
            c.window.pop_front();
            c.in_window -= count;
        }
        match c.window.back_mut() {
            Some((at, count)) if *at == now => *count += 1,
            _ => c.window.push_back((now, 1)),
        }
        c.in_window += 1;
        let second = c.series_to(now);
        c.series[second] += 1;
        c.stats.total += 1;
        c.stats.max_in_any_1s = c.stats.max_in_any_1s.max(c.in_window);
        c.in_flight += 1;
        c.stats.max_concurrent = c.stats.max_concurrent.max(c.in_flight);

        let outcome = if c.in_window > u64::from(self.config.limit.get()) {
            c.stats.rejected += 1;
            Outcome::Rejected
        } else {
            c.accepted += 1;
            match self.config.fail_every {
                Some(k) if c.accepted.is_multiple_of(k.get()) => {
                    c.stats.failed += 1;
                    Outcome::Failed
                }
                _ => Outcome::Ok,
            }
        };
        drop(c);
        (
            outcome,
            InFlight {
                shared: self.clone(),
            },
        )
    }
}

/// Counts one arrival as in flight until it is answered or dropped.
struct InFlight {
    shared: Arc<Shared>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut c = self.shared.counters.lock();
        c.in_flight = c.in_flight.saturating_sub(1);
    }
}

async fn arrival(State(shared): State<Arc<Shared>>) -> Response {
    let (outcome, _in_flight) = shared.arrive();
    if !shared.config.latency.is_zero() {
        tokio::time::sleep(shared.config.latency).await;
    }
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
    Json(shared.counters.lock().stats)
}

async fn series(State(shared): State<Arc<Shared>>) -> Json<Series> {
    Json(shared.counters.lock().series(Instant::now()))
}

async fn reset(State(shared): State<Arc<Shared>>) -> StatusCode {
    shared.counters.lock().reset();
    StatusCode::NO_CONTENT
}

/// The command line, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Command {
    /// Serve the mock on `listen`.
    Serve {
        /// Where to listen.
        listen: SocketAddr,
        /// How the mock behaves.
        config: MockConfig,
    },
    /// Print [`USAGE`] and exit.
    Help,
}

/// The default `--listen` address.
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:3300";

/// The usage line `--help` prints.
pub(crate) const USAGE: &str =
    "usage: mock_dependency [--listen ADDR] [--limit N] [--latency-ms MS] [--fail-every K]\n\
     defaults: --listen 127.0.0.1:3300 --limit 300 --latency-ms 5 --fail-every 0 (never)";

/// A refused command line: the flag at fault and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ArgError {
    /// The flag (or the unknown argument) at fault.
    pub(crate) flag: String,
    /// What is wrong with it.
    pub(crate) reason: String,
}

impl fmt::Display for ArgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.flag, self.reason)
    }
}

impl std::error::Error for ArgError {}

/// Parses the arguments after the program name. Each flag takes its value as
/// the next argument or after `=` (`--limit 50` or `--limit=50`).
pub(crate) fn parse_args<I>(args: I) -> Result<Command, ArgError>
where
    I: IntoIterator,
    I::Item: Into<String>,
{
    let mut listen: SocketAddr = DEFAULT_LISTEN.parse().expect("the default address parses");
    let mut config = MockConfig::default();
    let mut args = args.into_iter().map(Into::into);
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_owned(), Some(value.to_owned()))
            }
            _ => (arg, None),
        };
        let error = |reason: String| ArgError {
            flag: flag.clone(),
            reason,
        };
        let mut value = |example: &str| {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| error(format!("needs a value, e.g. {flag} {example}")))
        };
        match flag.as_str() {
            "--listen" => {
                let v = value("127.0.0.1:3300")?;
                listen = v.parse().map_err(|e| {
                    error(format!("{v:?} is not an address like 127.0.0.1:3300 ({e})"))
                })?;
            }
            "--limit" => {
                let v = value("300")?;
                config.limit = v.parse().map_err(|_| {
                    error(format!(
                        "{v:?} is not a whole number of arrivals per second from 1 to {}",
                        u32::MAX
                    ))
                })?;
            }
            "--latency-ms" => {
                let v = value("5")?;
                let ms: u64 = v.parse().map_err(|_| {
                    error(format!(
                        "{v:?} is not a whole number of milliseconds (0 or more)"
                    ))
                })?;
                config.latency = Duration::from_millis(ms);
            }
            "--fail-every" => {
                let v = value("3")?;
                let k: u64 = v.parse().map_err(|_| {
                    error(format!("{v:?} is not a whole number (0 = never fail, K = every K-th accepted arrival)"))
                })?;
                config.fail_every = NonZeroU64::new(k);
            }
            "-h" | "--help" => return Ok(Command::Help),
            _ => {
                return Err(ArgError {
                    flag,
                    reason: "unknown argument; try --help".to_owned(),
                })
            }
        }
    }
    Ok(Command::Serve { listen, config })
}
