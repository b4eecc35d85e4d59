//! Ordered transfers keep bounded records: 100,002 transfers (12,000 in the
//! CI form; `scripts/regions-long` runs the long one) leave each
//! region's keys at a size fixed by the number of regions, and a late retry
//! of a transfer whose record was compacted away (its number is below the
//! pair's watermark) is applied at most once. Each region is its own
//! `redis-server`, started by the test.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use tower_admission::outbound::{RegionError, RegionalBudget, TransferOutcome};

use support::RedisServer;

const REGIONS: [(&str, u64); 3] = [("eu", 100), ("us", 80), ("ap", 60)];
const TOTAL: u64 = 240;

struct Fleet {
    servers: Vec<RedisServer>,
    budget: RegionalBudget,
}

async fn fleet(hold: Duration) -> Fleet {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let mut builder = RegionalBudget::builder(TOTAL).credit_hold(hold);
    for ((name, initial), server) in REGIONS.iter().zip(&servers) {
        builder = builder.region(name, &server.url(), *initial);
    }
    let budget = builder.build().unwrap();
    budget.initialize().await.unwrap();
    Fleet { servers, budget }
}

fn state_key(region: &str) -> String {
    format!("tower-admission:regions:{{default:{region}}}:state")
}

fn pending_key(region: &str) -> String {
    format!("tower-admission:regions:{{default:{region}}}:pending")
}

/// (keys, fields, bytes) the region holds in its Redis.
fn footprint(server: &RedisServer) -> (usize, usize, usize) {
    let keys: Vec<String> = server
        .cli(&["--scan"])
        .lines()
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .collect();
    let mut fields = 0;
    let mut bytes = 0;
    for key in &keys {
        fields += server.cli(&["HLEN", key]).trim().parse::<usize>().unwrap();
        bytes += server
            .cli(&["MEMORY", "USAGE", key])
            .trim()
            .parse::<usize>()
            .unwrap();
    }
    (keys.len(), fields, bytes)
}

/// The documented bound: 6 fields of its own (alloc, debited, credited, seq,
/// epoch, hold) and, per other region, `from:`, `out:`, `last:` and one
/// `in:` per life of that region; no pending field once every transfer is
/// confirmed.
const FIELDS_BOUND: usize = 6 + 2 * 4;

#[tokio::test]
async fn many_transfers_leave_bounded_records() {
    let f = fleet(Duration::from_micros(1)).await;
    let pairs = [
        ("eu", "us"),
        ("us", "ap"),
        ("ap", "eu"),
        ("us", "eu"),
        ("ap", "us"),
        ("eu", "ap"),
    ];
    // CI runs 12,000; `scripts/regions-long` runs 100,002 (16,667 a pair).
    let per_pair: u64 = std::env::var("REGIONS_LEDGER_PER_PAIR")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    let tasks = pairs.map(|(from, to)| {
        let budget = f.budget.clone();
        tokio::spawn(async move {
            let mut n = 1;
            while n <= per_pair {
                match budget.send(from, to, n, 1).await {
                    Ok(TransferOutcome::Applied) => n += 1,
                    // The donor gave its last unit to another pair: wait for
                    // one to come back.
                    Err(RegionError::Insufficient { .. }) => tokio::task::yield_now().await,
                    other => panic!("{from}->{to} #{n}: {other:?}"),
                }
            }
        })
    });
    for task in tasks {
        task.await.unwrap();
    }
    let snapshot = f.budget.snapshot().await.unwrap();
    assert_eq!(snapshot.sum(), TOTAL);
    assert_eq!(snapshot.in_flight(), 0);
    for (server, (name, _)) in f.servers.iter().zip(REGIONS) {
        let (keys, fields, bytes) = footprint(server);
        println!(
            "{name}: {keys} key(s), {fields} fields, {bytes} bytes after {} transfers",
            6 * per_pair
        );
        assert_eq!(keys, 1, "{name}: only the state hash is left");
        assert!(fields <= FIELDS_BOUND, "{name}: {fields} fields");
        assert!(bytes <= 1024, "{name}: {bytes} bytes");
    }
}

#[tokio::test]
async fn a_late_retry_after_compaction_is_applied_at_most_once() {
    let f = fleet(Duration::from_micros(1)).await;
    let eu = &f.servers[0];
    for n in 1..=5 {
        assert_eq!(
            f.budget.send("eu", "us", n, 10).await.unwrap(),
            TransferOutcome::Applied
        );
    }
    let after = f.budget.snapshot().await.unwrap();
    assert_eq!(after.allocation("eu"), Some(50));
    assert_eq!(after.allocation("us"), Some(130));

    // A retry of an old number: its record is gone, the watermark answers.
    assert_eq!(
        f.budget.send("eu", "us", 2, 10).await.unwrap(),
        TransferOutcome::AlreadyApplied
    );
    // A stale pending mark for an old number (a lost settle, say) reaches
    // the receiver again through repair: the watermark refuses it.
    let record = eu.cli(&["HGET", &state_key("eu"), "last:us"]);
    let record = record.trim();
    eu.cli(&["HSET", &pending_key("eu"), "~us~3", record]);
    let report = f.budget.repair_all().await;
    let count = |outcome| report.iter().filter(|r| **r == Ok(outcome)).count();
    assert_eq!(count(TransferOutcome::Completed), 0, "{report:?}");
    assert_eq!(count(TransferOutcome::AlreadyApplied), 1);
    assert!(report.iter().all(Result::is_ok), "{report:?}");
    // The same for the last number, retried through send.
    eu.cli(&["HSET", &pending_key("eu"), "~us~5", record]);
    assert_eq!(
        f.budget.send("eu", "us", 5, 10).await.unwrap(),
        TransferOutcome::AlreadyApplied
    );

    let end = f.budget.snapshot().await.unwrap();
    assert_eq!(end.allocation("eu"), Some(50));
    assert_eq!(end.allocation("us"), Some(130));
    assert_eq!(end.sum(), TOTAL);
}

