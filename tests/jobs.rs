//! The asynchronous offer: a bounded job queue with owner-only status.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use http::header::{LOCATION, RETRY_AFTER};
use http::StatusCode;
use tokio::sync::Semaphore;
use tower_admission::jobs::{JobId, JobQueue, JobStatus};
use tower_admission::reject::Rejection;

/// The headers of a plain HTTP request.
fn http_call() -> http::HeaderMap {
    http::HeaderMap::new()
}

/// The headers of a gRPC request.
fn grpc_call() -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        "application/grpc".parse().unwrap(),
    );
    headers
}

/// Lets every ready task run until all are idle (paused time: the clock
/// only moves when nothing else can run).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

#[tokio::test(start_paused = true)]
async fn full_queue_answers_503_and_accepted_jobs_all_run() {
    // Jobs wait for a gate, so nothing finishes until the test opens it.
    let gate = Arc::new(Semaphore::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let queue = {
        let gate = Arc::clone(&gate);
        let done = Arc::clone(&done);
        JobQueue::builder()
            .capacity(3)
            .workers(1)
            .retry_after(Duration::from_secs(30))
            .build(move |n: u32| {
                let gate = Arc::clone(&gate);
                let done = Arc::clone(&done);
                async move {
                    gate.acquire().await.unwrap().forget();
                    done.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, String>(n * 2)
                }
            })
            .unwrap()
    };

    let first = queue.submit("alice", 0).unwrap();
    settle().await;
    assert_eq!(queue.running(), 1);
    assert_eq!(queue.queued(), 0);
    assert_eq!(queue.status("alice", first), Some(JobStatus::Running));

    let mut accepted = vec![first];
    let mut refused = Vec::new();
    for n in 1..=10 {
        match queue.submit("alice", n) {
            Ok(id) => accepted.push(id),
            Err(e) => refused.push(e),
        }
    }
    assert_eq!(accepted.len(), 4);
    assert_eq!(refused.len(), 7);
    assert_eq!(queue.queued(), 3);
    // No job has finished, so a job is assumed to take the configured 30 s;
    // the running one started 1 ms ago.
    assert_eq!(
        refused[0],
        Rejection::Overloaded {
            retry_after: Duration::from_millis(29_999),
            cap: Some(("job-queue", 3)),
        }
    );
    assert_eq!(queue.status("alice", accepted[3]), Some(JobStatus::Queued));

    let response = refused[0].clone().into_response(&http_call());
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()[RETRY_AFTER], "30");
    assert_eq!(
        response.headers()["ratelimit-policy"],
        "\"job-queue\";q=3;qu=\"concurrent-requests\""
    );
    assert_eq!(response.headers()["ratelimit"], "\"job-queue\";r=0;t=30");
    let grpc = refused[0].clone().into_response(&grpc_call());
    assert_eq!(grpc.headers().get("ratelimit"), None);
    assert_eq!(response.extensions().get::<Rejection>(), Some(&refused[0]));

    gate.add_permits(100);
    queue.shutdown().await;
    assert_eq!(done.load(Ordering::SeqCst), 4);
    assert_eq!(queue.completed_total(), 4);
    assert_eq!(queue.submitted_total(), 4);
    for (n, id) in accepted.iter().enumerate() {
        assert_eq!(
            queue.status("alice", *id),
            Some(JobStatus::Succeeded(n as u32 * 2))
        );
    }
    // Closed: a new job is refused, also with 503.
    let err = queue.submit("alice", 99).unwrap_err();
    assert_eq!(
        err,
        Rejection::Overloaded {
            retry_after: Duration::from_secs(30),
            cap: None,
        }
    );
    assert_eq!(err.into_response(&http_call()).status(), 503);
}

