//! The fleet simulation: 10 and then 40 separate `reporting_api` processes
//! share Redis and one dependency budget of 240 calls/s (200/s first
//! attempts + 40/s retries) in front of `mock_dependency --limit 300`, with
//! batches and injected failures that are retried.
//!
//! Everything runs in processes this test starts and kills on drop: two
//! `redis-server`s on free ports (one for the quotas, one for the budget's
//! rate leases, so that its `INFO commandstats` counts exactly the lease
//! calls), the mock dependency, and the instances. The load saturates every
//! instance: each always has one or two demo-pro batches of 20 items in
//! flight (closed loop), and demo-free batches of 4 items arrive open loop, round
//! robin.
//!
//! What is asserted, from the dependency's own counts (`GET /stats`) and
//! Redis's own counters:
//!
//! - the most arrivals in any 1 s stay within the rate-lease bound of
//!   `docs/leases.md`, `n + R·25 ms + R·1 s` for `n` instances (256 at 10,
//!   286 at 40), and at or below the dependency's 300; nothing is refused;
//! - the saturating load uses at least 90% of what the budget lets it use
//!   in the measured window: 200/s of first attempts plus the retries it
//!   needs, up to 40/s. That is 240/s only when retries fill their share;
//!   with 1 call in 20 failing (about 10 retries/s) it is about 210/s, since
//!   first attempts never borrow the idle retry share;
//! - every call is accounted for exactly: the dependency's `total` equals the
//!   sum of the `dependency.attempts` the answers report, and every 200
//!   answer made `2 × items + retries` attempts;
//! - the budget's Redis sees one lease call per instance per refresh
//!   period (at most one more per instance in the window);
//! - in the long form, the issue's targets: at least 90% of 240/s sent, and
//!   at most 0.05 budget Redis calls per admitted send. The short form, in
//!   debug on a shared CI machine, checks only 80% of what the load may use
//!   (its throughput is the machine's, not the budget's);
//! - with the budget's Redis killed, the arrivals stay within the fallback
//!   bounds of `docs/leases.md`, and the budget recovers when Redis is back,
//!   with the same instance processes.
//! - with `--pushback`, the fleet follows the dependency's limit down from
//!   300 to 150 per second and back (`pushback_follows_...`);
//! - under uneven demand (half the instances held back by their own
//!   free-plan quotas), with 10 or 40 instances and when 30 join or leave
//!   halfway, the arrivals stay within the bound and the budget is used
//!   again two lease lengths after the change (`uneven_demand_*`; the
//!   40-instance starts are long-form only).
//!
//! The short form runs in CI (about a minute in debug on 2 cores). The long
//! form measures `FLEET_SECONDS` per window (`scripts/fleet`;
//! `FLEET_FAIL_EVERY=K` changes the injected failures from 1 in 8;
//! `FLEET_TRACE=FILE` has the uneven runs write the lease table to FILE
//! every 0.5 s after the change):
//!
//! ```text
//! cargo build --release --all-features --examples
//! FLEET_SECONDS=60 cargo test --release --all-features --test fleet -- --nocapture --test-threads 1
//! ```
//!
//! Each saturated run also writes the dependency's arrivals per second
//! (`GET /stats/series`, from the load's start to the end of the measured
//! window) to `arrivals-10.csv` and `arrivals-40.csv` in `$FLEET_CSV_DIR`,
//! default `target/fleet`: columns `second,arrivals,measured`, `measured` 1
//! for the whole seconds inside the measured window. `scripts/plots --fleet`
//! draws them (`docs/img/fleet.png`).
//!
//! The examples must be built in the same profile as this test:
//! `cargo test --all-features` builds them; `cargo test --test fleet` alone
//! does not, and the test then fails with the command to run.
#![cfg(feature = "redis")]

mod support;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinSet;

use tower_admission::outbound::LeaseStore;

use support::process::{metrics_text, sample_sum};
use support::{client_command_calls, command_calls, free_port, RedisServer};

/// The dependency budget, calls per second, first attempts and retries.
const BUDGET: u64 = 240;
/// The retry share of the budget; first attempts have the rest (200/s).
const RETRY_SHARE: u64 = 40;
/// What the mock dependency allows in any 1 s.
const DEPENDENCY_LIMIT: u64 = 300;
/// Injected failures: every K-th accepted call answers 503 and is retried.
/// First attempts never take more than their 200/s, so a load uses 90% of
/// 240/s only if its retries use at least 16/s of theirs: 1 in 8 fails.
const FAIL_EVERY: u64 = 8;
/// The mock's latency per call.
const LATENCY_MS: u64 = 5;
/// Rate-lease defaults of the instances (docs/leases.md): lease length,
/// refresh period, burst and the largest cost of one attempt.
const LEASE: Duration = Duration::from_secs(5);
const REFRESH: Duration = Duration::from_secs(4);
const BURST_MS: u64 = 25;
const MAX_COST: u64 = 1;
/// The default of `--expected-instances`: the fallback capacity is R / N.
const EXPECTED_INSTANCES: u64 = 40;
/// Items per demo-pro batch; each makes 2 dependency calls.
const PRO_ITEMS: usize = 20;
/// demo-pro batches in flight fleet-wide (closed loop: each worker sends the
/// next batch when the answer comes), spread evenly over the instances, at
/// least one each: 2 per instance at 10 instances, 1 at 40. One batch is 5
/// items calling at once, so every instance always has attempts waiting on
/// its share of the budget, while the wait for the budget stays under the
/// instances' 2 s (5 waiters on 5/s first attempts at 40 instances).
/// Fleet-wide that is about 6-12 batches/s at saturation, within demo-pro's
/// 1,000 requests and 20,000 items per minute.
fn pro_in_flight(instances: usize) -> usize {
    (20 / instances).max(1)
}
/// Items per demo-free batch.
const FREE_ITEMS: usize = 4;
/// demo-free batches per second fleet-wide, open loop: 60 a minute, within
/// its 100 (burst 20) and 2,000 items.
const FREE_PER_SECOND: f64 = 1.0;

// ---------------------------------------------------------------------------
// The documented bounds (docs/leases.md), in whole send starts.
// ---------------------------------------------------------------------------

/// `n·c + τ·R + R·T`: send starts in any interval of `t_ms` with `n`
/// instances holding rate leases.
fn lease_bound(n: u64, t_ms: u64) -> u64 {
    n * MAX_COST + (BURST_MS * BUDGET + BUDGET * t_ms) / 1000
}

/// `n·K_f + n·(R/N)·T` with `K_f = max(c, τ·R/N)`: every grant expired, all
/// `n` instances on the fallback capacity `R/N`.
fn fallback_bound(n: u64, expected: u64, t_ms: u64) -> u64 {
    let k_f = MAX_COST.max(BURST_MS * BUDGET / expected / 1000);
    n * k_f + n * BUDGET * t_ms / expected / 1000
}

