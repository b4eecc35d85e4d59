//! What a [`LeasedBudget`](crate::outbound::LeasedBudget) reads from and
//! tells its lease, in the order its share path uses them.

use std::time::Duration;

use super::schedule::Schedule;
use super::{Rate, RateLease};
use crate::clock::{Clock, Timestamp};
use crate::outbound::bucket::whole;

impl<C: Clock> RateLease<C> {
    /// The local time now, on the lease's clock.
    pub(crate) fn now(&self) -> Timestamp {
        self.inner.clock.now()
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

    /// Counts `milli` milli-units of the lease toward the demand of share
    /// `share` (0 or 1): what an attempt of that share asks of the lease
    /// (see [`State::share_attempted`](super::state::State::share_attempted)).
    pub(crate) fn note_share_demand(&self, share: usize, milli: u64) {
        let mut s = self.inner.state.lock();
        s.share_attempted[share] = s.share_attempted[share].saturating_add(milli);
    }

    /// Counts the wait of `wait_us` given at `now` to an attempt that a
    /// share refused for its part of a rate above zero toward the time the
    /// lease was held back.
    pub(crate) fn note_held_back(&self, now: Timestamp, wait_us: u64) {
        self.inner.state.lock().note_wait(now, wait_us);
    }
}
