//! A share's local bucket: the outbound side's one [`Bucket`], filled on the
//! lease's own schedule at the share's part of the lease's rate.

use crate::clock::{Clock, Timestamp};
use crate::outbound::bucket::{Bucket, NANO};
use crate::outbound::lease::Schedule;
use crate::outbound::{Rate, RateLease};

/// A share's part of a lease: its rate out of the lease's whole rate.
pub(super) struct Part<'a, C: Clock> {
    pub(super) lease: &'a RateLease<C>,
    /// The share's rate.
    pub(super) rate: Rate,
}

impl<C: Clock> Part<'_, C> {
    /// The share's bucket capacity while the lease's rate is `rate`, in
    /// nano-tokens: its part of the lease's, and at least two attempts of
    /// the largest cost, so that a share that is full while the other share
    /// has just emptied the lease's bucket keeps what it accrues meanwhile.
    pub(super) fn capacity(&self, rate: Rate) -> u128 {
        let total = u128::from(self.lease.rate().as_milli());
        let part = u128::from(self.rate.as_milli());
        let units = u128::from(self.lease.capacity_at(rate)) * part / total;
        units.max(2 * u128::from(self.lease.max_cost())) * NANO
    }

    /// The rate the share's bucket fills at while the lease's rate is
    /// `rate`: its part of it, milli-units per second (nano-tokens per µs).
    pub(super) fn fill_rate(&self, rate: Rate) -> u128 {
        let total = u128::from(self.lease.rate().as_milli());
        let part = u128::from(self.rate.as_milli());
        u128::from(rate.as_milli()) * part / total
    }
}

/// A share's local bucket and the lease's schedule it last filled on.
#[derive(Debug, Clone, Copy)]
pub(super) struct ShareBucket {
    pub(super) bucket: Bucket,
    last: Timestamp,
    /// The lease's rate schedule when the bucket was last filled.
    schedule: Schedule,
}

impl ShareBucket {
    /// An empty bucket that fills from `now` on `schedule`.
    pub(super) fn new(now: Timestamp, schedule: Schedule) -> Self {
        ShareBucket {
            bucket: Bucket::EMPTY,
            last: now,
            schedule,
        }
    }

    /// Fills from the last fill to `now` as the lease's own bucket fills:
    /// each stretch of the lease's schedule at the share's part of its rate,
    /// capped at the share's part of its capacity. A share that was idle
    /// across a fallback so gets what the fallback filled, never what its
    /// grant would have.
    ///
    /// The schedule read at the last fill covers the time up to the change
    /// that followed it (the lease's bucket filled on it until that reply).
    /// When the lease changed more than once meanwhile, the schedules in
    /// between are not known here: that time fills nothing, and the bucket
    /// keeps at most its least capacity, so the fill never exceeds the
    /// lease's. A fill at a `now` before the change (read before the reply
    /// landed) keeps the earlier schedule, so the rest of the time up to
    /// the change fills on it too, never on the new one.
    pub(super) fn fill<C: Clock>(&mut self, part: &Part<'_, C>, now: Timestamp, current: Schedule) {
        let to = Timestamp(self.last.0.max(now.0));
        if current.epoch != self.schedule.epoch {
            let change = Timestamp(current.since.0.clamp(self.last.0, to.0));
            if current.epoch == self.schedule.epoch + 1 {
                let before = self.schedule;
                self.replay(part, &before, self.last, change);
            } else {
                self.bucket.cap(part.capacity(Rate::ZERO));
            }
            self.last = change;
            if change < current.since {
                return;
            }
            self.schedule = current;
        }
        self.replay(part, &current, self.last, to);
        self.last = to;
    }

    /// Fills over `[from, to)` on `schedule`.
    fn replay<C: Clock>(
        &mut self,
        part: &Part<'_, C>,
        schedule: &Schedule,
        from: Timestamp,
        to: Timestamp,
    ) {
        for (rate, micros) in schedule.stretches(from, to) {
            if micros == 0 {
                continue;
            }
            self.bucket
                .fill(part.fill_rate(rate), micros, part.capacity(rate));
        }
    }
}