#[tokio::test(start_paused = true)]
async fn every_accepted_job_completes_with_two_workers() {
    let running = Arc::new(AtomicUsize::new(0));
    let max_running = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let queue = {
        let (running, max_running, done) = (
            Arc::clone(&running),
            Arc::clone(&max_running),
            Arc::clone(&done),
        );
        JobQueue::builder()
            .capacity(100)
            .workers(2)
            .build(move |n: usize| {
                let (running, max_running, done) = (
                    Arc::clone(&running),
                    Arc::clone(&max_running),
                    Arc::clone(&done),
                );
                async move {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    max_running.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    running.fetch_sub(1, Ordering::SeqCst);
                    done.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, ()>(n)
                }
            })
            .unwrap()
    };

    let start = tokio::time::Instant::now();
    let mut accepted = Vec::new();
    let mut refused = 0;
    // Round 1: the workers have not run yet, so exactly `capacity` fit.
    for n in 0..300 {
        match queue.submit(format!("owner-{}", n % 7), n) {
            Ok(id) => accepted.push((n, id)),
            Err(_) => refused += 1,
        }
    }
    assert_eq!(accepted.len(), 100);
    assert_eq!(refused, 200);
    // The two workers each took one job (they take 10 ms): two places free.
    settle().await;
    assert_eq!(queue.running(), 2);
    assert_eq!(queue.queued(), 98);
    for n in 300..600 {
        match queue.submit(format!("owner-{}", n % 7), n) {
            Ok(id) => accepted.push((n, id)),
            Err(_) => refused += 1,
        }
    }
    assert_eq!(accepted.len(), 102);
    assert_eq!(refused, 498);

    queue.shutdown().await;
    assert_eq!(done.load(Ordering::SeqCst), accepted.len());
    assert_eq!(queue.completed_total(), 102);
    assert_eq!(max_running.load(Ordering::SeqCst), 2);
    for (n, id) in &accepted {
        let owner = format!("owner-{}", n % 7);
        assert_eq!(queue.status(&owner, *id), Some(JobStatus::Succeeded(*n)));
    }
    // 102 jobs, 2 at a time, 10 ms each: 51 rounds.
    assert_eq!(start.elapsed(), Duration::from_millis(510));
    assert_eq!(queue.running(), 0);
    assert_eq!(queue.queued(), 0);
}

