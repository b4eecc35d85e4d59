//! Shared state of a concurrency layer: the global cap, the per-identity map
//! and the refusal counters.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ahash::RandomState;
use hashbrown::HashTable;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::reject::Rejection;

use super::adaptive::gate::{Gate, GateRefusal, Ticket};
use super::adaptive::{Criticality, Outcome};
use super::gauges::{gauge_given_back, gauge_taken, moved, Moves};
use super::permits::{Given, GlobalLocked, Handoff, Limits, Permits, Take};
use super::reason::{ConcurrencyStats, OverloadReason, Scope};

/// A global cap that is a gate, with the functions that give a request's
/// class and tenant.
pub(crate) struct GlobalGate {
    pub(crate) gate: Arc<Gate>,
    pub(crate) class: Option<PartsFn<Criticality>>,
    pub(crate) tenant: Option<PartsFn<Option<Arc<str>>>>,
    /// Its queue, deadline and `Retry-After`; the limit moves.
    pub(crate) limits: Limits,
}

/// A function of a request's head.
pub(crate) type PartsFn<T> = Arc<dyn Fn(&http::request::Parts) -> T + Send + Sync>;

impl fmt::Debug for GlobalGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GlobalGate")
            .field("gate", &self.gate)
            .field("classified", &self.class.is_some())
            .field("fair", &self.tenant.is_some())
            .finish()
    }
}

/// A fixed global cap; its settings and permits are in [`Locked`].
#[derive(Debug)]
pub(crate) struct Cap;

/// The per-identity caps; their settings and the map are in [`Locked`].
#[derive(Debug)]
pub(crate) struct PerIdentity {
    hasher: RandomState,
}

/// The fixed caps' settings: read under the lock their permits take, so a
/// reload changes them between two steps, never within one.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CapLimits {
    pub(crate) global: Limits,
    pub(crate) identity: Limits,
    /// The map itself, as a load-shedding cap of `limit` identities.
    pub(crate) map: Limits,
}

/// Everything that changes, under one lock: the global cap's permits and
/// the per-identity map, one [`Entry`] per subject that has a request in
/// flight or queued (a subject alone in flight costs no allocation).
///
/// A step that changes an entry and the global cap together (a subject has
/// an entry only while one of its requests holds or waits for a global
/// permit) takes this one lock once.
#[derive(Debug, Default)]
struct Locked {
    global: Permits,
    map: HashTable<Entry>,
    limits: CapLimits,
}

/// One subject's cap.
#[derive(Debug)]
struct Entry {
    key: Arc<str>,
    hash: u64,
    permits: Permits<Handoff>,
}

impl Entry {
    fn is(&self, subject: &Arc<str>) -> bool {
        Arc::ptr_eq(&self.key, subject) || *self.key == **subject
    }

    /// The address of its key, which tells it from every other entry.
    fn addr(&self) -> usize {
        key_addr(&self.key)
    }
}

fn key_addr(key: &Arc<str>) -> usize {
    Arc::as_ptr(key).cast::<u8>() as usize
}

/// A subject's entry, found again by its hash and the address of its key:
/// giving a permit back hashes nothing, and holding it counts no reference.
///
/// The entry outlives every `EntryRef` that looks it up (it lives while it
/// has a permit or a waiter, and a request looks it up only to give one
/// back), so its key's allocation lives too, and no other live entry's key
/// has that address.
#[derive(Debug, Clone, Copy)]
struct EntryRef {
    addr: usize,
    hash: u64,
}

/// What the identified step of [`Shared::begin`] decided.
enum Step {
    /// The identity permit, and the global permit if there is a global cap.
    Held(EntryRef),
    /// The identity permit and a place in the global queue.
    GlobalQueued(EntryRef, oneshot::Receiver<()>),
    /// A place in the identity queue.
    IdentityQueued(EntryRef, oneshot::Receiver<Handoff>),
    IdentityQueueFull,
    GlobalQueueFull,
    TooManyIdentities,
}

/// What a request of a tracked subject gives back when it leaves.
enum Leave {
    /// Admitted: its identity permit and, when there is a global cap, its
    /// global permit.
    Admitted,
    /// Its identity permit and its place in the global queue.
    GlobalQueue(oneshot::Receiver<()>),
    /// Its place in the identity queue, or what it was handed meanwhile.
    IdentityQueue(oneshot::Receiver<Handoff>),
}

