//! Fault injection against `RedisStore` and the `Limiter` above it: Redis
//! killed mid-load, restarted, down at start, and traffic stalled through a
//! TCP proxy. Each test starts its own `redis-server` on a free port.
//!
//! **Wall time is inherent here.** A deadline is a promise about real
//! latency while a real server dies, so these tests run on a real-time
//! multi-thread runtime and measure each decision with
//! `tokio::time::Instant`. The bound asserted is `deadline + 250 ms`: the
//! margin absorbs scheduling delays on a busy 2-core CI machine running other
//! test binaries at the same time, and is still far below the redis crate's
//! own multi-second defaults that the deadline replaces. Where a lower
//! bound is deterministic (a stalled call cannot return before its deadline)
//! it is asserted too. Everything else is asserted exactly.
#![cfg(feature = "redis")]

mod support;

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::Notify;
use tokio::time::Instant;
use tower_admission::clock::ManualClock;
use tower_admission::quota::{Limiter, Policy, Quota, RedisStore, Store, StoreError, Verdict};
use tower_admission::reject::Rejection;

use support::{RedisServer, StallProxy};

const DEADLINE: Duration = Duration::from_millis(50);
const MARGIN: Duration = Duration::from_millis(250);

fn per_minute(limit: u64, mode: impl FnOnce(Policy) -> Policy) -> Quota {
    Quota::new(
        "api",
        [mode(
            Policy::sliding_log("per-minute", limit, Duration::from_secs(60)).unwrap(),
        )],
    )
    .unwrap()
}

#[derive(Debug)]
struct Sample {
    started: Instant,
    finished: Instant,
    verdict: Verdict,
}

impl Sample {
    fn elapsed(&self) -> Duration {
        self.finished - self.started
    }
}

#[derive(Debug, PartialEq)]
enum Kind {
    Ok,
    Timeout,
    Unavailable,
}

fn kind(error: Option<&StoreError>) -> Kind {
    match error {
        None => Kind::Ok,
        Some(StoreError::Timeout) => Kind::Timeout,
        Some(StoreError::Unavailable { .. }) => Kind::Unavailable,
        Some(other) => panic!("unexpected store error {other:?}"),
    }
}

/// 8 callers decide in a loop; after 200 decisions Redis is SIGKILLed, and
/// each caller makes 40 more. Returns every sample and the kill time.
async fn kill_mid_load(
    mode: impl FnOnce(Policy) -> Policy,
) -> (Vec<Sample>, Instant, Limiter<RedisStore>) {
    let mut server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .deadline(DEADLINE)
        .build()
        .unwrap();
    assert_eq!(store.deadline(), DEADLINE);
    let limiter = Limiter::new(store);
    let quota = per_minute(100, mode);
    let key: Arc<str> = "alice".into();
    let done = Arc::new(AtomicU64::new(0));
    let killed = Arc::new(AtomicBool::new(false));
    let reached = Arc::new(Notify::new());
    let callers: Vec<_> = (0..8)
        .map(|_| {
            let (limiter, quota, key) = (limiter.clone(), quota.clone(), key.clone());
            let (done, killed, reached) = (done.clone(), killed.clone(), reached.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                let mut after_kill = 0;
                while after_kill < 40 {
                    if killed.load(Ordering::SeqCst) {
                        after_kill += 1;
                    }
                    let started = Instant::now();
                    let verdict = limiter.check(&quota, &key, 1).await;
                    samples.push(Sample {
                        started,
                        finished: Instant::now(),
                        verdict,
                    });
                    if done.fetch_add(1, Ordering::SeqCst) + 1 == 200 {
                        reached.notify_one();
                    }
                }
                samples
            })
        })
        .collect();
    reached.notified().await;
    server.kill();
    let killed_at = Instant::now();
    killed.store(true, Ordering::SeqCst);
    let mut samples = Vec::new();
    for caller in callers {
        samples.extend(caller.await.unwrap());
    }
    samples.sort_by_key(|s| s.started);
    (samples, killed_at, limiter)
}