#[tokio::test]
async fn ordered_transfers_refuse_gaps_and_a_second_one_in_flight() {
    let f = fleet(Duration::from_micros(1)).await;
    assert_eq!(f.budget.next_number("eu", "us").await.unwrap(), 1);
    let err = f.budget.send("eu", "us", 2, 10).await.unwrap_err();
    assert!(
        matches!(
            err,
            RegionError::OutOfOrder {
                number: 2,
                last: 0,
                ..
            }
        ),
        "{err:?}"
    );
    f.budget.send("eu", "us", 1, 10).await.unwrap();
    // The credit of #1 unconfirmed (its pending mark back): no #2 yet.
    let eu = &f.servers[0];
    let record = eu.cli(&["HGET", &state_key("eu"), "last:us"]);
    eu.cli(&["HSET", &pending_key("eu"), "~us~1", record.trim()]);
    let err = f.budget.send("eu", "us", 2, 10).await.unwrap_err();
    assert!(
        matches!(err, RegionError::InFlight { number: 1, .. }),
        "{err:?}"
    );
    f.budget.repair_all().await;
    assert_eq!(f.budget.next_number("eu", "us").await.unwrap(), 2);
    f.budget.send("eu", "us", 2, 10).await.unwrap();
    let snapshot = f.budget.snapshot().await.unwrap();
    assert_eq!(snapshot.allocation("eu"), Some(80));
    assert_eq!(snapshot.allocation("us"), Some(100));
}

#[tokio::test]
async fn received_allocation_is_held_before_it_counts_or_moves_on() {
    let f = fleet(Duration::from_secs(3600)).await;
    f.budget.send("eu", "us", 1, 30).await.unwrap();
    let allocation = f.budget.allocation("us").await.unwrap();
    let spendable = f.budget.spendable("us").await.unwrap();
    assert_eq!(
        (allocation, allocation - spendable, spendable),
        (110, 30, 80),
        "(allocation, held, spendable)"
    );
    // us may give only what it held before.
    let err = f.budget.send("us", "ap", 1, 81).await.unwrap_err();
    assert!(
        matches!(err, RegionError::Insufficient { available: 80, .. }),
        "{err:?}"
    );
    f.budget.send("us", "ap", 1, 80).await.unwrap();
    let allocation = f.budget.allocation("us").await.unwrap();
    let spendable = f.budget.spendable("us").await.unwrap();
    assert_eq!((allocation, spendable), (30, 0));
}

#[tokio::test]
async fn restore_lost_returns_exactly_what_a_state_loss_took() {
    let mut f = fleet(Duration::from_micros(1)).await;
    f.budget.send("eu", "ap", 1, 20).await.unwrap();
    // ap dies without persistence; a transfer toward it (by id: bound to
    // the state last seen) is debited and never credited.
    f.servers[2].kill();
    let id = String::from("to-ap");
    let err = f.budget.transfer(&id, "us", "ap", 10).await.unwrap_err();
    assert!(err.needs_repair(), "{err:?}");
    f.servers[2].restart();
    assert!(f.budget.recover_lost("ap").await.unwrap());
    // An id-based transfer pending: its amount cannot be placed in a cut.
    let refused = f.budget.restore_lost("ap").await.unwrap_err();
    assert!(
        matches!(refused, RegionError::NotConsistent { .. }),
        "{refused:?}"
    );
    f.budget.repair_all().await; // the debit toward the lost ap is dropped
    let before = f.budget.allocations().await.unwrap();
    assert_eq!(
        before,
        [
            ("eu".to_owned(), 80),
            ("us".to_owned(), 70),
            ("ap".to_owned(), 0)
        ]
    );

    assert_eq!(f.budget.restore_lost("ap").await.unwrap(), 90);
    assert_eq!(f.budget.restore_lost("ap").await.unwrap(), 0, "once only");
    let after = f.budget.snapshot().await.unwrap();
    assert_eq!(after.allocation("ap"), Some(90));
    assert_eq!(after.sum(), TOTAL);
    // Held like a credit: spendable only after the hold (1 µs here).
    let spendable = f.budget.spendable("ap").await.unwrap();
    assert!(spendable <= 90, "{spendable}");
    assert_eq!(f.budget.allocation("ap").await, Ok(90));
}
