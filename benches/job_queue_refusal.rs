//! Time of `JobQueue::submit` refusing an owner at its cap, as the queue
//! grows: the refusal happens under the queue's lock, which every worker
//! and every other submit also takes, so its cost is everybody's wait.
//!
//! For queues of 10, 1,000 and 100,000 waiting jobs (4 workers, each
//! running one job that never ends, `per_owner` 2), the owner of the two
//! newest waiting jobs submits in a tight loop; each sample times 10,000
//! refusals, and the median of 21 samples is printed in ns per refusal. The
//! same is printed for an owner whose jobs run (its wait needs no queue
//! position) and for a full queue.
//!
//! Run: `cargo bench --bench job_queue_refusal`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use tower_admission::jobs::JobQueue;
use tower_admission::reject::Rejection;

const SAMPLES: usize = 21;
const REFUSALS: u32 = 10_000;

/// Median ns per refusal of `owner`'s submit.
fn median_ns(queue: &JobQueue<u32, (), ()>, owner: &str, expect_full: bool) -> f64 {
    let mut samples: Vec<f64> = (0..SAMPLES)
        .map(|_| {
            let start = Instant::now();
            for n in 0..REFUSALS {
                let refused = queue.submit(owner, black_box(n)).unwrap_err();
                debug_assert_eq!(matches!(refused, Rejection::Overloaded { .. }), expect_full);
                black_box(refused);
            }
            start.elapsed().as_nanos() as f64 / f64::from(REFUSALS)
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[SAMPLES / 2]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    println!("waiting jobs | owner busy, waiting (ns) | owner busy, running (ns) | full (ns)");
    for waiting in [10usize, 1_000, 100_000] {
        runtime.block_on(async {
            let queue = JobQueue::builder()
                .capacity(waiting + 1)
                .workers(4)
                .per_owner(2)
                .build(|_: u32| std::future::pending::<Result<(), ()>>())
                .unwrap();
            // The running owner's two jobs and two others take the 4 workers.
            for owner in ["runner", "runner", "x", "y"] {
                queue.submit(owner, 0).unwrap();
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
            assert_eq!(queue.running(), 4);
            for n in 0..waiting - 2 {
                queue.submit(format!("other-{}", n / 2), 0).unwrap();
            }
            queue.submit("last", 0).unwrap();
            queue.submit("last", 0).unwrap();
            let last = median_ns(&queue, "last", false);
            let runner = median_ns(&queue, "runner", false);
            queue.submit("filler", 0).unwrap();
            let full = median_ns(&queue, "newcomer", true);
            println!("{waiting:>12} | {last:>24.0} | {runner:>24.0} | {full:>9.0}");
        });
    }
}
