//! Regional budget allocations: a total of 240 split 100/80/60 over three
//! regions, each region its own `redis-server` started by the test.
//!
//! The observer never trusts a sum of separate reads (that sum can exceed
//! the total while transfers run, see `RegionalBudget::allocations`); it
//! asserts the invariant on consistent cuts from `RegionalBudget::snapshot`,
//! which carry the amount in flight.
//!
//! Interruptions are real: a receiver's `redis-server` is killed between
//! the two steps and restarted. The support servers run without
//! persistence, so a test that wants the receiver to come back *with* its
//! data saves it explicitly (`SAVE` writes `dump.rdb` to the server's own
//! directory, which `restart()` reuses and Redis loads at start), standing
//! in for a region that persists. A restart without that save is the
//! state-loss case and has its own test. The stall test goes through the
//! support TCP proxy and uses wall time only for its deadline bound, as the
//! fault tests do.
#![cfg(feature = "redis")]

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use tower_admission::outbound::{RegionError, RegionalBudget, TransferOutcome};

use support::{RedisServer, StallProxy};

const TOTAL: u64 = 240;
const REGIONS: [(&str, u64); 3] = [("eu", 100), ("us", 80), ("ap", 60)];
const EU: usize = 0;
const US: usize = 1;
const AP: usize = 2;

struct Fleet {
    servers: Vec<RedisServer>,
    budget: RegionalBudget,
}

fn budget_on(urls: &[String], call_timeout: Duration) -> RegionalBudget {
    let mut builder = RegionalBudget::builder(TOTAL).call_timeout(call_timeout);
    for ((name, initial), url) in REGIONS.iter().zip(urls) {
        builder = builder.region(name, url, *initial);
    }
    builder.build().expect("valid budget")
}

async fn fleet() -> Fleet {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let budget = budget_on(&urls, Duration::from_millis(500));
    assert!(budget.initialize().await.unwrap(), "seeded now");
    assert!(!budget.initialize().await.unwrap(), "already initialized");
    Fleet { servers, budget }
}

fn key(region: &str, what: &str) -> String {
    format!("tower-admission:regions:{{default:{region}}}:{what}")
}

/// A hash's field count, read straight from the server with redis-cli.
fn hlen(server: &RedisServer, region: &str, what: &str) -> u64 {
    server
        .cli(&["HLEN", &key(region, what)])
        .trim()
        .parse()
        .expect("HLEN answer")
}

async fn allocations(budget: &RegionalBudget) -> Vec<u64> {
    budget
        .allocations()
        .await
        .unwrap()
        .into_iter()
        .map(|(_, a)| a)
        .collect()
}

/// A few hundred random transfers from four concurrent tasks, some refused,
/// while an observer reads consistent cuts (allocations and the amount in
/// flight) as fast as it can. At every observation the sum is at most 240
/// and the sum plus what is in flight is exactly 240; at the end (after
/// repair_all) the sum is exactly 240 and every region holds exactly its
/// initial share plus what the applied transfers moved, so every transfer
/// was either applied once or refused with nothing changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_redistributions_never_exceed_the_total() {
    const TASKS: u64 = 4;
    const PER_TASK: u64 = 100;
    let f = fleet().await;
    let budget = f.budget.clone();
    let done = Arc::new(AtomicBool::new(false));

    let observer = {
        let budget = budget.clone();
        let done = done.clone();
        tokio::spawn(async move {
            let (mut cuts, mut with_in_flight, mut naive_above) = (0u64, 0u64, 0u64);
            while !done.load(Ordering::Acquire) {
                let snap = budget.snapshot().await.expect("a consistent cut");
                assert!(
                    snap.sum() <= TOTAL,
                    "sum {} > {TOTAL}: {snap:?}",
                    snap.sum()
                );
                assert!(snap.credited() <= snap.debited(), "{snap:?}");
                assert_eq!(snap.sum() + snap.in_flight(), TOTAL, "{snap:?}");
                cuts += 1;
                if snap.in_flight() > 0 {
                    with_in_flight += 1;
                }
                // Separate reads are not a moment; counted, never asserted.
                let naive: u64 = allocations(&budget).await.iter().sum();
                if naive > TOTAL {
                    naive_above += 1;
                }
            }
            (cuts, with_in_flight, naive_above)
        })
    };

    let workers: Vec<_> = (0..TASKS)
        .map(|task| {
            let budget = budget.clone();
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(0x5eed_0000 + task);
                let mut log = Vec::new();
                for n in 0..PER_TASK {
                    let from = rng.random_range(0..3);
                    let to = (from + rng.random_range(1..3)) % 3;
                    // Every 25th asks for more than any region can hold.
                    let amount = if n % 25 == 24 {
                        TOTAL + 1
                    } else {
                        rng.random_range(1..=90)
                    };
                    let id = format!("t{task}-{n}");
                    let result = budget
                        .transfer(&id, REGIONS[from].0, REGIONS[to].0, amount)
                        .await;
                    match &result {
                        Ok(TransferOutcome::Applied) => {}
                        Err(RegionError::Insufficient {
                            region,
                            available,
                            requested,
                        }) => {
                            assert_eq!(region, REGIONS[from].0);
                            assert!(available < requested);
                            assert_eq!(*requested, amount);
                        }
                        other => panic!("unexpected result {other:?}"),
                    }
                    log.push((from, to, amount, result.is_ok()));
                }
                log
            })
        })
        .collect();

    let mut log = Vec::new();
    for w in workers {
        log.extend(w.await.unwrap());
    }
    done.store(true, Ordering::Release);
    let (cuts, with_in_flight, naive_above) = observer.await.unwrap();

    let report = tally(&budget.repair_all().await);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.completed, 0, "nothing was interrupted");

    let applied = log.iter().filter(|t| t.3).count();
    let refused = log.len() - applied;
    let mut expected: Vec<i64> = REGIONS.iter().map(|r| r.1 as i64).collect();
    let (mut out, mut into) = ([0u64; 3], [0u64; 3]);
    for &(from, to, amount, ok) in &log {
        if ok {
            expected[from] -= amount as i64;
            expected[to] += amount as i64;
            out[from] += 1;
            into[to] += 1;
        }
    }
    let expected: Vec<u64> = expected.into_iter().map(|a| a as u64).collect();
    let snap = budget.snapshot().await.unwrap();
    assert_eq!(snap.sum(), TOTAL);
    assert_eq!(snap.in_flight(), 0);
    assert_eq!(allocations(&budget).await, expected);
    assert!(budget.pending().await.unwrap().is_empty());
    for (i, server) in f.servers.iter().enumerate() {
        let region = REGIONS[i].0;
        assert_eq!(hlen(server, region, "debits"), out[i], "{region} debits");
        assert_eq!(hlen(server, region, "credits"), into[i], "{region} credits");
        assert_eq!(hlen(server, region, "pending"), 0, "{region} pending");
    }
    assert_eq!(log.len() as u64, TASKS * PER_TASK);
    assert!(applied > 0);
    assert!(refused >= (TASKS * PER_TASK / 25) as usize);
    eprintln!(
        "{} transfers: {applied} applied, {refused} refused; final {expected:?}; \
         {cuts} consistent cuts observed, {with_in_flight} with money in flight; \
         {naive_above} sums of separate reads above {TOTAL}",
        log.len()
    );
}

