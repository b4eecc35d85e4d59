//! The per-owner entries kept beside the queue, checked against a recount
//! of the jobs after every step of random runs, and the refusals' waits
//! read from them checked against a walk of the whole queue.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use proptest::prelude::*;
use tokio::time::Instant;

use super::{ends_in, JobQueue, OwnerJobs, Shared, State};
use crate::reject::Rejection;

impl<T, R, E> State<T, R, E> {
    /// The per-owner entries equal a recount over the jobs waiting and
    /// running (the same jobs in the same order), agree with the records'
    /// statuses, and no owner without a job keeps an entry.
    fn check_owners(&self) -> Result<(), String> {
        let Some(owners) = &self.owners else {
            return Ok(());
        };
        let mut recount: HashMap<Arc<str>, OwnerJobs> = HashMap::new();
        for job in &self.pending {
            let jobs = recount.entry(Arc::clone(&job.owner)).or_default();
            jobs.waiting.push_back(job.seq);
        }
        for (key, owner) in &self.running {
            recount
                .entry(Arc::clone(owner))
                .or_default()
                .running
                .insert(*key);
        }
        if *owners != recount {
            return Err(format!("kept {owners:?}, recounted {recount:?}"));
        }
        if let Some(owner) = owners.iter().find(|(_, jobs)| jobs.active() == 0) {
            return Err(format!("{owner:?} has no job but an entry"));
        }
        let mut unfinished: HashMap<&str, usize> = HashMap::new();
        for record in self.records.values() {
            if !record.status.is_finished() {
                *unfinished.entry(&*record.owner).or_default() += 1;
            }
        }
        let kept: HashMap<&str, usize> = owners
            .iter()
            .map(|(owner, jobs)| (&**owner, jobs.active()))
            .collect();
        if kept != unfinished {
            return Err(format!("kept {kept:?}, records {unfinished:?}"));
        }
        let consecutive = self
            .pending
            .iter()
            .zip(self.pending.iter().skip(1))
            .all(|(a, b)| b.seq == a.seq + 1);
        if !consecutive {
            return Err("waiting jobs' numbers are not consecutive".to_owned());
        }
        Ok(())
    }

    /// Every worker's expected free time, soonest first, from every running
    /// job (the walk the refusals used to make).
    fn scan_free(&self, workers: usize, mean: Duration, now: Instant) -> Vec<Duration> {
        let mut free: Vec<Duration> = self
            .running
            .keys()
            .map(|&(started, _)| ends_in(mean, started, now))
            .collect();
        free.resize(workers.max(free.len()), Duration::ZERO);
        free.sort_unstable();
        free
    }
}

impl<T, R, E> Shared<T, R, E> {
    /// [`Shared::full_wait`] by a walk of every running job.
    fn scan_full_wait(&self, state: &State<T, R, E>, now: Instant) -> Duration {
        let mean = state.mean_duration(self.config.retry_after);
        let free = state.scan_free(self.config.workers, mean, now);
        free.first().copied().unwrap_or(Duration::ZERO)
    }

    /// [`Shared::owner_wait`] by a walk of every running and waiting job.
    fn scan_owner_wait(&self, state: &State<T, R, E>, owner: &str, now: Instant) -> Duration {
        let mean = state.mean_duration(self.config.retry_after);
        let running = state
            .running
            .iter()
            .filter(|(_, of)| &***of == owner)
            .map(|(&(started, _), _)| ends_in(mean, started, now))
            .min();
        if let Some(wait) = running {
            return wait;
        }
        let free = state.scan_free(self.config.workers, mean, now);
        let Some(position) = state.pending.iter().position(|job| &*job.owner == owner) else {
            return Duration::ZERO;
        };
        let first = free[position % free.len()];
        let rounds = u32::try_from(position / free.len()).unwrap_or(u32::MAX);
        first
            .saturating_add(mean.saturating_mul(rounds))
            .saturating_add(mean)
    }
}

/// One step of [`owner_entries_match_a_recount_after_every_step`].
#[derive(Debug, Clone)]
enum Step {
    /// `owner-N` submits a job (refused once the last handle is dropped).
    Submit(u8),
    /// The started, unfinished job at this index (modulo) ends: 0 succeeds,
    /// 1 fails, 2 panics.
    Finish(usize, u8),
    /// The clock moves on this many ms.
    Advance(u64),
    /// A clone of the handle is dropped.
    DropClone,
    /// The last handle is dropped: the queue closes, its jobs still run.
    DropLast,
}

type Gates = Arc<StdMutex<BTreeMap<usize, tokio::sync::oneshot::Sender<u8>>>>;

/// Lets every ready task run until all are idle (paused time).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