/// `n·c + τ·(R + k·R/N) + (R + k·R/N)·T`: some instances still hold
/// grants while `k` are on the fallback (the transition, and recovery).
fn transition_bound(n: u64, k: u64, expected: u64, t_ms: u64) -> u64 {
    // R + k·R/N, in thousandths of a call per second.
    let rate_milli = BUDGET * 1000 + k * BUDGET * 1000 / expected;
    n * MAX_COST + (rate_milli * BURST_MS + rate_milli * t_ms) / 1_000_000
}

// ---------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------

/// A child process with its output in a log file, killed on drop (also on
/// panic).
#[derive(Debug)]
struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &str, program: &Path, args: &[String], logs: &Path) -> Proc {
        let log = logs.join(format!("{name}.log"));
        let out = File::create(&log).expect("create log file");
        let err = out.try_clone().expect("clone log file");
        let child = Command::new(program)
            .args(args)
            .env("RUST_LOG", "warn,tower_admission=info")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
        Proc {
            name: name.to_owned(),
            child,
            log,
        }
    }

    /// Panics with the log's tail if the process has exited.
    fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "{} exited ({status}); its log ({}):\n{}",
                self.name,
                self.log.display(),
                self.log_tail()
            );
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `GET url` until it answers 200, a bounded number of times. False
/// if the process exited because its port was taken in the meantime (a
/// port from [`free_port`] is only free when it is picked); panics with the
/// process's log if it exited otherwise or never answers.
async fn wait_ready(client: &reqwest::Client, url: &str, proc: &mut Proc) -> bool {
    for _ in 0..1000 {
        if let Ok(Some(_)) = proc.child.try_wait() {
            if proc.log_tail().contains("Address already in use") {
                return false;
            }
            proc.assert_running();
        }
        let answer = client
            .get(url)
            .timeout(Duration::from_millis(500))
            .send()
            .await;
        if answer.is_ok_and(|r| r.status().is_success()) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "{} never answered {url}; its log:\n{}",
        proc.name,
        proc.log_tail()
    );
}

/// Starts `program` with `args(port)` on a free port and waits until `GET
/// path` answers, on another port if the first was taken meanwhile.
async fn start_on_free_port(
    client: &reqwest::Client,
    name: &str,
    program: &Path,
    args: impl Fn(u16) -> Vec<String>,
    path: &str,
    logs: &Path,
) -> (Proc, String) {
    for _ in 0..5 {
        let (mut proc, url) = spawn_on_free_port(name, program, &args, logs);
        if wait_ready(client, &format!("{url}{path}"), &mut proc).await {
            return (proc, url);
        }
    }
    panic!("{name}: no free port after 5 attempts");
}

fn spawn_on_free_port(
    name: &str,
    program: &Path,
    args: &impl Fn(u16) -> Vec<String>,
    logs: &Path,
) -> (Proc, String) {
    let port = free_port(false);
    let proc = Proc::spawn(name, program, &args(port), logs);
    (proc, format!("http://127.0.0.1:{port}"))
}

/// The mock's `GET /stats`.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
struct Stats {
    total: u64,
    max_in_any_1s: u64,
    max_concurrent: u64,
    rejected: u64,
    failed: u64,
}

/// Everything one simulation runs: the mock dependency, the quota and
/// budget Redis servers, and `n` instances.
struct Fleet {
    client: reqwest::Client,
    mock: Proc,
    mock_url: String,
    apis: Vec<Proc>,
    urls: Arc<Vec<String>>,
    quotas: RedisServer,
    budget: RedisServer,
    logs: PathBuf,
    tag: String,
    expected: u64,
    options: Options,
    api_bin: PathBuf,
}

/// What a simulation changes from the defaults.
#[derive(Debug, Clone, Copy, Default)]
struct Options {
    /// The instances follow the dependency's pushback (`--pushback`).
    pushback: bool,
    /// The mock's `--fail-every`, instead of `FLEET_FAIL_EVERY` or
    /// [`FAIL_EVERY`].
    fail_every: Option<u64>,
}

impl Fleet {
    /// Starts everything and waits until every process answers.
    async fn start(tag: &str, instances: usize, expected: u64) -> Fleet {
        Fleet::start_with(tag, instances, expected, Options::default()).await
    }

    /// [`start`](Self::start) with `options`.
    async fn start_with(tag: &str, instances: usize, expected: u64, options: Options) -> Fleet {
        let api_bin = support::process::example_binary("reporting_api");
        let mock_bin = support::process::example_binary("mock_dependency");
        let logs = std::env::current_exe()
            .expect("current exe")
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>")
            .join("fleet-logs")
            .join(tag);
        let _ = std::fs::remove_dir_all(&logs);
        std::fs::create_dir_all(&logs).expect("create log dir");

        let client = reqwest::Client::builder()
            // Longer than any answer can take: a request the client gave up
            // on would still make calls that no answer reports.
            .timeout(Duration::from_secs(120))
            .pool_max_idle_per_host(16)
            .build()
            .expect("http client");
        let quotas = RedisServer::start();
        let budget = RedisServer::start();

        let (mock, mock_url) = start_on_free_port(
            &client,
            "mock_dependency",
            &mock_bin,
            |port| {
                vec![
                    "--listen".into(),
                    format!("127.0.0.1:{port}"),
                    "--limit".into(),
                    DEPENDENCY_LIMIT.to_string(),
                    "--latency-ms".into(),
                    LATENCY_MS.to_string(),
                    "--fail-every".into(),
                    options.fail_every.map_or_else(
                        || std::env::var("FLEET_FAIL_EVERY").unwrap_or(FAIL_EVERY.to_string()),
                        |k| k.to_string(),
                    ),
                ]
            },
            "/stats",
            &logs,
        )
        .await;

        let mut fleet = Fleet {
            client,
            mock,
            mock_url,
            apis: Vec::new(),
            urls: Arc::new(Vec::new()),
            quotas,
            budget,
            logs,
            tag: tag.to_owned(),
            expected,
            options,
            api_bin,
        };
        fleet.add(instances).await;
        fleet
    }

    /// The arguments of instance `i`, given its port.
    fn api_args(&self, i: usize) -> impl Fn(u16) -> Vec<String> {
        let (quotas, budget, mock_url) =
            (self.quotas.url(), self.budget.url(), self.mock_url.clone());
        let id = format!("{}-{i}", self.tag);
        let (expected, pushback) = (self.expected, self.options.pushback);
        move |port: u16| {
            let mut args: Vec<String> = vec![
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--redis".into(),
                quotas.clone(),
                "--budget-redis".into(),
                budget.clone(),
                "--dependency-url".into(),
                mock_url.clone(),
                "--instance-id".into(),
                id.clone(),
                "--expected-instances".into(),
                expected.to_string(),
            ];
            if pushback {
                args.push("--pushback".into());
            }
            args
        }
    }