/// The same id applied three times, one after another and three at once,
/// moves the amount once; the same id with another amount is a conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_id_three_times_moves_the_amount_once() {
    let f = fleet().await;
    let b = &f.budget;
    let id = String::from("eu-us-30");
    assert_eq!(
        b.transfer(&id, "eu", "us", 30).await,
        Ok(TransferOutcome::Applied)
    );
    assert_eq!(
        b.transfer(&id, "eu", "us", 30).await,
        Ok(TransferOutcome::AlreadyApplied)
    );
    assert_eq!(
        b.transfer(&id, "eu", "us", 30).await,
        Ok(TransferOutcome::AlreadyApplied)
    );
    assert_eq!(allocations(b).await, [70, 110, 60]);

    let err = b.transfer(&id, "eu", "us", 31).await.unwrap_err();
    assert_eq!(
        err,
        RegionError::Conflict {
            id: id.clone(),
            from: "eu".into(),
            recorded_to: "us".into(),
            recorded_amount: 30,
        }
    );
    assert!(matches!(
        b.transfer(&id, "eu", "ap", 30).await,
        Err(RegionError::Conflict { .. })
    ));
    assert_eq!(allocations(b).await, [70, 110, 60]);

    let id = String::from("ap-eu-45");
    let results =
        futures_util::future::join_all((0..3).map(|_| b.transfer(&id, "ap", "eu", 45))).await;
    let applied = results
        .iter()
        .filter(|r| **r == Ok(TransferOutcome::Applied))
        .count();
    assert_eq!(applied, 1, "{results:?}");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(allocations(b).await, [115, 110, 15]);
    assert_eq!(b.repair(&id).await, Ok(TransferOutcome::AlreadyApplied));
    assert_eq!(b.snapshot().await.unwrap().sum(), TOTAL);
    assert_eq!(hlen(&f.servers[AP], "ap", "debits"), 1);
    assert_eq!(hlen(&f.servers[EU], "eu", "credits"), 1);
}

/// A refusal records nothing: the id stays free and the sum stays 240.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_transfer_changes_nothing() {
    let f = fleet().await;
    let b = &f.budget;
    let id = String::from("big");
    assert_eq!(
        b.transfer(&id, "ap", "eu", 61).await,
        Err(RegionError::Insufficient {
            region: "ap".into(),
            available: 60,
            requested: 61,
        })
    );
    assert_eq!(allocations(b).await, [100, 80, 60]);
    assert_eq!(hlen(&f.servers[AP], "ap", "debits"), 0);
    assert_eq!(b.repair(&id).await, Ok(TransferOutcome::NothingDebited));
    // The whole share may move; the allocation reaches 0, never below.
    assert_eq!(
        b.transfer(&id, "ap", "eu", 60).await,
        Ok(TransferOutcome::Applied)
    );
    assert_eq!(allocations(b).await, [160, 80, 0]);
    assert!(matches!(
        b.transfer("ap-us-1", "ap", "us", 1).await,
        Err(RegionError::Insufficient { available: 0, .. })
    ));
    assert_eq!(b.snapshot().await.unwrap().sum(), TOTAL);
}

