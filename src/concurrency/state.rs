//! Shared state of a concurrency layer: semaphores, waiter counts and the
//! per-identity map.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::reject::{OverloadScope, Rejection};

/// Why a concurrency cap refused a request.
///
/// Inserted into the response extensions of every refusal, beside the
/// [`Rejection`], so tests and logs can tell the cases apart.
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
    /// [`OverloadScope::Global`] (503), since the service, not the caller, is
    /// full.
    TooManyIdentities,
}

impl OverloadReason {
    /// Short kebab-case name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            OverloadReason::QueueFull => "queue-full",
            OverloadReason::DeadlinePassed => "deadline-passed",
            OverloadReason::TooManyIdentities => "too-many-identities",
        }
    }
}

impl fmt::Display for OverloadReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The settings of one cap.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) limit: usize,
    pub(crate) queue: usize,
    pub(crate) deadline: Duration,
    pub(crate) retry_after: Duration,
}

/// One semaphore with its counters.
#[derive(Debug)]
pub(crate) struct Cap {
    sem: Arc<Semaphore>,
    in_flight: AtomicUsize,
    waiters: AtomicUsize,
    /// The `scope` label of this cap's gauges: `global` or `identity`.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    scope: &'static str,
}

impl Cap {
    fn new(limit: usize, scope: &'static str) -> Arc<Self> {
        Arc::new(Cap {
            sem: Arc::new(Semaphore::new(limit)),
            in_flight: AtomicUsize::new(0),
            waiters: AtomicUsize::new(0),
            scope,
        })
    }

    /// Moves the `tower_admission_concurrency_in_flight` gauge of this cap's
    /// scope by `delta`.
    ///
    /// Each scope's label is a literal, so the macro keeps the key in a
    /// `static` and builds nothing per call.
    #[inline]
    fn gauge_in_flight(&self, delta: f64) {
        #[cfg(feature = "metrics")]
        match self.scope {
            "global" => {
                metrics::gauge!("tower_admission_concurrency_in_flight", "scope" => "global")
                    .increment(delta)
            }
            _ => metrics::gauge!("tower_admission_concurrency_in_flight", "scope" => "identity")
                .increment(delta),
        }
        #[cfg(not(feature = "metrics"))]
        let _ = delta;
    }

    /// Moves the `tower_admission_concurrency_queued` gauge of this cap's
    /// scope by `delta`.
    #[inline]
    fn gauge_queued(&self, delta: f64) {
        #[cfg(feature = "metrics")]
        match self.scope {
            "global" => metrics::gauge!("tower_admission_concurrency_queued", "scope" => "global")
                .increment(delta),
            _ => metrics::gauge!("tower_admission_concurrency_queued", "scope" => "identity")
                .increment(delta),
        }
        #[cfg(not(feature = "metrics"))]
        let _ = delta;
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    pub(crate) fn queued(&self) -> usize {
        self.waiters.load(Ordering::Acquire)
    }

    fn hold(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> HeldPermit {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.gauge_in_flight(1.0);
        HeldPermit {
            cap: Arc::clone(self),
            _permit: permit,
        }
    }

    fn try_acquire(self: &Arc<Self>) -> Option<HeldPermit> {
        Arc::clone(&self.sem)
            .try_acquire_owned()
            .ok()
            .map(|p| self.hold(p))
    }

    /// Takes a place in the queue if fewer than `queue` are waiting. The
    /// check and the increment are one atomic step, so the queue never holds
    /// more than `queue` waiters.
    fn try_enqueue(self: &Arc<Self>, queue: usize) -> Option<QueueSlot> {
        self.waiters
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < queue).then_some(w + 1)
            })
            .ok()
            .map(|_| {
                self.gauge_queued(1.0);
                QueueSlot {
                    cap: Arc::clone(self),
                }
            })
    }

    /// Waits for a permit for at most `deadline`.
    async fn wait(self: Arc<Self>, slot: QueueSlot, deadline: Duration) -> Option<HeldPermit> {
        let acquired = tokio::time::timeout(deadline, Arc::clone(&self.sem).acquire_owned()).await;
        let held = match acquired {
            Ok(Ok(permit)) => Some(self.hold(permit)),
            // Timed out; the semaphore is never closed.
            Ok(Err(_)) | Err(_) => None,
        };
        drop(slot);
        held
    }
}

/// A place in a cap's wait queue; leaving it (by any path, including
/// cancellation) frees the place.
struct QueueSlot {
    cap: Arc<Cap>,
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.cap.waiters.fetch_sub(1, Ordering::AcqRel);
        self.cap.gauge_queued(-1.0);
    }
}

