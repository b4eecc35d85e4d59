//! [`JobQueueBuilder`]: a queue's configuration, and its defaults.

use std::time::Duration;

use crate::ConfigError;

/// Default for [`JobQueueBuilder::capacity`]: 1000.
pub(crate) const DEFAULT_CAPACITY: usize = 1_000;
/// Default for [`JobQueueBuilder::workers`]: 4.
pub(crate) const DEFAULT_WORKERS: usize = 4;
/// Default for [`JobQueueBuilder::retain_finished`]: 10 000.
pub(crate) const DEFAULT_RETAIN_FINISHED: usize = 10_000;
/// Default for [`JobQueueBuilder::finished_ttl`]: one hour.
pub(crate) const DEFAULT_FINISHED_TTL: Duration = Duration::from_secs(3600);
/// Default for [`JobQueueBuilder::retry_after`]: one second.
pub(crate) const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Most [`workers`](JobQueueBuilder::workers) a queue may have. Each worker
/// is a task spawned when the queue is built and runs a job too large for a
/// request; more than this many such jobs at once is beyond what one process
/// runs well, and a larger number is a typo rather than a plan.
pub(crate) const MAX_WORKERS: usize = 1_024;
/// Finished jobs whose durations make the measured mean of the
/// [`Retry-After` estimate](crate::jobs#retry-after).
pub(crate) const MEASURED_JOBS: usize = 16;

/// Configuration of a [`JobQueue`](crate::jobs::JobQueue); see [`JobQueue::builder`](crate::jobs::JobQueue::builder).
#[derive(Debug, Clone)]
pub struct JobQueueBuilder {
    pub(super) capacity: usize,
    pub(super) workers: usize,
    pub(super) retain_finished: usize,
    pub(super) finished_ttl: Duration,
    pub(super) retry_after: Duration,
    pub(super) per_owner: Option<usize>,
}

impl Default for JobQueueBuilder {
    fn default() -> Self {
        JobQueueBuilder {
            capacity: DEFAULT_CAPACITY,
            workers: DEFAULT_WORKERS,
            retain_finished: DEFAULT_RETAIN_FINISHED,
            finished_ttl: DEFAULT_FINISHED_TTL,
            retry_after: DEFAULT_RETRY_AFTER,
            per_owner: None,
        }
    }
}

impl JobQueueBuilder {
    /// Most jobs waiting for a worker (not counting the ones running).
    /// Default: 1000.
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity;
        self
    }

    /// Number of worker tasks, hence most jobs running at once: 1 to 1024.
    /// Default: 4.
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// Most finished job records kept; the oldest finished is dropped first.
    /// Default: 10 000.
    pub fn retain_finished(mut self, max: usize) -> Self {
        self.retain_finished = max;
        self
    }

    /// How long a finished job's record is kept after it finished. Default:
    /// one hour.
    pub fn finished_ttl(mut self, ttl: Duration) -> Self {
        self.finished_ttl = ttl;
        self
    }

    /// Most jobs one owner may have waiting or running; a submit over it is
    /// refused with [`Rejection::CallerBusy`](crate::reject::Rejection::CallerBusy)
    /// (429), so that one caller cannot take the whole queue. Default: no cap
    /// per owner.
    pub fn per_owner(mut self, limit: usize) -> Self {
        self.per_owner = Some(limit);
        self
    }

    /// The duration assumed for a job until one has finished, in the
    /// [`Retry-After` estimate](crate::jobs#retry-after) of the refusals; also the
    /// `Retry-After` of a shut-down queue. Default: one second.
    pub fn retry_after(mut self, wait: Duration) -> Self {
        self.retry_after = wait;
        self
    }

    /// Checks the configuration as [`build`](Self::build) does, without a
    /// runtime: `capacity`, `workers`, `retain_finished` and `per_owner` at
    /// least 1, `workers` at most 1024, `finished_ttl` above zero.
    pub fn check(&self) -> Result<(), ConfigError> {
        let positive = [
            ("capacity", self.capacity),
            ("workers", self.workers),
            ("retain_finished", self.retain_finished),
            ("per_owner", self.per_owner.unwrap_or(1)),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(ConfigError::new(field, "must be at least 1"));
            }
        }
        if self.workers > MAX_WORKERS {
            return Err(ConfigError::new(
                "workers",
                format!(
                    "must be at most {MAX_WORKERS}: each worker is a task spawned at once, \
                     running one job too large for a request"
                ),
            ));
        }
        if self.finished_ttl.is_zero() {
            return Err(ConfigError::new("finished_ttl", "must be above zero"));
        }
        Ok(())
    }
}
