//! [`JobStatus`]: where a job is.

/// Where a job is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "status", content = "output", rename_all = "snake_case")]
#[non_exhaustive]
pub enum JobStatus<R, E> {
    /// Accepted, waiting for a worker.
    Queued,
    /// A worker is running it.
    Running,
    /// It finished with this result.
    Succeeded(R),
    /// It finished with this error.
    Failed(E),
    /// The job function panicked; the worker survived.
    Panicked,
}

impl<R, E> JobStatus<R, E> {
    /// `queued`, `running`, `succeeded`, `failed` or `panicked`.
    pub fn as_str(&self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Running => "running",
            JobStatus::Succeeded(_) => "succeeded",
            JobStatus::Failed(_) => "failed",
            JobStatus::Panicked => "panicked",
        }
    }

    /// True once the job has finished, successfully or not.
    pub fn is_finished(&self) -> bool {
        !matches!(self, JobStatus::Queued | JobStatus::Running)
    }
}
