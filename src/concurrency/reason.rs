//! Why a cap refused, and the snapshot of a layer's counters.

use std::fmt;

use std::time::Duration;

use super::adaptive::stats::{ClassCounts, GateStats};
use super::Criticality;
use crate::reject::Rejection;

/// Which cap refused: the service's own or the caller's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scope {
    /// The service-wide cap.
    Global,
    /// The caller's own cap.
    Identity,
}

impl Scope {
    /// The label of the scope in logs and metrics.
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Scope::Global => "global",
            Scope::Identity => "identity",
        }
    }

    /// The refusal of this cap, of `limit` requests (`None` when a full
    /// identity map refused: it counts callers): [`Rejection::Overloaded`]
    /// (503) for the service's, advertised as `global-concurrency`, and
    /// [`Rejection::CallerBusy`] (429) for the caller's, as `concurrency`.
    pub(super) fn rejection(self, retry_after: Duration, limit: Option<usize>) -> Rejection {
        match self {
            Scope::Global => Rejection::Overloaded {
                retry_after,
                cap: limit.map(|limit| ("global-concurrency", limit)),
            },
            Scope::Identity => Rejection::CallerBusy {
                retry_after,
                cap: limit.map(|limit| ("concurrency", limit)),
            },
        }
    }
}

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
    /// [`Rejection::Overloaded`](crate::reject::Rejection::Overloaded) (503),
    /// since the service, not the caller, is full.
    TooManyIdentities,
    /// The request's tenant already holds its fair share of its class's
    /// queue (the queue's places over the tenants waiting), or it was
    /// pushed out of the queue by a tenant under its share: refused with
    /// [`Rejection::Overloaded`](crate::reject::Rejection::Overloaded). See
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

/// A snapshot of the counters of a [`ConcurrencyLayer`](super::ConcurrencyLayer)
/// or an [`AdaptiveLimitLayer`](super::AdaptiveLimitLayer), for tests and
/// metrics.
///
/// The gauges (`*_in_flight`, `*_queued`, `tracked_identities`, the limit
/// and its latencies) are read together in one step; the refusal counters
/// one after the other, not atomically with them. An `AdaptiveLimitLayer`
/// reports its limit as the global cap, and has no identity cap.
///
/// ```
/// use tower_admission::concurrency::{AdaptiveLimit, AdaptiveLimitLayer, Criticality};
///
/// let layer = AdaptiveLimitLayer::<()>::builder(AdaptiveLimit::default().initial(8))
///     .build()
///     .unwrap();
/// let stats = layer.stats();
/// // The first baseline probe runs at its own level (3) until it has samples.
/// assert!(stats.probing);
/// assert_eq!(stats.limit, Some(3));
/// assert_eq!(stats.class_in_flight(Criticality::Critical), 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConcurrencyStats {
    /// Requests holding a global permit: running, or sending their body.
    pub global_in_flight: usize,
    /// Requests waiting in the global queue (every class).
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
    /// The global limit in force: the fixed cap, or where the adaptive
    /// limit stands. `None` without a global cap.
    pub limit: Option<usize>,
    /// The measured no-load latency (adaptive only; `None` before the first
    /// probe ends).
    pub baseline_latency: Option<Duration>,
    /// The latency of the last sample window that moved the limit
    /// (adaptive only).
    pub latency: Option<Duration>,
    /// True while a baseline probe runs.
    pub probing: bool,
    /// Per class, indexed sheddable, default, critical; all zero for a
    /// plain fixed cap (no classes, no tenants), which keeps no class
    /// counts.
    pub(crate) classes: [ClassCounts; 3],
}

impl ConcurrencyStats {
    /// Requests of `class` holding a global permit.
    pub fn class_in_flight(&self, class: Criticality) -> usize {
        self.classes[class.index()].in_flight
    }

    /// Requests of `class` waiting in its global queue.
    pub fn class_queued(&self, class: Criticality) -> usize {
        self.classes[class.index()].queued
    }

    /// Requests of `class` refused by the global limit so far (queue full,
    /// fair share of the queue full, deadline passed).
    pub fn class_shed(&self, class: Criticality) -> u64 {
        self.classes[class.index()].shed
    }

    /// These counters with the global limit's: its limit, latencies, slots,
    /// queues and per-class counts.
    pub(crate) fn with_gate(mut self, gate: GateStats) -> Self {
        self.global_in_flight = gate.in_flight;
        self.global_queued = gate.queued;
        self.limit = Some(gate.limit);
        self.baseline_latency = gate.baseline_latency;
        self.latency = gate.latency;
        self.probing = gate.probing;
        self.classes = gate.classes;
        self
    }
}