/// The receiver's Redis dies between the debit and the credit. The transfer
/// fails naming the credit step, 25 is in flight (the sum is 215), and a
/// repair while the receiver is still down changes nothing. The receiver
/// comes back with its data; `repair` credits exactly once (240), and
/// repairing, repairing all and retrying the transfer change nothing after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_transfer_is_repaired_exactly_once() {
    let mut f = fleet().await;
    let id = String::from("eu-us-25");
    assert_eq!(f.servers[US].cli(&["SAVE"]).trim(), "OK");
    f.servers[US].kill();

    let err = f.budget.transfer(&id, "eu", "us", 25).await.unwrap_err();
    match &err {
        RegionError::Unreachable {
            region, message, ..
        } => {
            assert_eq!(region, "us");
            assert!(at_step(message, "credit"), "{message}");
        }
        other => panic!("expected the credit step to fail, got {other:?}"),
    }
    assert!(err.needs_repair());
    assert!(err.to_string().contains("credit"), "{err}");
    assert_eq!(f.budget.allocation("eu").await, Ok(75));
    assert_eq!(f.budget.allocation("ap").await, Ok(60));
    assert!(matches!(
        f.budget.allocation("us").await,
        Err(RegionError::Unreachable { .. })
    ));
    let pending = f.budget.pending().await;
    assert!(pending.is_err(), "us cannot be listed while down");

    assert!(matches!(
        f.budget.repair(&id).await,
        Err(RegionError::Unreachable {
            debited: false,
            ref message,
            ..
        }) if at_step(message, "lookup")
    ));
    assert_eq!(f.budget.allocation("eu").await, Ok(75));

    f.servers[US].restart();
    assert_eq!(
        f.budget.allocation("us").await,
        Ok(80),
        "restored from SAVE"
    );
    let snap = f.budget.snapshot().await.unwrap();
    assert_eq!(snap.sum(), TOTAL - 25);
    assert_eq!(snap.in_flight(), 25);
    let pending = f.budget.pending().await.unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(
        (
            pending[0].id(),
            pending[0].from(),
            pending[0].to(),
            pending[0].amount()
        ),
        (id.as_str(), "eu", "us", 25)
    );

    assert_eq!(f.budget.repair(&id).await, Ok(TransferOutcome::Completed));
    assert_eq!(allocations(&f.budget).await, [75, 105, 60]);
    let snap = f.budget.snapshot().await.unwrap();
    assert_eq!((snap.sum(), snap.in_flight()), (TOTAL, 0));

    assert_eq!(
        f.budget.repair(&id).await,
        Ok(TransferOutcome::AlreadyApplied)
    );
    let report = tally(&f.budget.repair_all().await);
    assert!(report.completed == 0 && report.errors.is_empty());
    assert_eq!(report.already_complete, 0);
    assert_eq!(
        f.budget.transfer(&id, "eu", "us", 25).await,
        Ok(TransferOutcome::AlreadyApplied)
    );
    assert_eq!(allocations(&f.budget).await, [75, 105, 60]);
    assert_eq!(hlen(&f.servers[US], "us", "credits"), 1);
    assert_eq!(hlen(&f.servers[EU], "eu", "pending"), 0);
}

/// The receiver stalls (behind a TCP proxy) with the credit sent: the call
/// gives up at its 200 ms deadline with an unknown outcome, and until the
/// stall ends 30 is in flight. After it ends the held credit may or may not
/// run before the repair does; either way the amount arrives exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_credit_has_an_unknown_outcome_and_is_never_doubled() {
    const DEADLINE: Duration = Duration::from_millis(200);
    const MARGIN: Duration = Duration::from_millis(250);
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxy = StallProxy::start(servers[US].port()).await;
    let urls = [servers[EU].url(), proxy.url(), servers[AP].url()];
    let b = budget_on(&urls, DEADLINE);
    assert!(b.initialize().await.unwrap(), "seeded now");
    // A first credit to us, so the held call is a script us already knows.
    let warm = String::from("ap-us-10");
    assert_eq!(
        b.transfer(&warm, "ap", "us", 10).await,
        Ok(TransferOutcome::Applied)
    );

    proxy.stall();
    let id = String::from("eu-us-30");
    let started = Instant::now();
    let err = b.transfer(&id, "eu", "us", 30).await.unwrap_err();
    let elapsed = started.elapsed();
    match &err {
        RegionError::Unreachable {
            region,
            debited,
            outcome_unknown,
            message,
        } => {
            assert_eq!(
                (
                    region.as_str(),
                    at_step(message, "credit"),
                    *debited,
                    *outcome_unknown
                ),
                ("us", true, true, true)
            );
        }
        other => panic!("expected an unknown credit, got {other:?}"),
    }
    assert!(elapsed >= DEADLINE, "{elapsed:?}");
    assert!(elapsed <= DEADLINE + MARGIN, "{elapsed:?}");
    // Read us straight from its server: the held credit has not run.
    let us = servers[US].cli(&["HGET", &key("us", "state"), "alloc"]);
    assert_eq!(us.trim(), "90");
    assert_eq!(b.allocation("eu").await, Ok(70));
    assert_eq!(b.allocation("ap").await, Ok(50));

    proxy.resume();
    let outcome = b.repair(&id).await.unwrap();
    assert!(
        matches!(
            outcome,
            TransferOutcome::Completed | TransferOutcome::AlreadyApplied
        ),
        "{outcome:?}"
    );
    assert_eq!(b.repair(&id).await, Ok(TransferOutcome::AlreadyApplied));
    assert_eq!(allocations(&b).await, [70, 120, 50]);
    assert_eq!(b.snapshot().await.unwrap().sum(), TOTAL);
    assert_eq!(hlen(&servers[US], "us", "credits"), 2);
    eprintln!("after the stall, repair answered {outcome:?}");
}

/// A call dropped by its caller after it was sent (an outer timeout, a
/// cancelled request) closes its connection as the call's own timeout
/// does: the next call on that region reconnects instead of being sent
/// into a connection that may hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_unanswered_replaces_a_hung_connection() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxy = StallProxy::start(servers[US].port()).await;
    let urls = [servers[EU].url(), proxy.url(), servers[AP].url()];
    let b = budget_on(&urls, Duration::from_secs(2));
    assert!(b.initialize().await.unwrap(), "seeded now");
    assert_eq!(b.allocation("us").await, Ok(80));

    proxy.stall_open_connections();
    // Sent on the hung connection on its first poll, then dropped unanswered.
    assert_eq!(b.allocation("us").now_or_never(), None);
    assert_eq!(
        b.allocation("us").await,
        Ok(80),
        "a new connection, not a timeout on the hung one"
    );
}