/// The checks every mode shares; returns the failed samples.
fn check_kill_samples(samples: &[Sample], killed_at: Instant) -> Vec<&Sample> {
    for s in samples {
        assert!(
            s.elapsed() <= DEADLINE + MARGIN,
            "a decision took {:?}",
            s.elapsed()
        );
    }
    // Redis is dead for every decision started after the kill.
    for s in samples.iter().filter(|s| s.started >= killed_at) {
        assert_ne!(kind(s.verdict.store_error()), Kind::Ok);
    }
    // Once a decision has found Redis unreachable, every decision started
    // later is `Unavailable` (nothing sent), never another unknown outcome.
    let first_unavailable = samples
        .iter()
        .filter(|s| kind(s.verdict.store_error()) == Kind::Unavailable)
        .map(|s| s.finished)
        .min()
        .expect("some decision found redis unreachable");
    for s in samples.iter().filter(|s| s.started > first_unavailable) {
        assert_eq!(kind(s.verdict.store_error()), Kind::Unavailable);
    }
    let failed: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.verdict.store_error().is_some())
        .collect();
    eprintln!(
        "{} decisions: {} answered, {} unknown outcomes, {} unavailable; slowest {:?}",
        samples.len(),
        samples.len() - failed.len(),
        unknown(&failed),
        failed.len() as u64 - unknown(&failed),
        samples
            .iter()
            .map(Sample::elapsed)
            .max()
            .unwrap_or_default()
    );
    assert!(failed.len() >= 320, "{} failed decisions", failed.len());
    failed
}

