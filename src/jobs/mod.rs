//! Asynchronous offer: answer `202 Accepted` for work over the synchronous
//! bound, and run it in a bounded background queue.
//!
//! When a request asks for more work than may be done while the caller
//! waits (a large report, a wide date range), a handler can refuse it, or
//! accept it for later: it calls [`JobQueue::submit`] and answers `202
//! Accepted` with a `Location` where the caller polls the job's status
//! ([`JobId::accepted_response`]).
//!
//! # Bounds
//!
//! * **Waiting jobs**: at most [`capacity`](JobQueueBuilder::capacity). A
//!   submit that finds the queue full is refused at once with
//!   [`Rejection::Overloaded`](crate::reject::Rejection::Overloaded) of cap
//!   `("job-queue", capacity)`; answer it with
//!   [`Rejection::into_response`](crate::reject::Rejection::into_response),
//!   a `503` + `Retry-After` (over HTTP, with `RateLimit` fields that
//!   advertise the cap): the service is out of room, not the caller.
//! * **Running jobs**: at most [`workers`](JobQueueBuilder::workers); each
//!   worker is one Tokio task running one job at a time.
//! * **Per owner** (optional): at most [`per_owner`](JobQueueBuilder::per_owner)
//!   jobs waiting or running for one owner; a submit over it is refused with
//!   [`Rejection::CallerBusy`](crate::reject::Rejection::CallerBusy) of cap
//!   `("jobs-per-owner", limit)`, a `429` + `Retry-After`: the caller can fix
//!   it by waiting for its own jobs, and one caller cannot fill the queue for
//!   everyone. Each owner's jobs are kept beside the queue, so a refusal and
//!   its `Retry-After` cost the same however long the queue is (no walk of the waiting jobs under the queue's lock),
//!   and an owner with no job waiting or running holds no memory.
//! * **Workers** are 1 to 1024; every other bound is at least 1.
//! * **Records**: waiting and running jobs always have a record (so at most
//!   `capacity + workers`). Finished records are kept for at most
//!   [`finished_ttl`](JobQueueBuilder::finished_ttl) after they finish, and at
//!   most [`retain_finished`](JobQueueBuilder::retain_finished) of them (the
//!   oldest finished goes first). Expired records are dropped on the next
//!   `submit`, `status` or job completion. After that, `status` answers `None`.
//!
//! # Retry-After
//!
//! A refusal's wait depends on how long jobs take, which the queue cannot
//! know; it estimates it from what it can see. A job is expected to take
//! the mean duration of the last 16 finished jobs (before
//! any has finished, the configured
//! [`retry_after`](JobQueueBuilder::retry_after)). A running job is then
//! expected to end after that mean less its elapsed time, or at any moment
//! once it has run longer. With those ends sorted (an idle worker is free
//! now), worker `k` is free after `free[k]`, then every mean after that:
//! the waiting job at position `p` (0 = oldest) starts after
//! `free[p % workers] + (p / workers) * mean`.
//!
//! * A full queue: a place frees when the oldest waiting job starts, after
//!   `free[0]`.
//! * An owner at its cap: when the owner's first job ends: the
//!   soonest expected end of its running jobs, else its oldest waiting job's
//!   start plus one mean.
//!
//! The header rounds it up to whole seconds, never 0: a job past the mean
//! answers `Retry-After: 1`. A shut-down queue answers the configured
//! `retry_after`.
//!
//! # Nothing accepted is lost
//!
//! Once `submit` returns `Ok`, the job is in the queue and a worker will run
//! it. [`JobQueue::shutdown`] stops taking new jobs (`submit` then answers
//! [`Rejection::Overloaded`](crate::reject::Rejection::Overloaded) without a
//! cap, also a 503: its `cap`, `None`, tells it from a full queue) and waits
//! until every accepted job has finished. Dropping the last clone of the
//! queue also closes it: accepted jobs still run, but nothing waits for them.
//! A panicking job is caught and recorded as [`JobStatus::Panicked`]; the
//! worker goes on.
//!
//! The queue lives in memory. Jobs that are still queued or running when the
//! Tokio runtime itself shuts down, or when the process exits, are lost: call
//! `shutdown().await` during graceful shutdown, and use a durable queue when
//! jobs must survive a crash.
//!
//! # Privacy
//!
//! Job ids ([`JobId`]) are 128 random bits and safe to put in URLs. A job's
//! status is readable only by the owner that submitted it:
//! [`JobQueue::status`] returns `None` for another owner exactly as for an
//! unknown id, so the handler answers 404 and never reveals that the job
//! exists.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use http::StatusCode;
//! use tower_admission::jobs::{JobQueue, JobStatus};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let reports = JobQueue::builder()
//!     .capacity(100)
//!     .workers(2)
//!     .finished_ttl(Duration::from_secs(600))
//!     .build(|days: u32| async move {
//!         // ... the expensive work ...
//!         Ok::<_, String>(format!("report over {days} days"))
//!     })?;
//!
//! // In a handler, with the authenticated subject as owner:
//! let response = match reports.submit("alice", 365) {
//!     Ok(id) => id.accepted_response(&format!("/reports/jobs/{id}"))?,
//!     Err(refused) => refused.into_response(&http::HeaderMap::new()), // 503 + Retry-After
//! };
//! assert_eq!(response.status(), StatusCode::ACCEPTED);
//! let location = response.headers()["location"].to_str()?;
//! let id = location.rsplit('/').next().unwrap().parse()?;
//!
//! reports.shutdown().await; // drains: every accepted job has finished
//! assert_eq!(
//!     reports.status("alice", id),
//!     Some(JobStatus::Succeeded("report over 365 days".to_owned()))
//! );
//! assert_eq!(reports.status("mallory", id), None); // 404, not 403
//! # Ok(())
//! # }
//! ```

mod id;
mod queue;

pub use id::JobId;
pub use queue::{JobQueue, JobQueueBuilder, JobStatus};
