//! Shared state of a concurrency layer: the global cap, the per-identity map
//! and the refusal counters.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ahash::RandomState;
use hashbrown::HashTable;
use parking_lot::Mutex;
use tokio::sync::oneshot;

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

/// Moves the `tower_admission_concurrency_in_flight` gauge of `scope` by
/// `delta`.
///
/// Each scope's label is a literal, so the macro keeps the key in a `static`
/// and builds nothing per call.
#[inline]
fn gauge_in_flight(scope: OverloadScope, delta: f64) {
    #[cfg(feature = "metrics")]
    match scope {
        OverloadScope::Global => {
            metrics::gauge!("tower_admission_concurrency_in_flight", "scope" => "global")
                .increment(delta)
        }
        _ => metrics::gauge!("tower_admission_concurrency_in_flight", "scope" => "identity")
            .increment(delta),
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (scope, delta);
}

/// Moves the `tower_admission_concurrency_queued` gauge of `scope` by
/// `delta`.
#[inline]
fn gauge_queued(scope: OverloadScope, delta: f64) {
    #[cfg(feature = "metrics")]
    match scope {
        OverloadScope::Global => {
            metrics::gauge!("tower_admission_concurrency_queued", "scope" => "global")
                .increment(delta)
        }
        _ => metrics::gauge!("tower_admission_concurrency_queued", "scope" => "identity")
            .increment(delta),
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (scope, delta);
}

/// Moves the gauges of `scope` after [`Permits::take`].
fn gauge_taken(scope: OverloadScope, take: &Take) {
    match take {
        Take::Held => gauge_in_flight(scope, 1.0),
        Take::Queued(_) => gauge_queued(scope, 1.0),
        Take::QueueFull => {}
    }
}

/// Moves the gauges of `scope` after [`Permits::give_back`]: a permit
/// freed, or else one fewer waiter.
fn gauge_given_back(scope: OverloadScope, freed: bool) {
    if freed {
        gauge_in_flight(scope, -1.0);
    } else {
        gauge_queued(scope, -1.0);
    }
}

/// One cap's permits and wait queue, kept under its owner's lock.
///
/// A permit given back goes to the first waiter still waiting, so while any
/// waiter waits every permit is held: a newcomer never passes the queue.
#[derive(Debug, Default)]
struct Permits {
    /// Permits taken: requests running or sending their body, and waiters
    /// handed a permit they have not yet woken up to.
    held: usize,
    /// Waiters still waiting.
    queued: usize,
    /// The waiters in arrival order. A waiter that left keeps its (closed)
    /// sender here until it is skipped or swept.
    queue: VecDeque<oneshot::Sender<()>>,
}

/// What [`Permits::take`] decided.
enum Take {
    Held,
    Queued(oneshot::Receiver<()>),
    QueueFull,
}

impl Permits {
    /// Takes a permit if one is free, or else a place at the back of the
    /// queue if fewer than `limits.queue` wait.
    ///
    /// One step under the owner's lock: a permit given back between a failed
    /// take and the enqueue would reach no waiter, and this one would wait
    /// with a permit free.
    fn take(&mut self, limits: &Limits) -> Take {
        if self.held < limits.limit {
            self.held += 1;
            return Take::Held;
        }
        if self.queued >= limits.queue {
            return Take::QueueFull;
        }
        while self.queue.front().is_some_and(oneshot::Sender::is_closed) {
            self.queue.pop_front();
        }
        // Senders of waiters that left mid-queue: swept once they are as
        // many as the live ones, so the queue stays within twice its bound.
        if self.queue.len() > 2 * self.queued {
            self.queue.retain(|tx| !tx.is_closed());
        }
        let (tx, rx) = oneshot::channel();
        self.queue.push_back(tx);
        self.queued += 1;
        Take::Queued(rx)
    }

    /// Gives one permit back: to the first waiter still waiting (true), or
    /// to the cap (false).
    fn release(&mut self) -> bool {
        while let Some(tx) = self.queue.pop_front() {
            if tx.send(()).is_ok() {
                self.queued -= 1;
                return true;
            }
        }
        self.held -= 1;
        false
    }

    /// Gives back a permit or, with `rx`, the place of a waiter that leaves
    /// without waking up to a permit (and a permit handed to it meanwhile).
    /// True when a permit was freed, false when one fewer waits.
    fn give_back(&mut self, rx: Option<&mut oneshot::Receiver<()>>) -> bool {
        let holds = match rx {
            None => true,
            Some(rx) => {
                rx.close();
                rx.try_recv().is_ok()
            }
        };
        if holds {
            !self.release()
        } else {
            self.queued -= 1;
            false
        }
    }

    fn is_idle(&self) -> bool {
        self.held == 0 && self.queued == 0
    }
}

/// The global cap.
#[derive(Debug)]
pub(crate) struct Cap {
    pub(crate) limits: Limits,
    permits: Mutex<Permits>,
}

impl Cap {
    fn new(limits: Limits) -> Self {
        Cap {
            limits,
            permits: Mutex::default(),
        }
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.permits.lock().held
    }

    pub(crate) fn queued(&self) -> usize {
        self.permits.lock().queued
    }

    fn take(&self) -> Take {
        let take = self.permits.lock().take(&self.limits);
        gauge_taken(OverloadScope::Global, &take);
        take
    }

    fn give_back(&self, rx: Option<&mut oneshot::Receiver<()>>) {
        let freed = self.permits.lock().give_back(rx);
        gauge_given_back(OverloadScope::Global, freed);
    }
}

/// The per-identity caps: one [`Entry`] per subject that has a request in
/// flight or queued, under one lock: a subject alone in flight costs no
/// allocation.
#[derive(Debug)]
pub(crate) struct PerIdentity {
    pub(crate) limits: Limits,
    /// The map itself, as a load-shedding cap of `limit` identities.
    map_limits: Limits,
    hasher: RandomState,
    map: Mutex<HashTable<Entry>>,
}

/// One subject's cap.
#[derive(Debug)]
struct Entry {
    key: Arc<str>,
    hash: u64,
    permits: Permits,
}

impl Entry {
    fn is(&self, subject: &Arc<str>) -> bool {
        Arc::ptr_eq(&self.key, subject) || *self.key == **subject
    }
}

/// A subject's entry, found again by its hash and key pointer: giving a
/// permit back hashes nothing.
#[derive(Debug)]
struct EntryRef {
    key: Arc<str>,
    hash: u64,
}

/// What [`PerIdentity::enter`] decided.
enum Enter {
    Held(EntryRef),
    Queued(EntryRef, oneshot::Receiver<()>),
    QueueFull,
    TooManyIdentities,
}

impl PerIdentity {
    /// Takes a permit of `subject`, or a place in its queue.
    fn enter(&self, subject: &Arc<str>) -> Enter {
        let hash = self.hasher.hash_one(&**subject);
        let mut map = self.map.lock();
        if let Some(entry) = map.find_mut(hash, |e| e.is(subject)) {
            let at = EntryRef {
                key: Arc::clone(&entry.key),
                hash,
            };
            let take = entry.permits.take(&self.limits);
            drop(map);
            gauge_taken(OverloadScope::Identity, &take);
            return match take {
                Take::Held => Enter::Held(at),
                Take::Queued(rx) => Enter::Queued(at, rx),
                Take::QueueFull => Enter::QueueFull,
            };
        }
        if map.len() >= self.map_limits.limit {
            return Enter::TooManyIdentities;
        }
        let entry = Entry {
            key: Arc::clone(subject),
            hash,
            permits: Permits {
                held: 1,
                ..Permits::default()
            },
        };
        map.insert_unique(hash, entry, |e| e.hash);
        drop(map);
        gauge_tracked_identities(1.0);
        gauge_in_flight(OverloadScope::Identity, 1.0);
        Enter::Held(EntryRef {
            key: Arc::clone(subject),
            hash,
        })
    }

    /// [`Permits::give_back`] for `at`'s subject; the last to go removes the
    /// entry.
    fn give_back(&self, at: &EntryRef, rx: Option<&mut oneshot::Receiver<()>>) {
        let mut map = self.map.lock();
        // Never `Err`: an entry lives while it has a permit or a waiter.
        let Ok(mut found) = map.find_entry(at.hash, |e| Arc::ptr_eq(&e.key, &at.key)) else {
            return;
        };
        let freed = found.get_mut().permits.give_back(rx);
        let removed = found.get().permits.is_idle().then(|| found.remove().0);
        drop(map);
        gauge_given_back(OverloadScope::Identity, freed);
        if removed.is_some() {
            gauge_tracked_identities(-1.0);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// The permits held by `subject` and its waiters.
    pub(crate) fn counts_of(&self, subject: &str) -> (usize, usize) {
        let hash = self.hasher.hash_one(subject);
        self.map
            .lock()
            .find(hash, |e| *e.key == *subject)
            .map_or((0, 0), |e| (e.permits.held, e.permits.queued))
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

/// Which cap a waiter waits for.
enum Place {
    Global,
    Identity(EntryRef),
}

/// A request in a queue. Leaving it by any path (including cancellation)
/// frees the place.
struct Waiter {
    shared: Arc<Shared>,
    /// `None` once the waiter holds its permit.
    place: Option<Place>,
    rx: oneshot::Receiver<()>,
}

impl Waiter {
    /// Waits for a permit for at most `deadline`.
    async fn wait(mut self, deadline: Duration) -> Option<Place> {
        match tokio::time::timeout(deadline, &mut self.rx).await {
            Ok(Ok(())) => self.place.take(),
            // Timed out (no sender is dropped before its waiter left).
            Ok(Err(_)) | Err(_) => None,
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        match (&self.place, &self.shared.global, &self.shared.per_identity) {
            (Some(Place::Global), Some(cap), _) => cap.give_back(Some(&mut self.rx)),
            (Some(Place::Identity(at)), _, Some(ids)) => ids.give_back(at, Some(&mut self.rx)),
            _ => {}
        }
    }
}

/// Everything a request holds while it is admitted. Dropping it releases the
/// permits (and the identity's map entry when it was the last user).
pub(crate) struct Guard {
    shared: Arc<Shared>,
    global: bool,
    identity: Option<EntryRef>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        // The global permit first, as a waiter for it may hold the other.
        if let (true, Some(cap)) = (self.global, &self.shared.global) {
            cap.give_back(None);
        }
        if let (Some(ids), Some(at)) = (&self.shared.per_identity, &self.identity) {
            ids.give_back(at, None);
        }
    }
}

impl fmt::Debug for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("global", &self.global)
            .field("identity", &self.identity.as_ref().map(|at| &*at.key))
            .finish()
    }
}

/// A refusal: the rejection and why.
#[derive(Debug, Clone)]
pub(crate) struct Refusal {
    pub(crate) rejection: Rejection,
    pub(crate) reason: OverloadReason,
    /// The cap of requests that refused, advertised in the `RateLimit`
    /// fields; `None` for a full identity map, which counts callers.
    pub(crate) cap: Option<usize>,
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
    pub(crate) global: Option<Cap>,
    pub(crate) per_identity: Option<PerIdentity>,
    refusals: RefusalCounters,
}

impl Shared {
    pub(crate) fn new(
        global: Option<Limits>,
        per_identity: Option<Limits>,
        identity_map: Limits,
    ) -> Arc<Self> {
        Arc::new(Shared {
            global: global.map(Cap::new),
            per_identity: per_identity.map(|limits| PerIdentity {
                limits,
                map_limits: identity_map,
                hasher: RandomState::new(),
                map: Mutex::new(HashTable::new()),
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
            cap: (reason != OverloadReason::TooManyIdentities).then_some(limits.limit),
        }
    }

    /// The synchronous part of admission: take every permit that is free
    /// now, refuse at once when a queue is full, or hand back a future that
    /// waits in the queue(s).
    pub(crate) fn begin(self: &Arc<Self>, subject: Option<&Arc<str>>) -> Begin {
        let mut guard = Guard {
            shared: Arc::clone(self),
            global: false,
            identity: None,
        };
        if let (Some(ids), Some(subject)) = (&self.per_identity, subject) {
            let limits = ids.limits;
            match ids.enter(subject) {
                Enter::Held(at) => guard.identity = Some(at),
                Enter::Queued(at, rx) => {
                    let waiter = Waiter {
                        shared: Arc::clone(self),
                        place: Some(Place::Identity(at)),
                        rx,
                    };
                    return Begin::Wait(Box::pin(async move {
                        let Some(Place::Identity(at)) = waiter.wait(limits.deadline).await else {
                            return Err(guard.shared.refuse(
                                OverloadScope::Identity,
                                OverloadReason::DeadlinePassed,
                                &limits,
                            ));
                        };
                        guard.identity = Some(at);
                        let shared = Arc::clone(&guard.shared);
                        match shared.begin_global(guard) {
                            Begin::Ready(guard) => Ok(guard),
                            Begin::Refused(refusal) => Err(refusal),
                            Begin::Wait(fut) => fut.await,
                        }
                    }));
                }
                Enter::QueueFull => {
                    return Begin::Refused(self.refuse(
                        OverloadScope::Identity,
                        OverloadReason::QueueFull,
                        &limits,
                    ))
                }
                Enter::TooManyIdentities => {
                    return Begin::Refused(self.refuse(
                        OverloadScope::Global,
                        OverloadReason::TooManyIdentities,
                        &ids.map_limits,
                    ))
                }
            }
        }
        self.begin_global(guard)
    }

    fn begin_global(self: &Arc<Self>, mut guard: Guard) -> Begin {
        let Some(cap) = &self.global else {
            return Begin::Ready(guard);
        };
        let limits = cap.limits;
        let rx = match cap.take() {
            Take::Held => {
                guard.global = true;
                return Begin::Ready(guard);
            }
            Take::Queued(rx) => rx,
            Take::QueueFull => {
                return Begin::Refused(self.refuse(
                    OverloadScope::Global,
                    OverloadReason::QueueFull,
                    &limits,
                ))
            }
        };
        let waiter = Waiter {
            shared: Arc::clone(self),
            place: Some(Place::Global),
            rx,
        };
        Begin::Wait(Box::pin(async move {
            if waiter.wait(limits.deadline).await.is_some() {
                guard.global = true;
                Ok(guard)
            } else {
                Err(guard.shared.refuse(
                    OverloadScope::Global,
                    OverloadReason::DeadlinePassed,
                    &limits,
                ))
            }
        }))
    }

    pub(crate) fn stats(&self) -> ConcurrencyStats {
        let r = &self.refusals;
        let (global_in_flight, global_queued) = match &self.global {
            Some(cap) => (cap.in_flight(), cap.queued()),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// One permit, two places in the queue.
    const LIMITS: Limits = Limits {
        limit: 1,
        queue: 2,
        deadline: Duration::from_secs(1),
        retry_after: Duration::from_secs(1),
    };

    fn held(permits: &mut Permits) -> bool {
        matches!(permits.take(&LIMITS), Take::Held)
    }

    fn queued(permits: &mut Permits) -> oneshot::Receiver<()> {
        match permits.take(&LIMITS) {
            Take::Queued(rx) => rx,
            Take::Held => panic!("took a permit"),
            Take::QueueFull => panic!("queue full"),
        }
    }

    #[test]
    fn senders_of_waiters_that_left_mid_queue_are_swept() {
        let mut permits = Permits::default();
        assert!(held(&mut permits));
        let mut first = queued(&mut permits);
        for _ in 0..1_000 {
            // A waiter queues behind the first and leaves, as a request
            // cancelled or timed out does.
            let mut rx = queued(&mut permits);
            assert!(!permits.give_back(Some(&mut rx)));
            assert_eq!(permits.queued, 1);
            assert!(permits.queue.len() <= 3, "{} senders", permits.queue.len());
        }
        // The permit goes to the first waiter, then back to the cap.
        assert!(!permits.give_back(None));
        assert_eq!(first.try_recv(), Ok(()));
        assert_eq!((permits.held, permits.queued), (1, 0));
        assert!(permits.give_back(None));
        assert!(permits.is_idle());
        assert!(permits.queue.is_empty());
    }

    #[test]
    fn a_permit_handed_to_a_waiter_that_leaves_passes_on() {
        let mut permits = Permits::default();
        assert!(held(&mut permits));
        let mut second = queued(&mut permits);
        let mut third = queued(&mut permits);
        assert!(matches!(permits.take(&LIMITS), Take::QueueFull));
        // Handed to the second, which leaves before it woke up: the third
        // gets it.
        assert!(!permits.give_back(None));
        assert!(!permits.give_back(Some(&mut second)));
        assert_eq!(third.try_recv(), Ok(()));
        assert_eq!((permits.held, permits.queued), (1, 0));
        assert!(permits.give_back(None));
        assert!(permits.is_idle());
    }
}