#[tokio::test(start_paused = true)]
async fn status_is_visible_only_to_the_owner() {
    let queue = JobQueue::builder()
        .build(|s: &'static str| async move { Ok::<_, String>(s.len()) })
        .unwrap();
    let id = queue.submit("alice", "hello").unwrap();
    assert_eq!(queue.status("alice", id), Some(JobStatus::Queued));
    assert_eq!(queue.status("bob", id), None);
    queue.shutdown().await;
    assert_eq!(queue.status("alice", id), Some(JobStatus::Succeeded(5)));
    // Another owner cannot tell the job from one that never existed.
    assert_eq!(queue.status("bob", id), None);
    assert_eq!(queue.status("alice", JobId::random()), None);
}

#[tokio::test(start_paused = true)]
async fn job_ids_are_distinct_and_round_trip() {
    let queue = JobQueue::builder()
        .capacity(10_000)
        .build(|()| async { Ok::<_, ()>(()) })
        .unwrap();
    let mut ids = HashSet::new();
    for i in 0..10_000 {
        let id = queue.submit(format!("u{}", i % 10), ()).unwrap();
        let text = id.to_string();
        assert_eq!(text.len(), 32);
        assert_eq!(text.parse::<JobId>().unwrap(), id);
        ids.insert(id);
    }
    assert_eq!(ids.len(), 10_000);
    queue.shutdown().await;
    assert_eq!(queue.completed_total(), 10_000);
}

#[tokio::test(start_paused = true)]
async fn failures_and_panics_are_recorded_and_workers_survive() {
    let queue = JobQueue::builder()
        .workers(1)
        .build(|n: i32| async move {
            if n == 0 {
                panic!("job panicked on purpose");
            }
            if n < 0 {
                return Err(format!("negative: {n}"));
            }
            Ok(n)
        })
        .unwrap();
    let panics = queue.submit("o", 0).unwrap();
    let fails = queue.submit("o", -1).unwrap();
    let works = queue.submit("o", 7).unwrap();
    queue.shutdown().await;
    assert_eq!(queue.status("o", panics), Some(JobStatus::Panicked));
    assert_eq!(
        queue.status("o", fails),
        Some(JobStatus::Failed("negative: -1".to_owned()))
    );
    assert_eq!(queue.status("o", works), Some(JobStatus::Succeeded(7)));
    assert_eq!(queue.completed_total(), 3);
}

#[tokio::test(start_paused = true)]
async fn finished_records_are_bounded_by_count_and_ttl() {
    let queue = JobQueue::builder()
        .workers(1)
        .retain_finished(5)
        .finished_ttl(Duration::from_secs(60))
        .build(|n: u32| async move { Ok::<_, ()>(n) })
        .unwrap();
    let ids: Vec<JobId> = (0..10).map(|n| queue.submit("o", n).unwrap()).collect();
    settle().await;
    assert_eq!(queue.completed_total(), 10);
    assert_eq!(queue.retained_finished(), 5);
    for (n, id) in ids.iter().enumerate() {
        let expected = (n >= 5).then_some(JobStatus::Succeeded(n as u32));
        assert_eq!(queue.status("o", *id), expected);
    }
    // Past the TTL every finished record is gone.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(queue.status("o", ids[9]), None);
    assert_eq!(queue.retained_finished(), 0);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_last_handle_still_runs_accepted_jobs() {
    let done = Arc::new(AtomicUsize::new(0));
    let queue = {
        let done = Arc::clone(&done);
        JobQueue::builder()
            .workers(2)
            .build(move |()| {
                let done = Arc::clone(&done);
                async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    done.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, ()>(())
                }
            })
            .unwrap()
    };
    for _ in 0..20 {
        queue.submit("o", ()).unwrap();
    }
    drop(queue);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(done.load(Ordering::SeqCst), 20);
}

#[tokio::test(start_paused = true)]
async fn accepted_response_is_202_with_location() {
    let id = JobId::random();
    let location = format!("/reports/jobs/{id}");
    let response = id.accepted_response(&location).unwrap();
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    assert_eq!(response.headers()[LOCATION], location.as_str());
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(doc["id"], id.to_string());
    assert_eq!(doc["status"], "queued");
}

#[test]
fn bad_configuration_names_the_field() {
    let build = |b: tower_admission::jobs::JobQueueBuilder| {
        b.build(|()| async { Ok::<_, ()>(()) }).unwrap_err().field()
    };
    assert_eq!(build(JobQueue::builder().capacity(0)), "capacity");
    assert_eq!(build(JobQueue::builder().workers(0)), "workers");
    assert_eq!(
        build(JobQueue::builder().retain_finished(0)),
        "retain_finished"
    );
    assert_eq!(
        build(JobQueue::builder().finished_ttl(Duration::ZERO)),
        "finished_ttl"
    );
    assert_eq!(build(JobQueue::builder().per_owner(0)), "per_owner");
    // Outside a Tokio runtime.
    assert_eq!(build(JobQueue::builder()), "runtime");
}

/// A shutdown dropped while a job still runs (its caller gave up) leaves the
/// drain to the next shutdown, which waits for that job.
#[tokio::test(start_paused = true)]
async fn a_shutdown_given_up_on_leaves_the_drain_for_the_next_one() {
    let gate = Arc::new(Semaphore::new(0));
    let queue = {
        let gate = Arc::clone(&gate);
        JobQueue::builder()
            .workers(1)
            .build(move |()| {
                let gate = Arc::clone(&gate);
                async move {
                    gate.acquire().await.unwrap().forget();
                    Ok::<_, ()>(())
                }
            })
            .unwrap()
    };
    queue.submit("o", ()).unwrap();
    settle().await;
    assert_eq!(queue.running(), 1);

    // The caller gives up while the worker still runs the job.
    assert!(queue.shutdown().now_or_never().is_none());
    // A later shutdown still waits for that job.
    assert!(queue.shutdown().now_or_never().is_none());
    assert_eq!(queue.running(), 1);

    gate.add_permits(1);
    queue.shutdown().await;
    assert_eq!(queue.running(), 0);
    assert_eq!(queue.completed_total(), 1);
}

/// An owner's cap counts its jobs waiting and running: alice gets exactly 2
/// of 5 in, with 429 for the rest, while bob still gets his in; each of
/// alice's jobs that finishes lets exactly one more in. Before, alice alone
/// could fill the whole queue.
#[tokio::test(start_paused = true)]
async fn one_owner_cannot_take_the_whole_queue() {
    let gate = Arc::new(Semaphore::new(0));
    let queue = {
        let gate = Arc::clone(&gate);
        JobQueue::builder()
            .capacity(10)
            .workers(1)
            .per_owner(2)
            .retry_after(Duration::from_secs(7))
            .build(move |n: u32| {
                let gate = Arc::clone(&gate);
                async move {
                    gate.acquire().await.unwrap().forget();
                    Ok::<_, String>(n)
                }
            })
            .unwrap()
    };
    let submit = |owner: &str, n: u32| queue.submit(owner, n);
    let results: Vec<_> = (0..5).map(|n| submit("alice", n)).collect();
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 2);
    let busy = Rejection::CallerBusy {
        retry_after: Duration::from_secs(7),
        cap: Some(("jobs-per-owner", 2)),
    };
    assert!(results[2..].iter().all(|r| *r == Err(busy.clone())));
    assert!(submit("bob", 10).is_ok());
    assert!(submit("bob", 11).is_ok());
    // bob's first job waits behind alice's two on the one worker: it starts
    // after 2 x 7 s (the assumed duration) and ends 7 s later.
    assert_eq!(
        submit("bob", 12),
        Err(Rejection::CallerBusy {
            retry_after: Duration::from_secs(21),
            cap: Some(("jobs-per-owner", 2)),
        })
    );

    let response = busy.clone().into_response(&http_call());
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()[RETRY_AFTER], "7");
    assert_eq!(
        response.headers()["ratelimit-policy"],
        "\"jobs-per-owner\";q=2;qu=\"concurrent-requests\""
    );
    assert_eq!(response.extensions().get::<Rejection>(), Some(&busy));

    // alice's first job (the one running) finishes: one more of hers fits.
    settle().await;
    gate.add_permits(1);
    settle().await;
    assert!(submit("alice", 5).is_ok());
    // (The waits now follow the 1 ms the finished job took.)
    let owner_busy = |r| {
        matches!(
            r,
            Err(Rejection::CallerBusy {
                cap: Some(("jobs-per-owner", 2)),
                ..
            })
        )
    };
    assert!(owner_busy(submit("alice", 6)));
    // Everything finishes: alice has room for 2 again, and no owner is tracked.
    gate.add_permits(5);
    settle().await;
    assert_eq!(queue.running() + queue.queued(), 0);
    assert!(submit("alice", 7).is_ok());
    assert!(submit("alice", 8).is_ok());
    assert!(owner_busy(submit("alice", 9)));
}

