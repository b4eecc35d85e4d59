//! The fixed caps' gauges through the `metrics` facade, moved as permits
//! and queue places are taken and given back.

use super::permits::Take;
use super::reason::Scope;

/// The gauges' keys and metadata, as `metrics::gauge!` builds them (in
/// `static`s, since every name and label is a literal), so that one step
/// moves all its gauges with one look-up of the recorder.
#[cfg(feature = "metrics")]
mod keys {
    use metrics::{Key, Label};

    const IN_FLIGHT: &str = "tower_admission_concurrency_in_flight";
    const QUEUED: &str = "tower_admission_concurrency_queued";
    static GLOBAL: [Label; 1] = [Label::from_static_parts("scope", "global")];
    static IDENTITY: [Label; 1] = [Label::from_static_parts("scope", "identity")];

    /// `in_flight` then `queued`, of scope `global`, then of `identity`.
    pub(super) static SCOPED: [[Key; 2]; 2] = [
        [
            Key::from_static_parts(IN_FLIGHT, &GLOBAL),
            Key::from_static_parts(QUEUED, &GLOBAL),
        ],
        [
            Key::from_static_parts(IN_FLIGHT, &IDENTITY),
            Key::from_static_parts(QUEUED, &IDENTITY),
        ],
    ];
    pub(super) static TRACKED: Key =
        Key::from_static_name("tower_admission_concurrency_tracked_identities");
}

/// The metadata `metrics::gauge!` gives a gauge registered here.
#[cfg(feature = "metrics")]
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// Index of `scope` in [`keys::SCOPED`].
#[cfg(feature = "metrics")]
fn scope_index(scope: Scope) -> usize {
    match scope {
        Scope::Global => 0,
        Scope::Identity => 1,
    }
}

/// Moves the `tower_admission_concurrency_in_flight` gauge of `scope` by
/// `delta`.
#[inline]
pub(super) fn gauge_in_flight(scope: Scope, delta: f64) {
    #[cfg(feature = "metrics")]
    metrics::with_recorder(|r| {
        r.register_gauge(&keys::SCOPED[scope_index(scope)][0], &METADATA)
            .increment(delta)
    });
    #[cfg(not(feature = "metrics"))]
    let _ = (scope, delta);
}

/// Moves the `tower_admission_concurrency_queued` gauge of `scope` by
/// `delta`.
#[inline]
pub(super) fn gauge_queued(scope: Scope, delta: f64) {
    #[cfg(feature = "metrics")]
    metrics::with_recorder(|r| {
        r.register_gauge(&keys::SCOPED[scope_index(scope)][1], &METADATA)
            .increment(delta)
    });
    #[cfg(not(feature = "metrics"))]
    let _ = (scope, delta);
}

/// Moves the gauges of `scope` after [`Permits::take`].
pub(super) fn gauge_taken(scope: Scope, take: &Take) {
    match take {
        Take::Held => gauge_in_flight(scope, 1.0),
        Take::Queued(_) => gauge_queued(scope, 1.0),
        Take::QueueFull => {}
    }
}

/// Moves the gauges of `scope` after [`Permits::give_back`]: a permit
/// freed, or else one fewer waiter.
pub(super) fn gauge_given_back(scope: Scope, freed: bool) {
    if freed {
        gauge_in_flight(scope, -1.0);
    } else {
        gauge_queued(scope, -1.0);
    }
}

/// The gauge moves of one step under the map's lock, applied once the locks
/// are released.
#[derive(Default)]
pub(super) struct Moves {
    /// Global permits held, then waiters.
    pub(super) global: [isize; 2],
    /// Identity permits held, then waiters.
    pub(super) identity: [isize; 2],
    pub(super) tracked: isize,
}

/// `after - before`, per count.
pub(super) fn moved(total: &mut [isize; 2], before: [usize; 2], after: [usize; 2]) {
    for ((total, before), after) in total.iter_mut().zip(before).zip(after) {
        *total += after as isize - before as isize;
    }
}

impl Moves {
    /// Moves the gauges that moved, with one look-up of the recorder.
    pub(super) fn apply(self) {
        #[cfg(feature = "metrics")]
        if self.global != [0; 2] || self.identity != [0; 2] || self.tracked != 0 {
            metrics::with_recorder(|r| {
                let [[global_held, global_queued], [identity_held, identity_queued]] =
                    &keys::SCOPED;
                let bump = |key, delta: isize| {
                    if delta != 0 {
                        r.register_gauge(key, &METADATA).increment(delta as f64);
                    }
                };
                bump(global_held, self.global[0]);
                bump(global_queued, self.global[1]);
                bump(identity_held, self.identity[0]);
                bump(identity_queued, self.identity[1]);
                bump(&keys::TRACKED, self.tracked);
            });
        }
        #[cfg(not(feature = "metrics"))]
        let _ = self;
    }
}
