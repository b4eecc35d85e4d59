//! The sample reporting API reloading its `--config` file while it runs, as
//! a process: on SIGHUP after an atomic rename, by itself after a symlink
//! swap (the way a Kubernetes ConfigMap changes), keeping the running
//! configuration on a broken file, and 100 reloads in a row under steady
//! load without a failed request.
//!
//! Every process is killed when its test ends, also on a panic. Reloads
//! are awaited by polling `/metrics` against a deadline; nothing sleeps to
//! wait for a condition.
#![cfg(unix)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::Client;
use support::process::{metrics_text, reporting_api, Served};
use support::TempDir;

/// The free plan's burst policy, as the shipped file spells it.
const FREE_BURST: &str = r#"{ name = "burst", algorithm = "token_bucket", capacity = 20, refill = 100, period = "60s" }"#;

/// Keys of six more users on the free plan: each starts with a fresh
/// bucket, so a burst can be measured again after a reload.
const FRESH: [&str; 6] = [
    "fresh-1", "fresh-2", "fresh-3", "fresh-4", "fresh-5", "fresh-6",
];

/// How long a reload may take to show: the watcher polls every 500 ms.
const RELOAD_DEADLINE: Duration = Duration::from_secs(2);

fn shipped_config() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/reporting_api/reporting.toml"
    );
    std::fs::read_to_string(path).expect("read examples/reporting_api/reporting.toml")
}

/// `text` with `from` (which it holds once) replaced by `to`.
fn replaced(text: &str, from: &str, to: &str) -> String {
    assert_eq!(
        text.matches(from).count(),
        1,
        "the config no longer holds {from}"
    );
    text.replacen(from, to, 1)
}

/// The shipped file with the free plan's burst at `capacity` (refilling one
/// token a minute, so a burst is counted exactly) and the fresh users' keys.
fn config(capacity: u64) -> String {
    let burst = format!(
        r#"{{ name = "burst", algorithm = "token_bucket", capacity = {capacity}, refill = 1, period = "60s" }}"#
    );
    let mut text = replaced(&shipped_config(), FREE_BURST, &burst);
    for (i, key) in FRESH.iter().enumerate() {
        text = replaced(
            &text,
            "\n# Per user:",
            &format!(
                "\n[[keys]]\nkey = \"{key}\"\nsubject = \"fresh-user-{i}\"\ntenant = \"acme\"\nplan = \"free\"\n\n# Per user:"
            ),
        );
    }
    text
}

/// Writes `text` next to `path` and renames it over `path`: the file is
/// replaced whole, never read half written.
fn write_atomically(path: &Path, text: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, text).expect("write the next config");
    std::fs::rename(&next, path).expect("rename the next config over the file");
}

/// `text` without the terminal's colour codes.
fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|c| *c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

fn sighup(served: &Served) {
    let status = Command::new("kill")
        .args(["-HUP", &served.process.pid().to_string()])
        .status()
        .expect("run kill -HUP");
    assert!(status.success());
}

fn client() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("a reqwest client")
}

/// How many of `n` requests of `key`, one after the other, were admitted;
/// every answer is 200 or 429.
async fn admitted(client: &Client, served: &Served, key: &str, n: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..n {
        let status = client
            .get(format!("{}/v1/reports?page_size=1", served.url))
            .bearer_auth(key)
            .send()
            .await
            .expect("the API answers")
            .status()
            .as_u16();
        match status {
            200 => admitted += 1,
            429 => {}
            other => panic!("{key}: answered {other}"),
        }
    }
    admitted
}