/// One step of [`random_submits_and_completions_follow_the_model`].
#[derive(Debug, Clone)]
enum Step {
    /// `owner-N` submits a job.
    Submit(u8),
    /// The running job at this index (modulo) finishes; `true` fails it.
    Finish(usize, bool),
    /// The workers run until they are idle or waiting on their jobs.
    Settle,
}

/// Random submits of three owners, completions and pauses against a model
/// of the queue: each submit is refused exactly when the model says (503
/// when `capacity` wait, else 429 when the owner has `per_owner` waiting or
/// running), jobs start in submit order, no worker idles while a job waits,
/// each status is the model's for its owner and `None` for the others, and
/// every accepted job finishes once before `shutdown` returns.
#[test]
fn random_submits_and_completions_follow_the_model() {
    use proptest::prelude::*;
    let step = prop_oneof![
        4 => (0u8..3).prop_map(Step::Submit),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(i, fail)| Step::Finish(i, fail)),
        2 => Just(Step::Settle),
    ];
    let plan = proptest::collection::vec(step, 1..80);
    let caps = (1usize..5, 1usize..4, 1usize..4);
    proptest!(ProptestConfig::with_cases(300), |(caps in caps, plan in plan)| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(follow_the_model(caps, &plan));
    });
}

/// Where the model has a job.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Modelled {
    Queued,
    Running,
    Done(bool),
}