    /// Starts `count` more instances and waits until each answers.
    async fn add(&mut self, count: usize) {
        let first = self.apis.len();
        // All start at once; one whose port was taken starts again.
        let mut started: Vec<(Proc, String)> = (first..first + count)
            .map(|i| {
                spawn_on_free_port(
                    &format!("reporting_api-{i}"),
                    &self.api_bin,
                    &self.api_args(i),
                    &self.logs,
                )
            })
            .collect();
        for (k, (api, url)) in started.iter_mut().enumerate() {
            let i = first + k;
            if !wait_ready(&self.client, &format!("{url}/healthz"), api).await {
                let (again, again_url) = start_on_free_port(
                    &self.client,
                    &format!("reporting_api-{i}"),
                    &self.api_bin,
                    self.api_args(i),
                    "/healthz",
                    &self.logs,
                )
                .await;
                *api = again;
                *url = again_url;
            }
        }
        let mut urls = self.urls.to_vec();
        for (api, url) in started {
            self.apis.push(api);
            urls.push(url);
        }
        self.urls = Arc::new(urls);
    }

    /// Kills the last `count` instances (SIGKILL: their grants count until
    /// they expire).
    /// Stops the last `count` instances as a scale-down does: SIGTERM, then
    /// waits for each to exit (it drains, then releases its rate lease).
    async fn stop_last(&mut self, count: usize) {
        let keep = self.apis.len() - count;
        for api in &mut self.apis[keep..] {
            let pid = api.child.id().to_string();
            let sent = Command::new("kill").args(["-TERM", &pid]).status();
            assert!(sent.is_ok_and(|s| s.success()), "kill -TERM {pid}");
        }
        for api in &mut self.apis[keep..] {
            let mut exited = None;
            for _ in 0..600 {
                exited = api.child.try_wait().expect("try_wait");
                if exited.is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let status = exited
                .unwrap_or_else(|| panic!("{} did not exit within 30 s of SIGTERM", api.name));
            assert!(status.success(), "{} exited with {status}", api.name);
        }
        self.kill_last(count);
    }

    fn kill_last(&mut self, count: usize) {
        let keep = self.apis.len() - count;
        self.apis.truncate(keep);
        let mut urls = self.urls.to_vec();
        urls.truncate(keep);
        self.urls = Arc::new(urls);
    }

    async fn stats(&self) -> Stats {
        let url = format!("{}/stats", self.mock_url);
        let response = self.client.get(&url).send().await.expect("GET /stats");
        assert!(response.status().is_success(), "GET /stats");
        response.json().await.expect("stats JSON")
    }

    /// The mock's `GET /stats/series`: arrivals per whole second since the
    /// last reset, without the second in progress.
    async fn series(&self) -> Vec<u64> {
        #[derive(Deserialize)]
        struct Series {
            first_second: u64,
            arrivals: Vec<u64>,
        }
        let url = format!("{}/stats/series", self.mock_url);
        let response = self
            .client
            .get(&url)
            .send()
            .await
            .expect("GET /stats/series");
        assert!(response.status().is_success(), "GET /stats/series");
        let series: Series = response.json().await.expect("series JSON");
        assert_eq!(
            series.first_second, 0,
            "a run is shorter than the series' hour"
        );
        let mut arrivals = series.arrivals;
        arrivals.pop();
        arrivals
    }

    async fn reset_stats(&self) {
        let url = format!("{}/stats/reset", self.mock_url);
        let response = self.client.post(&url).send().await.expect("POST reset");
        assert_eq!(response.status(), 204, "POST /stats/reset");
    }

    /// Panics if any process has exited: the instances are never restarted.
    fn assert_all_running(&mut self) {
        self.mock.assert_running();
        for api in &mut self.apis {
            api.assert_running();
        }
    }

    fn pids(&self) -> Vec<u32> {
        self.apis.iter().map(Proc::pid).collect()
    }
}

/// Writes `arrivals` (per second since the load started) as
/// `arrivals-{n}.csv` in `$FLEET_CSV_DIR`, default `target/fleet`; the
/// seconds wholly inside `measured` (seconds since the load started) are
/// marked. Returns the path.
fn write_arrivals(n: usize, arrivals: &[u64], measured: std::ops::Range<f64>) -> PathBuf {
    let dir = std::env::var_os("FLEET_CSV_DIR").map_or_else(
        || {
            // target/<profile>/deps/fleet-HASH
            std::env::current_exe()
                .expect("current exe")
                .ancestors()
                .nth(3)
                .expect("the test binary lives in target/<profile>/deps")
                .join("fleet")
        },
        PathBuf::from,
    );
    std::fs::create_dir_all(&dir).expect("create the CSV dir");
    let mut csv = String::from("second,arrivals,measured\n");
    for (second, count) in arrivals.iter().enumerate() {
        let inside = measured.start <= second as f64 && (second + 1) as f64 <= measured.end;
        csv.push_str(&format!("{second},{count},{}\n", u8::from(inside)));
    }
    let path = dir.join(format!("arrivals-{n}.csv"));
    std::fs::write(&path, csv).expect("write the arrivals CSV");
    path
}

/// The rate leases on the budget Redis as its grant script counts them,
/// for the report: per budget key, the rates committed now, their sum and
/// the demands reported. (Reading them is one script call more, so it comes
/// after the calls are counted.)
async fn grant_summary(budget: &RedisServer) -> String {
    let keys = budget.cli(&["--scan", "--pattern", "*{lease:*}"]);
    let mut out = Vec::new();
    for key in keys.lines().filter(|k| !k.is_empty()) {
        let Some((prefix, name)) = key
            .split_once(":{lease:")
            .and_then(|(p, rest)| Some((p, rest.strip_suffix('}')?)))
        else {
            continue;
        };
        let store = LeaseStore::new(&budget.url(), prefix, Duration::from_millis(100))
            .expect("lease store");
        match (store.committed(name).await, store.peak(name).await) {
            (Ok(now), Ok(peak)) => out.push(format!("{key}: committed {now}, peak {peak}")),
            (Err(e), _) | (_, Err(e)) => out.push(format!("{key}: {e}")),
        }
    }
    if out.is_empty() {
        "none found".to_owned()
    } else {
        out.join("; ")
    }
}

// ---------------------------------------------------------------------------
// Load
// ---------------------------------------------------------------------------

/// Batches of `items` with API key `key`.
#[derive(Debug, Clone, Copy)]
struct Batches {
    key: &'static str,
    items: usize,
}

impl Batches {
    fn request(self, client: &reqwest::Client, url: &str) -> reqwest::RequestBuilder {
        let item = json!({
            "metric": "latency",
            "from": "2026-01-01T00:00:00Z",
            "to": "2026-01-02T00:00:00Z",
        });
        let body = serde_json::to_vec(&json!({ "items": vec![item; self.items] })).expect("body");
        client
            .post(format!("{url}/v1/reports/batch"))
            .header("authorization", format!("Bearer {}", self.key))
            .header("content-type", "application/json")
            .body(body)
    }
}

const PRO: Batches = Batches {
    key: "demo-pro",
    items: PRO_ITEMS,
};
const FREE: Batches = Batches {
    key: "demo-free",
    items: FREE_ITEMS,
};
/// The other free-plan key: its own quota, as small as demo-free's.
const GLOBEX: Batches = Batches {
    key: "demo-globex",
    items: FREE_ITEMS,
};

/// Sends one batch and reads its answer: status and JSON body.
async fn send(request: reqwest::RequestBuilder) -> Result<(u16, Value), String> {
    let response = request.send().await.map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let bytes = response.bytes().await.map_err(|e| e.to_string())?;
    Ok((
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    ))
}

/// What the answers reported.
#[derive(Debug, Default)]
struct Tally {
    /// Answers by status.
    statuses: BTreeMap<u16, u64>,
    /// Σ `dependency.attempts` and `dependency.retries` over every answer.
    attempts: u64,
    retries: u64,
    /// 200 answers: their items, attempts and retries.
    ok: u64,
    ok_items: u64,
    ok_attempts: u64,
    ok_retries: u64,
    /// 200 answers whose attempts are not `2 × items + retries`.
    ok_mismatches: Vec<String>,
    /// Answers with a `dependency` member that are not 200 (503: a call
    /// could not be made within the budget's wait, or failed every attempt).
    partial: u64,
    /// 429 from the API (a quota) and 503 from a layer (the concurrency
    /// queue), neither with a `dependency` member: no call was made.
    refused_429: u64,
    /// The 429s by batch size and the problem's detail.
    refusals: BTreeMap<String, u64>,
    shed_503: u64,
    /// Answers that cannot be accounted for: no `dependency` member on a
    /// status other than 429/503, or a transport error.
    unexplained: Vec<String>,
}

impl Tally {
    fn record(&mut self, items: usize, answer: Result<(u16, Value), String>) {
        let (status, body) = match answer {
            Ok(answer) => answer,
            Err(e) => {
                self.unexplained.push(format!("transport error: {e}"));
                return;
            }
        };
        *self.statuses.entry(status).or_default() += 1;
        let dependency = body.get("dependency").map(|d| {
            (
                d.get("attempts").and_then(Value::as_u64),
                d.get("retries").and_then(Value::as_u64),
            )
        });
        match dependency {
            Some((Some(attempts), Some(retries))) => {
                self.attempts += attempts;
                self.retries += retries;
                if status == 200 {
                    let items = items as u64;
                    self.ok += 1;
                    self.ok_items += items;
                    self.ok_attempts += attempts;
                    self.ok_retries += retries;
                    if attempts != 2 * items + retries {
                        self.ok_mismatches.push(format!(
                            "{items} items, attempts {attempts}, retries {retries}"
                        ));
                    }
                } else {
                    self.partial += 1;
                }
            }
            Some(_) => self
                .unexplained
                .push(format!("{status}: malformed dependency member: {body}")),
            None if status == 429 => {
                self.refused_429 += 1;
                let reason = format!(
                    "{} items: {}",
                    items,
                    body.get("detail")
                        .or(body.get("title"))
                        .unwrap_or(&Value::Null)
                );
                *self.refusals.entry(reason).or_default() += 1;
            }
            None if status == 503 => self.shed_503 += 1,
            None => self
                .unexplained
                .push(format!("{status} without a dependency member: {body}")),
        }
    }
}

/// The load: [`pro_in_flight`] closed-loop demo-pro workers per instance,
/// and demo-free batches open loop, round robin over the instances.
struct Load {
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
    tally: Arc<Mutex<Tally>>,
}

impl Load {
    fn start(fleet: &Fleet) -> Load {
        let (stop, _) = watch::channel(false);
        let tally = Arc::new(Mutex::new(Tally::default()));
        let mut tasks = JoinSet::new();
        for url in fleet.urls.iter() {
            for _ in 0..pro_in_flight(fleet.urls.len()) {
                tasks.spawn(closed_loop(
                    PRO,
                    fleet.client.clone(),
                    url.clone(),
                    stop.subscribe(),
                    tally.clone(),
                ));
            }
        }
        tasks.spawn(open_loop(
            FREE,
            FREE_PER_SECOND,
            fleet.client.clone(),
            fleet.urls.clone(),
            stop.subscribe(),
            tally.clone(),
        ));
        Load { stop, tasks, tally }
    }