/// A receiver restarted without its data is a state loss. The credit is
/// refused rather than re-creating the allocation from nothing, initialize
/// refuses to re-seed it at its initial share (others have moved), and the
/// explicit recovery sets it to 0: the sum stays at most 240 throughout and
/// the lost share is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_region_never_raises_the_sum() {
    let mut f = fleet().await;
    let b = f.budget.clone();
    let first = String::from("eu-us-20");
    assert_eq!(
        b.transfer(&first, "eu", "us", 20).await,
        Ok(TransferOutcome::Applied)
    );
    assert_eq!(allocations(&b).await, [80, 100, 60]);

    f.servers[US].restart(); // no SAVE: us comes back empty

    let id = String::from("eu-us-25");
    let err = b.transfer(&id, "eu", "us", 25).await.unwrap_err();
    // The first call may still find the old connection dead.
    assert!(
        matches!(
            &err,
            RegionError::StateLost { regions, debited: true } if regions == &["us"]
        ) || matches!(
            &err,
            RegionError::Unreachable { region, message, .. }
                if region == "us" && at_step(message, "credit")
        ),
        "{err:?}"
    );
    assert_eq!(
        b.repair(&id).await,
        Err(RegionError::StateLost {
            regions: vec!["us".into()],
            debited: true
        })
    );
    assert_eq!(b.allocation("eu").await, Ok(55));
    assert_eq!(
        b.allocation("us").await,
        Err(RegionError::StateLost {
            regions: vec!["us".into()],
            debited: false
        })
    );
    assert_eq!(
        b.initialize().await,
        Err(RegionError::StateLost {
            regions: vec!["us".into()],
            debited: false
        })
    );
    assert!(matches!(
        b.snapshot().await,
        Err(RegionError::StateLost { .. })
    ));
    assert_eq!(
        f.servers[US].cli(&["EXISTS", &key("us", "state")]).trim(),
        "0",
        "nothing re-created us behind our back"
    );

    assert_eq!(b.recover_lost("us").await, Ok(true));
    assert_eq!(b.recover_lost("us").await, Ok(false));
    assert_eq!(b.allocation("us").await, Ok(0));
    // The debit was made against the lost state of us: never credited to
    // the new one, and dropped from the pending list.
    let lost = RegionError::ReceiverRecreated {
        id: id.clone(),
        from: "eu".into(),
        to: "us".into(),
        amount: 25,
    };
    assert_eq!(b.repair(&id).await, Err(lost.clone()));
    assert_eq!(b.repair(&id).await, Err(lost));
    assert_eq!(b.pending().await, Ok(vec![]));
    assert_eq!(allocations(&b).await, [55, 0, 60]);
    let snap = b.snapshot().await.unwrap();
    assert_eq!(snap.sum(), 115);
    assert!(snap.sum() <= TOTAL);
    assert_eq!(
        b.transfer("ap-us-5", "ap", "us", 5).await,
        Ok(TransferOutcome::Applied)
    );
    assert_eq!(allocations(&b).await, [55, 5, 55]);
}

/// Bad settings and bad requests are typed errors, found before any Redis
/// call (these budgets point at ports where nothing listens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_and_requests_are_typed_errors() {
    let url = format!("redis://127.0.0.1:{}/", support::free_port(false));
    let field =
        |b: tower_admission::outbound::RegionalBudgetBuilder| b.build().unwrap_err().field();
    assert_eq!(field(RegionalBudget::builder(240)), "regions");
    assert_eq!(
        field(RegionalBudget::builder(0).region("eu", &url, 0)),
        "total"
    );
    assert_eq!(
        field(RegionalBudget::builder(1 << 53).region("eu", &url, 1 << 53)),
        "total"
    );
    assert_eq!(
        field(
            RegionalBudget::builder(240)
                .region("eu", &url, 100)
                .region("us", &url, 80)
        ),
        "regions"
    );
    assert_eq!(
        field(
            RegionalBudget::builder(240)
                .region("eu", &url, 120)
                .region("eu", &url, 120)
        ),
        "region"
    );
    assert_eq!(
        field(RegionalBudget::builder(240).region("e u", &url, 240)),
        "region"
    );
    assert_eq!(
        field(RegionalBudget::builder(240).region("", &url, 240)),
        "region"
    );
    assert_eq!(
        field(RegionalBudget::builder(240).region("eu", "http://x/", 240)),
        "url"
    );
    assert_eq!(
        field(
            RegionalBudget::builder(240)
                .name("a{b}")
                .region("eu", &url, 240)
        ),
        "name"
    );
    for timeout in [Duration::ZERO, Duration::MAX] {
        assert_eq!(
            field(
                RegionalBudget::builder(240)
                    .region("eu", &url, 240)
                    .call_timeout(timeout)
            ),
            "call_timeout"
        );
    }
    let urls = [url.clone(), url.clone(), url];
    let b = budget_on(&urls, Duration::from_millis(100));
    // Ids are checked before any Redis call; `~` names ordered transfers.
    for bad in [
        String::new(),
        "x".repeat(129),
        "tab\there".into(),
        "~us~1".into(),
    ] {
        assert_eq!(
            b.transfer(&bad, "eu", "us", 1).await,
            Err(RegionError::InvalidId { id: bad.clone() })
        );
    }
    assert_eq!(
        b.repair("has space").await,
        Err(RegionError::InvalidId {
            id: "has space".into()
        })
    );
    let id = "x".repeat(128);
    assert_eq!(
        b.transfer(&id, "eu", "us", 0).await,
        Err(RegionError::ZeroAmount)
    );
    assert_eq!(
        b.transfer(&id, "eu", "mars", 1).await,
        Err(RegionError::UnknownRegion {
            region: "mars".into()
        })
    );
    assert_eq!(
        b.transfer(&id, "eu", "eu", 1).await,
        Err(RegionError::SameRegion {
            region: "eu".into()
        })
    );
    assert_eq!(
        b.allocation("mars").await,
        Err(RegionError::UnknownRegion {
            region: "mars".into()
        })
    );
    // Nothing listens: a real call fails as unreachable at the debit, known
    // not applied (the connection was refused), within the deadline.
    let started = Instant::now();
    let err = b.transfer(&id, "eu", "us", 1).await.unwrap_err();
    assert!(started.elapsed() <= Duration::from_millis(100 + 250));
    assert!(
        matches!(
            &err,
            RegionError::Unreachable {
                debited: false,
                outcome_unknown: false,
                message,
                ..
            } if at_step(message, "debit")
        ),
        "{err:?}"
    );
    assert!(!err.needs_repair());
}