/// A request in the global queue. Leaving it by any path (including
/// cancellation) frees the place, and the identity permit it holds.
struct GlobalWaiter {
    shared: Arc<Shared>,
    /// The global cap's settings when it began to wait.
    limits: Limits,
    identity: Option<EntryRef>,
    /// `None` once the waiter holds its permit.
    rx: Option<oneshot::Receiver<()>>,
}

impl GlobalWaiter {
    /// Waits for a global permit for at most the global deadline.
    async fn wait(mut self) -> Result<Guard, Refusal> {
        let limits = self.limits;
        if let Some(rx) = &mut self.rx {
            // Timed out, or (never: no sender is dropped before its waiter
            // left) the sender is gone.
            if let Ok(Ok(())) = tokio::time::timeout(limits.deadline, rx).await {
                self.rx = None;
                return Ok(Guard {
                    shared: Arc::clone(&self.shared),
                    identity: self.identity.take(),
                    ticket: None,
                });
            }
        }
        let shared = Arc::clone(&self.shared);
        drop(self);
        Err(shared.refuse(Scope::Global, OverloadReason::DeadlinePassed, &limits))
    }
}

impl Drop for GlobalWaiter {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        match (&self.identity, &self.shared.per_identity) {
            (Some(at), Some(_)) => self.shared.leave(at, Leave::GlobalQueue(rx)),
            _ => self.shared.give_back_global(Some(&mut rx)),
        }
    }
}

/// A request in its identity queue. Leaving it by any path (including
/// cancellation) frees the place, and whatever it was handed meanwhile.
struct IdentityWaiter {
    shared: Arc<Shared>,
    /// The per-identity cap's settings when it began to wait.
    limits: Limits,
    at: EntryRef,
    /// `None` once the waiter was handed its permit.
    rx: Option<oneshot::Receiver<Handoff>>,
}

impl IdentityWaiter {
    /// Waits for an identity permit for at most the identity deadline, then
    /// for the global permit if it was handed a place in the global queue.
    async fn wait(mut self) -> Result<Guard, Refusal> {
        let limits = self.limits;
        let handoff = match &mut self.rx {
            Some(rx) => tokio::time::timeout(limits.deadline, rx).await,
            None => unreachable!("waited twice"),
        };
        let shared = Arc::clone(&self.shared);
        let Ok(Ok(handoff)) = handoff else {
            drop(self);
            return Err(shared.refuse(Scope::Identity, OverloadReason::DeadlinePassed, &limits));
        };
        self.rx = None;
        let at = self.at;
        drop(self);
        match handoff {
            Handoff::Held => Ok(Guard {
                identity: Some(at),
                shared,
                ticket: None,
            }),
            Handoff::Queued(rx) => {
                GlobalWaiter {
                    limits: shared.limits().global,
                    shared,
                    identity: Some(at),
                    rx: Some(rx),
                }
                .wait()
                .await
            }
            Handoff::Refused => {
                let limits = shared.limits().global;
                Err(shared.refuse(Scope::Global, OverloadReason::QueueFull, &limits))
            }
        }
    }
}

impl Drop for IdentityWaiter {
    fn drop(&mut self) {
        if let Some(rx) = self.rx.take() {
            self.shared.leave(&self.at, Leave::IdentityQueue(rx));
        }
    }
}

/// Everything a request holds while it is admitted: the global permit if
/// there is a global cap, and its identity permit if it has an entry.
/// Dropping it releases the permits (and the identity's map entry when it
/// was the last user), in one step under the lock.
pub(crate) struct Guard {
    shared: Arc<Shared>,
    identity: Option<EntryRef>,
    /// The global gate's slot, when the global cap is a gate (boxed: the
    /// fixed caps' guard stays small).
    pub(crate) ticket: Option<Box<Ticket>>,
}

impl Guard {
    /// Records the inner service's answer for the adaptive limit, if any.
    #[inline]
    pub(crate) fn answered(&mut self, outcome: impl FnOnce() -> Outcome) {
        if let Some(ticket) = &mut self.ticket {
            ticket.answered(outcome());
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        match (&self.identity, &self.shared.per_identity) {
            (Some(at), Some(_)) => self.shared.leave(at, Leave::Admitted),
            _ => self.shared.give_back_global(None),
        }
    }
}

impl fmt::Debug for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("global", &self.shared.global.is_some())
            .field("identity", &self.identity.is_some())
            .field("gate", &self.ticket.is_some())
            .finish()
    }
}