type Gates =
    Arc<std::sync::Mutex<std::collections::BTreeMap<usize, tokio::sync::oneshot::Sender<bool>>>>;

async fn follow_the_model((capacity, workers, per_owner): (usize, usize, usize), plan: &[Step]) {
    let context = format!("capacity {capacity}, workers {workers}, per owner {per_owner}");
    // The jobs a worker started, in order, and how to finish each.
    let started: Arc<std::sync::Mutex<Vec<usize>>> = Arc::default();
    let gates: Gates = Arc::default();
    let queue = {
        let (started, gates) = (started.clone(), gates.clone());
        JobQueue::builder()
            .capacity(capacity)
            .workers(workers)
            .per_owner(per_owner)
            .build(move |n: usize| {
                let (tx, rx) = tokio::sync::oneshot::channel();
                started.lock().unwrap().push(n);
                gates.lock().unwrap().insert(n, tx);
                async move {
                    match rx.await {
                        Ok(false) | Err(_) => Ok(n),
                        Ok(true) => Err(format!("job {n} failed")),
                    }
                }
            })
            .unwrap()
    };
    // The refusal's kind; its wait is an estimate, tested on its own.
    let kind = |refused: &Rejection| match *refused {
        Rejection::Overloaded {
            cap: Some(("job-queue", capacity)),
            ..
        } => ("full", capacity),
        Rejection::CallerBusy {
            cap: Some(("jobs-per-owner", limit)),
            ..
        } => ("owner busy", limit),
        _ => ("other", 0),
    };
    let full = ("full", capacity);
    let busy = ("owner busy", per_owner);
    // Accepted jobs in submit order: owner, id, where the model has it.
    let mut jobs: Vec<(u8, JobId, Modelled)> = Vec::new();
    for (n, step) in plan.iter().enumerate() {
        let at = format!("{context}, step {n} {step:?}");
        match *step {
            Step::Submit(owner) => {
                let waiting = jobs.iter().filter(|j| j.2 == Modelled::Queued).count();
                let active = jobs
                    .iter()
                    .filter(|j| j.0 == owner && !matches!(j.2, Modelled::Done(_)))
                    .count();
                let expected = if waiting >= capacity {
                    Err(full)
                } else if active >= per_owner {
                    Err(busy)
                } else {
                    Ok(())
                };
                let submitted = queue.submit(format!("owner-{owner}"), jobs.len());
                assert_eq!(
                    submitted.as_ref().map(|_| ()).map_err(kind),
                    expected,
                    "{at}"
                );
                if let Ok(id) = submitted {
                    jobs.push((owner, id, Modelled::Queued));
                }
            }
            Step::Finish(i, fail) => {
                let running: Vec<usize> = (0..jobs.len())
                    .filter(|&j| jobs[j].2 == Modelled::Running)
                    .collect();
                if !running.is_empty() {
                    let job = running[i % running.len()];
                    let gate = gates.lock().unwrap().remove(&job).unwrap();
                    gate.send(fail).unwrap();
                    jobs[job].2 = Modelled::Done(fail);
                }
            }
            Step::Settle => {}
        }
        // Every step ends with the workers idle or waiting on their jobs.
        settle().await;
        // Free workers take the oldest waiting jobs.
        let mut free = workers - jobs.iter().filter(|j| j.2 == Modelled::Running).count();
        for job in jobs.iter_mut().filter(|j| j.2 == Modelled::Queued) {
            if free == 0 {
                break;
            }
            job.2 = Modelled::Running;
            free -= 1;
        }
        let in_model = |m: Modelled| jobs.iter().filter(|j| j.2 == m).count();
        assert_eq!(queue.running(), in_model(Modelled::Running), "{at}");
        assert_eq!(queue.queued(), in_model(Modelled::Queued), "{at}");
        let started_now = started.lock().unwrap().clone();
        let expected_started: Vec<usize> = (0..started_now.len()).collect();
        assert_eq!(
            started_now, expected_started,
            "{at}: jobs start in submit order"
        );
        for (j, &(owner, id, modelled)) in jobs.iter().enumerate() {
            let status = queue.status(&format!("owner-{owner}"), id);
            let expected = match modelled {
                Modelled::Queued => JobStatus::Queued,
                Modelled::Running => JobStatus::Running,
                Modelled::Done(false) => JobStatus::Succeeded(j),
                Modelled::Done(true) => JobStatus::Failed(format!("job {j} failed")),
            };
            assert_eq!(status, Some(expected), "{at}: job {j}");
            let other = format!("owner-{}", (owner + 1) % 3);
            assert_eq!(
                queue.status(&other, id),
                None,
                "{at}: job {j} seen by {other}"
            );
        }
    }
    // Every gate opens: the drain finishes every accepted job.
    let drain = queue.shutdown();
    tokio::pin!(drain);
    loop {
        let gates_now: Vec<_> = std::mem::take(&mut *gates.lock().unwrap())
            .into_values()
            .collect();
        for gate in gates_now {
            let _ = gate.send(false);
        }
        tokio::select! {
            () = &mut drain => break,
            () = settle() => {}
        }
    }
    assert_eq!(queue.completed_total(), jobs.len() as u64, "{context}");
    assert_eq!((queue.running(), queue.queued()), (0, 0), "{context}");
    assert!(queue.submit("owner-0", 0).is_err(), "{context}: shut down");
}