/// A region added to a running budget (240 all in eu, then a split of 120
/// eu + 120 us) is not seeded at its initial share: eu still holds 240, so
/// us at 120 would raise the sum to 360. `initialize` refuses and changes
/// nothing; the region is created at 0 and allocation moved to it by a
/// transfer. A cut above the total, as an older version could leave, is
/// never reported as a snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_added_later_never_raises_the_sum() {
    let eu = RedisServer::start();
    let us = RedisServer::start();
    let v1 = RegionalBudget::builder(TOTAL)
        .name("pay")
        .region("eu", &eu.url(), 240)
        .build()
        .unwrap();
    assert_eq!(v1.initialize().await, Ok(true));
    let v2 = RegionalBudget::builder(TOTAL)
        .name("pay")
        .region("eu", &eu.url(), 120)
        .region("us", &us.url(), 120)
        .build()
        .unwrap();
    assert_eq!(
        v2.initialize().await,
        Err(RegionError::AboveTotal {
            sum: 360,
            total: 240
        })
    );
    let us_state = "tower-admission:regions:{pay:us}:state";
    assert_eq!(us.cli(&["EXISTS", us_state]).trim(), "0");
    assert_eq!(v2.recover_lost("us").await, Ok(true));
    assert_eq!(
        v2.transfer("eu-us-120", "eu", "us", 120).await,
        Ok(TransferOutcome::Applied)
    );
    let snap = v2.snapshot().await.unwrap();
    assert_eq!(
        snap.allocations().collect::<Vec<_>>(),
        [("eu", 120), ("us", 120)]
    );
    assert_eq!(v2.initialize().await, Ok(false));

    // The state the unchecked seeding left: eu 240 and us 120.
    eu.cli(&[
        "HSET",
        "tower-admission:regions:{pay:eu}:state",
        "alloc",
        "240",
    ]);
    assert_eq!(
        v2.snapshot().await,
        Err(RegionError::AboveTotal {
            sum: 360,
            total: 240
        })
    );
}

/// The receiver loses its data after a transfer to it was credited and
/// passed on (eu → us 30, then us → ap 110), and is recovered at 0. The
/// debit was bound to the receiver's lost state, so a retry, a repair and a
/// repair of a stale pending mark are all refused: crediting the new state
/// would count the 30 twice (270 of 240).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_recreated_after_a_debit_is_never_credited_it() {
    let mut f = fleet().await;
    let b = f.budget.clone();
    let t1 = String::from("t1-eu-us-30");
    assert_eq!(
        b.transfer(&t1, "eu", "us", 30).await,
        Ok(TransferOutcome::Applied)
    );
    let t2 = String::from("t2-us-ap-110");
    assert_eq!(
        b.transfer(&t2, "us", "ap", 110).await,
        Ok(TransferOutcome::Applied)
    );
    // A pending mark left behind, as when the settle step failed.
    let record = f.servers[EU].cli(&["HGET", &key("eu", "debits"), t1.as_str()]);
    f.servers[EU].cli(&["HSET", &key("eu", "pending"), t1.as_str(), record.trim()]);

    f.servers[US].restart(); // no SAVE: us comes back empty
    let _ = b.allocation("us").await; // the first call may find the old connection dead
    assert_eq!(b.recover_lost("us").await, Ok(true));
    assert_eq!(allocations(&b).await, [70, 0, 170]);

    let lost = RegionError::ReceiverRecreated {
        id: t1.clone(),
        from: "eu".into(),
        to: "us".into(),
        amount: 30,
    };
    let report = tally(&b.repair_all().await);
    assert_eq!(report.errors, std::slice::from_ref(&lost));
    assert_eq!(report.completed, 0);
    assert_eq!(
        b.pending().await,
        Ok(vec![]),
        "dropped from the pending list"
    );
    assert_eq!(b.transfer(&t1, "eu", "us", 30).await, Err(lost.clone()));
    assert_eq!(b.repair(&t1).await, Err(lost.clone()));
    assert!(!lost.needs_repair());
    assert_eq!(allocations(&b).await, [70, 0, 170]);
    assert_eq!(b.snapshot().await.unwrap().sum(), TOTAL);

    // New transfers to the recovered region are bound to its new state.
    assert_eq!(
        b.transfer("ap-us-20", "ap", "us", 20).await,
        Ok(TransferOutcome::Applied)
    );
    assert_eq!(allocations(&b).await, [70, 20, 150]);
}

