//! The example binaries (`reporting_api`, `mock_dependency`) as child
//! processes on free ports, killed on drop (also when a test panics).
//!
//! The binaries are the ones `cargo test` builds next to the test binary:
//! `target/<profile>/examples/NAME`. A missing one fails the test with the
//! command that builds it; these tests never skip.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use super::{free_port, TempDir};

/// How often a readiness or exit poll looks again.
const POLL: Duration = Duration::from_millis(20);
/// Readiness polls before a start counts as failed (about 10 s).
const READY_TRIES: u32 = 500;
/// Starts on fresh ports before giving up (another process may take a port
/// between [`free_port`] and the child's bind).
const START_ATTEMPTS: u32 = 5;

/// The path of the example binary `name`, built by `cargo test`.
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // target/<profile>/deps/TEST-HASH -> target/<profile>/examples/NAME
    let examples = exe
        .parent()
        .and_then(Path::parent)
        .map(|profile| profile.join("examples"))
        .expect("the test binary lives in target/<profile>/deps");
    let path = examples.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let release = examples
        .parent()
        .and_then(Path::file_name)
        .is_some_and(|profile| profile == "release");
    let build = if release {
        "cargo build --release --examples --all-features"
    } else {
        "cargo build --examples --all-features"
    };
    assert!(
        path.is_file(),
        "the example binary {} is missing. Build the examples in this test's profile \
         first: `{build}` (or run `cargo test --all-features`, which builds them), then \
         run this test again.",
        path.display()
    );
    // Only the sources cargo built it from count (a unit test's file does not).
    let built = modified(&path);
    if let Some((time, source)) = newest_source(&examples.join(format!("{name}.d"))) {
        assert!(
            time <= built,
            "the example binary {} is older than its source {}. `cargo test --test NAME` \
             does not rebuild examples: run `{build}` (or `cargo test --all-features`) first.",
            path.display(),
            source.display()
        );
    }
    path
}

fn modified(path: &Path) -> std::time::SystemTime {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(std::time::SystemTime::UNIX_EPOCH)
}

/// The most recently modified source listed in cargo's dep-info file
/// `dep_info` (`target/<profile>/examples/NAME.d`), if it exists.
fn newest_source(dep_info: &Path) -> Option<(std::time::SystemTime, PathBuf)> {
    let text = std::fs::read_to_string(dep_info).ok()?;
    let (_, sources) = text.lines().next()?.split_once(": ")?;
    sources
        .split_whitespace()
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .map(|p| (modified(&p), p))
        .max_by_key(|(time, _)| *time)
}

/// A child process whose stdout and stderr go to one log file; killed
/// (SIGKILL) on drop unless it has already exited.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
    exited: Option<ExitStatus>,
    log: PathBuf,
    _dir: TempDir,
}

impl Process {
    /// Starts example `name` with `args`.
    pub fn spawn(name: &str, args: &[String]) -> Self {
        let binary = example_binary(name);
        let dir = TempDir::new(name);
        let log = dir.path().join("output.log");
        let out = File::create(&log).expect("create the log file");
        let err = out.try_clone().expect("clone the log file");
        let child = Command::new(&binary)
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        Process {
            name: name.to_owned(),
            child,
            exited: None,
            log,
            _dir: dir,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the process wrote to stdout and stderr so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The exit status if the process has exited.
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().expect("poll the child");
        }
        self.exited
    }

    /// Waits up to `limit` for the process to exit; panics with its output
    /// if it is still running then.
    pub async fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let tries = (limit.as_millis() / POLL.as_millis()).max(1);
        for _ in 0..tries {
            if let Some(status) = self.try_exit() {
                return status;
            }
            tokio::time::sleep(POLL).await;
        }
        panic!(
            "{} (pid {}) still runs after {limit:?}; its output:\n{}",
            self.name,
            self.pid(),
            self.output()
        );
    }

    /// Sends SIGTERM (through `kill -TERM PID`).
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("run kill -TERM");
        assert!(status.success(), "kill -TERM {} failed", self.pid());
    }

    /// A field of `/proc/PID/status` in KiB, such as `VmRSS` or `VmHWM`.
    pub fn memory_kib(&self, field: &str) -> Option<u64> {
        proc_status_kib(self.pid(), field)
    }
}

/// A field of `/proc/PID/status` in KiB, such as `VmRSS` (resident now) or
/// `VmHWM` (the peak resident size); `None` once the process is gone.
pub fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

impl Drop for Process {
    fn drop(&mut self) {
        if self.try_exit().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A started example: the process and its base URL.
#[derive(Debug)]
pub struct Served {
    pub process: Process,
    pub url: String,
}

/// Starts example `name` with `--listen 127.0.0.1:PORT` plus `args` on a
/// free port and polls `ready_path` until it answers 200, a bounded number
/// of times. Panics with the process's output if it never gets ready.
pub async fn serve(name: &str, args: &[String], ready_path: &str) -> Served {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("a reqwest client");
    let mut last_output = String::new();
    for _ in 0..START_ATTEMPTS {
        let port = free_port(false);
        let url = format!("http://127.0.0.1:{port}");
        let mut all = vec!["--listen".to_owned(), format!("127.0.0.1:{port}")];
        all.extend_from_slice(args);
        let mut process = Process::spawn(name, &all);
        for _ in 0..READY_TRIES {
            if process.try_exit().is_some() {
                break;
            }
            let answer = client.get(format!("{url}{ready_path}")).send().await;
            if answer.is_ok_and(|r| r.status() == reqwest::StatusCode::OK) {
                return Served { process, url };
            }
            tokio::time::sleep(POLL).await;
        }
        last_output = process.output();
        if !last_output.contains("cannot listen") {
            break;
        }
    }
    panic!("{name} {args:?} did not get ready; its output:\n{last_output}");
}

/// `mock_dependency` with `args` (e.g. `--limit`, `--latency-ms`,
/// `--fail-every`), ready once `GET /stats` answers (which is not counted as
/// an arrival).
pub async fn mock_dependency(args: &[&str]) -> Served {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    serve("mock_dependency", &args, "/stats").await
}

/// `reporting_api` with `args`, ready once `GET /healthz` answers.
pub async fn reporting_api(args: &[String]) -> Served {
    serve("reporting_api", args, "/healthz").await
}

/// The text of `GET {url}/metrics` (the Prometheus format), or `None` when
/// the process does not answer.
pub async fn metrics_text(client: &reqwest::Client, url: &str) -> Option<String> {
    let response = client.get(format!("{url}/metrics")).send().await.ok()?;
    response.text().await.ok()
}

/// The sum of the samples of series `name` in `text` whose labels include
/// each of `labels` (as the text writes them: `share="retry"`), or `None`
/// when no sample does.
pub fn sample_sum(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let series = format!("{name}{{");
    text.lines()
        .filter(|l| l.starts_with(&series) && labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(None, |sum, value| Some(sum.unwrap_or(0.0) + value))
}