/// A job's duration, in seconds, is its input.
fn sleeping_queue(capacity: usize, per_owner: usize) -> JobQueue<u64, u64, String> {
    JobQueue::builder()
        .capacity(capacity)
        .workers(2)
        .per_owner(per_owner)
        .build(|secs: u64| async move {
            tokio::time::sleep(Duration::from_secs(secs)).await;
            Ok(secs)
        })
        .unwrap()
}

/// The refusals' `Retry-After` is estimated from the measured mean job
/// duration and the running jobs' elapsed times, as the module docs say.
#[tokio::test(start_paused = true)]
async fn retry_after_is_estimated_from_measured_durations_and_positions() {
    let queue = sleeping_queue(4, 2);
    // Before any job has finished, a job is assumed to take the default 1 s.
    queue.submit("mia", 4).unwrap();
    queue.submit("mia", 8).unwrap();
    let assumed = queue.submit("mia", 1).unwrap_err();
    assert_eq!(
        assumed,
        Rejection::CallerBusy {
            retry_after: Duration::from_secs(1),
            cap: Some(("jobs-per-owner", 2)),
        }
    );
    // They end at 4 s and 8 s: the mean is 6 s.
    tokio::time::sleep(Duration::from_secs(8)).await;
    settle().await;
    assert_eq!(queue.completed_total(), 2);

    let now = tokio::time::Instant::now();
    queue.submit("alice", 100).unwrap();
    queue.submit("bob", 100).unwrap();
    // Both workers start them at once; 2 s later they are expected to end
    // in 6 - 2 = 4 s.
    tokio::time::sleep_until(now + Duration::from_secs(2)).await;
    assert_eq!(queue.running(), 2);
    queue.submit("alice", 100).unwrap(); // waiting, position 0
    queue.submit("carol", 100).unwrap(); // position 1
    queue.submit("carol", 100).unwrap(); // position 2
    let busy = |retry_after| Rejection::CallerBusy {
        retry_after,
        cap: Some(("jobs-per-owner", 2)),
    };
    // alice's running job is expected to end first.
    assert_eq!(queue.submit("alice", 1), Err(busy(Duration::from_secs(4))));
    // carol's first job (position 1) starts when the second worker is
    // free, in 4 s, and ends one mean later.
    assert_eq!(queue.submit("carol", 1), Err(busy(Duration::from_secs(10))));
    queue.submit("erin", 100).unwrap(); // position 3: the queue is full
    let full = queue.submit("frank", 1).unwrap_err();
    assert_eq!(
        full,
        Rejection::Overloaded {
            retry_after: Duration::from_secs(4),
            cap: Some(("job-queue", 4)),
        }
    );
    let response = full.into_response(&http_call());
    assert_eq!(response.headers()[RETRY_AFTER], "4");
    assert_eq!(response.headers()["ratelimit"], "\"job-queue\";r=0;t=4");
    let response = queue
        .submit("carol", 1)
        .unwrap_err()
        .into_response(&http_call());
    assert_eq!(response.headers()[RETRY_AFTER], "4"); // full first
                                                      // 2.5 s later, the running jobs are expected to end in 1.5 s.
    tokio::time::sleep_until(now + Duration::from_millis(4_500)).await;
    let full = queue.submit("frank", 1).unwrap_err();
    assert_eq!(
        full,
        Rejection::Overloaded {
            retry_after: Duration::from_millis(1_500),
            cap: Some(("job-queue", 4)),
        }
    );
    assert_eq!(full.into_response(&http_call()).headers()[RETRY_AFTER], "2");
    // Past the mean, a running job may end at any moment: never 0.
    tokio::time::sleep_until(now + Duration::from_secs(12)).await;
    let overdue = queue.submit("frank", 1).unwrap_err();
    assert_eq!(
        overdue,
        Rejection::Overloaded {
            retry_after: Duration::ZERO,
            cap: Some(("job-queue", 4)),
        }
    );
    assert_eq!(
        overdue.into_response(&http_call()).headers()[RETRY_AFTER],
        "1"
    );
}