    /// Uneven demand on the instances `range` of `fleet`: the even ones
    /// saturate (demo-pro batches, closed loop, [`pro_in_flight`] of the
    /// whole fleet each, at least one), the odd ones carry only free-plan
    /// batches (one a second each, open loop, demo-free and demo-globex in
    /// turn), which those keys' own quotas hold back.
    fn uneven(fleet: &Fleet, range: std::ops::Range<usize>, fleet_size: usize) -> Load {
        let (stop, _) = watch::channel(false);
        let tally = Arc::new(Mutex::new(Tally::default()));
        let mut tasks = JoinSet::new();
        for i in range {
            let url = fleet.urls[i].clone();
            if i % 2 == 0 {
                for _ in 0..pro_in_flight(fleet_size / 2).max(1) {
                    tasks.spawn(closed_loop(
                        PRO,
                        fleet.client.clone(),
                        url.clone(),
                        stop.subscribe(),
                        tally.clone(),
                    ));
                }
            } else {
                let key = if i % 4 == 1 { FREE } else { GLOBEX };
                tasks.spawn(open_loop(
                    key,
                    1.0,
                    fleet.client.clone(),
                    Arc::new(vec![url]),
                    stop.subscribe(),
                    tally.clone(),
                ));
            }
        }
        Load { stop, tasks, tally }
    }

