//! Snapshots of a gate: its limit, latencies and per-class counts.

use std::time::Duration;

use super::class::Criticality;

/// One criticality class's counts; [`LimitStats`] has an example.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClassStats {
    /// Requests of the class holding a slot.
    pub in_flight: usize,
    /// Requests of the class waiting in its queue.
    pub queued: usize,
    /// Requests of the class refused so far (queue full, fair share of the
    /// queue full, deadline passed).
    pub shed: u64,
}

/// A snapshot of a limit (fixed or adaptive) with classes and fair queues,
/// read in one step.
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
/// assert_eq!(stats.limit, 3);
/// assert_eq!(stats.class(Criticality::Critical).in_flight, 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LimitStats {
    /// The limit in force.
    pub limit: usize,
    /// The measured no-load latency (adaptive only; `None` before the first
    /// probe ends).
    pub baseline_latency: Option<Duration>,
    /// The latency of the last sample window that moved the limit
    /// (adaptive only).
    pub latency: Option<Duration>,
    /// True while a baseline probe runs.
    pub probing: bool,
    /// Requests holding a slot, every class.
    pub in_flight: usize,
    /// Requests waiting, every class.
    pub queued: usize,
    /// Per class, indexed sheddable, default, critical; see
    /// [`class`](Self::class).
    pub classes: [ClassStats; 3],
}

impl LimitStats {
    /// The counts of `class`.
    pub fn class(&self, class: Criticality) -> ClassStats {
        self.classes[class.index()]
    }
}