/// A permit of one cap, counted in its `in_flight`.
struct HeldPermit {
    cap: Arc<Cap>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for HeldPermit {
    fn drop(&mut self) {
        self.cap.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.cap.gauge_in_flight(-1.0);
    }
}

/// The per-identity caps: one [`Cap`] per subject that has a request in
/// flight or queued.
#[derive(Debug)]
pub(crate) struct PerIdentity {
    pub(crate) limits: Limits,
    pub(crate) max_identities: usize,
    map: Mutex<HashMap<Arc<str>, Slot>>,
}

#[derive(Debug)]
struct Slot {
    cap: Arc<Cap>,
    /// Number of live [`Lease`]s: requests of this subject that are queued,
    /// in flight, or whose response body is still being sent.
    refs: usize,
}

impl PerIdentity {
    /// Registers one request of `subject`. `None` when the map is full and
    /// the subject is new.
    fn enter(self: &Arc<Self>, subject: &Arc<str>) -> Option<Lease> {
        let mut map = self.map.lock();
        let cap = match map.get_mut(subject) {
            Some(slot) => {
                slot.refs += 1;
                Arc::clone(&slot.cap)
            }
            None => {
                if map.len() >= self.max_identities {
                    return None;
                }
                let cap = Cap::new(self.limits.limit, "identity");
                map.insert(
                    Arc::clone(subject),
                    Slot {
                        cap: Arc::clone(&cap),
                        refs: 1,
                    },
                );
                gauge_tracked_identities(1.0);
                cap
            }
        };
        Some(Lease {
            owner: Arc::clone(self),
            key: Arc::clone(subject),
            cap,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.map.lock().len()
    }

    pub(crate) fn cap_of(&self, subject: &str) -> Option<Arc<Cap>> {
        self.map.lock().get(subject).map(|s| Arc::clone(&s.cap))
    }
}

/// Moves the `tower_admission_concurrency_tracked_identities` gauge by
/// `delta`.
#[inline]
fn gauge_tracked_identities(delta: f64) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("tower_admission_concurrency_tracked_identities").increment(delta);
    #[cfg(not(feature = "metrics"))]
    let _ = delta;
}

/// Keeps a subject's map entry alive; the last lease to go removes it, so
/// the map only holds subjects with work queued or in flight.
struct Lease {
    owner: Arc<PerIdentity>,
    key: Arc<str>,
    cap: Arc<Cap>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut map = self.owner.map.lock();
        if let Some(slot) = map.get_mut(&self.key) {
            slot.refs -= 1;
            if slot.refs == 0 {
                map.remove(&self.key);
                gauge_tracked_identities(-1.0);
            }
        }
    }
}

/// Everything a request holds while it is admitted. Dropping it releases the
/// permits (and the identity's map entry when it was the last user).
#[derive(Default)]
pub(crate) struct Guard {
    global: Option<HeldPermit>,
    // Field order matters: the permit is released before the lease.
    identity: Option<(HeldPermit, Lease)>,
}

impl fmt::Debug for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("global", &self.global.is_some())
            .field(
                "identity",
                &self.identity.as_ref().map(|(_, lease)| &*lease.key),
            )
            .finish()
    }
}

/// A refusal: the rejection and why.
#[derive(Debug, Clone)]
pub(crate) struct Refusal {
    pub(crate) rejection: Rejection,
    pub(crate) reason: OverloadReason,
    /// The cap that refused, in requests.
    pub(crate) cap: usize,
}

pub(crate) type AcquireFuture = Pin<Box<dyn Future<Output = Result<Guard, Refusal>> + Send>>;

/// The outcome of the synchronous part of admission.
pub(crate) enum Begin {
    /// Admitted at once.
    Ready(Guard),
    /// Refused at once.
    Refused(Refusal),
    /// Must wait in a queue; the future resolves within the deadline(s).
    Wait(AcquireFuture),
}

/// Counters of refusals, by scope and reason.
#[derive(Debug, Default)]
struct RefusalCounters {
    global_queue_full: AtomicU64,
    global_deadline: AtomicU64,
    identity_queue_full: AtomicU64,
    identity_deadline: AtomicU64,
    too_many_identities: AtomicU64,
}

/// State shared by a layer and every service and clone built from it.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) global: Option<(Limits, Arc<Cap>)>,
    pub(crate) per_identity: Option<Arc<PerIdentity>>,
    refusals: RefusalCounters,
}

impl Shared {
    pub(crate) fn new(
        global: Option<Limits>,
        per_identity: Option<Limits>,
        max_identities: usize,
    ) -> Arc<Self> {
        Arc::new(Shared {
            global: global.map(|l| (l, Cap::new(l.limit, "global"))),
            per_identity: per_identity.map(|limits| {
                Arc::new(PerIdentity {
                    limits,
                    max_identities,
                    map: Mutex::new(HashMap::new()),
                })
            }),
            refusals: RefusalCounters::default(),
        })
    }