    /// Stops sending and waits for every outstanding answer.
    async fn stop(mut self) -> Tally {
        self.stop.send_replace(true);
        while let Some(done) = self.tasks.join_next().await {
            done.expect("load task");
        }
        Arc::try_unwrap(self.tally)
            .expect("every load task finished")
            .into_inner()
            .expect("tally lock")
    }
}

/// One batch after another to `url` until stopped; after a 429 it waits the
/// `Retry-After` first.
async fn closed_loop(
    batches: Batches,
    client: reqwest::Client,
    url: String,
    stop: watch::Receiver<bool>,
    tally: Arc<Mutex<Tally>>,
) {
    while !*stop.borrow() {
        let answer = send(batches.request(&client, &url)).await;
        let refused = matches!(answer, Ok((429, _)));
        tally.lock().unwrap().record(batches.items, answer);
        if refused {
            let mut stop = stop.clone();
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.wait_for(|s| *s) => {}
            }
        }
    }
}

/// `per_second` batches, round robin over `urls`, until stopped; then waits
/// for their answers.
async fn open_loop(
    batches: Batches,
    per_second: f64,
    client: reqwest::Client,
    urls: Arc<Vec<String>>,
    mut stop: watch::Receiver<bool>,
    tally: Arc<Mutex<Tally>>,
) {
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / per_second));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut outstanding = JoinSet::new();
    for i in 0.. {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let request = batches.request(&client, &urls[i % urls.len()]);
        let tally = tally.clone();
        outstanding.spawn(async move {
            let answer = send(request).await;
            tally.lock().unwrap().record(batches.items, answer);
        });
    }
    while let Some(done) = outstanding.join_next().await {
        done.expect("request task");
    }
}

// ---------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------

/// Whether `FLEET_SECONDS` asks for the long form.
fn long_form() -> bool {
    std::env::var_os("FLEET_SECONDS").is_some()
}