/// A refusal: the rejection and why.
#[derive(Debug, Clone)]
pub(crate) struct Refusal {
    pub(crate) rejection: Rejection,
    pub(crate) reason: OverloadReason,
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
    /// The global cap when it is a gate (adaptive, classes or fair
    /// queues); `global` is then `None`.
    pub(crate) gate: Option<GlobalGate>,
    pub(crate) per_identity: Option<PerIdentity>,
    locked: Mutex<Locked>,
    refusals: RefusalCounters,
}

impl Shared {
    pub(crate) fn new(
        global: Option<Limits>,
        gate: Option<GlobalGate>,
        per_identity: Option<Limits>,
        identity_map: Limits,
    ) -> Arc<Self> {
        let limits = CapLimits {
            global: global.unwrap_or_default(),
            identity: per_identity.unwrap_or_default(),
            map: identity_map,
        };
        Arc::new(Shared {
            global: global.map(|_| Cap),
            gate,
            per_identity: per_identity.map(|_| PerIdentity {
                hasher: RandomState::new(),
            }),
            locked: Mutex::new(Locked {
                limits,
                ..Locked::default()
            }),
            refusals: RefusalCounters::default(),
        })
    }

    /// The fixed caps' settings in force.
    pub(crate) fn limits(&self) -> CapLimits {
        self.locked.lock().limits
    }

    /// Puts `limits` in force in one step under the lock: requests in
    /// flight keep their permits (a lowered cap admits no one until fewer
    /// than its limit hold one), and the permits a raised cap frees go to
    /// the waiters at once, the global queue's first, then every
    /// identity's, each with its global step taken for it.
    pub(crate) fn set_limits(&self, limits: CapLimits) {
        let mut moves = Moves::default();
        let mut locked = self.locked.lock();
        let Locked {
            global: global_permits,
            map,
            limits: in_force,
        } = &mut *locked;
        *in_force = limits;
        if self.global.is_some() {
            let global = GlobalLocked::new(&in_force.global, global_permits);
            global.permits.admit_waiters(global.limits);
            global.finish(&mut moves);
        }
        if self.per_identity.is_some() {
            for entry in map.iter_mut() {
                let before = entry.permits.counts();
                let global = self.global.as_ref();
                let mut global =
                    global.map(|_| GlobalLocked::new(&in_force.global, global_permits));
                entry
                    .permits
                    .admit_waiters(&in_force.identity, global.as_mut());
                if let Some(global) = global {
                    global.finish(&mut moves);
                }
                moved(&mut moves.identity, before, entry.permits.counts());
            }
        }
        drop(locked);
        moves.apply();
    }

    /// Identities the map tracks now.
    pub(crate) fn tracked_identities(&self) -> usize {
        self.locked.lock().map.len()
    }

    /// The permits held by `subject` and its waiters.
    pub(crate) fn identity_counts(&self, subject: &str) -> (usize, usize) {
        let Some(ids) = &self.per_identity else {
            return (0, 0);
        };
        let hash = ids.hasher.hash_one(subject);
        self.locked
            .lock()
            .map
            .find(hash, |e| *e.key == *subject)
            .map_or((0, 0), |e| (e.permits.held, e.permits.queued))
    }

    /// Gives back what a request without an identity entry holds of the
    /// global cap, if there is one.
    fn give_back_global(&self, rx: Option<&mut oneshot::Receiver<()>>) {
        if self.global.is_some() {
            let mut locked = self.locked.lock();
            let Locked { global, limits, .. } = &mut *locked;
            let freed = global.give_back(rx, &limits.global);
            drop(locked);
            gauge_given_back(Scope::Global, freed);
        }
    }

    fn refuse(&self, scope: Scope, reason: OverloadReason, limits: &Limits) -> Refusal {
        let counter = match (scope, reason) {
            (_, OverloadReason::TooManyIdentities) => &self.refusals.too_many_identities,
            (Scope::Global, OverloadReason::QueueFull | OverloadReason::TenantQueueFull) => {
                &self.refusals.global_queue_full
            }
            (Scope::Global, _) => &self.refusals.global_deadline,
            (Scope::Identity, OverloadReason::QueueFull) => &self.refusals.identity_queue_full,
            (Scope::Identity, _) => &self.refusals.identity_deadline,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let scope_name = scope.as_str();
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
            rejection: scope.rejection(
                limits.retry_after,
                (reason != OverloadReason::TooManyIdentities).then_some(limits.limit),
            ),
            reason,
        }
    }

