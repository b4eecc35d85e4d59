use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::id::JobId;
use crate::reject::Rejection;
use crate::ConfigError;

mod builder;
mod status;

pub use builder::JobQueueBuilder;
pub(crate) use builder::MEASURED_JOBS;
pub use status::JobStatus;

struct Record<R, E> {
    owner: Arc<str>,
    status: JobStatus<R, E>,
}

/// A job waiting for a worker.
struct Pending<T> {
    /// Its place in submit order: the jobs waiting have consecutive numbers,
    /// so a job's position in the queue is its number less the oldest's.
    seq: u64,
    id: JobId,
    owner: Arc<str>,
    input: T,
}

/// Where a running job is found: its start, then its submit number (the
/// numbers of jobs that started at the same instant tell them apart).
type RunKey = (Instant, u64);

/// One owner's jobs waiting or running, kept beside the queue so that a
/// refusal of the owner needs no walk of the queue. Never empty: an owner
/// with neither has no entry.
#[derive(Debug, Default, PartialEq, Eq)]
struct OwnerJobs {
    /// Submit numbers of the owner's waiting jobs, oldest first (the queue
    /// starts jobs oldest first, so a start takes the front).
    waiting: VecDeque<u64>,
    /// The owner's running jobs, soonest started first.
    running: BTreeSet<RunKey>,
}

impl OwnerJobs {
    /// Jobs waiting or running, which count against the owner's cap.
    fn active(&self) -> usize {
        self.waiting.len() + self.running.len()
    }
}

struct State<T, R, E> {
    /// Jobs waiting for a worker, oldest first.
    pending: VecDeque<Pending<T>>,
    /// Submit number of the next accepted job.
    next_seq: u64,
    /// Jobs a worker is running, soonest started first, with their owners.
    running: BTreeMap<RunKey, Arc<str>>,
    /// Durations of the last [`MEASURED_JOBS`] finished jobs, and their sum.
    durations: VecDeque<Duration>,
    durations_sum: Duration,
    records: HashMap<JobId, Record<R, E>>,
    /// Each owner's jobs waiting or running, when owners are capped (`None`
    /// otherwise); an owner with none has no entry, so there are at most
    /// `capacity + workers` entries.
    owners: Option<HashMap<Arc<str>, OwnerJobs>>,
    /// Finished jobs in order of completion, for retention.
    finished: VecDeque<(JobId, Instant)>,
    submitted: u64,
    completed: u64,
    closed: bool,
}

impl<T, R, E> State<T, R, E> {
    /// A job ran for `duration`: it joins the measured mean.
    fn measure(&mut self, duration: Duration) {
        if self.durations.len() == MEASURED_JOBS {
            if let Some(oldest) = self.durations.pop_front() {
                self.durations_sum = self.durations_sum.saturating_sub(oldest);
            }
        }
        self.durations.push_back(duration);
        self.durations_sum = self.durations_sum.saturating_add(duration);
    }

    /// A job's expected duration: the mean of the measured ones, or
    /// `assumed` before any job has finished.
    fn mean_duration(&self, assumed: Duration) -> Duration {
        match u32::try_from(self.durations.len()) {
            Ok(0) | Err(_) => assumed,
            Ok(n) => self.durations_sum / n,
        }
    }

    /// When worker `k` of `workers` (sorted, soonest free first) is
    /// expected to be free: zero for an idle worker (they sort first), else
    /// its running job's `mean` less its elapsed time (zero once past it).
    /// The soonest started job ends soonest, so the running jobs in start
    /// order are the busy workers in order. `O(min(k, workers - k))`.
    fn free_in(&self, workers: usize, k: usize, mean: Duration, now: Instant) -> Duration {
        let idle = workers.saturating_sub(self.running.len());
        let Some(busy) = k.checked_sub(idle) else {
            return Duration::ZERO;
        };
        let Some(from_end) = self.running.len().checked_sub(busy + 1) else {
            return Duration::ZERO;
        };
        let key = if busy <= from_end {
            self.running.keys().nth(busy)
        } else {
            self.running.keys().nth_back(from_end)
        };
        key.map_or(Duration::ZERO, |&(started, _)| ends_in(mean, started, now))
    }

    /// The estimated wait until the job at `position` in `pending` starts:
    /// with every job taking `mean`, worker `k` is free at `free_in(k)`, then
    /// every `mean` after, and the jobs ahead take those turns in order.
    fn start_in(&self, workers: usize, mean: Duration, position: usize, now: Instant) -> Duration {
        let workers = workers.max(self.running.len()).max(1);
        let first = self.free_in(workers, position % workers, mean, now);
        let rounds = u32::try_from(position / workers).unwrap_or(u32::MAX);
        first.saturating_add(mean.saturating_mul(rounds))
    }