/// The donor loses its data after a completed transfer (eu → us 30), is
/// recovered at 0 and receives 50. A retry of the transfer finds no debit
/// record on eu, but us holds the credit from eu's earlier state: the new
/// debit is given back, and the retry answers what happened before,
/// `AlreadyApplied`, with nothing moved, however often it is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_the_donor_lost_its_data_moves_nothing() {
    let mut f = fleet().await;
    let b = f.budget.clone();
    let t1 = String::from("t1");
    assert_eq!(
        b.transfer(&t1, "eu", "us", 30).await,
        Ok(TransferOutcome::Applied)
    );
    f.servers[EU].restart(); // no SAVE: eu comes back empty
    let _ = b.allocation("eu").await;
    assert_eq!(b.recover_lost("eu").await, Ok(true));
    assert_eq!(
        b.transfer(&String::from("t3"), "ap", "eu", 50).await,
        Ok(TransferOutcome::Applied)
    );
    assert_eq!(allocations(&b).await, [50, 110, 10]);

    for _ in 0..2 {
        assert_eq!(
            b.transfer(&t1, "eu", "us", 30).await,
            Ok(TransferOutcome::AlreadyApplied)
        );
        assert_eq!(allocations(&b).await, [50, 110, 10]);
    }
    assert_eq!(b.repair(&t1).await, Ok(TransferOutcome::AlreadyApplied));
    assert_eq!(b.pending().await, Ok(vec![]));
    let snap = b.snapshot().await.unwrap();
    assert_eq!((snap.sum(), snap.in_flight()), (170, 0));
    assert_eq!(hlen(&f.servers[US], "us", "credits"), 1);
}

/// What the model expects of one transfer out of one donor.
#[derive(Debug, Clone)]
struct Modelled {
    to: usize,
    amount: u64,
    credited: bool,
}

/// The regions' allocations and every debited transfer, keyed by donor and
/// id, as the documented semantics say they must be.
struct Model {
    alloc: [u64; 3],
    debited: std::collections::HashMap<(usize, String), Modelled>,
}

impl Model {
    fn in_flight(&self) -> u64 {
        self.debited
            .values()
            .filter(|t| !t.credited)
            .map(|t| t.amount)
            .sum()
    }

    fn credit(&mut self, key: &(usize, String)) {
        let t = self.debited.get_mut(key).expect("a debited transfer");
        assert!(!t.credited, "{key:?} credited twice by the model");
        t.credited = true;
        self.alloc[t.to] += t.amount;
    }

    /// What `transfer` must answer, and the model's change: `None` for a
    /// refusal (nothing changes).
    fn expect_transfer(&mut self, id: &str, from: usize, to: usize, amount: u64) -> Expected {
        let key = (from, id.to_owned());
        if let Some(t) = self.debited.get(&key).cloned() {
            if t.to != to || t.amount != amount {
                return Expected::Conflict;
            }
            if t.credited {
                return Expected::Ok(TransferOutcome::AlreadyApplied);
            }
            self.credit(&key);
            return Expected::Ok(TransferOutcome::Completed);
        }
        if self.alloc[from] < amount {
            return Expected::Insufficient(self.alloc[from]);
        }
        self.alloc[from] -= amount;
        self.debited.insert(
            key.clone(),
            Modelled {
                to,
                amount,
                credited: false,
            },
        );
        self.credit(&key);
        Expected::Ok(TransferOutcome::Applied)
    }
}

#[derive(Debug, PartialEq)]
enum Expected {
    Ok(TransferOutcome),
    Conflict,
    Insufficient(u64),
}

fn matches_expected(got: &Result<TransferOutcome, RegionError>, want: &Expected) -> bool {
    match (got, want) {
        (Ok(outcome), Expected::Ok(expected)) => outcome == expected,
        (Err(RegionError::Conflict { .. }), Expected::Conflict) => true,
        (Err(RegionError::Insufficient { available, .. }), Expected::Insufficient(a)) => {
            available == a
        }
        _ => false,
    }
}

/// After every step: a consistent cut sums to at most the total, the sum
/// plus what is in flight is exactly the total, every region holds what
/// the model says, and each region's credit records are exactly the
/// transfers credited to it (so none was applied twice).
async fn check_against_model(f: &Fleet, model: &Model, context: &str) {
    let snap = f.budget.snapshot().await.expect("a consistent cut");
    assert!(snap.sum() <= TOTAL, "{context}: {snap:?}");
    assert_eq!(snap.sum() + snap.in_flight(), TOTAL, "{context}: {snap:?}");
    assert_eq!(snap.in_flight(), model.in_flight(), "{context}: {snap:?}");
    for (i, (name, _)) in REGIONS.iter().enumerate() {
        assert_eq!(
            snap.allocation(name),
            Some(model.alloc[i]),
            "{context}: {name} in {snap:?}"
        );
        let credited = model
            .debited
            .values()
            .filter(|t| t.to == i && t.credited)
            .count() as u64;
        assert_eq!(
            hlen(&f.servers[i], name, "credits"),
            credited,
            "{context}: credits recorded in {name}"
        );
    }
}

/// Waits until `region` answers again after a restart.
async fn reachable(budget: &RegionalBudget, region: &str) {
    for _ in 0..20 {
        if budget.allocation(region).await.is_ok() {
            return;
        }
    }
    panic!("{region} stays unreachable");
}