fn unknown(samples: &[&Sample]) -> u64 {
    samples
        .iter()
        .filter(|s| kind(s.verdict.store_error()) == Kind::Timeout)
        .count() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_load_fail_open_admits_every_failed_decision() {
    let (samples, killed_at, limiter) = kill_mid_load(Policy::fail_open).await;
    let failed = check_kill_samples(&samples, killed_at);
    for s in &failed {
        assert!(s.verdict.is_admitted());
        assert_eq!(s.verdict.rejection(), None);
    }
    let stats = limiter.stats();
    assert_eq!(stats.failed_open, failed.len() as u64);
    assert_eq!(stats.unknown_outcomes, unknown(&failed));
    assert_eq!(stats.failed_closed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_load_fail_closed_refuses_with_503() {
    let (samples, killed_at, limiter) = kill_mid_load(Policy::fail_closed).await;
    let failed = check_kill_samples(&samples, killed_at);
    for s in &failed {
        assert!(!s.verdict.is_admitted());
        assert_eq!(
            s.verdict.rejection(),
            Some(Rejection::LimiterUnavailable {
                retry_after: Duration::from_secs(1)
            })
        );
    }
    let stats = limiter.stats();
    assert_eq!(stats.failed_closed, failed.len() as u64);
    assert_eq!(stats.unknown_outcomes, unknown(&failed));
    assert_eq!(stats.failed_open, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_load_local_share_admits_exactly_the_share() {
    let divisor = NonZeroU64::new(4).unwrap();
    let (samples, killed_at, limiter) =
        kill_mid_load(move |p| p.fail_to_local_share(divisor)).await;
    let failed = check_kill_samples(&samples, killed_at);
    // The local limiter holds 100 / 4 = 25 per minute; this test runs well
    // under a minute. Unknown outcomes are charged locally like the rest.
    let admitted = failed.iter().filter(|s| s.verdict.is_admitted()).count();
    assert_eq!(admitted, 25);
    for s in failed.iter().filter(|s| !s.verdict.is_admitted()) {
        assert!(matches!(
            s.verdict.rejection(),
            Some(Rejection::QuotaExceeded { .. })
        ));
    }
    let stats = limiter.stats();
    assert_eq!(stats.local_share, failed.len() as u64);
    assert_eq!(stats.unknown_outcomes, unknown(&failed));
}

/// A restart loses every admission (no persistence): the quota resets. The
/// same store reconnects by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_recovers_without_rebuild_and_the_quota_resets() {
    let mut server = RedisServer::start();
    // No reconnect backoff, so recovery is visible on the very next decision;
    // a generous deadline, since this test is about recovery, not latency.
    let store = RedisStore::builder(server.url())
        .deadline(Duration::from_secs(2))
        .reconnect_backoff(Duration::ZERO, Duration::ZERO)
        .build()
        .unwrap();
    let quota = per_minute(10, Policy::fail_closed);
    let key: Arc<str> = "alice".into();
    let mut admitted = 0;
    for _ in 0..12 {
        if store.decide(&quota, &key, 1).await.unwrap().admitted {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 10);

    server.kill();
    // The first call may race the client noticing the closed socket: it is
    // either refused before sending or sent into the dead connection
    // (unknown outcome). From then on the store knows Redis is gone.
    let first = store.decide(&quota, &key, 1).await.unwrap_err();
    assert!(
        matches!(first, StoreError::Unavailable { .. } | StoreError::Timeout),
        "{first:?}"
    );
    for _ in 0..3 {
        let error = store.decide(&quota, &key, 1).await.unwrap_err();
        assert!(
            matches!(&error, StoreError::Unavailable { message } if message.contains("unreachable")),
            "{error:?}"
        );
    }

    server.restart();
    // Same store, no rebuild: it reconnects and reloads the script
    // (NOSCRIPT -> SCRIPT LOAD). The state is gone: 10 more are admitted
    // within the same minute, 20 in total. This is the documented state loss.
    let mut admitted = 0;
    for _ in 0..12 {
        if store.decide(&quota, &key, 1).await.unwrap().admitted {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 10);
}

/// A refund from before a restart that lost the data never takes back a
/// charge made after it: a window's first state after the loss begins a
/// new epoch (its start time), which the old hold does not name. A charges
/// 10 of 10 per minute; Redis restarts empty; B charges 10; A's refund to 0
/// leaves B's 10 standing (before, it freed them and 10 more passed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_from_before_a_restart_takes_nothing_from_a_later_charge() {
    let mut server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .deadline(Duration::from_secs(2))
        .reconnect_backoff(Duration::ZERO, Duration::ZERO)
        .build()
        .unwrap();
    for quota in [
        Quota::new(
            "fixed",
            [Policy::fixed_window("per-minute", 10, Duration::from_secs(60)).unwrap()],
        )
        .unwrap(),
        Quota::new(
            "weighted",
            [Policy::sliding_window("per-minute", 10, Duration::from_secs(60)).unwrap()],
        )
        .unwrap(),
    ] {
        let key: Arc<str> = "alice".into();
        let a = store.decide(&quota, &key, 10).await.unwrap();
        assert!(a.admitted);
        server.kill();
        server.restart();
        // The first call after the restart may find the old socket closed.
        let mut b = store.decide(&quota, &key, 10).await;
        if b.is_err() {
            b = store.decide(&quota, &key, 10).await;
        }
        assert!(b.unwrap().admitted);
        store.settle(&quota, &key, &a, -10).await.unwrap();
        let after = store.decide(&quota, &key, 0).await.unwrap();
        assert_eq!(after.decisions[0].remaining, 0, "{}", quota.name());
    }
}

/// The same for a token bucket: its state after the loss begins a new life
/// (the time of its first charge), which the old hold does not name. A
/// charges 10 of a bucket of 10 refilled 10 per minute; Redis restarts
/// empty; 1 ms later B charges 10; A's refund of 10 gives nothing back, so
/// nothing more passes in that instant (before, the refund freed 9 of B's
/// tokens, those of A's segment still ahead, and 9 more passed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_refund_from_before_a_restart_takes_nothing_from_a_later_charge() {
    let mut server = RedisServer::start();
    let clock = ManualClock::new(Duration::from_micros(1_700_000_000_000_000));
    let store = RedisStore::builder(server.url())
        .test_clock(clock.clone())
        .deadline(Duration::from_secs(2))
        .reconnect_backoff(Duration::ZERO, Duration::ZERO)
        .build()
        .unwrap();
    let quota = Quota::new(
        "bucket",
        [Policy::token_bucket("burst", 10, 10, Duration::from_secs(60)).unwrap()],
    )
    .unwrap();
    let key: Arc<str> = "alice".into();
    let a = store.decide(&quota, &key, 10).await.unwrap();
    assert!(a.admitted);
    server.kill();
    server.restart();
    clock.advance(Duration::from_millis(1));
    // The first call after the restart may find the old socket closed.
    let mut b = store.decide(&quota, &key, 10).await;
    if b.is_err() {
        b = store.decide(&quota, &key, 10).await;
    }
    let b = b.unwrap();
    assert!(b.admitted);
    store.settle(&quota, &key, &a, -10).await.unwrap();
    let mut admitted = 0;
    for _ in 0..10 {
        if store.decide(&quota, &key, 1).await.unwrap().admitted {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 0);
    // B's own refund still reaches B's charge: its life is the current one.
    store.settle(&quota, &key, &b, -10).await.unwrap();
    let after = store.decide(&quota, &key, 0).await.unwrap();
    assert_eq!(after.decisions[0].remaining, 10);
}

/// A store built while Redis is down answers `Unavailable` at once, then
/// works as soon as Redis is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn down_at_start_is_unavailable_then_connects() {
    let mut server = RedisServer::start();
    server.kill();
    let store = RedisStore::builder(server.url())
        .deadline(Duration::from_secs(2))
        .reconnect_backoff(Duration::ZERO, Duration::ZERO)
        .build()
        .unwrap();
    let quota = per_minute(10, Policy::fail_closed);
    let key: Arc<str> = "alice".into();
    let started = Instant::now();
    let error = store.decide(&quota, &key, 1).await.unwrap_err();
    assert!(matches!(error, StoreError::Unavailable { .. }), "{error:?}");
    assert!(!error.outcome_unknown());
    // Refused connections fail fast, far inside the deadline.
    assert!(started.elapsed() <= MARGIN, "{:?}", started.elapsed());
    server.restart();
    assert!(store.decide(&quota, &key, 1).await.unwrap().admitted);
}

/// A stall after sending: every decision ends at its deadline with
/// `Timeout`, an unknown outcome the limiter counts. When the stall ends the
/// held requests reach Redis and run: they really were consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_traffic_times_out_with_unknown_outcomes_that_were_consumed() {
    let server = RedisServer::start();
    let proxy = StallProxy::start(server.port()).await;
    let store = RedisStore::builder(proxy.url())
        .deadline(DEADLINE)
        .reconnect_after_stall(Duration::from_secs(3600))
        .build()
        .unwrap();
    let limiter = Limiter::new(store);
    let quota = per_minute(10, Policy::fail_closed);
    let key: Arc<str> = "alice".into();
    for _ in 0..3 {
        assert!(limiter.check(&quota, &key, 1).await.is_admitted());
    }

    proxy.stall();
    for _ in 0..5 {
        let started = Instant::now();
        let verdict = limiter.check(&quota, &key, 1).await;
        let elapsed = started.elapsed();
        assert!(
            elapsed >= DEADLINE && elapsed <= DEADLINE + MARGIN,
            "{elapsed:?}"
        );
        assert_eq!(verdict.store_error(), Some(&StoreError::Timeout));
        assert!(!verdict.is_admitted());
        assert_eq!(
            verdict.rejection(),
            Some(Rejection::LimiterUnavailable {
                retry_after: Duration::from_secs(1)
            })
        );
    }
    let stats = limiter.stats();
    assert_eq!(stats.unknown_outcomes, 5);
    assert_eq!(stats.failed_closed, 5);

    proxy.resume();
    // The five held decisions ran when the bytes moved: 3 + 5 + this one.
    let verdict = limiter.check(&quota, &key, 1).await;
    assert!(verdict.is_admitted());
    assert_eq!(verdict.decisions()[0].remaining, 1);
}

/// A store behind a [`StallProxy`] with `deadline`, replacing a connection
/// stalled for `stall_reset` and reconnecting at once within
/// `connect_timeout`, with a per-minute quota of 100 and its key, `alice`,
/// admitted once before any stall.
async fn reconnecting_behind_a_proxy(
    deadline: Duration,
    stall_reset: Duration,
    connect_timeout: Duration,
) -> (RedisServer, StallProxy, RedisStore, Quota, Arc<str>) {
    let server = RedisServer::start();
    let proxy = StallProxy::start(server.port()).await;
    let store = RedisStore::builder(proxy.url())
        .deadline(deadline)
        .reconnect_after_stall(stall_reset)
        .connect_timeout(connect_timeout)
        .reconnect_backoff(Duration::ZERO, Duration::ZERO)
        .build()
        .unwrap();
    let quota = per_minute(100, Policy::fail_closed);
    let key: Arc<str> = "alice".into();
    assert!(store.decide(&quota, &key, 1).await.unwrap().admitted);
    (server, proxy, store, quota, key)
}

/// Callers that give up before the store's deadline (an outer timeout, a
/// client hanging up) count toward a stall too: a stalled connection on
/// which every call is dropped unanswered is replaced all the same, instead
/// of taking every later call until its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_dropped_unanswered_replace_a_stalled_connection() {
    let (_server, proxy, store, quota, key) = reconnecting_behind_a_proxy(
        Duration::from_secs(2),
        Duration::ZERO,
        Duration::from_millis(200),
    )
    .await;

    proxy.stall();
    // Each call is handed to the live connection on its first poll, then
    // dropped unanswered.
    for _ in 0..2 {
        assert!(store.decide(&quota, &key, 1).now_or_never().is_none());
    }
    // The stalled connection is gone: this call waits for a new one, which
    // cannot finish its handshake, instead of being sent into the stall.
    let result = store.decide(&quota, &key, 1).await;
    assert_eq!(kind(result.err().as_ref()), Kind::Unavailable);
}

/// A stall that lasts: after `reconnect_after_stall` of timeouts the store
/// drops the connection. The new connection cannot finish its handshake
/// through the stalled proxy, so decisions are `Unavailable` (nothing sent)
/// instead of unknown outcomes. When traffic moves again the store is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_stall_replaces_the_connection_and_recovers() {
    let (_server, proxy, store, quota, key) = reconnecting_behind_a_proxy(
        DEADLINE,
        Duration::from_millis(200),
        Duration::from_millis(300),
    )
    .await;

    proxy.stall();
    let mut kinds = Vec::new();
    for _ in 0..14 {
        let started = Instant::now();
        let result = store.decide(&quota, &key, 1).await;
        assert!(
            started.elapsed() <= DEADLINE + MARGIN,
            "{:?}",
            started.elapsed()
        );
        kinds.push(kind(result.err().as_ref()));
    }
    eprintln!("during the stall: {kinds:?}");
    // Timeouts while the old connection is kept, then only Unavailable.
    let timeouts = kinds.iter().take_while(|k| **k == Kind::Timeout).count();
    assert!(timeouts >= 1, "{kinds:?}");
    assert!(
        kinds[timeouts..].iter().all(|k| *k == Kind::Unavailable),
        "{kinds:?}"
    );
    assert!(
        timeouts < kinds.len(),
        "the connection was never replaced: {kinds:?}"
    );

    proxy.resume();
    let mut recovered = false;
    for _ in 0..3 {
        if let Ok(decision) = store.decide(&quota, &key, 1).await {
            assert!(decision.admitted);
            recovered = true;
            break;
        }
    }
    assert!(recovered, "the store did not recover after the stall ended");
}

/// One master of a 3-master cluster is SIGKILLed. Decisions for keys it owned
/// fail closed (503) within the deadline; decisions for keys on the other
/// masters keep being admitted. The check runs well inside the cluster's node
/// timeout (2 s), before the survivors declare the cluster down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_master_killed_fails_only_its_keys_within_the_deadline() {
    let mut cluster = support::RedisCluster::start();
    let store = RedisStore::cluster_builder(cluster.urls())
        .deadline(DEADLINE)
        .build()
        .unwrap();
    let limiter = Limiter::new(store.clone());
    let quota = per_minute(1_000, Policy::fail_closed);
    let keys: Vec<Arc<str>> = (0..30).map(|i| Arc::from(format!("user-{i}"))).collect();
    for key in &keys {
        assert!(limiter.check(&quota, key, 1).await.is_admitted());
    }
    // Which keys live on node 0: it answers EXISTS for its own keys only.
    let on_dead: Vec<bool> = keys
        .iter()
        .map(|key| {
            let redis_key = &store.keys(&quota, key)[0];
            cluster.nodes()[0].cli(&["exists", redis_key]).trim() == "1"
        })
        .collect();
    let dead_count = on_dead.iter().filter(|d| **d).count();
    assert!(
        dead_count > 0 && dead_count < keys.len(),
        "30 keys spread over 3 masters"
    );

    cluster.kill_node(0);
    let killed_at = Instant::now();
    let (mut refused_dead, mut admitted_alive) = (0, 0);
    for (key, dead) in keys.iter().zip(&on_dead) {
        let started = Instant::now();
        let verdict = limiter.check(&quota, key, 1).await;
        assert!(
            started.elapsed() <= DEADLINE + MARGIN,
            "{:?}",
            started.elapsed()
        );
        if *dead {
            let rejection = verdict.rejection().expect("dead master: refused");
            assert_eq!(rejection.status(), http::StatusCode::SERVICE_UNAVAILABLE);
            refused_dead += 1;
        } else {
            assert!(
                verdict.is_admitted(),
                "live master refused {key}: {:?}",
                verdict.store_error()
            );
            admitted_alive += 1;
        }
    }
    assert!(
        killed_at.elapsed() < Duration::from_secs(2),
        "ran past the node timeout"
    );
    assert_eq!(refused_dead, dead_count);
    assert_eq!(admitted_alive, keys.len() - dead_count);
    assert_eq!(limiter.stats().failed_closed, dead_count as u64);
}

