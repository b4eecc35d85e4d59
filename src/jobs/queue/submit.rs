//! The answers to a submit: [`SubmitError`] and the `202 Accepted`.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Response};
use http_body_util::Full;

use crate::reject::{Protocol, Rejection};

/// Why [`JobQueue::submit`](crate::jobs::JobQueue::submit) did not accept a job: 503 when the service is
/// out of room, 429 when the owner is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SubmitError {
    /// `capacity` jobs are already waiting for a worker.
    Full {
        /// The queue's capacity, in jobs waiting.
        capacity: usize,
        /// Estimated wait until a place frees (see the
        /// [module docs](crate::jobs#retry-after)).
        retry_after: Duration,
    },
    /// The owner already has [`per_owner`](crate::jobs::JobQueueBuilder::per_owner) jobs
    /// waiting or running.
    OwnerBusy {
        /// The most jobs one owner may have waiting or running.
        limit: usize,
        /// Estimated wait until one of the owner's jobs finishes (see the
        /// [module docs](crate::jobs#retry-after)).
        retry_after: Duration,
    },
    /// The queue was shut down and takes no new jobs.
    ShutDown {
        /// The configured [`retry_after`](crate::jobs::JobQueueBuilder::retry_after)
        /// (another instance may take the job).
        retry_after: Duration,
    },
}

impl SubmitError {
    /// The refusal, with `Retry-After`: [`Rejection::Overloaded`] (503)
    /// when the service is out of room, [`Rejection::CallerBusy`] (429) when
    /// the owner is.
    pub fn rejection(&self) -> Rejection {
        match *self {
            SubmitError::Full { retry_after, .. } | SubmitError::ShutDown { retry_after } => {
                Rejection::Overloaded { retry_after }
            }
            SubmitError::OwnerBusy { retry_after, .. } => Rejection::CallerBusy { retry_after },
        }
    }

    /// The 503 or 429 response to a request with `request_headers`:
    /// problem+json, or gRPC `UNAVAILABLE` or `RESOURCE_EXHAUSTED` for a
    /// gRPC or gRPC-Web request (see [`Rejection::into_response`]).
    ///
    /// Over HTTP a full queue is also advertised as the service's quota of
    /// concurrent work, used up: `RateLimit-Policy: "job-queue";q=<capacity>;
    /// qu="concurrent-requests"` and `RateLimit: "job-queue";r=0;t=<wait>`;
    /// an owner's cap likewise as `"jobs-per-owner"`.
    pub fn into_response(self, request_headers: &HeaderMap) -> Response<Full<Bytes>> {
        self.respond(Protocol::of(request_headers))
    }

    /// The response in `protocol`.
    pub(crate) fn respond(self, protocol: Protocol) -> Response<Full<Bytes>> {
        let grpc = protocol.is_grpc();
        let mut response = self.rejection().respond(protocol);
        let advertised = match self {
            SubmitError::Full {
                capacity,
                retry_after,
            } => Some(("job-queue", capacity, retry_after)),
            SubmitError::OwnerBusy { limit, retry_after } => {
                Some(("jobs-per-owner", limit, retry_after))
            }
            SubmitError::ShutDown { .. } => None,
        };
        if let (Some((name, limit, retry_after)), false) = (advertised, grpc) {
            crate::quota::headers::insert_concurrency(
                response.headers_mut(),
                name,
                limit,
                retry_after,
            );
        }
        response
    }
}

impl fmt::Display for SubmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubmitError::Full { .. } => f.write_str("the job queue is full"),
            SubmitError::ShutDown { .. } => f.write_str("the job queue is shut down"),
            SubmitError::OwnerBusy { limit, .. } => {
                write!(f, "the owner already has {limit} jobs waiting or running")
            }
        }
    }
}

impl std::error::Error for SubmitError {}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for SubmitError {
    fn into_response(self) -> axum::response::Response {
        self.respond(Protocol::HTTP).into_response()
    }
}