    /// Jobs `owner` has waiting or running (0 when owners are not capped).
    fn active(&self, owner: &str) -> usize {
        self.owners
            .as_ref()
            .and_then(|owners| owners.get(owner))
            .map_or(0, OwnerJobs::active)
    }

    /// Job `seq` of `owner` joined the queue.
    fn owner_queued(&mut self, owner: &Arc<str>, seq: u64) {
        if let Some(owners) = &mut self.owners {
            owners
                .entry(Arc::clone(owner))
                .or_default()
                .waiting
                .push_back(seq);
        }
    }

    /// `owner`'s oldest waiting job started: it now runs as `key`.
    fn owner_started(&mut self, owner: &Arc<str>, key: RunKey) {
        if let Some(jobs) = self.owners.as_mut().and_then(|o| o.get_mut(owner)) {
            let oldest = jobs.waiting.pop_front();
            debug_assert_eq!(oldest, Some(key.1), "jobs start oldest first");
            jobs.running.insert(key);
        }
    }

    /// `owner`'s job running as `key` finished: it no longer counts against
    /// the owner's cap, and an owner left with no job loses its entry.
    fn owner_finished(&mut self, owner: &Arc<str>, key: RunKey) {
        if let Some(owners) = &mut self.owners {
            if let Some(jobs) = owners.get_mut(owner) {
                jobs.running.remove(&key);
                if jobs.active() == 0 {
                    owners.remove(owner);
                }
            }
        }
    }
}

struct Shared<T, R, E> {
    state: Mutex<State<T, R, E>>,
    notify: Notify,
    config: JobQueueBuilder,
    workers: tokio::sync::Mutex<Vec<JoinHandle<()>>>,
}

impl<T, R, E> Shared<T, R, E> {
    fn close(&self) {
        self.state.lock().closed = true;
        self.notify.notify_waiters();
    }

    /// Drops finished records past the count or age bound.
    fn prune(&self, state: &mut State<T, R, E>, now: Instant) {
        while let Some(&(id, at)) = state.finished.front() {
            let too_many = state.finished.len() > self.config.retain_finished;
            let too_old = now.saturating_duration_since(at) >= self.config.finished_ttl;
            if !(too_many || too_old) {
                break;
            }
            state.finished.pop_front();
            state.records.remove(&id);
        }
    }

    /// The estimated wait until a place in the full queue frees: until the
    /// soonest worker is free to take the oldest waiting job. `O(1)`.
    fn full_wait(&self, state: &State<T, R, E>, now: Instant) -> Duration {
        let mean = state.mean_duration(self.config.retry_after);
        state.free_in(self.config.workers, 0, mean, now)
    }

    /// The estimated wait until one of `owner`'s jobs finishes: its running
    /// job expected to end first (the one started first), else its oldest
    /// waiting job's start plus one `mean`. Read from the owner's entry and
    /// the oldest job's number, never by a walk of the queue:
    /// `O(min(k, workers - k))` for the worker `k` it waits for.
    fn owner_wait(&self, state: &State<T, R, E>, owner: &str, now: Instant) -> Duration {
        let mean = state.mean_duration(self.config.retry_after);
        let Some(jobs) = state.owners.as_ref().and_then(|o| o.get(owner)) else {
            return Duration::ZERO;
        };
        if let Some(&(started, _)) = jobs.running.first() {
            return ends_in(mean, started, now);
        }
        let (Some(&seq), Some(oldest)) = (jobs.waiting.front(), state.pending.front()) else {
            return Duration::ZERO;
        };
        let position = usize::try_from(seq.saturating_sub(oldest.seq)).unwrap_or(usize::MAX);
        state
            .start_in(self.config.workers, mean, position, now)
            .saturating_add(mean)
    }
}

/// Closes the queue when the last [`JobQueue`] handle goes.
struct Closer<T, R, E>(Arc<Shared<T, R, E>>);