/// A settle whose reply is lost after it ran (the connection drops with the
/// answer on it) is an unknown outcome, and is never run a second time.
/// Before, the cluster client resent it on a new connection: a refund of 5
/// was applied twice and freed another charge's 5 in the same window
/// (10 remaining instead of 5), and the settle reported success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_settle_whose_reply_was_lost_is_applied_once() {
    let cluster = support::RedisCluster::start();
    let proxies = cluster.behind_reply_cut_proxies().await;
    let clock = tower_admission::clock::ManualClock::default();
    clock.set(Duration::from_millis(1_704_110_400_000));
    let store = RedisStore::cluster_builder(proxies.iter().map(support::ReplyCutProxy::url))
        .test_clock(clock.clone())
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    let quota = Quota::new(
        "lost",
        [Policy::fixed_window("per-minute", 10, Duration::from_secs(60)).unwrap()],
    )
    .unwrap();
    let key: Arc<str> = "alice".into();
    let a = store.decide(&quota, &key, 5).await.unwrap();
    let b = store.decide(&quota, &key, 5).await.unwrap();
    assert!(a.admitted && b.admitted);
    // The node holding the key answers EXISTS for it; cut its proxy only.
    let redis_key = &store.keys(&quota, &key)[0];
    let owner = cluster
        .nodes()
        .iter()
        .position(|n| n.cli(&["exists", redis_key]).trim() == "1")
        .unwrap();
    proxies[owner].cut_next_reply();
    let settled = store.settle(&quota, &key, &a, -5).await;
    let cuts: u64 = proxies.iter().map(support::ReplyCutProxy::cuts).sum();
    assert_eq!(cuts, 1);
    // A's refund of 5 ran once: B's 5 still stand.
    let after = store.decide(&quota, &key, 0).await.unwrap();
    assert_eq!(after.decisions[0].remaining, 5);
    assert_eq!(settled.unwrap_err(), StoreError::Timeout);
    // A decision whose reply is lost is charged once too (before, it was
    // charged twice and reported as one admission of 1).
    proxies[owner].cut_next_reply();
    let lost = store.decide(&quota, &key, 1).await;
    assert_eq!(lost.unwrap_err(), StoreError::Timeout);
    let after = store.decide(&quota, &key, 0).await.unwrap();
    assert_eq!(after.decisions[0].remaining, 4);
    assert_eq!(proxies[owner].cuts(), 2);
}
