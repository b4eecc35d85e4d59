//! The gate: a limit (fixed or adaptive), criticality classes with their
//! shares of it, and a fair queue per class, under one lock.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::class::{class_cap, Criticality};
use super::config::AdaptiveLimit;
use super::controller::{Controller, Outcome, Sample};
use super::fair::{Admit, FairQueue, Full};
use std::sync::atomic::{AtomicU64, Ordering};

use super::stats::{ClassCounts, GateStats};
use super::telemetry::Telemetry;
use crate::concurrency::OverloadReason;

/// Where the limit comes from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Source {
    Fixed(usize),
    Adaptive(AdaptiveLimit),
}

/// The settings of a gate.
#[derive(Debug, Clone)]
pub(crate) struct GateConfig {
    pub(crate) source: Source,
    /// Share of the limit per class, by [`Criticality::index`].
    pub(crate) shares: [f64; 3],
    /// Places in each class's queue.
    pub(crate) queue: usize,
    pub(crate) deadline: Duration,
    /// The `scope` label of its metrics.
    pub(crate) scope: Arc<str>,
}

/// What changes, under the gate's lock.
#[derive(Debug)]
struct State {
    controller: Option<Controller>,
    /// The limit of a fixed source; a reload changes it.
    fixed: usize,
    in_flight: usize,
    class_in_flight: [usize; 3],
    queues: [FairQueue; 3],
    shed: [u64; 3],
}

pub(crate) struct Gate {
    pub(crate) config: GateConfig,
    state: Mutex<State>,
    telemetry: Telemetry,
    /// Refused at once (queue or tenant's share full), and after the deadline.
    refused: [AtomicU64; 2],
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Why a gate refused, and its limit then.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GateRefusal {
    pub(crate) reason: OverloadReason,
    pub(crate) class: Criticality,
    pub(crate) limit: usize,
}

/// What [`Gate::begin`] decided.
#[derive(Debug)]
pub(crate) enum GateBegin {
    Ready(Ticket),
    Wait(GateWaiter),
    Refused(GateRefusal),
}

/// The tenant of requests without one: they share one sub-queue.
fn no_tenant() -> Arc<str> {
    Arc::from("")
}

impl State {
    fn limit(&self, config: &GateConfig) -> usize {
        match (&self.controller, config.source) {
            (Some(c), _) => c.limit(),
            (None, Source::Fixed(_)) => self.fixed,
            (None, Source::Adaptive(cfg)) => cfg.initial,
        }
    }

    fn epoch(&self) -> u64 {
        self.controller.as_ref().map_or(0, Controller::epoch)
    }

    fn take(&mut self, class: Criticality) {
        self.in_flight += 1;
        self.class_in_flight[class.index()] += 1;
        if let Some(c) = &mut self.controller {
            c.admitted(self.in_flight);
        }
    }

    fn queued(&self) -> [usize; 3] {
        [
            self.queues[0].live(),
            self.queues[1].live(),
            self.queues[2].live(),
        ]
    }
}

impl Gate {
    pub(crate) fn new(config: GateConfig) -> Arc<Self> {
        let controller = match config.source {
            Source::Adaptive(cfg) => Some(Controller::new(cfg, Instant::now())),
            Source::Fixed(_) => None,
        };
        let fixed = match config.source {
            Source::Fixed(limit) => limit,
            Source::Adaptive(cfg) => cfg.initial,
        };
        let state = State {
            controller,
            fixed,
            in_flight: 0,
            class_in_flight: [0; 3],
            queues: Default::default(),
            shed: [0; 3],
        };
        let telemetry = Telemetry::new(&config.scope);
        let gate = Arc::new(Gate {
            state: Mutex::new(state),
            telemetry,
            refused: Default::default(),
            config,
        });
        let limit = gate.state.lock().limit(&gate.config);
        gate.telemetry.start(limit, gate.adaptive());
        gate
    }

    /// Puts a reload's numbers in force: a fixed source's limit, or an
    /// adaptive one's floor and ceiling. Requests in flight keep their
    /// slots; the slots a higher limit frees go to the waiters at once.
    pub(crate) fn set_source(&self, source: Source) {
        let now = self.now();
        let mut st = self.state.lock();
        match (source, &mut st.controller) {
            (Source::Adaptive(cfg), Some(c)) => c.set_bounds(cfg.floor, cfg.ceiling),
            (Source::Fixed(limit), None) => st.fixed = limit,
            _ => unreachable!("a reload keeps the kind of a gate's source"),
        }
        let handed = self.dispatch(&mut st, now);
        self.publish_limit(&st);
        drop(st);
        for class in Criticality::BY_PRIORITY {
            let n = handed[class.index()];
            if n != 0 {
                self.telemetry.moved(class, n, -n);
            }
        }
    }