/// The value of the sample `name` (with its labels, as the text format
/// writes them) on `/metrics`.
async fn metric(client: &Client, served: &Served, name: &str) -> Option<f64> {
    let text = metrics_text(client, &served.url).await?;
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Polls `/metrics` until `name` is at least `value`, for at most `limit`;
/// the time it took. A rename followed by SIGHUP may reload twice (the
/// watcher sees the change before the signal arrives): each reload counts.
async fn await_metric(
    client: &Client,
    served: &Served,
    name: &str,
    value: f64,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    loop {
        if metric(client, served, name).await >= Some(value) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "{name} is {:?}, below {value}, {limit:?} on; output:\n{}",
            metric(client, served, name).await,
            served.process.output()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

const GENERATION: &str = "reporting_api_config_generation";
const SUCCESS: &str = "reporting_api_config_last_reload_success";
const FAILURES: &str = "reporting_api_config_reloads_total{result=\"failure\"}";
const SUCCESSES: &str = "reporting_api_config_reloads_total{result=\"success\"}";

async fn start(dir: &TempDir, text: &str) -> (Served, PathBuf) {
    let path = dir.path().join("reporting.toml");
    std::fs::write(&path, text).expect("write the config");
    let served = reporting_api(&["--config".to_owned(), path.display().to_string()]).await;
    (served, path)
}

#[tokio::test]
async fn a_burst_of_20_becomes_5_after_an_atomic_rename_and_sighup() {
    let dir = TempDir::new("reload-sighup");
    let (served, path) = start(&dir, &config(20)).await;
    let client = client();
    assert_eq!(metric(&client, &served, GENERATION).await, Some(0.0));
    assert_eq!(metric(&client, &served, SUCCESS).await, Some(1.0));
    assert_eq!(admitted(&client, &served, "demo-free", 25).await, 20);

    write_atomically(&path, &config(5));
    sighup(&served);
    await_metric(&client, &served, GENERATION, 1.0, RELOAD_DEADLINE).await;
    // A fresh key gets exactly the new burst; the key that used its 20
    // gets nothing more (one token a minute refills).
    assert_eq!(admitted(&client, &served, FRESH[0], 10).await, 5);
    assert_eq!(admitted(&client, &served, "demo-free", 10).await, 0);
    let output = served.process.output();
    assert!(output.contains("configuration reloaded"), "{output}");
    assert!(!output.contains("cannot change while running"), "{output}");
}

#[tokio::test]
async fn a_swapped_symlink_is_reloaded_within_2_s_with_no_signal() {
    // The shape of a mounted ConfigMap: the file is a symlink through
    // `..data`, itself a symlink to a versioned directory, and an update
    // swaps `..data` by an atomic rename.
    let dir = TempDir::new("reload-symlink");
    let version = |name: &str, text: &str| {
        let versioned = dir.path().join(name);
        std::fs::create_dir(&versioned).unwrap();
        std::fs::write(versioned.join("reporting.toml"), text).unwrap();
    };
    version("..v1", &config(20));
    std::os::unix::fs::symlink("..v1", dir.path().join("..data")).unwrap();
    let path = dir.path().join("reporting.toml");
    std::os::unix::fs::symlink("..data/reporting.toml", &path).unwrap();
    let served = reporting_api(&["--config".to_owned(), path.display().to_string()]).await;
    let client = client();
    assert_eq!(admitted(&client, &served, FRESH[0], 25).await, 20);

    version("..v2", &config(5));
    std::os::unix::fs::symlink("..v2", dir.path().join("..data_tmp")).unwrap();
    std::fs::rename(dir.path().join("..data_tmp"), dir.path().join("..data")).unwrap();
    let took = await_metric(&client, &served, GENERATION, 1.0, RELOAD_DEADLINE).await;
    assert!(took < RELOAD_DEADLINE, "{took:?}");
    assert_eq!(admitted(&client, &served, FRESH[1], 10).await, 5);
    assert_eq!(admitted(&client, &served, FRESH[0], 10).await, 0);
}

#[tokio::test]
async fn a_broken_file_keeps_the_running_burst_and_says_where_it_is_broken() {
    let dir = TempDir::new("reload-broken");
    let (served, path) = start(&dir, &config(5)).await;
    let client = client();
    let text = config(5);
    let broken = replaced(
        &text,
        "capacity = 5, refill = 1",
        "capacity = 0, refill = 1",
    );
    let line = broken
        .lines()
        .position(|l| l.contains("capacity = 0"))
        .unwrap()
        + 1;
    write_atomically(&path, &broken);
    sighup(&served);
    await_metric(&client, &served, FAILURES, 1.0, RELOAD_DEADLINE).await;
    assert_eq!(metric(&client, &served, SUCCESS).await, Some(0.0));
    assert_eq!(metric(&client, &served, GENERATION).await, Some(0.0));
    let output = plain(&served.process.output());
    let at = format!(
        "{}:{line}: plans.free.policies[1].capacity:",
        path.display()
    );
    assert!(output.contains(&at), "no {at:?} in:\n{output}");
    // Still up, still 5.
    assert_eq!(admitted(&client, &served, FRESH[0], 10).await, 5);

    // A good file afterwards applies, and says so.
    write_atomically(&path, &config(7));
    sighup(&served);
    await_metric(&client, &served, GENERATION, 1.0, RELOAD_DEADLINE).await;
    assert_eq!(metric(&client, &served, SUCCESS).await, Some(1.0));
    assert_eq!(admitted(&client, &served, FRESH[1], 10).await, 7);
}

#[tokio::test]
async fn settings_that_cannot_change_while_running_are_named_and_kept() {
    let dir = TempDir::new("reload-fixed");
    let (served, path) = start(&dir, &config(20)).await;
    let client = client();
    let moved = replaced(
        &config(5),
        "[server]\n",
        "[server]\nlisten = \"127.0.0.1:1\"\nredis = \"redis://127.0.0.1:1/\"\n",
    );
    let moved = replaced(&moved, "max_page_size = 100", "max_page_size = 50");
    write_atomically(&path, &moved);
    sighup(&served);
    await_metric(&client, &served, GENERATION, 1.0, RELOAD_DEADLINE).await;
    let output = plain(&served.process.output());
    for key in ["server.listen", "server.redis", "query"] {
        let named = output.lines().any(|l| {
            l.contains("cannot change while running") && l.contains(&format!("key=\"{key}\""))
        });
        assert!(named, "{key} not named in:\n{output}");
    }
    // The quotas applied; the listen address and the store are as started.
    assert_eq!(admitted(&client, &served, FRESH[0], 10).await, 5);
}

/// Both configurations admit the whole load: a refusal or a 5xx under
/// reloads would be one that neither gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_reloads_under_steady_load_fail_no_request() {
    let roomy = |burst: u64, global: u64| {
        let text = config(burst);
        let text = text.replace("limit = 100, window", "limit = 100000, window");
        let text = text.replace("limit = 2000, window", "limit = 1000000, window");
        let text = replaced(
            &text,
            "capacity = 500, refill = 250",
            "capacity = 100000, refill = 100000",
        );
        replaced(
            &text,
            "global = { limit = 64, queue = 128",
            &format!("global = {{ limit = {global}, queue = 128"),
        )
    };
    let (a, b) = (roomy(50_000, 64), roomy(40_000, 32));
    let dir = TempDir::new("reload-load");
    let (served, path) = start(&dir, &a).await;
    let client = client();
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    // One caller per fresh user, one request at a time: within every cap.
    let load: Vec<_> = FRESH
        .iter()
        .map(|key| {
            let (client, url, stop, answered) = (
                client.clone(),
                served.url.clone(),
                stop.clone(),
                answered.clone(),
            );
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let status = client
                        .get(format!("{url}/v1/reports?page_size=1"))
                        .bearer_auth(key)
                        .send()
                        .await
                        .map(|r| r.status().as_u16());
                    statuses.push(status.map_err(|e| e.to_string()));
                    answered.fetch_add(1, Ordering::Relaxed);
                }
                statuses
            })
        })
        .collect();
    let mut generation = 0.0;
    for reload in 0..100 {
        let next = if reload % 2 == 0 { &b } else { &a };
        write_atomically(&path, next);
        sighup(&served);
        await_metric(
            &client,
            &served,
            GENERATION,
            generation + 1.0,
            RELOAD_DEADLINE,
        )
        .await;
        generation = metric(&client, &served, GENERATION).await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    for caller in load {
        for status in caller.await.unwrap() {
            assert_eq!(status, Ok(200));
            total += 1;
        }
    }
    assert!(total >= 100, "only {total} requests under 100 reloads");
    let successes = metric(&client, &served, SUCCESSES).await.unwrap();
    assert!(successes >= 100.0, "{successes}");
    assert_eq!(metric(&client, &served, GENERATION).await, Some(successes));
    assert_eq!(metric(&client, &served, FAILURES).await, Some(0.0));
    assert_eq!(answered.load(Ordering::Relaxed), total);
}