impl<T, R, E> Drop for Closer<T, R, E> {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// A bounded queue of jobs run by a bounded set of worker tasks, for work
/// that is too large to do within a request. See the [module docs](super).
///
/// Clones share the queue, the workers and the job records. When the last
/// clone is dropped the queue closes: accepted jobs still run, then the
/// workers exit.
pub struct JobQueue<T, R, E> {
    shared: Arc<Shared<T, R, E>>,
    _closer: Arc<Closer<T, R, E>>,
}

impl<T, R, E> Clone for JobQueue<T, R, E> {
    fn clone(&self) -> Self {
        JobQueue {
            shared: Arc::clone(&self.shared),
            _closer: Arc::clone(&self._closer),
        }
    }
}

impl<T, R, E> fmt::Debug for JobQueue<T, R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.shared.state.lock();
        f.debug_struct("JobQueue")
            .field("config", &self.shared.config)
            .field("queued", &state.pending.len())
            .field("running", &state.running.len())
            .field("retained_finished", &state.finished.len())
            .field("closed", &state.closed)
            .finish()
    }
}

impl JobQueue<(), (), ()> {
    /// Starts a configuration.
    pub fn builder() -> JobQueueBuilder {
        JobQueueBuilder::default()
    }
}

impl<T, R, E> JobQueue<T, R, E>
where
    T: Send + 'static,
    R: Send + 'static,
    E: Send + 'static,
{
    /// Accepts a job for `owner` (the authenticated subject, e.g.
    /// [`Identity::subject`](crate::identity::Identity::subject)), or refuses
    /// it at once.
    ///
    /// On `Ok` the job is in the queue and will run (see the module docs for
    /// shutdown). Refused at once when the queue or the owner is at its
    /// [bound](crate::jobs#bounds), or after [`shutdown`](Self::shutdown):
    /// answer with [`Rejection::into_response`].
    pub fn submit(&self, owner: impl Into<Arc<str>>, input: T) -> Result<JobId, Rejection> {
        let now = Instant::now();
        let mut state = self.shared.state.lock();
        if state.closed {
            let retry_after = self.shared.config.retry_after;
            return Err(Rejection::Overloaded {
                retry_after,
                cap: None,
            });
        }
        if state.pending.len() >= self.shared.config.capacity {
            let retry_after = self.shared.full_wait(&state, now);
            drop(state);
            tracing::debug!(
                capacity = self.shared.config.capacity,
                ?retry_after,
                "job queue full, job refused"
            );
            return Err(Rejection::Overloaded {
                retry_after,
                cap: Some(("job-queue", self.shared.config.capacity)),
            });
        }
        let owner = owner.into();
        if let Some(limit) = self.shared.config.per_owner {
            if state.active(&owner) >= limit {
                let retry_after = self.shared.owner_wait(&state, &owner, now);
                drop(state);
                tracing::debug!(limit, ?retry_after, "owner's job cap reached, job refused");
                return Err(Rejection::CallerBusy {
                    retry_after,
                    cap: Some(("jobs-per-owner", limit)),
                });
            }
        }
        self.shared.prune(&mut state, now);
        let mut id = JobId::random();
        while state.records.contains_key(&id) {
            id = JobId::random();
        }
        state.records.insert(
            id,
            Record {
                owner: owner.clone(),
                status: JobStatus::Queued,
            },
        );
        let seq = state.next_seq;
        state.next_seq += 1;
        state.owner_queued(&owner, seq);
        state.pending.push_back(Pending {
            seq,
            id,
            owner,
            input,
        });
        state.submitted += 1;
        drop(state);
        self.shared.notify.notify_one();
        Ok(id)
    }

    /// The status of job `id`, only if `owner` submitted it.
    ///
    /// `None` for an unknown id, a record already dropped by retention, and
    /// a job of another owner alike, so a handler answers 404 in every case
    /// and never reveals that someone else's job exists.
    pub fn status(&self, owner: &str, id: JobId) -> Option<JobStatus<R, E>>
    where
        R: Clone,
        E: Clone,
    {
        let mut state = self.shared.state.lock();
        self.shared.prune(&mut state, Instant::now());
        state
            .records
            .get(&id)
            .filter(|r| &*r.owner == owner)
            .map(|r| r.status.clone())
    }

    /// Jobs accepted and waiting for a worker.
    pub fn queued(&self) -> usize {
        self.shared.state.lock().pending.len()
    }

    /// Jobs a worker is running now.
    pub fn running(&self) -> usize {
        self.shared.state.lock().running.len()
    }

    /// Finished jobs whose records are still retained.
    pub fn retained_finished(&self) -> usize {
        self.shared.state.lock().finished.len()
    }

    /// Jobs accepted since the queue was built.
    pub fn submitted_total(&self) -> u64 {
        self.shared.state.lock().submitted
    }

    /// Jobs finished (succeeded, failed or panicked) since the queue was
    /// built.
    pub fn completed_total(&self) -> u64 {
        self.shared.state.lock().completed
    }

    /// Stops taking jobs, then waits until every accepted job has finished
    /// and the workers have exited. Records stay readable.
    ///
    /// Calling it again (or from a clone) waits for the same drain.
    pub async fn shutdown(&self) {
        self.shared.close();
        let mut workers = self.shared.workers.lock().await;
        // A handle leaves the list only once its worker has exited, so a
        // shutdown dropped while waiting leaves the rest to the next one.
        while let Some(handle) = workers.last_mut() {
            // A worker never panics (job panics are caught); a JoinError
            // here means the runtime is shutting down.
            let _ = handle.await;
            workers.pop();
        }
    }
}