#[tokio::test]
async fn workers_are_bounded() {
    let job = |n: u32| async move { Ok::<_, String>(n) };
    let max = 1024; // the documented most workers
    let err = JobQueue::builder()
        .workers(100_000_000)
        .build(job)
        .unwrap_err();
    assert_eq!(err.field(), "workers");
    assert_eq!(
        err.reason(),
        "must be at most 1024: each worker is a task spawned at once, \
         running one job too large for a request"
    );
    assert_eq!(
        JobQueue::builder()
            .workers(max + 1)
            .check()
            .unwrap_err()
            .field(),
        "workers"
    );
    let queue = JobQueue::builder().workers(max).build(job).unwrap();
    queue.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_free_worker_takes_a_new_job_while_another_runs_a_long_one() {
    let gates: Gates = Arc::default();
    let queue = {
        let gates = gates.clone();
        JobQueue::builder()
            .workers(2)
            .build(move |n: usize| {
                let (tx, rx) = tokio::sync::oneshot::channel::<bool>();
                gates.lock().unwrap().insert(n, tx);
                async move {
                    let _ = rx.await;
                    Ok::<_, String>(n)
                }
            })
            .unwrap()
    };
    let first = queue.submit("alice", 0).unwrap();
    settle().await;
    let long = queue.submit("bob", 1).unwrap();
    settle().await;
    assert_eq!((queue.running(), queue.queued()), (2, 0));
    // The first job ends; its worker is free while bob's job runs on.
    gates
        .lock()
        .unwrap()
        .remove(&0)
        .unwrap()
        .send(false)
        .unwrap();
    settle().await;
    assert_eq!(queue.status("alice", first), Some(JobStatus::Succeeded(0)));
    let next = queue.submit("carol", 2).unwrap();
    settle().await;
    // The free worker took it at once, not once the long job ends.
    assert_eq!((queue.running(), queue.queued()), (2, 0));
    assert_eq!(queue.status("carol", next), Some(JobStatus::Running));
    assert_eq!(queue.status("bob", long), Some(JobStatus::Running));
    for gate in std::mem::take(&mut *gates.lock().unwrap()).into_values() {
        gate.send(false).unwrap();
    }
    queue.shutdown().await;
    assert_eq!(queue.completed_total(), 3);
}

/// The answer to an owner at its cap does not depend on how the queue finds
/// it: owner A at `per_owner` behind 1,000 other owners' jobs is refused,
/// again and again, with exactly the 429 it got before the per-owner counts
/// were kept beside the queue (status, `Retry-After`, `RateLimit` fields and
/// problem type), and every refusal leaves the queue as it was.
#[tokio::test(start_paused = true)]
async fn an_owner_at_its_cap_behind_a_thousand_jobs_gets_the_same_429() {
    let gate = Arc::new(Semaphore::new(0));
    let queue = {
        let gate = Arc::clone(&gate);
        JobQueue::builder()
            .capacity(2_000)
            .workers(2)
            .per_owner(2)
            .retry_after(Duration::from_secs(7))
            .build(move |n: u32| {
                let gate = Arc::clone(&gate);
                async move {
                    gate.acquire().await.unwrap().forget();
                    Ok::<_, String>(n)
                }
            })
            .unwrap()
    };
    // A's two jobs run; 1,000 jobs of 500 other owners wait behind them.
    queue.submit("owner-a", 0).unwrap();
    queue.submit("owner-a", 1).unwrap();
    settle().await;
    for n in 0..1_000 {
        queue.submit(format!("other-{}", n % 500), n).unwrap();
    }
    assert_eq!((queue.running(), queue.queued()), (2, 1_000));
    // A's running jobs started 1 ms ago and are assumed to take 7 s.
    let running_busy = Rejection::CallerBusy {
        retry_after: Duration::from_millis(6_999),
        cap: Some(("jobs-per-owner", 2)),
    };
    for n in 0..10_000 {
        assert_eq!(
            queue.submit("owner-a", n),
            Err(running_busy.clone()),
            "try {n}"
        );
    }
    assert_eq!((queue.running(), queue.queued()), (2, 1_000));
    assert_eq!(queue.submitted_total(), 1_002);

    // B's two jobs wait at positions 1,000 and 1,001 (0 = oldest): the
    // first starts when a worker has run 500 more jobs after the running
    // one, 6.999 s + 500 x 7 s from now, and ends 7 s after that.
    queue.submit("owner-b", 0).unwrap();
    queue.submit("owner-b", 1).unwrap();
    let waiting_busy = Rejection::CallerBusy {
        retry_after: Duration::from_millis(3_513_999),
        cap: Some(("jobs-per-owner", 2)),
    };
    for n in 0..10_000 {
        assert_eq!(
            queue.submit("owner-b", n),
            Err(waiting_busy.clone()),
            "try {n}"
        );
    }
    assert_eq!((queue.running(), queue.queued()), (2, 1_002));
    assert_eq!(queue.submitted_total(), 1_004);

    for (refused, seconds) in [(running_busy, "7"), (waiting_busy, "3514")] {
        let response = refused.into_response(&http_call());
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[RETRY_AFTER], seconds);
        assert_eq!(
            response.headers()["ratelimit-policy"],
            "\"jobs-per-owner\";q=2;qu=\"concurrent-requests\""
        );
        assert_eq!(
            response.headers()["ratelimit"],
            format!("\"jobs-per-owner\";r=0;t={seconds}").as_str()
        );
        assert_eq!(
            response.headers()[http::header::CONTENT_TYPE],
            "application/problem+json"
        );
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            doc,
            serde_json::json!({
                "type": "https://docs.rs/tower-admission/latest/tower_admission/reject/#overloaded",
                "title": "Too many requests in progress",
                "status": 429,
                "detail": "you are at your concurrency limit",
                "retry_after": seconds.parse::<u64>().unwrap(),
            })
        );
    }
    gate.add_permits(2_000);
    queue.shutdown().await;
    assert_eq!(queue.completed_total(), 1_004);
}
