//! One cap's permits and wait queue, and the hand-off of a global step to
//! a request handed its identity permit.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::oneshot;

use super::gauges::{moved, Moves};

/// The settings of one cap.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Limits {
    pub(crate) limit: usize,
    pub(crate) queue: usize,
    pub(crate) deadline: Duration,
    pub(crate) retry_after: Duration,
}

/// One cap's permits and wait queue, kept under its owner's lock. `M` is
/// what a waiter is handed with its permit.
///
/// A permit given back goes to the first waiter still waiting, so while any
/// waiter waits every permit is held: a newcomer never passes the queue.
#[derive(Debug)]
pub(super) struct Permits<M = ()> {
    /// Permits taken: requests running or sending their body, and waiters
    /// handed a permit they have not yet woken up to.
    pub(super) held: usize,
    /// Waiters still waiting.
    pub(super) queued: usize,
    /// The waiters in arrival order. A waiter that left keeps its (closed)
    /// sender here until it is skipped or swept.
    pub(super) queue: VecDeque<oneshot::Sender<M>>,
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
pub(super) enum Take<M = ()> {
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
    pub(super) fn take(&mut self, limits: &Limits) -> Take<M> {
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
    pub(super) fn is_full(&self, limits: &Limits) -> bool {
        self.held >= limits.limit && self.queued >= limits.queue
    }

    pub(super) fn counts(&self) -> [usize; 2] {
        [self.held, self.queued]
    }

    pub(super) fn is_idle(&self) -> bool {
        self.held == 0 && self.queued == 0
    }
}

impl Permits {
    /// Gives one permit back: to the first waiter still waiting (true), or
    /// to the cap (false). While more are held than `limits.limit` (a
    /// lowered cap), it goes to the cap.
    #[inline]
    pub(super) fn release(&mut self, limits: &Limits) -> bool {
        if self.held > limits.limit {
            self.held -= 1;
            return false;
        }
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
    pub(super) fn give_back(
        &mut self,
        rx: Option<&mut oneshot::Receiver<()>>,
        limits: &Limits,
    ) -> bool {
        let holds = match rx {
            None => true,
            Some(rx) => {
                rx.close();
                rx.try_recv().is_ok()
            }
        };
        if holds {
            !self.release(limits)
        } else {
            self.queued -= 1;
            false
        }
    }

    /// Hands the permits a raised cap frees to the waiters, first come
    /// first served.
    pub(super) fn admit_waiters(&mut self, limits: &Limits) {
        while self.held < limits.limit {
            let Some(tx) = self.queue.pop_front() else {
                return;
            };
            if tx.send(()).is_ok() {
                self.held += 1;
                self.queued -= 1;
            }
        }
    }
}

/// What a request waiting in its identity queue is handed with its
/// identity permit: the global step, taken for it in the same locked step
/// that handed the permit over, so no newcomer can take the global permit
/// between the two.
#[derive(Debug)]
pub(super) enum Handoff {
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
    /// locked), or else to the entry. While the entry holds more than
    /// `limits.limit` (a lowered cap), it goes to the entry.
    pub(super) fn release_identity(
        &mut self,
        limits: &Limits,
        mut global: Option<&mut GlobalLocked<'_>>,
    ) {
        if self.held <= limits.limit && self.hand_to_waiter(&mut global) {
            return;
        }
        self.held -= 1;
    }

    /// Hands the permits a raised cap frees to the entry's waiters, each
    /// with its global step taken for it.
    pub(super) fn admit_waiters(
        &mut self,
        limits: &Limits,
        mut global: Option<&mut GlobalLocked<'_>>,
    ) {
        while self.held < limits.limit && self.hand_to_waiter(&mut global) {
            self.held += 1;
        }
    }

    /// Hands one identity permit to the first waiter still waiting, with
    /// its global step taken for it: true when one took it, false when none
    /// waits.
    fn hand_to_waiter(&mut self, global: &mut Option<&mut GlobalLocked<'_>>) -> bool {
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
                        return true;
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
        false
    }
}

/// The global cap's permits, under the lock they share with the map, with
/// their counts when the step began.
pub(super) struct GlobalLocked<'a> {
    pub(super) limits: &'a Limits,
    pub(super) permits: &'a mut Permits,
    before: [usize; 2],
}

/// What a request gives back of the global cap.
pub(super) enum Given {
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
    pub(super) fn new(limits: &'a Limits, permits: &'a mut Permits) -> Self {
        GlobalLocked {
            limits,
            before: permits.counts(),
            permits,
        }
    }

    pub(super) fn take(&mut self) -> Take {
        self.permits.take(self.limits)
    }

    #[inline]
    pub(super) fn give_back(&mut self, given: Given) {
        match given {
            Given::Nothing => {}
            Given::Permit => {
                self.permits.release(self.limits);
            }
            Given::Place(mut rx) => {
                self.permits.give_back(Some(&mut rx), self.limits);
            }
        }
    }

    /// Records how the counts moved.
    pub(super) fn finish(self, moves: &mut Moves) {
        moved(&mut moves.global, self.before, self.permits.counts());
    }
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
            assert!(!permits.give_back(Some(&mut rx), &LIMITS));
            assert_eq!(permits.queued, 1);
            assert!(permits.queue.len() <= 3, "{} senders", permits.queue.len());
        }
        // The permit goes to the first waiter, then back to the cap.
        assert!(!permits.give_back(None, &LIMITS));
        assert_eq!(first.try_recv(), Ok(()));
        assert_eq!((permits.held, permits.queued), (1, 0));
        assert!(permits.give_back(None, &LIMITS));
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
        assert!(!permits.give_back(None, &LIMITS));
        assert!(!permits.give_back(Some(&mut second), &LIMITS));
        assert_eq!(third.try_recv(), Ok(()));
        assert_eq!((permits.held, permits.queued), (1, 0));
        assert!(permits.give_back(None, &LIMITS));
        assert!(permits.is_idle());
    }
}
