//! What a [`LeasedBudget`](crate::outbound::LeasedBudget) reads from and
//! tells its lease, in the order its share path uses them.

use std::time::Duration;

use super::schedule::{cap_at_refresh, Schedule};
use super::{Asked, Rate, RateLease};
use crate::clock::{Clock, Timestamp};
use crate::outbound::bucket::whole;

impl<C: Clock> RateLease<C> {
    /// The local time now, on the lease's clock.
    pub(crate) fn now(&self) -> Timestamp {
        Timestamp::now(&self.inner.clock)
    }

    /// Whether the fallback admits without limit now
    /// ([`RateLeaseBuilder::fail_open`], and the id is not held by another
    /// lease).
    pub(crate) fn fails_open(&self) -> bool {
        self.inner.settings().fail_open && !self.inner.state.lock().id_taken
    }

    /// The rate schedule in force now.
    pub(crate) fn schedule(&self) -> Schedule {
        self.inner.state.lock().schedule(&self.inner.settings())
    }

    /// The bucket's capacity at `rate`, in whole cost units (as
    /// [`LeaseStatus::capacity`] gives it).
    pub(crate) fn capacity_at(&self, rate: Rate) -> u64 {
        whole(self.inner.settings().capacity(rate))
    }

    /// The wait [`try_acquire_at`](Self::try_acquire_at) gives at `now`
    /// when there is no rate to spend.
    pub(crate) fn wait_without_rate(&self, now: Timestamp) -> Duration {
        self.inner
            .state
            .lock()
            .wait_without_rate(now, &self.inner.settings())
    }

    /// `wait_us` at `now`, capped as the lease's own waits are: never past
    /// the next refresh, nor past `retry_every` while one is due.
    pub(crate) fn cap_wait(&self, wait_us: u64, now: Timestamp) -> u64 {
        let next_refresh = self.inner.state.lock().next_refresh;
        cap_at_refresh(wait_us, next_refresh, now, self.inner.settings().retry_us)
    }

    /// Counts `asked` toward the demand of an attempt that a caller refused
    /// before it reached the bucket (its cost is more than any bucket
    /// holds).
    pub(crate) fn note_demand(&self, asked: Asked) {
        self.inner.state.lock().count(asked);
    }

    /// [`note_demand`](Self::note_demand) for an attempt refused at `now`
    /// and told to wait `wait_us` for its share of the lease: the wait
    /// counts toward the time the lease was held back.
    pub(crate) fn note_held_back(&self, asked: Asked, now: Timestamp, wait_us: u64) {
        let mut s = self.inner.state.lock();
        s.count(asked);
        s.note_wait(now, wait_us);
    }
}