/// Random interleavings of every kind of step against a model: new
/// transfers (some larger than the donor holds), replays of earlier ids
/// (same and different amounts), transfers to and from the same region and
/// to an unknown one, two transfers at once, transfers whose credit never
/// runs (the receiver is down after the debit, as when the process dies
/// between the steps), repairs of those and of finished ones, retries of
/// interrupted ids, and `repair_all`. After every step the cut and the
/// credit records match the model exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_transfers_replays_interruptions_and_repairs_match_the_model() {
    let names = REGIONS.map(|(name, _)| name);
    let (mut interrupted, mut replays, mut concurrent) = (0, 0, 0);
    for seed in 0..4u64 {
        let mut f = fleet().await;
        let mut rng = StdRng::seed_from_u64(seed);
        let mut model = Model {
            alloc: REGIONS.map(|(_, initial)| initial),
            debited: Default::default(),
        };
        let mut next_id = 0u64;
        let mut fresh = |prefix: &str| {
            next_id += 1;
            format!("{prefix}-{seed}-{next_id}")
        };
        for step in 0..60 {
            let context = format!("seed {seed} step {step}");
            let pair = |rng: &mut StdRng| {
                let from = rng.random_range(0..3);
                (from, (from + rng.random_range(1..3)) % 3)
            };
            match rng.random_range(0..10) {
                // A new transfer, at times more than the donor holds.
                0..=2 => {
                    let (from, to) = pair(&mut rng);
                    let amount = rng.random_range(1..=120);
                    let id = fresh("t");
                    let want = model.expect_transfer(&id, from, to, amount);
                    let got = f.budget.transfer(&id, names[from], names[to], amount).await;
                    assert!(
                        matches_expected(&got, &want),
                        "{context}: {got:?} != {want:?}"
                    );
                }
                // A replay of an earlier id, with its amount or another.
                3 if !model.debited.is_empty() => {
                    let keys: Vec<_> = model.debited.keys().cloned().collect();
                    let (from, id) = keys[rng.random_range(0..keys.len())].clone();
                    let t = model.debited[&(from, id.clone())].clone();
                    let amount = if rng.random_bool(0.7) {
                        t.amount
                    } else {
                        t.amount + 1
                    };
                    let want = model.expect_transfer(&id, from, t.to, amount);
                    let got = f
                        .budget
                        .transfer(&id, names[from], names[t.to], amount)
                        .await;
                    assert!(
                        matches_expected(&got, &want),
                        "{context}: {got:?} != {want:?}"
                    );
                    replays += 1;
                }
                // To and from the same region, or to an unknown region.
                4 => {
                    let from = rng.random_range(0..3);
                    let id = fresh("bad");
                    assert!(matches!(
                        f.budget.transfer(&id, names[from], names[from], 1).await,
                        Err(RegionError::SameRegion { .. })
                    ));
                    assert!(matches!(
                        f.budget.transfer(&id, names[from], "mars", 1).await,
                        Err(RegionError::UnknownRegion { .. })
                    ));
                    assert_eq!(
                        f.budget.repair(&id).await,
                        Ok(TransferOutcome::NothingDebited)
                    );
                }
                // Two transfers at once: each applied or refused, whole.
                5 => {
                    let ((a_from, a_to), (b_from, b_to)) = (pair(&mut rng), pair(&mut rng));
                    let (a_amount, b_amount) = (rng.random_range(1..=80), rng.random_range(1..=80));
                    let (a_id, b_id) = (fresh("a"), fresh("b"));
                    let (a_key, b_key) = (String::from(&a_id), String::from(&b_id));
                    let (a, b) = tokio::join!(
                        f.budget
                            .transfer(&a_key, names[a_from], names[a_to], a_amount),
                        f.budget
                            .transfer(&b_key, names[b_from], names[b_to], b_amount),
                    );
                    for (got, id, from, to, amount) in [
                        (a, a_id, a_from, a_to, a_amount),
                        (b, b_id, b_from, b_to, b_amount),
                    ] {
                        match got {
                            Ok(TransferOutcome::Applied) => {
                                assert!(model.alloc[from] >= amount, "{context}: overdrawn");
                                let want = model.expect_transfer(&id, from, to, amount);
                                assert_eq!(want, Expected::Ok(TransferOutcome::Applied));
                            }
                            Err(RegionError::Insufficient { .. }) => {}
                            other => panic!("{context}: {other:?}"),
                        }
                    }
                    concurrent += 1;
                }
                // The credit never runs: the receiver is down after the debit.
                6 => {
                    let (from, to) = pair(&mut rng);
                    if model.alloc[from] == 0 {
                        continue;
                    }
                    let amount = rng.random_range(1..=model.alloc[from]);
                    let id = fresh("cut");
                    assert_eq!(f.servers[to].cli(&["SAVE"]).trim(), "OK");
                    f.servers[to].kill();
                    let got = f.budget.transfer(&id, names[from], names[to], amount).await;
                    assert!(
                        matches!(
                            &got,
                            Err(RegionError::Unreachable {
                                debited: true,
                                message,
                                ..
                            }) if at_step(message, "credit")
                        ),
                        "{context}: {got:?}"
                    );
                    model.alloc[from] -= amount;
                    model.debited.insert(
                        (from, id),
                        Modelled {
                            to,
                            amount,
                            credited: false,
                        },
                    );
                    f.servers[to].restart();
                    reachable(&f.budget, names[to]).await;
                    interrupted += 1;
                }
                // A repair of one transfer, finished or not.
                7 if !model.debited.is_empty() => {
                    let keys: Vec<_> = model.debited.keys().cloned().collect();
                    let key = keys[rng.random_range(0..keys.len())].clone();
                    let want = if model.debited[&key].credited {
                        TransferOutcome::AlreadyApplied
                    } else {
                        model.credit(&key);
                        TransferOutcome::Completed
                    };
                    let id = String::from(&key.1);
                    assert_eq!(f.budget.repair(&id).await, Ok(want), "{context}");
                }
                // Everything pending, repaired at once.
                8 => {
                    let open: Vec<_> = model
                        .debited
                        .iter()
                        .filter(|(_, t)| !t.credited)
                        .map(|(k, _)| k.clone())
                        .collect();
                    let report = tally(&f.budget.repair_all().await);
                    assert!(report.errors.is_empty(), "{context}: {report:?}");
                    assert_eq!(report.completed, open.len(), "{context}");
                    for key in &open {
                        model.credit(key);
                    }
                }
                _ => continue,
            }
            check_against_model(&f, &model, &context).await;
        }
        assert_eq!(model.alloc.iter().sum::<u64>() + model.in_flight(), TOTAL);
    }
    assert!(
        interrupted >= 4 && replays >= 4 && concurrent >= 4,
        "{interrupted} interrupted, {replays} replays, {concurrent} concurrent"
    );
}

