//! Why a cap refused, and the snapshot of a layer's counters.

use std::fmt;

use super::adaptive::LimitStats;

/// Why a concurrency cap refused a request.
///
/// Inserted into the response extensions of every refusal, beside the
/// [`Rejection`](crate::reject::Rejection), so tests and logs can tell the cases apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OverloadReason {
    /// All permits were taken and the wait queue was full (or has length 0):
    /// refused at once, without waiting.
    QueueFull,
    /// The request waited in the queue for the whole queue deadline without
    /// getting a permit.
    DeadlinePassed,
    /// The per-identity map already tracks `max_identities` distinct
    /// identities and this one is new: refused at once with
    /// [`OverloadScope::Global`](crate::reject::OverloadScope::Global) (503), since the service, not the caller, is
    /// full.
    TooManyIdentities,
    /// The request's tenant already holds its fair share of its class's
    /// queue (the queue's places over the tenants waiting), or it was
    /// pushed out of the queue by a tenant under its share: refused with
    /// [`OverloadScope::Global`](crate::reject::OverloadScope::Global). See
    /// [fair queues](crate::concurrency#fair-queues).
    TenantQueueFull,
}

impl OverloadReason {
    /// Short kebab-case name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            OverloadReason::QueueFull => "queue-full",
            OverloadReason::DeadlinePassed => "deadline-passed",
            OverloadReason::TooManyIdentities => "too-many-identities",
            OverloadReason::TenantQueueFull => "tenant-queue-full",
        }
    }
}

impl fmt::Display for OverloadReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A snapshot of a concurrency layer's counters, for tests and metrics.
///
/// The gauges (`*_in_flight`, `*_queued`, `tracked_identities`) are read
/// together in one step; the refusal counters one after the other, not
/// atomically with them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConcurrencyStats {
    /// Requests holding a global permit: running, or sending their body.
    pub global_in_flight: usize,
    /// Requests waiting in the global queue.
    pub global_queued: usize,
    /// Identities with a request queued or in flight (the per-identity map's
    /// size).
    pub tracked_identities: usize,
    /// Refused at once because the global queue was full, or the
    /// tenant's fair share of it (503).
    pub refused_global_queue_full: u64,
    /// Refused after waiting the global queue deadline (503).
    pub refused_global_deadline: u64,
    /// Refused at once because the identity's queue was full (429).
    pub refused_identity_queue_full: u64,
    /// Refused after waiting the per-identity queue deadline (429).
    pub refused_identity_deadline: u64,
    /// Refused because the per-identity map was full (503).
    pub refused_too_many_identities: u64,
    /// The global limit with classes or fair queues (adaptive, or fixed
    /// with a classifier or tenants): its limit, latencies and per-class
    /// counts. `None` for a plain fixed cap or none.
    pub limit: Option<LimitStats>,
}