    /// The synchronous part of admission: take every permit that is free
    /// now, refuse at once when a queue is full, or hand back a future that
    /// waits in the queue(s).
    pub(crate) fn begin(self: &Arc<Self>, subject: Option<&Arc<str>>) -> Begin {
        if let (Some(ids), Some(subject)) = (&self.per_identity, subject) {
            return self.begin_identified(ids, subject);
        }
        if self.global.is_none() {
            return Begin::Ready(Guard {
                shared: Arc::clone(self),
                identity: None,
                ticket: None,
            });
        }
        let (take, limits) = {
            let mut locked = self.locked.lock();
            let limits = locked.limits.global;
            (locked.global.take(&limits), limits)
        };
        gauge_taken(Scope::Global, &take);
        match take {
            Take::Held => Begin::Ready(Guard {
                shared: Arc::clone(self),
                identity: None,
                ticket: None,
            }),
            Take::Queued(rx) => Begin::Wait(Box::pin(
                GlobalWaiter {
                    shared: Arc::clone(self),
                    limits,
                    identity: None,
                    rx: Some(rx),
                }
                .wait(),
            )),
            Take::QueueFull => {
                Begin::Refused(self.refuse(Scope::Global, OverloadReason::QueueFull, &limits))
            }
        }
    }

    /// Admission of a request of `subject`: its identity step and then the
    /// global step, in one step under the map's lock, so the subject has an
    /// entry only while one of its requests holds or waits for a global
    /// permit.
    fn begin_identified(self: &Arc<Self>, ids: &PerIdentity, subject: &Arc<str>) -> Begin {
        let hash = ids.hasher.hash_one(&**subject);
        let mut moves = Moves::default();
        let mut locked = self.locked.lock();
        let Locked {
            global: global_permits,
            map,
            limits,
        } = &mut *locked;
        let limits = &*limits;
        let step = if let Some(entry) = map.find_mut(hash, |e| e.is(subject)) {
            let at = EntryRef {
                addr: entry.addr(),
                hash,
            };
            let before = entry.permits.counts();
            let step = if entry.permits.held < limits.identity.limit {
                // One of its own permits is free (so none of its requests
                // waits for one): the global step decides.
                let global = self.global.as_ref();
                let take = match global.map(|_| GlobalLocked::new(&limits.global, global_permits)) {
                    Some(mut global) => {
                        let take = global.take();
                        global.finish(&mut moves);
                        take
                    }
                    None => Take::Held,
                };
                match take {
                    Take::Held => {
                        entry.permits.held += 1;
                        Step::Held(at)
                    }
                    Take::Queued(rx) => {
                        entry.permits.held += 1;
                        Step::GlobalQueued(at, rx)
                    }
                    Take::QueueFull => Step::GlobalQueueFull,
                }
            } else {
                match entry.permits.take(&limits.identity) {
                    Take::Queued(rx) => Step::IdentityQueued(at, rx),
                    Take::Held | Take::QueueFull => Step::IdentityQueueFull,
                }
            };
            moved(&mut moves.identity, before, entry.permits.counts());
            step
        } else {
            let global = self.global.as_ref();
            let mut global = global.map(|_| GlobalLocked::new(&limits.global, global_permits));
            // The global refusal first: with `max_identities >= limit +
            // queue` of the global cap, the map is never full while the
            // global cap has a permit or a place.
            let step = if global.as_ref().is_some_and(|g| g.permits.is_full(g.limits)) {
                Step::GlobalQueueFull
            } else if map.len() >= limits.map.limit {
                Step::TooManyIdentities
            } else {
                let key = Arc::clone(subject);
                let at = EntryRef {
                    addr: key_addr(&key),
                    hash,
                };
                let step = match global.as_mut().map(GlobalLocked::take) {
                    None | Some(Take::Held) => Step::Held(at),
                    Some(Take::Queued(rx)) => Step::GlobalQueued(at, rx),
                    Some(Take::QueueFull) => unreachable!("checked above"),
                };
                let entry = Entry {
                    key,
                    hash,
                    permits: Permits {
                        held: 1,
                        ..Permits::default()
                    },
                };
                map.insert_unique(hash, entry, |e| e.hash);
                moves.identity[0] += 1;
                moves.tracked += 1;
                step
            };
            if let Some(global) = global {
                global.finish(&mut moves);
            }
            step
        };
        if let Step::Held(at) = step {
            drop(locked);
            moves.apply();
            return Begin::Ready(Guard {
                shared: Arc::clone(self),
                identity: Some(at),
                ticket: None,
            });
        }
        // A step that waits or refuses reads the settings after the lock.
        let limits = *limits;
        drop(locked);
        moves.apply();
        match step {
            Step::Held(_) => unreachable!("returned above"),
            Step::GlobalQueued(at, rx) => Begin::Wait(Box::pin(
                GlobalWaiter {
                    shared: Arc::clone(self),
                    limits: limits.global,
                    identity: Some(at),
                    rx: Some(rx),
                }
                .wait(),
            )),
            Step::IdentityQueued(at, rx) => Begin::Wait(Box::pin(
                IdentityWaiter {
                    shared: Arc::clone(self),
                    limits: limits.identity,
                    at,
                    rx: Some(rx),
                }
                .wait(),
            )),
            Step::IdentityQueueFull => Begin::Refused(self.refuse(
                Scope::Identity,
                OverloadReason::QueueFull,
                &limits.identity,
            )),
            Step::GlobalQueueFull => Begin::Refused(self.refuse(
                Scope::Global,
                OverloadReason::QueueFull,
                &limits.global,
            )),
            Step::TooManyIdentities => Begin::Refused(self.refuse(
                Scope::Global,
                OverloadReason::TooManyIdentities,
                &limits.map,
            )),
        }
    }