    fn adaptive(&self) -> bool {
        matches!(self.config.source, Source::Adaptive(_))
    }

    fn now(&self) -> Option<Instant> {
        self.adaptive().then(Instant::now)
    }

    /// Admits at once, queues, or refuses a request of `class` and
    /// `tenant`. A newcomer never passes a waiter of its class or a more
    /// critical one.
    pub(crate) fn begin(
        self: &Arc<Self>,
        class: Criticality,
        tenant: Option<&Arc<str>>,
    ) -> GateBegin {
        let now = self.now();
        let mut st = self.state.lock();
        let limit = st.limit(&self.config);
        let cap = class_cap(&self.config.shares, class, limit);
        let waiting = Criticality::BY_PRIORITY
            .iter()
            .take_while(|c| **c >= class)
            .any(|c| st.queues[c.index()].live() > 0);
        if st.in_flight < cap && !waiting {
            st.take(class);
            let epoch = st.epoch();
            drop(st);
            self.telemetry.moved(class, 1, 0);
            return GateBegin::Ready(Ticket::new(self, class, now, epoch));
        }
        if let Some(c) = &mut st.controller {
            c.pressed();
        }
        let pushed = if self.config.queue == 0 {
            Err(Full::Queue)
        } else {
            let tenant = tenant.cloned().unwrap_or_else(no_tenant);
            st.queues[class.index()]
                .push(&tenant, self.config.queue)
                .map(|rx| (rx, tenant))
        };
        match pushed {
            Ok((rx, tenant)) => {
                drop(st);
                self.telemetry.moved(class, 0, 1);
                GateBegin::Wait(GateWaiter {
                    gate: Arc::clone(self),
                    class,
                    tenant,
                    rx: Some(rx),
                })
            }
            Err(full) => {
                let reason = match full {
                    Full::Queue => OverloadReason::QueueFull,
                    Full::Tenant => OverloadReason::TenantQueueFull,
                };
                st.shed[class.index()] += 1;
                drop(st);
                GateBegin::Refused(self.refused(class, reason, limit))
            }
        }
    }

    fn refused(&self, class: Criticality, reason: OverloadReason, limit: usize) -> GateRefusal {
        self.telemetry.shed(class, reason);
        let counter = usize::from(reason == OverloadReason::DeadlinePassed);
        self.refused[counter].fetch_add(1, Ordering::Relaxed);
        GateRefusal {
            reason,
            class,
            limit,
        }
    }

    /// Hands free slots to waiters, most critical class first, each class
    /// within its share, round-robin across tenants within a class.
    /// Returns how many were handed per class.
    fn dispatch(&self, st: &mut State, now: Option<Instant>) -> [isize; 3] {
        let mut handed = [0; 3];
        let at = now.unwrap_or_else(Instant::now);
        'slots: loop {
            let limit = st.limit(&self.config);
            for class in Criticality::BY_PRIORITY {
                let i = class.index();
                if st.queues[i].live() == 0
                    || st.in_flight >= class_cap(&self.config.shares, class, limit)
                {
                    continue;
                }
                let epoch = st.epoch();
                if st.queues[i].next(at, epoch) {
                    st.take(class);
                    handed[i] += 1;
                    continue 'slots;
                }
            }
            return handed;
        }
    }

    /// A request of `class` leaves its slot; with a controller, `sample`
    /// tells how (`None`: a slot handed to a waiter that had left).
    fn release(&self, class: Criticality, sample: Option<Left>) {
        let now = self.now();
        let mut st = self.state.lock();
        st.in_flight -= 1;
        st.class_in_flight[class.index()] -= 1;
        let in_flight = st.in_flight;
        let mut limit_moved = false;
        if let (Some(c), Some(now), Some((epoch, started, answer))) =
            (&mut st.controller, now, sample)
        {
            let (elapsed, sample) = match answer {
                Some((elapsed, outcome)) => (elapsed, Sample::Answered(outcome)),
                None => (now.saturating_duration_since(started), Sample::Dropped),
            };
            limit_moved = c.sample(now, epoch, elapsed, sample, in_flight);
        }
        let handed = self.dispatch(&mut st, now);
        if limit_moved {
            self.publish_limit(&st);
        }
        drop(st);
        self.telemetry.moved(class, -1, 0);
        for class in Criticality::BY_PRIORITY {
            let n = handed[class.index()];
            if n != 0 {
                self.telemetry.moved(class, n, -n);
            }
        }
    }