async fn run((capacity, workers, per_owner): (usize, usize, usize), plan: &[Step]) {
    let context = format!("capacity {capacity}, workers {workers}, per owner {per_owner}");
    let gates: Gates = Arc::default();
    let queue = {
        let gates = Arc::clone(&gates);
        JobQueue::builder()
            .capacity(capacity)
            .workers(workers)
            .per_owner(per_owner)
            .retry_after(Duration::from_millis(700))
            .build(move |n: usize| {
                let (tx, rx) = tokio::sync::oneshot::channel();
                gates.lock().unwrap().insert(n, tx);
                async move {
                    match rx.await {
                        Ok(0) | Err(_) => Ok(n),
                        Ok(1) => Err(n),
                        Ok(_) => panic!("job {n} panics on purpose"),
                    }
                }
            })
            .unwrap()
    };
    let shared = Arc::clone(&queue.shared);
    let mut queue = Some(queue);
    // Accepted and finished jobs per owner, as the test sees them.
    let mut accepted = [0usize; 3];
    let mut finished = [0usize; 3];
    let mut owner_of: Vec<usize> = Vec::new();
    for (n, step) in plan.iter().enumerate() {
        let at = format!("{context}, step {n} {step:?}");
        match *step {
            Step::Submit(owner) => {
                let owner = usize::from(owner);
                let Some(queue) = &queue else { continue };
                let active = accepted[owner] - finished[owner];
                let waiting = queue.queued();
                let submitted = queue.submit(format!("owner-{owner}"), owner_of.len());
                match submitted {
                    Ok(_) => {
                        assert!(waiting < capacity && active < per_owner, "{at}");
                        accepted[owner] += 1;
                        owner_of.push(owner);
                    }
                    Err(Rejection::Overloaded { .. }) => assert!(waiting >= capacity, "{at}"),
                    Err(Rejection::CallerBusy { .. }) => {
                        assert!(waiting < capacity && active >= per_owner, "{at}");
                    }
                    Err(other) => panic!("{at}: {other:?}"),
                }
            }
            Step::Finish(i, outcome) => {
                let mut gates = gates.lock().unwrap();
                let started: Vec<usize> = gates.keys().copied().collect();
                if !started.is_empty() {
                    let job = started[i % started.len()];
                    gates.remove(&job).unwrap().send(outcome).unwrap();
                    finished[owner_of[job]] += 1;
                }
            }
            Step::Advance(ms) => tokio::time::advance(Duration::from_millis(ms)).await,
            Step::DropClone => drop(queue.clone()),
            Step::DropLast => drop(queue.take()),
        }
        settle().await;
        let now = Instant::now();
        let state = shared.state.lock();
        state.check_owners().unwrap_or_else(|e| panic!("{at}: {e}"));
        for owner in 0..3 {
            let name = format!("owner-{owner}");
            assert_eq!(
                state.active(&name),
                accepted[owner] - finished[owner],
                "{at}: {name}'s jobs"
            );
            assert_eq!(
                shared.owner_wait(&state, &name, now),
                shared.scan_owner_wait(&state, &name, now),
                "{at}: {name}'s wait"
            );
        }
        assert_eq!(
            shared.full_wait(&state, now),
            shared.scan_full_wait(&state, now),
            "{at}: the full queue's wait"
        );
    }
    // Every job ends: the drain leaves no owner entry.
    drop(queue);
    loop {
        let open: Vec<_> = std::mem::take(&mut *gates.lock().unwrap())
            .into_values()
            .collect();
        for gate in open {
            let _ = gate.send(0);
        }
        settle().await;
        let state = shared.state.lock();
        if state.pending.is_empty() && state.running.is_empty() {
            state
                .check_owners()
                .unwrap_or_else(|e| panic!("{context}: {e}"));
            assert_eq!(
                state.owners.as_ref().map(HashMap::len),
                Some(0),
                "{context}"
            );
            assert_eq!(state.completed, owner_of.len() as u64, "{context}");
            break;
        }
    }
}

/// Random submits of three owners, completions (success, failure, panic),
/// clock moves and dropped handles: after every step each owner's entry is
/// exactly the recount of its jobs waiting and running, an owner without a
/// job has no entry, and the `Retry-After` estimates read from the entries
/// equal the ones found by walking the whole queue.
#[test]
fn owner_entries_match_a_recount_after_every_step() {
    let step = prop_oneof![
        5 => (0u8..3).prop_map(Step::Submit),
        3 => (any::<usize>(), prop_oneof![8 => Just(0u8), 3 => Just(1u8), 1 => Just(2u8)])
            .prop_map(|(i, outcome)| Step::Finish(i, outcome)),
        2 => (0u64..1_500).prop_map(Step::Advance),
        1 => Just(Step::DropClone),
        1 => Just(Step::DropLast),
    ];
    let plan = proptest::collection::vec(step, 1..80);
    let caps = (1usize..9, 1usize..5, 1usize..5);
    proptest!(ProptestConfig::with_cases(300), |(caps in caps, plan in plan)| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(run(caps, &plan));
    });
}

/// Without a cap per owner no owner is tracked at all.
#[tokio::test(start_paused = true)]
async fn uncapped_queue_keeps_no_owner_entries() {
    let queue = JobQueue::builder()
        .workers(1)
        .build(|n: u32| async move { Ok::<_, ()>(n) })
        .unwrap();
    for n in 0..10 {
        queue.submit(format!("owner-{n}"), n).unwrap();
    }
    assert!(queue.shared.state.lock().owners.is_none());
    queue.shutdown().await;
    assert_eq!(queue.completed_total(), 10);
}