    /// A request of `at`'s subject leaves: in one step under the lock, it
    /// gives back its global permit or
    /// place, then its identity permit, which goes to the subject's first
    /// waiter with the global step taken for it; the last to go removes the
    /// entry.
    fn leave(&self, at: &EntryRef, leave: Leave) {
        let mut moves = Moves::default();
        let mut locked = self.locked.lock();
        let Locked {
            global: global_permits,
            map,
            limits,
        } = &mut *locked;
        // What it gives back of the global cap (if there is one), and
        // whether it gives back an identity permit (or else a place in the
        // identity queue).
        let (given, permit) = match leave {
            Leave::Admitted => (Given::Permit, true),
            Leave::GlobalQueue(rx) => (Given::Place(rx), true),
            Leave::IdentityQueue(mut rx) => {
                rx.close();
                match rx.try_recv() {
                    Ok(Handoff::Refused) => return,
                    Ok(handoff) => (Given::from(handoff), true),
                    Err(_) => (Given::Nothing, false),
                }
            }
        };
        // Never `Err`: an entry lives while it has a permit or a waiter.
        let Ok(mut found) = map.find_entry(at.hash, |e| e.addr() == at.addr) else {
            return;
        };
        let permits = &mut found.get_mut().permits;
        let before = permits.counts();
        if permit {
            let global = self.global.as_ref();
            let mut global = global.map(|_| GlobalLocked::new(&limits.global, global_permits));
            if let Some(global) = &mut global {
                global.give_back(given);
            }
            permits.release_identity(&limits.identity, global.as_mut());
            if let Some(global) = global {
                global.finish(&mut moves);
            }
        } else {
            permits.queued -= 1;
        }
        moved(&mut moves.identity, before, permits.counts());
        if permits.is_idle() {
            found.remove();
            moves.tracked -= 1;
        }
        drop(locked);
        moves.apply();
    }

    /// The refusal of the global gate.
    pub(crate) fn gate_refusal(&self, refusal: GateRefusal) -> Refusal {
        let limits = match &self.gate {
            Some(g) => Limits {
                limit: refusal.limit,
                ..g.limits
            },
            None => unreachable!("a gate refusal without a gate"),
        };
        self.refuse(Scope::Global, refusal.reason, &limits)
    }

    pub(crate) fn stats(&self) -> ConcurrencyStats {
        let r = &self.refusals;
        let (global_in_flight, global_queued, tracked_identities, limit) = {
            let locked = self.locked.lock();
            let limit = self.global.as_ref().map(|_| locked.limits.global.limit);
            (
                locked.global.held,
                locked.global.queued,
                locked.map.len(),
                limit,
            )
        };
        let stats = ConcurrencyStats {
            global_in_flight,
            global_queued,
            tracked_identities,
            refused_global_queue_full: r.global_queue_full.load(Ordering::Relaxed),
            refused_global_deadline: r.global_deadline.load(Ordering::Relaxed),
            refused_identity_queue_full: r.identity_queue_full.load(Ordering::Relaxed),
            refused_identity_deadline: r.identity_deadline.load(Ordering::Relaxed),
            refused_too_many_identities: r.too_many_identities.load(Ordering::Relaxed),
            limit,
            ..ConcurrencyStats::default()
        };
        match &self.gate {
            Some(g) => stats.with_gate(g.gate.stats()),
            None => stats,
        }
    }
}