    fn refuse(&self, scope: OverloadScope, reason: OverloadReason, limits: &Limits) -> Refusal {
        let counter = match (scope, reason) {
            (_, OverloadReason::TooManyIdentities) => &self.refusals.too_many_identities,
            (OverloadScope::Global, OverloadReason::QueueFull) => &self.refusals.global_queue_full,
            (OverloadScope::Global, _) => &self.refusals.global_deadline,
            (OverloadScope::Identity, OverloadReason::QueueFull) => {
                &self.refusals.identity_queue_full
            }
            (OverloadScope::Identity, _) => &self.refusals.identity_deadline,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let scope_name = match scope {
            OverloadScope::Global => "global",
            OverloadScope::Identity => "identity",
        };
        tracing::debug!(
            scope = scope_name,
            reason = reason.as_str(),
            limit = limits.limit,
            queue = limits.queue,
            deadline_ms = limits.deadline.as_millis() as u64,
            "concurrency cap refused a request"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "tower_admission_concurrency_refused_total",
            "scope" => scope_name,
            "reason" => reason.as_str()
        )
        .increment(1);
        Refusal {
            rejection: Rejection::Overloaded {
                scope,
                retry_after: limits.retry_after,
            },
            reason,
            cap: limits.limit,
        }
    }

    /// The synchronous part of admission: take every permit that is free
    /// now, refuse at once when a queue is full, or hand back a future that
    /// waits in the queue(s).
    pub(crate) fn begin(self: &Arc<Self>, subject: Option<&Arc<str>>) -> Begin {
        let mut guard = Guard::default();
        if let (Some(ids), Some(subject)) = (&self.per_identity, subject) {
            let limits = ids.limits;
            let Some(lease) = ids.enter(subject) else {
                return Begin::Refused(self.refuse(
                    OverloadScope::Global,
                    OverloadReason::TooManyIdentities,
                    &limits,
                ));
            };
            match lease.cap.try_acquire() {
                Some(permit) => guard.identity = Some((permit, lease)),
                None => {
                    let Some(slot) = lease.cap.try_enqueue(limits.queue) else {
                        return Begin::Refused(self.refuse(
                            OverloadScope::Identity,
                            OverloadReason::QueueFull,
                            &limits,
                        ));
                    };
                    let shared = Arc::clone(self);
                    return Begin::Wait(Box::pin(async move {
                        let cap = Arc::clone(&lease.cap);
                        let Some(permit) = cap.wait(slot, limits.deadline).await else {
                            return Err(shared.refuse(
                                OverloadScope::Identity,
                                OverloadReason::DeadlinePassed,
                                &limits,
                            ));
                        };
                        guard.identity = Some((permit, lease));
                        match shared.begin_global(guard) {
                            Begin::Ready(guard) => Ok(guard),
                            Begin::Refused(refusal) => Err(refusal),
                            Begin::Wait(fut) => fut.await,
                        }
                    }));
                }
            }
        }
        self.begin_global(guard)
    }

    fn begin_global(self: &Arc<Self>, mut guard: Guard) -> Begin {
        let Some((limits, cap)) = &self.global else {
            return Begin::Ready(guard);
        };
        let limits = *limits;
        if let Some(permit) = cap.try_acquire() {
            guard.global = Some(permit);
            return Begin::Ready(guard);
        }
        let Some(slot) = cap.try_enqueue(limits.queue) else {
            return Begin::Refused(self.refuse(
                OverloadScope::Global,
                OverloadReason::QueueFull,
                &limits,
            ));
        };
        let cap = Arc::clone(cap);
        let shared = Arc::clone(self);
        Begin::Wait(Box::pin(async move {
            match cap.wait(slot, limits.deadline).await {
                Some(permit) => {
                    guard.global = Some(permit);
                    Ok(guard)
                }
                None => Err(shared.refuse(
                    OverloadScope::Global,
                    OverloadReason::DeadlinePassed,
                    &limits,
                )),
            }
        }))
    }

    pub(crate) fn stats(&self) -> ConcurrencyStats {
        let r = &self.refusals;
        let (global_in_flight, global_queued) = match &self.global {
            Some((_, cap)) => (cap.in_flight(), cap.queued()),
            None => (0, 0),
        };
        ConcurrencyStats {
            global_in_flight,
            global_queued,
            tracked_identities: self.per_identity.as_ref().map_or(0, |ids| ids.len()),
            refused_global_queue_full: r.global_queue_full.load(Ordering::Relaxed),
            refused_global_deadline: r.global_deadline.load(Ordering::Relaxed),
            refused_identity_queue_full: r.identity_queue_full.load(Ordering::Relaxed),
            refused_identity_deadline: r.identity_deadline.load(Ordering::Relaxed),
            refused_too_many_identities: r.too_many_identities.load(Ordering::Relaxed),
        }
    }
}

/// A snapshot of a concurrency layer's counters, for tests and metrics.
///
/// The gauges (`*_in_flight`, `*_queued`, `tracked_identities`) are read one
/// after the other, not atomically together.
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
    /// Refused at once because the global queue was full (503).
    pub refused_global_queue_full: u64,
    /// Refused after waiting the global queue deadline (503).
    pub refused_global_deadline: u64,
    /// Refused at once because the identity's queue was full (429).
    pub refused_identity_queue_full: u64,
    /// Refused after waiting the per-identity queue deadline (429).
    pub refused_identity_deadline: u64,
    /// Refused because the per-identity map was full (503).
    pub refused_too_many_identities: u64,
}
