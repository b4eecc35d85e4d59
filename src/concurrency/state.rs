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
fn scope_index(scope: OverloadScope) -> usize {
    match scope {
        OverloadScope::Global => 0,
        _ => 1,
    }
}

/// Moves the `tower_admission_concurrency_in_flight` gauge of `scope` by
/// `delta`.
#[inline]
fn gauge_in_flight(scope: OverloadScope, delta: f64) {
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
fn gauge_queued(scope: OverloadScope, delta: f64) {
    #[cfg(feature = "metrics")]
    metrics::with_recorder(|r| {
        r.register_gauge(&keys::SCOPED[scope_index(scope)][1], &METADATA)
            .increment(delta)
    });
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

/// The gauge moves of one step under the map's lock, applied once the locks
/// are released.
#[derive(Default)]
struct Moves {
    /// Global permits held, then waiters.
    global: [isize; 2],
    /// Identity permits held, then waiters.
    identity: [isize; 2],
    tracked: isize,
}

/// `after - before`, per count.
fn moved(total: &mut [isize; 2], before: [usize; 2], after: [usize; 2]) {
    for ((total, before), after) in total.iter_mut().zip(before).zip(after) {
        *total += after as isize - before as isize;
    }
}

impl Moves {
    /// Moves the gauges that moved, with one look-up of the recorder.
    fn apply(self) {
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

/// One cap's permits and wait queue, kept under its owner's lock. `M` is
/// what a waiter is handed with its permit.
///
/// A permit given back goes to the first waiter still waiting, so while any
/// waiter waits every permit is held: a newcomer never passes the queue.
#[derive(Debug)]
struct Permits<M = ()> {
    /// Permits taken: requests running or sending their body, and waiters
    /// handed a permit they have not yet woken up to.
    held: usize,
    /// Waiters still waiting.
    queued: usize,
    /// The waiters in arrival order. A waiter that left keeps its (closed)
    /// sender here until it is skipped or swept.
    queue: VecDeque<oneshot::Sender<M>>,
}

impl<M> Default for Permits<M> {
    fn default() -> Self {
        Permits {
            held: 0,
            queued: 0,
            queue: VecDeque::new(),
        }
    }
}

/// What [`Permits::take`] decided.
enum Take<M = ()> {
    Held,
    Queued(oneshot::Receiver<M>),
    QueueFull,
}

impl<M> Permits<M> {
    /// Takes a permit if one is free, or else a place at the back of the
    /// queue if fewer than `limits.queue` wait.
    ///
    /// One step under the owner's lock: a permit given back between a failed
    /// take and the enqueue would reach no waiter, and this one would wait
    /// with a permit free.
    #[inline]
    fn take(&mut self, limits: &Limits) -> Take<M> {
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

    /// True when [`take`](Self::take) would refuse.
    fn is_full(&self, limits: &Limits) -> bool {
        self.held >= limits.limit && self.queued >= limits.queue
    }

    fn counts(&self) -> [usize; 2] {
        [self.held, self.queued]
    }

    fn is_idle(&self) -> bool {
        self.held == 0 && self.queued == 0
    }
}

impl Permits {
    /// Gives one permit back: to the first waiter still waiting (true), or
    /// to the cap (false).
    #[inline]
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
}

/// What a request waiting in its identity queue is handed with its
/// identity permit: the global step, taken for it in the same locked step
/// that handed the permit over, so no newcomer can take the global permit
/// between the two.
#[derive(Debug)]
enum Handoff {
    /// The global permit too (or there is no global cap).
    Held,
    /// A place at the back of the global queue.
    Queued(oneshot::Receiver<()>),
    /// Nothing: the global queue was full, so the request is refused. A
    /// request that leaves always frees a global permit or place for the
    /// waiter it hands its identity permit to, so this is a backstop only.
    Refused,
}

impl Permits<Handoff> {
    /// Gives an identity permit back: to the first waiter still waiting,
    /// with its global step taken for it from `global` (the global cap,
    /// locked), or else to the entry.
    fn release_identity(&mut self, mut global: Option<&mut GlobalLocked<'_>>) {
        while let Some(tx) = self.queue.pop_front() {
            if tx.is_closed() {
                continue;
            }
            let handoff = match global.as_deref_mut() {
                None => Handoff::Held,
                Some(g) => match g.take() {
                    Take::Held => Handoff::Held,
                    Take::Queued(rx) => Handoff::Queued(rx),
                    Take::QueueFull => Handoff::Refused,
                },
            };
            let refused = matches!(handoff, Handoff::Refused);
            match tx.send(handoff) {
                Ok(()) => {
                    self.queued -= 1;
                    if !refused {
                        return;
                    }
                }
                // It left meanwhile: what was taken for it goes back.
                Err(handoff) => {
                    if let Some(g) = global.as_deref_mut() {
                        g.give_back(Given::from(handoff));
                    }
                }
            }
        }
        self.held -= 1;
    }
}

/// The global cap's permits, under the lock they share with the map, with
/// their counts when the step began.
struct GlobalLocked<'a> {
    limits: &'a Limits,
    permits: &'a mut Permits,
    before: [usize; 2],
}

/// What a request gives back of the global cap.
enum Given {
    Nothing,
    Permit,
    /// A place in the queue, with the permit handed to it meanwhile if any.
    Place(oneshot::Receiver<()>),
}

impl From<Handoff> for Given {
    fn from(handoff: Handoff) -> Self {
        match handoff {
            Handoff::Held => Given::Permit,
            Handoff::Queued(rx) => Given::Place(rx),
            Handoff::Refused => Given::Nothing,
        }
    }
}

impl<'a> GlobalLocked<'a> {
    fn new(cap: &'a Cap, permits: &'a mut Permits) -> Self {
        GlobalLocked {
            limits: &cap.limits,
            before: permits.counts(),
            permits,
        }
    }

    fn take(&mut self) -> Take {
        self.permits.take(self.limits)
    }

    #[inline]
    fn give_back(&mut self, given: Given) {
        match given {
            Given::Nothing => {}
            Given::Permit => {
                self.permits.release();
            }
            Given::Place(mut rx) => {
                self.permits.give_back(Some(&mut rx));
            }
        }
    }

    /// Records how the counts moved.
    fn finish(self, moves: &mut Moves) {
        moved(&mut moves.global, self.before, self.permits.counts());
    }
}

/// The global cap's settings; its permits are in [`Locked`].
#[derive(Debug)]
pub(crate) struct Cap {
    pub(crate) limits: Limits,
}

/// The per-identity caps' settings; the map is in [`Locked`].
#[derive(Debug)]
pub(crate) struct PerIdentity {
    pub(crate) limits: Limits,
    /// The map itself, as a load-shedding cap of `limit` identities.
    map_limits: Limits,
    hasher: RandomState,
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
    identity: Option<EntryRef>,
    /// `None` once the waiter holds its permit.
    rx: Option<oneshot::Receiver<()>>,
}

impl GlobalWaiter {
    /// Waits for a global permit for at most the global deadline.
    async fn wait(mut self) -> Result<Guard, Refusal> {
        let limits = match &self.shared.global {
            Some(cap) => cap.limits,
            None => unreachable!("a global waiter without a global cap"),
        };
        if let Some(rx) = &mut self.rx {
            // Timed out, or (never: no sender is dropped before its waiter
            // left) the sender is gone.
            if let Ok(Ok(())) = tokio::time::timeout(limits.deadline, rx).await {
                self.rx = None;
                return Ok(Guard {
                    shared: Arc::clone(&self.shared),
                    identity: self.identity.take(),
                });
            }
        }
        let shared = Arc::clone(&self.shared);
        drop(self);
        Err(shared.refuse(
            OverloadScope::Global,
            OverloadReason::DeadlinePassed,
            &limits,
        ))
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
    at: EntryRef,
    /// `None` once the waiter was handed its permit.
    rx: Option<oneshot::Receiver<Handoff>>,
}

impl IdentityWaiter {
    /// Waits for an identity permit for at most the identity deadline, then
    /// for the global permit if it was handed a place in the global queue.
    async fn wait(mut self) -> Result<Guard, Refusal> {
        let limits = match &self.shared.per_identity {
            Some(ids) => ids.limits,
            None => unreachable!("an identity waiter without a per-identity cap"),
        };
        let handoff = match &mut self.rx {
            Some(rx) => tokio::time::timeout(limits.deadline, rx).await,
            None => unreachable!("waited twice"),
        };
        let shared = Arc::clone(&self.shared);
        let Ok(Ok(handoff)) = handoff else {
            drop(self);
            return Err(shared.refuse(
                OverloadScope::Identity,
                OverloadReason::DeadlinePassed,
                &limits,
            ));
        };
        self.rx = None;
        let at = self.at;
        drop(self);
        match handoff {
            Handoff::Held => Ok(Guard {
                identity: Some(at),
                shared,
            }),
            Handoff::Queued(rx) => {
                GlobalWaiter {
                    shared,
                    identity: Some(at),
                    rx: Some(rx),
                }
                .wait()
                .await
            }
            Handoff::Refused => {
                let limits = match &shared.global {
                    Some(cap) => cap.limits,
                    None => unreachable!("refused by a global cap that is not there"),
                };
                Err(shared.refuse(OverloadScope::Global, OverloadReason::QueueFull, &limits))
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
    locked: Mutex<Locked>,
    refusals: RefusalCounters,
}

impl Shared {
    pub(crate) fn new(
        global: Option<Limits>,
        per_identity: Option<Limits>,
        identity_map: Limits,
    ) -> Arc<Self> {
        Arc::new(Shared {
            global: global.map(|limits| Cap { limits }),
            per_identity: per_identity.map(|limits| PerIdentity {
                limits,
                map_limits: identity_map,
                hasher: RandomState::new(),
            }),
            locked: Mutex::default(),
            refusals: RefusalCounters::default(),
        })
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
            let freed = self.locked.lock().global.give_back(rx);
            gauge_given_back(OverloadScope::Global, freed);
        }
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
        if let (Some(ids), Some(subject)) = (&self.per_identity, subject) {
            return self.begin_identified(ids, subject);
        }
        let Some(cap) = &self.global else {
            return Begin::Ready(Guard {
                shared: Arc::clone(self),
                identity: None,
            });
        };
        let take = self.locked.lock().global.take(&cap.limits);
        gauge_taken(OverloadScope::Global, &take);
        match take {
            Take::Held => Begin::Ready(Guard {
                shared: Arc::clone(self),
                identity: None,
            }),
            Take::Queued(rx) => Begin::Wait(Box::pin(
                GlobalWaiter {
                    shared: Arc::clone(self),
                    identity: None,
                    rx: Some(rx),
                }
                .wait(),
            )),
            Take::QueueFull => Begin::Refused(self.refuse(
                OverloadScope::Global,
                OverloadReason::QueueFull,
                &cap.limits,
            )),
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
        } = &mut *locked;
        let step = if let Some(entry) = map.find_mut(hash, |e| e.is(subject)) {
            let at = EntryRef {
                addr: entry.addr(),
                hash,
            };
            let before = entry.permits.counts();
            let step = if entry.permits.held < ids.limits.limit {
                // One of its own permits is free (so none of its requests
                // waits for one): the global step decides.
                let global = self.global.as_ref();
                let take = match global.map(|cap| GlobalLocked::new(cap, global_permits)) {
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
                match entry.permits.take(&ids.limits) {
                    Take::Queued(rx) => Step::IdentityQueued(at, rx),
                    Take::Held | Take::QueueFull => Step::IdentityQueueFull,
                }
            };
            moved(&mut moves.identity, before, entry.permits.counts());
            step
        } else {
            let global = self.global.as_ref();
            let mut global = global.map(|cap| GlobalLocked::new(cap, global_permits));
            // The global refusal first: with `max_identities >= limit +
            // queue` of the global cap, the map is never full while the
            // global cap has a permit or a place.
            let step = if global.as_ref().is_some_and(|g| g.permits.is_full(g.limits)) {
                Step::GlobalQueueFull
            } else if map.len() >= ids.map_limits.limit {
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
        drop(locked);
        moves.apply();
        match step {
            Step::Held(at) => Begin::Ready(Guard {
                shared: Arc::clone(self),
                identity: Some(at),
            }),
            Step::GlobalQueued(at, rx) => Begin::Wait(Box::pin(
                GlobalWaiter {
                    shared: Arc::clone(self),
                    identity: Some(at),
                    rx: Some(rx),
                }
                .wait(),
            )),
            Step::IdentityQueued(at, rx) => Begin::Wait(Box::pin(
                IdentityWaiter {
                    shared: Arc::clone(self),
                    at,
                    rx: Some(rx),
                }
                .wait(),
            )),
            Step::IdentityQueueFull => Begin::Refused(self.refuse(
                OverloadScope::Identity,
                OverloadReason::QueueFull,
                &ids.limits,
            )),
            Step::GlobalQueueFull => {
                let limits = match &self.global {
                    Some(cap) => cap.limits,
                    None => unreachable!("refused by a global cap that is not there"),
                };
                Begin::Refused(self.refuse(
                    OverloadScope::Global,
                    OverloadReason::QueueFull,
                    &limits,
                ))
            }
            Step::TooManyIdentities => Begin::Refused(self.refuse(
                OverloadScope::Global,
                OverloadReason::TooManyIdentities,
                &ids.map_limits,
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
            let mut global = global.map(|cap| GlobalLocked::new(cap, global_permits));
            if let Some(global) = &mut global {
                global.give_back(given);
            }
            permits.release_identity(global.as_mut());
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

    pub(crate) fn stats(&self) -> ConcurrencyStats {
        let r = &self.refusals;
        let (global_in_flight, global_queued, tracked_identities) = {
            let locked = self.locked.lock();
            (locked.global.held, locked.global.queued, locked.map.len())
        };
        ConcurrencyStats {
            global_in_flight,
            global_queued,
            tracked_identities,
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
