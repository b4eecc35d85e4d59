//! The mock's capacity: processor sharing among the requests in flight.
//!
//! Each request brings `latency` of *work*. With capacity C (`None`:
//! unlimited) and n requests in flight, each one is served at the rate
//! `min(1, C / n)`: up to C at once take `latency`, and above C they share
//! the C "servers" equally, so n requests that arrive together all finish
//! after `latency × n / C`. The rate is re-evaluated at every arrival,
//! departure and capacity change, so a request that arrives while others are
//! in flight slows them down from that instant only, and a departure speeds
//! up the rest.
//!
//! The model is exact, event by event, in integer nanoseconds: it keeps a
//! *virtual time* `V` that advances at the common rate, and a request that
//! arrives at `V = v` with work `w` is done when `V` reaches `v + w`. `V` is
//! computed from an anchor set at the last event (arrival, departure,
//! capacity change), so reading it in between loses nothing. A completion's
//! instant is rounded up to the nanosecond and `V` at an arrival rounded
//! down, so each event can delay the rest by under 1 ns of work.
//!
//! Time is given as nanoseconds since an origin the caller picks, so the model
//! is a pure state machine: no clock, no tasks.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

/// Nanoseconds since the caller's origin.
pub(crate) type Nanos = u64;

/// One request's place in the model: the virtual time at which it is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    finish: Nanos,
}

/// Processor sharing with a capacity. See the module docs.
#[derive(Debug)]
pub(crate) struct Sharing {
    capacity: Option<NonZeroU32>,
    /// The instant of the last event: the anchor `V` is computed from.
    at: Nanos,
    /// Virtual time at `at`: the work each request then in flight had
    /// received since the origin.
    virtual_at: Nanos,
    /// The latest instant the model was advanced to.
    now: Nanos,
    /// The requests in flight by the virtual time at which they are done.
    finishing: BTreeMap<Nanos, u64>,
    in_flight: u64,
}

impl Sharing {
    /// An empty model at `now`.
    pub(crate) fn new(capacity: Option<NonZeroU32>, now: Nanos) -> Self {
        Sharing {
            capacity,
            at: now,
            virtual_at: 0,
            now,
            finishing: BTreeMap::new(),
            in_flight: 0,
        }
    }

    /// The requests not done yet, as of the last advance.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// The capacity: `None` is unlimited.
    pub(crate) fn capacity(&self) -> Option<NonZeroU32> {
        self.capacity
    }

    /// Changes the capacity at `now`; the requests in flight keep the work
    /// they have received and continue at the new rate.
    pub(crate) fn set_capacity(&mut self, capacity: Option<NonZeroU32>, now: Nanos) {
        self.anchor(now);
        self.capacity = capacity;
    }

    /// A request with `work` nanoseconds of work arrives at `now`.
    pub(crate) fn arrive(&mut self, work: Nanos, now: Nanos) -> Ticket {
        self.anchor(now);
        let finish = self.virtual_at.saturating_add(work);
        if work > 0 {
            *self.finishing.entry(finish).or_insert(0) += 1;
            self.in_flight += 1;
        }
        Ticket { finish }
    }

    /// Whether `ticket` was done by the last advance.
    pub(crate) fn is_done(&self, ticket: Ticket) -> bool {
        self.virtual_now() >= ticket.finish
    }

    /// Removes a request that leaves before it is done (its client went
    /// away). Returns whether the others speed up from `now`: it was in
    /// flight and they were sharing the capacity.
    pub(crate) fn cancel(&mut self, ticket: Ticket, now: Nanos) -> bool {
        self.advance(now);
        if self.is_done(ticket) {
            return false;
        }
        self.anchor(now);
        let sharing = matches!(self.capacity, Some(c) if self.in_flight > u64::from(c.get()));
        if let Some(count) = self.finishing.get_mut(&ticket.finish) {
            *count -= 1;
            if *count == 0 {
                self.finishing.remove(&ticket.finish);
            }
            self.in_flight -= 1;
        }
        sharing
    }

    /// When `ticket` will be done if nothing else arrives and the capacity
    /// stays: the departures before it, which speed it up, are counted.
    pub(crate) fn done_at(&self, ticket: Ticket) -> Nanos {
        let (mut at, mut v, mut n) = (self.at, self.virtual_at, self.in_flight);
        for (&finish, &count) in self.finishing.range(..=ticket.finish) {
            at = at.saturating_add(self.time_for(finish - v, n));
            v = finish;
            n -= count;
        }
        at
    }

    /// Moves the model to `now`, completing every request whose work is done
    /// by then, each at its own instant (so the rate changes in between).
    /// An instant before the last one is taken as the last one.
    pub(crate) fn advance(&mut self, now: Nanos) {
        self.now = self.now.max(now);
        while let Some((&finish, &count)) = self.finishing.first_key_value() {
            let done = self
                .at
                .saturating_add(self.time_for(finish - self.virtual_at, self.in_flight));
            if done > self.now {
                break;
            }
            self.at = done;
            self.virtual_at = finish;
            self.finishing.pop_first();
            self.in_flight -= count;
        }
    }

    /// Advances to `now` and makes it the anchor, before the rate changes.
    fn anchor(&mut self, now: Nanos) {
        self.advance(now);
        self.virtual_at = self.virtual_now();
        self.at = self.now;
    }

    /// `V` at the last advance.
    fn virtual_now(&self) -> Nanos {
        self.virtual_at + self.work_in(self.now - self.at, self.in_flight)
    }

    /// The time `work` takes with `n` in flight, rounded up.
    fn time_for(&self, work: Nanos, n: u64) -> Nanos {
        match self.capacity {
            Some(c) if n > u64::from(c.get()) => {
                let time = (u128::from(work) * u128::from(n)).div_ceil(u128::from(c.get()));
                Nanos::try_from(time).unwrap_or(Nanos::MAX)
            }
            _ => work,
        }
    }

    /// The work each of `n` in flight receives in `time`, rounded down.
    fn work_in(&self, time: Nanos, n: u64) -> Nanos {
        match self.capacity {
            Some(c) if n > u64::from(c.get()) => {
                (u128::from(time) * u128::from(c.get()) / u128::from(n)) as Nanos
            }
            _ => time,
        }
    }
}