impl JobQueueBuilder {
    /// Checks the configuration ([`check`](Self::check)), spawns the
    /// workers on the current Tokio runtime and returns the queue. Each
    /// worker runs `job` on one input at a time.
    ///
    /// Fails with field `runtime` when called outside a Tokio runtime.
    pub fn build<T, R, E, F, Fut>(self, job: F) -> Result<JobQueue<T, R, E>, ConfigError>
    where
        T: Send + 'static,
        R: Send + 'static,
        E: Send + 'static,
        F: Fn(T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
    {
        self.check()?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            ConfigError::new("runtime", "JobQueue must be built inside a Tokio runtime")
        })?;
        let workers = self.workers;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                pending: VecDeque::new(),
                next_seq: 0,
                running: BTreeMap::new(),
                durations: VecDeque::with_capacity(MEASURED_JOBS),
                durations_sum: Duration::ZERO,
                records: HashMap::new(),
                owners: self.per_owner.map(|_| HashMap::new()),
                finished: VecDeque::new(),
                submitted: 0,
                completed: 0,
                closed: false,
            }),
            notify: Notify::new(),
            config: self,
            workers: tokio::sync::Mutex::new(Vec::with_capacity(workers)),
        });
        let job = Arc::new(job);
        let handles = (0..workers)
            .map(|_| runtime.spawn(worker(Arc::clone(&shared), Arc::clone(&job))))
            .collect();
        // Nobody else can hold the lock yet.
        if let Ok(mut slot) = shared.workers.try_lock() {
            *slot = handles;
        }
        Ok(JobQueue {
            _closer: Arc::new(Closer(Arc::clone(&shared))),
            shared,
        })
    }
}

/// When a job started at `started` is expected to end, if jobs take
/// `mean`: zero once it has run longer.
fn ends_in(mean: Duration, started: Instant, now: Instant) -> Duration {
    mean.saturating_sub(now.saturating_duration_since(started))
}

async fn worker<T, R, E, F, Fut>(shared: Arc<Shared<T, R, E>>, job: Arc<F>)
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = Result<R, E>>,
{
    loop {
        let (id, owner, key, input) = loop {
            // Register for a wake-up before looking at the queue, so a job
            // submitted between the look and the wait is never missed. The
            // registration ends before the job runs: a wake-up is only ever
            // handed to an idle worker, never to a busy one that would keep
            // it while another worker idles and a job waits.
            let notified = shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let next = {
                let mut state = shared.state.lock();
                match state.pending.pop_front() {
                    Some(Pending {
                        seq,
                        id,
                        owner,
                        input,
                    }) => {
                        let key = (Instant::now(), seq);
                        state.running.insert(key, Arc::clone(&owner));
                        state.owner_started(&owner, key);
                        if let Some(record) = state.records.get_mut(&id) {
                            record.status = JobStatus::Running;
                        }
                        Some((id, owner, key, input))
                    }
                    None if state.closed => return,
                    None => None,
                }
            };
            match next {
                Some(job) => break job,
                None => notified.await,
            }
        };
        let outcome = AssertUnwindSafe(async { job(input).await })
            .catch_unwind()
            .await;
        let status = match outcome {
            Ok(Ok(output)) => JobStatus::Succeeded(output),
            Ok(Err(error)) => JobStatus::Failed(error),
            Err(_) => {
                tracing::warn!(job = %id, "job panicked");
                JobStatus::Panicked
            }
        };
        let now = Instant::now();
        let mut state = shared.state.lock();
        state.running.remove(&key);
        state.measure(now.saturating_duration_since(key.0));
        state.owner_finished(&owner, key);
        state.completed += 1;
        if let Some(record) = state.records.get_mut(&id) {
            record.status = status;
        }
        state.finished.push_back((id, now));
        shared.prune(&mut state, now);
    }
}

#[cfg(test)]
mod tests;