    fn publish_limit(&self, st: &State) {
        let limit = st.limit(&self.config);
        let c = st.controller.as_ref();
        self.telemetry.limit(
            limit,
            c.and_then(Controller::baseline),
            c.and_then(Controller::latency),
        );
    }

    /// A waiter of `class` and `tenant` leaves the queue unserved.
    fn leave_queue(&self, class: Criticality, tenant: &Arc<str>) {
        self.state.lock().queues[class.index()].leave(tenant);
        self.telemetry.moved(class, 0, -1);
    }

    pub(crate) fn stats(&self) -> GateStats {
        let st = self.state.lock();
        let queued = st.queued();
        let c = st.controller.as_ref();
        GateStats {
            limit: st.limit(&self.config),
            baseline_latency: c.and_then(Controller::baseline),
            latency: c.and_then(Controller::latency),
            probing: c.is_some_and(Controller::probing),
            in_flight: st.in_flight,
            queued: queued.iter().sum(),
            classes: [0, 1, 2].map(|i| ClassCounts {
                in_flight: st.class_in_flight[i],
                queued: queued[i],
                shed: st.shed[i],
            }),
            refused_queue_full: self.refused[0].load(Ordering::Relaxed),
            refused_deadline: self.refused[1].load(Ordering::Relaxed),
        }
    }
}

/// How a slot of an adaptive gate was left: its probe epoch, when it was
/// taken, and the answer's latency and outcome (`None`: dropped first).
type Left = (u64, Instant, Option<(Duration, Outcome)>);

/// A slot of the gate. Dropping it gives the slot back, with the answer
/// recorded by [`answered`](Self::answered), or as a dropped request when
/// there is none.
#[derive(Debug)]
pub(crate) struct Ticket {
    gate: Arc<Gate>,
    class: Criticality,
    started: Option<Instant>,
    epoch: u64,
    answer: Option<(Duration, Outcome)>,
}

impl Ticket {
    fn new(gate: &Arc<Gate>, class: Criticality, started: Option<Instant>, epoch: u64) -> Self {
        Ticket {
            gate: Arc::clone(gate),
            class,
            started,
            epoch,
            answer: None,
        }
    }

    /// Records the answer: its latency is measured now. Only the first
    /// answer counts.
    pub(crate) fn answered(&mut self, outcome: Outcome) {
        if let (Some(started), None) = (self.started, self.answer) {
            self.answer = Some((started.elapsed(), outcome));
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let sample = self.started.map(|at| (self.epoch, at, self.answer));
        self.gate.release(self.class, sample);
    }
}

/// A request in a class's queue. Leaving it by any path (cancellation
/// included) frees its place, or the slot handed to it meanwhile.
#[derive(Debug)]
pub(crate) struct GateWaiter {
    gate: Arc<Gate>,
    class: Criticality,
    tenant: Arc<str>,
    rx: Option<oneshot::Receiver<Admit>>,
}

impl GateWaiter {
    /// Waits for a slot for at most the queue deadline.
    pub(crate) async fn wait(mut self) -> Result<Ticket, GateRefusal> {
        let deadline = self.gate.config.deadline;
        let got = match &mut self.rx {
            Some(rx) => tokio::time::timeout(deadline, rx).await,
            None => unreachable!("waited twice"),
        };
        let gate = Arc::clone(&self.gate);
        let class = self.class;
        let reason = match got {
            Ok(Ok(Admit::Go { at, epoch })) => {
                self.rx = None;
                let started = gate.adaptive().then_some(at);
                return Ok(Ticket::new(&gate, class, started, epoch));
            }
            Ok(Ok(Admit::Evicted)) => {
                self.rx = None;
                OverloadReason::TenantQueueFull
            }
            _ => OverloadReason::DeadlinePassed,
        };
        drop(self);
        let limit = {
            let mut st = gate.state.lock();
            st.shed[class.index()] += 1;
            st.limit(&gate.config)
        };
        if reason == OverloadReason::TenantQueueFull {
            gate.telemetry.moved(class, 0, -1);
        }
        Err(gate.refused(class, reason, limit))
    }
}

impl Drop for GateWaiter {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        rx.close();
        match rx.try_recv() {
            // Handed a slot it will not use: it goes on at once, as from a
            // request that never ran.
            Ok(Admit::Go { .. }) => self.gate.release(self.class, None),
            Ok(Admit::Evicted) => self.gate.telemetry.moved(self.class, 0, -1),
            Err(_) => self.gate.leave_queue(self.class, &self.tenant),
        }
    }
}