/// A donor that lost its data while its debit's credit was still on the
/// way: the credit reaches the receiver after `initialize` re-seeded the
/// donor at its initial share, which already holds the amount again. The
/// credit of that earlier life must never land: the sum stays 240. Before,
/// `initialize` found the other regions untouched (the credit had not
/// landed yet) and re-seeded eu at 100; the held credit then raised us to
/// 110 and the sum to 270.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credit_from_a_donor_reseeded_after_its_debit_never_lands() {
    const DEADLINE: Duration = Duration::from_millis(200);
    let mut servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxy = StallProxy::start(servers[US].port()).await;
    let urls = [servers[EU].url(), proxy.url(), servers[AP].url()];
    let b = budget_on(&urls, DEADLINE);
    assert!(b.initialize().await.unwrap(), "seeded now");
    // us knows the credit script, so the held call runs once delivered.
    let credit = include_str!("../src/outbound/regions/scripts/regions_credit.lua");
    servers[US].cli(&["SCRIPT", "LOAD", credit]);

    proxy.stall_open_connections();
    let id = String::from("eu-us-30");
    let err = b.transfer(&id, "eu", "us", 30).await.unwrap_err();
    assert!(
        matches!(
            &err,
            RegionError::Unreachable {
                debited: true,
                outcome_unknown: true,
                message,
                ..
            } if at_step(message, "credit")
        ),
        "{err:?}"
    );
    servers[EU].restart(); // no SAVE: eu comes back empty, its debit gone
    let initialized = b.initialize().await;
    let credits_run = support::command_calls(&servers[US], &["evalsha"]);
    proxy.resume();
    for _ in 0..500 {
        if support::command_calls(&servers[US], &["evalsha"]) > credits_run {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        support::command_calls(&servers[US], &["evalsha"]),
        credits_run + 1,
        "the held credit ran"
    );
    let us = servers[US].cli(&["HGET", &key("us", "state"), "alloc"]);
    let eu = servers[EU].cli(&["HGET", &key("eu", "state"), "alloc"]);
    let sum = us.trim().parse::<u64>().unwrap() + eu.trim().parse::<u64>().unwrap_or(0) + 60;
    assert!(
        sum <= TOTAL,
        "{initialized:?}: eu {eu:?}, us {us:?}, sum {sum}"
    );
    assert_eq!(us.trim(), "80", "{initialized:?}");
    assert_eq!(initialized, Ok(true));
    assert_eq!(allocations(&b).await, [100, 80, 60]);
    let snap = b.snapshot().await.unwrap();
    assert_eq!((snap.sum(), snap.in_flight()), (TOTAL, 0));

    // The re-seeded eu sends as before.
    let next = String::from("eu-us-10");
    assert_eq!(
        b.transfer(&next, "eu", "us", 10).await,
        Ok(TransferOutcome::Applied)
    );
    assert_eq!(allocations(&b).await, [90, 90, 60]);
    // Lost again, now recovered at 0: its new state sends too.
    servers[EU].restart();
    assert!(matches!(
        b.initialize().await,
        Err(RegionError::StateLost { .. })
    ));
    assert_eq!(b.recover_lost("eu").await, Ok(true));
    for (id, from, to) in [("ap-eu-5", "ap", "eu"), ("eu-us-5", "eu", "us")] {
        assert_eq!(
            b.transfer(id, from, to, 5).await,
            Ok(TransferOutcome::Applied),
            "{id}"
        );
    }
    assert_eq!(allocations(&b).await, [0, 95, 55]);
}

/// Processes initializing at once on a first start, some finding regions
/// another has seeded already: every region is seeded once, at its share,
/// and afterwards every region sends to every other (none is left taking
/// credits only from a state that never was).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_initializing_at_once_leave_every_region_sending() {
    for round in 0..5 {
        let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
        let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
        let processes: Vec<RegionalBudget> = (0..4)
            .map(|_| budget_on(&urls, Duration::from_millis(500)))
            .collect();
        let results =
            futures_util::future::join_all(processes.iter().map(|p| p.initialize())).await;
        assert!(
            results.iter().all(Result::is_ok),
            "round {round}: {results:?}"
        );
        assert!(results.contains(&Ok(true)), "round {round}");
        let b = &processes[round % processes.len()];
        assert_eq!(allocations(b).await, [100, 80, 60], "round {round}");
        for (from, _) in REGIONS {
            for (to, _) in REGIONS.iter().filter(|(to, _)| *to != from) {
                let id = format!("{from}-{to}");
                assert_eq!(
                    b.transfer(&id, from, to, 1).await,
                    Ok(TransferOutcome::Applied),
                    "round {round}: {from} to {to}"
                );
            }
        }
        assert_eq!(allocations(b).await, [100, 80, 60], "round {round}");
    }
}

/// True if an unreachable region's `message` names the transfer step `step`.
fn at_step(message: &str, step: &str) -> bool {
    message.starts_with(&format!("at the {step} step:"))
}

/// What `repair_all` answered, counted.
#[derive(Debug)]
struct Tally {
    /// Transfers credited by that call.
    completed: usize,
    /// Pending entries that were complete already.
    already_complete: usize,
    /// The failures.
    errors: Vec<RegionError>,
}

fn tally(results: &[Result<TransferOutcome, RegionError>]) -> Tally {
    let count = |outcome| results.iter().filter(|r| **r == Ok(outcome)).count();
    Tally {
        completed: count(TransferOutcome::Completed),
        already_complete: count(TransferOutcome::AlreadyApplied),
        errors: results.iter().filter_map(|r| r.clone().err()).collect(),
    }
}