/// Seconds per measured window: `FLEET_SECONDS`, default `short`.
fn window(short: u64) -> Duration {
    let secs = std::env::var("FLEET_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(short);
    Duration::from_secs(secs)
}

/// [`window`] rounded up to whole refresh periods: each instance then makes
/// the same number of refreshes in it wherever its phase falls, so the Redis
/// calls counted are not one period more or less than the rate.
fn refresh_periods(short: u64) -> Duration {
    let periods = window(short).as_secs().div_ceil(REFRESH.as_secs()).max(1);
    REFRESH * u32::try_from(periods).expect("a sane FLEET_SECONDS")
}

/// The simulations share the machine's two cores: one at a time.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// How long the leases take to settle on max-min fair shares before the
/// measured window: the first refresh, the first measured demand a quarter
/// period later, and one lease length for the older grants to run out.
const WARM_UP: Duration = Duration::from_secs(7);

/// What a saturating load may send per second: first attempts their 200/s,
/// retries what they need (`retry_rate`, the injected failures) of their
/// 40/s. First attempts never borrow the idle part of the retry share, so
/// this is 240/s only when retries fill it.
fn usable_rate(retry_rate: f64) -> f64 {
    (BUDGET - RETRY_SHARE) as f64 + retry_rate.min(RETRY_SHARE as f64)
}

/// A saturated fleet of `n` instances: the send-start bound, utilisation,
/// exact call accounting and Redis calls per send.
async fn saturated(n: usize) {
    let tag = format!("saturated-{n}");
    let measured = refresh_periods(8);
    let mut fleet = Fleet::start(&tag, n, EXPECTED_INSTANCES).await;
    fleet.reset_stats().await;
    let started = Instant::now();
    let load = Load::start(&fleet);

    tokio::time::sleep(WARM_UP).await;
    let before = fleet.stats().await;
    fleet.budget.cli(&["CONFIG", "RESETSTAT"]);
    let t1 = Instant::now();
    tokio::time::sleep(measured).await;
    let after = fleet.stats().await;
    let elapsed = t1.elapsed();
    let arrivals = fleet.series().await;
    let csv = write_arrivals(
        n,
        &arrivals,
        t1.duration_since(started).as_secs_f64()
            ..(t1 + elapsed).duration_since(started).as_secs_f64(),
    );
    let redis_calls = client_command_calls(&fleet.budget);
    let evalsha = command_calls(&fleet.budget, &["evalsha"]);
    let quota_calls = client_command_calls(&fleet.quotas);
    let grants = grant_summary(&fleet.budget).await;

    let tally = load.stop().await;
    let end = fleet.stats().await;
    fleet.assert_all_running();

    let sends = after.total - before.total;
    let secs = elapsed.as_secs_f64();
    let rate = sends as f64 / secs;
    let utilisation = rate / BUDGET as f64;
    // Every injected failure in the window is retried (all 200s show it):
    // the retries are the failures, the first attempts the rest.
    let retry_rate = (after.failed - before.failed) as f64 / secs;
    let first_rate = rate - retry_rate;
    // First attempts may use their 200/s, retries what they need of their
    // 40/s: 240/s only when retries fill their share.
    let usable = usable_rate(retry_rate);
    let per_send = redis_calls as f64 / sends.max(1) as f64;
    let bound = lease_bound(n as u64, 1000);
    println!(
        "fleet {n} instances: max_in_any_1s {} (bound {bound}, dependency {DEPENDENCY_LIMIT}), \
         max_concurrent {}, {rate:.1} calls/s over {:.1} s = {:.1}% of {BUDGET}/s \
         ({first_rate:.1}/s first attempts, {retry_rate:.1}/s retries; {:.1}% of the {usable:.1}/s \
         this load may use), budget Redis {redis_calls} calls \
         ({evalsha} EVALSHA) = {per_send:.4} per send; quota Redis {quota_calls} calls; \
         leases: {grants}; dependency {end:?}; answers {:?}; 200: {} batches, {} items, {} attempts, {} retries; \
         503 with calls {}; shed 503 {}; API 429 {} {:?}; run {:.1} s; arrivals per second \
         (most {}) in {}",
        end.max_in_any_1s,
        end.max_concurrent,
        secs,
        utilisation * 100.0,
        rate / usable * 100.0,
        tally.statuses,
        tally.ok,
        tally.ok_items,
        tally.ok_attempts,
        tally.ok_retries,
        tally.partial,
        tally.shed_503,
        tally.refused_429,
        tally.refusals,
        started.elapsed().as_secs_f64(),
        arrivals.iter().max().unwrap_or(&0),
        csv.display(),
    );

    assert!(
        tally.unexplained.is_empty(),
        "answers that cannot be accounted for ({}), first: {:?}; logs in {}",
        tally.unexplained.len(),
        tally.unexplained.first(),
        fleet.logs.display()
    );
    assert_eq!(
        end.total, tally.attempts,
        "every call the dependency saw is one an answer reported"
    );
    assert!(
        tally.ok_mismatches.is_empty(),
        "200 answers must make 2 × items + retries attempts: {:?}",
        &tally.ok_mismatches[..tally.ok_mismatches.len().min(5)]
    );
    assert_eq!(tally.ok_attempts, 2 * tally.ok_items + tally.ok_retries);
    assert!(tally.ok > 0, "some batches were answered");
    assert!(
        tally.retries > 0 && end.failed > 0,
        "injected failures were retried"
    );
    assert!(
        end.max_in_any_1s <= bound && end.max_in_any_1s <= DEPENDENCY_LIMIT,
        "at most {bound} send starts in any 1 s with {n} instances; the dependency saw {}",
        end.max_in_any_1s
    );
    assert_eq!(end.rejected, 0, "the dependency refused nothing");
    if long_form() {
        assert!(
            rate >= 0.9 * BUDGET as f64,
            "a saturating load uses at least 90% of {BUDGET}/s: {rate:.1}/s \
             ({first_rate:.1}/s first attempts, {retry_rate:.1}/s retries)"
        );
        assert!(
            per_send <= 0.05,
            "at most 0.05 budget Redis calls per admitted send: {per_send:.4}"
        );
    } else {
        assert!(
            rate >= 0.8 * usable,
            "a saturating load uses at least 80% of the {usable:.1}/s it may use: {rate:.1}/s \
             ({first_rate:.1}/s first attempts, {retry_rate:.1}/s retries)"
        );
    }
    // One script call per instance per refresh period (docs/leases.md), at
    // most one more per instance in the window: n / (P · rate) per send,
    // 0.042 at 40 instances and 240/s.
    let periods = (secs / REFRESH.as_secs_f64()).round() as u64;
    let allowed = n as u64 * (periods + 1);
    assert!(
        redis_calls <= allowed,
        "at most one lease call per instance per {REFRESH:?} (+1): {redis_calls} > {allowed}"
    );
}

#[test]
fn ten_instances_share_the_budget() {
    let _one = one_at_a_time();
    runtime().block_on(saturated(10));
}

#[test]
fn forty_instances_share_the_budget() {
    let _one = one_at_a_time();
    runtime().block_on(saturated(40));
}

/// 10 instances with the default `--expected-instances 40` (fallback 6/s
/// each): the budget's Redis is killed under load, then started again,
/// empty. Each phase is measured on its own, after a reset of the mock.
#[test]
fn budget_redis_killed_then_restarted() {
    let _one = one_at_a_time();
    runtime().block_on(async {
        let n = 10;
        let expected = EXPECTED_INSTANCES;
        let outage = window(5);
        let mut fleet = Fleet::start("outage", n, expected).await;
        let pids = fleet.pids();
        fleet.reset_stats().await;
        let load = Load::start(&fleet);

        // Normal: leases granted.
        tokio::time::sleep(WARM_UP).await;
        let normal = fleet.stats().await;

        // Transition: Redis gone; grants run until their local expiry, at
        // most one lease length after the last refresh.
        fleet.budget.kill();
        fleet.reset_stats().await;
        tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
        let transition = fleet.stats().await;

        // Fallback: every grant expired, each instance at R / N.
        fleet.reset_stats().await;
        let t_fallback = Instant::now();
        tokio::time::sleep(outage).await;
        let fallback = fleet.stats().await;
        let fallback_elapsed = t_fallback.elapsed();

        // Recovery: Redis back, empty; the same processes lease again.
        fleet.budget.restart();
        fleet.reset_stats().await;
        let t_restart = Instant::now();
        let mut samples = vec![(Instant::now(), Stats::default())];
        let mut recovered = None;
        let limit = LEASE + REFRESH + Duration::from_secs(10);
        while t_restart.elapsed() < limit {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = Instant::now();
            let stats = fleet.stats().await;
            samples.push((now, stats));
            // The rate over the last 2 s, against what this load may use.
            if let Some(&(then, before)) = samples
                .iter()
                .rev()
                .find(|(t, _)| now.duration_since(*t) >= Duration::from_secs(2))
            {
                let secs = now.duration_since(then).as_secs_f64();
                let rate = (stats.total - before.total) as f64 / secs;
                let usable = usable_rate((stats.failed - before.failed) as f64 / secs);
                if rate >= 0.9 * usable {
                    recovered = Some((t_restart.elapsed(), rate, usable));
                    break;
                }
            }
        }
        let recovery = fleet.stats().await;
        let evalsha_after_restart = command_calls(&fleet.budget, &["evalsha"]);

        let tally = load.stop().await;
        fleet.assert_all_running();

        let normal_bound = lease_bound(n as u64, 1000);
        let transition_bound_1s = transition_bound(n as u64, n as u64, expected, 1000);
        let fallback_bound_1s = fallback_bound(n as u64, expected, 1000);
        let fallback_ms = u64::try_from(fallback_elapsed.as_millis()).unwrap_or(u64::MAX);
        let fallback_bound_all = fallback_bound(n as u64, expected, fallback_ms);
        println!(
            "outage, {n} instances, expected {expected}: normal max_in_any_1s {} (bound \
             {normal_bound}); transition {} (bound {transition_bound_1s}, {} calls in {:.1} s); \
             fallback {} (bound {fallback_bound_1s}), {} calls in {:.1} s = {:.1}/s (bound \
             {fallback_bound_all} calls); recovery {} (bound {transition_bound_1s}), {:?}; \
             {evalsha_after_restart} EVALSHA on the restarted Redis; answers {:?}",
            normal.max_in_any_1s,
            transition.max_in_any_1s,
            transition.total,
            (LEASE + Duration::from_millis(200)).as_secs_f64(),
            fallback.max_in_any_1s,
            fallback.total,
            fallback_elapsed.as_secs_f64(),
            fallback.total as f64 / fallback_elapsed.as_secs_f64(),
            recovery.max_in_any_1s,
            recovered.map(|(t, r, u)| format!(
                "{r:.1}/s of {u:.1}/s usable at {:.1} s",
                t.as_secs_f64()
            )),
            tally.statuses,
        );

        assert!(
            tally.unexplained.is_empty(),
            "answers that cannot be accounted for ({}), first: {:?}",
            tally.unexplained.len(),
            tally.unexplained.first()
        );
        assert!(normal.max_in_any_1s <= normal_bound, "normal: {normal:?}");
        assert!(
            transition.max_in_any_1s <= transition_bound_1s,
            "transition: {transition:?}"
        );
        assert!(
            fallback.max_in_any_1s <= fallback_bound_1s,
            "fallback: at most {fallback_bound_1s} in any 1 s: {fallback:?}"
        );
        assert!(
            fallback.total <= fallback_bound_all,
            "fallback: at most {fallback_bound_all} over the phase: {fallback:?}"
        );
        assert!(fallback.total > 0, "the fallback capacity is spent");
        assert!(
            recovery.max_in_any_1s <= transition_bound_1s,
            "recovery: {recovery:?}"
        );
        assert!(
            recovered.is_some(),
            "the budget recovered to 90% of what the load may use within {limit:?} of the restart"
        );
        assert!(
            evalsha_after_restart >= n as u64,
            "every instance leases from the restarted Redis"
        );
        assert_eq!(fleet.pids(), pids, "the same instance processes throughout");
    });
}

/// The retries every instance's budget admitted so far: the sum of
/// `tower_admission_dependency_attempts_total{share="retry"}` over their
/// `GET /metrics`.
async fn retries_admitted(fleet: &Fleet) -> u64 {
    let mut sum = 0;
    for url in fleet.urls.iter() {
        sum += attempts_sent(&fleet.client, url, "retry")
            .await
            .expect("GET /metrics");
    }
    sum
}

/// Changes the mock's limit at once (`POST /config`).
async fn set_limit(fleet: &Fleet, limit: u64) {
    let response = fleet
        .client
        .post(format!("{}/config", fleet.mock_url))
        .json(&json!({ "limit": limit }))
        .send()
        .await
        .expect("POST /config");
    assert_eq!(response.status(), 204, "POST /config");
}

/// 10 instances with `--pushback` at saturating load, no injected failures
/// (so first attempts are what arrives while nothing is refused). The
/// mock's limit drops from 300 to 150 per second, then goes back to 300.
///
/// Asserted (docs/leases.md, "Pushback"): from 5 s after the drop until
/// 7.5 s after it, every second's arrivals are at most 150 and the mock
/// refuses nothing more; within 10 s of the raise, a second's arrivals are
/// at least 90% of the 200/s of first attempts; in every sampled interval
/// `dt` the retries admitted fleet-wide stay within the retry share's bound,
/// `2n + 1 + 40·dt` (docs/leases.md, "Normal and retry shares on one
/// lease"). Each second's arrivals are printed.
#[test]
fn pushback_follows_a_lowered_dependency_limit_and_recovers() {
    let _one = one_at_a_time();
    runtime().block_on(async {
        let n = 10;
        let options = Options {
            pushback: true,
            fail_every: Some(0),
        };
        let mut fleet = Fleet::start_with("pushback", n, EXPECTED_INSTANCES, options).await;
        let load = Load::start(&fleet);
        tokio::time::sleep(WARM_UP).await;

        // Retries admitted fleet-wide, sampled with the mock's refusals.
        let mut retry_samples: Vec<(Instant, u64)> = Vec::new();
        let mut rejected_at: Vec<(f64, u64)> = Vec::new();
        fleet.reset_stats().await;
        set_limit(&fleet, 150).await;
        let dropped = Instant::now();
        let low_for = Duration::from_millis(7_500);
        while dropped.elapsed() < low_for {
            retry_samples.push((Instant::now(), retries_admitted(&fleet).await));
            rejected_at.push((
                dropped.elapsed().as_secs_f64(),
                fleet.stats().await.rejected,
            ));
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let low = fleet.series().await;
        let at_5s = rejected_at
            .iter()
            .find(|(t, _)| *t >= 5.0)
            .map_or(0, |&(_, r)| r);
        let at_end = fleet.stats().await.rejected;

        set_limit(&fleet, 300).await;
        fleet.reset_stats().await;
        let raised = Instant::now();
        let mut recovered = None;
        while raised.elapsed() < Duration::from_secs(11) {
            retry_samples.push((Instant::now(), retries_admitted(&fleet).await));
            tokio::time::sleep(Duration::from_millis(250)).await;
            let series = fleet.series().await;
            if let Some(k) = series.iter().position(|&a| a >= 180) {
                recovered = Some(k);
                break;
            }
        }
        let high = fleet.series().await;
        let tally = load.stop().await;
        fleet.assert_all_running();

        let retry_bound = |dt: f64| 2.0 * n as f64 + 1.0 + RETRY_SHARE as f64 * dt;
        let worst_retries = retry_samples
            .windows(2)
            .map(|w| {
                let dt = w[1].0.duration_since(w[0].0).as_secs_f64();
                (w[1].1 - w[0].1, dt, retry_bound(dt))
            })
            .max_by(|a, b| (a.0 as f64 / a.2).total_cmp(&(b.0 as f64 / b.2)))
            .unwrap_or((0, 0.0, 0.0));
        println!(
            "pushback, {n} instances: arrivals per second after the drop to 150 {low:?}; \
             refused by the mock {rejected_at:?}; after the raise to 300 {high:?}, first second \
             at >= 180: {recovered:?}; worst retries {} in {:.2} s (bound {:.1}); answers {:?}",
            worst_retries.0, worst_retries.1, worst_retries.2, tally.statuses
        );
        assert!(
            tally.unexplained.is_empty(),
            "answers that cannot be accounted for: {:?}",
            tally.unexplained.first()
        );
        let settled = &low[5.min(low.len())..];
        assert!(
            settled.iter().all(|&a| a <= 150),
            "from 5 s after the drop every second's arrivals are at most 150: {low:?}"
        );
        assert_eq!(
            at_5s, at_end,
            "the mock refuses nothing from 5 s to 7.5 s after the drop: {rejected_at:?}"
        );
        assert!(
            recovered.is_some_and(|k| k < 10),
            "within 10 s of the raise a second has at least 180 arrivals: {high:?}"
        );
        for w in retry_samples.windows(2) {
            let dt = w[1].0.duration_since(w[0].0).as_secs_f64();
            assert!(
                (w[1].1 - w[0].1) as f64 <= retry_bound(dt),
                "retries admitted fleet-wide in {dt:.2} s: {} > {:.1}",
                w[1].1 - w[0].1,
                retry_bound(dt)
            );
        }
    });
}

/// `from` instances under uneven demand ([`Load::uneven`]), no injected
/// failures, then `to`: started (their load with them) or stopped as a
/// scale-down stops them (their load stopped first, then SIGTERM: each
/// drains and releases its rate lease) halfway through. A killed
/// instance's share comes back only when its grants expire, up to a lease
/// length later (`tests/internal/outbound_leases.rs`). The usable share is the 200/s of
/// first attempts: the saturating instances can take whatever the
/// quota-held ones leave.
///
/// Asserted: the most arrivals in any 1 s within the bound on send starts
/// for the larger fleet ([`lease_bound`]), and from two lease lengths after
/// the change every whole second at least 90% of
/// 200/s in the long form (`FLEET_SECONDS` set, release), 60% on average in
/// the short form (debug on a shared machine: the throughput is the
/// machine's). The per-second series is printed. The runs that start 40
/// instances are long-form only (`scripts/fleet` runs the ignored tests
/// too): in CI's debug build they take minutes.
async fn scaled(from: usize, to: usize) {
    let tag = format!("scale-{from}-{to}");
    let options = Options {
        pushback: false,
        fail_every: Some(0),
    };
    let mut fleet = Fleet::start_with(&tag, from, EXPECTED_INSTANCES, options).await;
    let largest = from.max(to);
    // The instances that stay carry the saturating load of a fleet of
    // `to` from the start: after a scale-down, the leavers' users are
    // theirs (one batch in flight per saturating instance of 40 would not
    // keep a fifth of them saturated).
    let stay = Load::uneven(&fleet, 0..from.min(to), to);
    let mut extra = (from > to).then(|| Load::uneven(&fleet, to..from, largest));
    tokio::time::sleep(WARM_UP).await;
    fleet.reset_stats().await;
    let t0 = Instant::now();
    tokio::time::sleep(window(8)).await;
    let before = t0.elapsed();
    let mut tallies = Vec::new();
    if to > from {
        fleet.add(to - from).await;
        extra = Some(Load::uneven(&fleet, from..to, largest));
    } else if to < from {
        if let Some(load) = extra.take() {
            tallies.push(load.stop().await);
        }
        fleet.stop_last(from - to).await;
    }
    // The change is when the instances are there or gone: starting 30
    // takes a while, and the leaving ones' load is drained first (their
    // batches answered, budget waits of up to 2 s each included).
    let changed = t0.elapsed();
    println!(
        "scale {from} -> {to}: the change began at {:.1} s and took {:.1} s",
        before.as_secs_f64(),
        (changed - before).as_secs_f64()
    );
    let settle = 2 * LEASE;
    match std::env::var_os("FLEET_TRACE") {
        Some(path) => trace_grants(&fleet, t0, settle + window(8), &path).await,
        None => tokio::time::sleep(settle + window(8)).await,
    }
    let series = fleet.series().await;
    let end = fleet.stats().await;
    tallies.push(stay.stop().await);
    if let Some(load) = extra.take() {
        tallies.push(load.stop().await);
    }
    fleet.assert_all_running();

    let changed_s = changed.as_secs_f64();
    let from_second = (changed + settle).as_secs_f64().ceil() as usize;
    let settled = &series[from_second.min(series.len())..];
    let lowest = settled.iter().copied().min().unwrap_or(0);
    let mean = settled.iter().sum::<u64>() as f64 / settled.len().max(1) as f64;
    let bound = lease_bound(largest as u64, 1000);
    let usable = (BUDGET - RETRY_SHARE) as f64;
    println!(
        "scale {from} -> {to} at {changed_s:.1} s: arrivals per second {series:?}; from second \
         {from_second}: lowest {lowest} ({:.1}% of {usable}/s), mean {mean:.1} ({:.1}%); \
         max_in_any_1s {} (bound {bound}); rejected {}; answers {:?}",
        lowest as f64 / usable * 100.0,
        mean / usable * 100.0,
        end.max_in_any_1s,
        end.rejected,
        tallies.iter().map(|t| &t.statuses).collect::<Vec<_>>(),
    );
    for tally in &tallies {
        assert!(
            tally.unexplained.is_empty(),
            "answers that cannot be accounted for: {:?}",
            tally.unexplained.first()
        );
    }
    assert!(
        end.max_in_any_1s <= bound,
        "at most {bound} send starts in any 1 s: {}",
        end.max_in_any_1s
    );
    assert!(
        !settled.is_empty(),
        "seconds measured after the settling time"
    );
    if long_form() {
        assert!(
            lowest as f64 >= 0.9 * usable,
            "from two lease lengths after the change every second uses 90% of {usable}/s: \
             {series:?} (from second {from_second})"
        );
    } else {
        // Debug on a shared machine: the throughput is the machine's, so
        // only a use far below the budget's is a failure.
        assert!(
            mean >= 0.6 * usable,
            "from two lease lengths after the change the fleet uses 60% of {usable}/s on \
             average: {series:?} (from second {from_second})"
        );
    }
}

/// For `duration`, every 0.5 s, one line per lease key in `path`: the
/// seconds since `t0` and the key's hash as `HGETALL` gives it (per
/// instance its demand, flag and grant steps; `lease.lua` has the format),
/// then a line `s=<seconds> <sent> ...`: each instance's first attempts sent
/// so far, in instance order (`-` for one that did not answer, such as a
/// stopped one).
async fn trace_grants(fleet: &Fleet, t0: Instant, duration: Duration, path: &std::ffi::OsStr) {
    let mut out = String::new();
    let end = Instant::now() + duration;
    while Instant::now() < end {
        let keys = fleet.budget.cli(&["--scan", "--pattern", "*{lease:*}"]);
        for key in keys.lines().filter(|k| !k.is_empty()) {
            let hash = fleet.budget.cli(&["HGETALL", key]).replace('\n', " ");
            out.push_str(&format!("t={:.2} {hash}\n", t0.elapsed().as_secs_f64()));
        }
        let mut sent = Vec::new();
        for url in fleet.urls.iter() {
            let count = attempts_sent(&fleet.client, url, "normal").await;
            sent.push(count.map_or_else(|| "-".to_owned(), |n| n.to_string()));
        }
        out.push_str(&format!(
            "s={:.2} {}\n",
            t0.elapsed().as_secs_f64(),
            sent.join(" ")
        ));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    std::fs::write(path, out).expect("write FLEET_TRACE");
}

/// The attempts of share `share` (`normal` or `retry`) that `url`'s
/// instance has sent to the dependency (its `/metrics`), or `None` when it
/// does not answer.
async fn attempts_sent(client: &reqwest::Client, url: &str, share: &str) -> Option<u64> {
    let text = metrics_text(client, url).await?;
    let label = format!("share=\"{share}\"");
    let sent = sample_sum(
        &text,
        "tower_admission_dependency_attempts_total",
        &[&label],
    );
    Some(sent.unwrap_or(0.0) as u64)
}

#[test]
fn uneven_demand_ten_then_forty_instances() {
    let _one = one_at_a_time();
    runtime().block_on(scaled(10, 40));
}

#[test]
#[ignore = "long form: scripts/fleet uneven"]
fn uneven_demand_forty_then_ten_instances() {
    let _one = one_at_a_time();
    runtime().block_on(scaled(40, 10));
}

#[test]
fn uneven_demand_ten_instances() {
    let _one = one_at_a_time();
    runtime().block_on(scaled(10, 10));
}

#[test]
#[ignore = "long form: scripts/fleet uneven"]
fn uneven_demand_forty_instances() {
    let _one = one_at_a_time();
    runtime().block_on(scaled(40, 40));
}
