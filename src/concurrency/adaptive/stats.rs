//! A snapshot of a gate: its limit, latencies, per-class counts and
//! refusals, read into a [`ConcurrencyStats`].

use std::time::Duration;

use crate::concurrency::ConcurrencyStats;

/// One criticality class's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ClassCounts {
    /// Requests of the class holding a slot.
    pub(crate) in_flight: usize,
    /// Requests of the class waiting in its queue.
    pub(crate) queued: usize,
    /// Requests of the class refused so far.
    pub(crate) shed: u64,
}

/// What a gate reports, read in one step (the refusal counters beside it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct GateStats {
    pub(crate) limit: usize,
    pub(crate) baseline_latency: Option<Duration>,
    pub(crate) latency: Option<Duration>,
    pub(crate) probing: bool,
    pub(crate) in_flight: usize,
    pub(crate) queued: usize,
    /// Per class, by [`Criticality::index`](super::Criticality).
    pub(crate) classes: [ClassCounts; 3],
    /// Refused at once: the class's queue, or the tenant's share of it, full.
    pub(crate) refused_queue_full: u64,
    /// Refused after waiting the whole deadline.
    pub(crate) refused_deadline: u64,
}

impl GateStats {
    /// The snapshot of an [`AdaptiveLimitLayer`](super::AdaptiveLimitLayer):
    /// its slots and queues as the global cap's, no identity cap.
    pub(crate) fn into_layer_stats(self) -> ConcurrencyStats {
        ConcurrencyStats {
            global_in_flight: self.in_flight,
            global_queued: self.queued,
            refused_global_queue_full: self.refused_queue_full,
            refused_global_deadline: self.refused_deadline,
            ..ConcurrencyStats::default()
        }
        .with_gate(self)
    }
}
