//! A dependency budget spent from one rate lease (feature `redis`).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::clock::{Clock, SystemClock, Timestamp};
use crate::outbound::bucket::{Bucket, NANO};
use crate::outbound::budget::Counters;
use crate::outbound::lease::{cap_at_refresh, Schedule};
use crate::outbound::{AttemptBudget, BudgetStats, LeaseMode, Rate, RateLease, Refusal, Share};
use crate::ConfigError;

/// The refusal of a released lease: this budget never admits again.
const RELEASED: Refusal = Refusal::Unavailable {
    wait: Duration::MAX,
};

/// A [`DependencyBudget`](crate::outbound::DependencyBudget) for a fleet that
/// keeps Redis off the send path (feature `redis`): every attempt is spent
/// from one [`RateLease`] on the **whole** budget, locally, and each share
/// also from a local bucket that fills at its part of the lease's current
/// rate.
///
/// With a lease on 240/s and a retry share of 40/s, an instance granted
/// 24/s spends at most 20/s on first attempts and 4/s on retries.
///
/// - **The total** is bounded by the lease alone: across the fleet, at most
///   the lease's bound on send starts (`docs/leases.md`: `n + R·τ + R·T` in
///   any interval `T` for `n` instances and the defaults). One lease, not
///   one per share, so the `n` term is paid once.
/// - **Each share** is held to its part of whatever the lease spends,
///   grant or fallback: a burst of retries cannot take what first attempts
///   need, nor the reverse. A share's bucket holds its part of the lease's
///   burst, and at least two attempts of the largest cost, so that a share
///   waiting while the other emptied the lease's bucket loses nothing.
///   A share's bucket fills on the lease's own schedule, stretch by
///   stretch: at its part of the grant until the grant's local expiry, of
///   the fallback after it, each capped at that stretch's capacity. So a
///   share idle across a fallback comes back with what the fallback filled,
///   not what the grant would have, and sends in any interval stay within
///   its capacity at the interval's start plus its part of what the lease
///   fills over it. When the lease changed more than once while a share was
///   idle, the time before the latest change fills nothing for that share.
/// - **No rate** (before the first refresh, or a zero grant): the wait is
///   the lease's own, the time to its next refresh. A **released** lease
///   refuses every attempt at once with [`Refusal::Unavailable`] and
///   `Duration::MAX`: the budget never admits again.
/// - **Fail-open** leases ([`RateLeaseBuilder::fail_open`](crate::outbound::RateLeaseBuilder::fail_open))
///   admit every attempt, share or not, while they are in the fallback.
/// - **Demand** reported to the grant script counts every attempt, refused
///   by a share or by the lease, so a starved share asks for more; a share's
///   waits count toward the time the lease was held back, as the lease's do.
///
/// Clones share the lease, the share buckets and the counters. Start the
/// lease's refresher ([`RateLease::spawn_refresher`]) yourself.
///
/// ```no_run
/// use std::num::NonZeroU32;
/// use tower_admission::outbound::{LeaseStore, LeasedBudget, Rate, RateLease};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = LeaseStore::builder("redis://127.0.0.1:6379/").prefix("myapp").build()?;
/// let expected_instances = NonZeroU32::new(40).unwrap();
/// let lease = RateLease::builder(store, "reports-db", Rate::per_second(240), expected_instances)
///     .build()?;
/// let _refresher = lease.spawn_refresher();
/// // 200/s for first attempts, 40/s for retries.
/// let budget = LeasedBudget::new(lease, Rate::per_second(40))?;
/// # Ok(())
/// # }
/// ```
pub struct LeasedBudget<C: Clock = SystemClock> {
    inner: Arc<Inner<C>>,
}

impl<C: Clock> Clone for LeasedBudget<C> {
    fn clone(&self) -> Self {
        LeasedBudget {
            inner: self.inner.clone(),
        }
    }
}

impl<C: Clock> fmt::Debug for LeasedBudget<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeasedBudget")
            .field("lease", &self.inner.lease)
            .field("retry", &self.inner.retry)
            .field("stats", &self.inner.stats.snapshot())
            .finish()
    }
}

struct Inner<C: Clock> {
    lease: RateLease<C>,
    /// The retry share; the normal share is the rest of the lease's rate.
    retry: Rate,
    /// The share buckets, normal then retry.
    shares: Mutex<[ShareBucket; 2]>,
    stats: Counters,
}

/// A share's local bucket and the schedule it last filled on.
#[derive(Debug, Clone, Copy)]
struct ShareBucket {
    bucket: Bucket,
    last: Timestamp,
    /// The lease's rate schedule when the bucket was last filled.
    schedule: Schedule,
}

impl<C: Clock> LeasedBudget<C> {
    /// Spends `lease` with `retry` of its rate kept for retries and the rest
    /// for first attempts. Fails unless `0 < retry < lease.rate()`.
    pub fn new(lease: RateLease<C>, retry: Rate) -> Result<Self, ConfigError> {
        if retry.as_milli() == 0 || retry.as_milli() >= lease.rate().as_milli() {
            return Err(ConfigError::new(
                "retry",
                format!(
                    "{retry} must be more than zero and less than the lease's rate {}",
                    lease.rate()
                ),
            ));
        }
        let now = lease.now();
        let stats = Counters::new(lease.budget());
        // The buckets fill from now on the schedule the lease has now.
        let empty = ShareBucket {
            bucket: Bucket::EMPTY,
            last: now,
            schedule: lease.schedule(),
        };
        Ok(LeasedBudget {
            inner: Arc::new(Inner {
                lease,
                retry,
                shares: Mutex::new([empty; 2]),
                stats,
            }),
        })
    }

    /// `share`'s bucket capacity while the lease's rate is `rate`, in
    /// nano-tokens: its part of the lease's, and at least two attempts of
    /// the largest cost, so that a share that is full while the other share
    /// has just emptied the lease's bucket keeps what it accrues meanwhile.
    fn share_capacity(&self, share: Share, rate: Rate) -> u128 {
        let lease = &self.inner.lease;
        let total = u128::from(lease.rate().as_milli());
        let part = u128::from(self.share_rate(share).as_milli());
        let units = u128::from(lease.capacity_at(rate)) * part / total;
        units.max(2 * u128::from(lease.max_cost())) * NANO
    }

    /// Fills `bucket` from its last fill to `now` as the lease's own bucket
    /// fills: each stretch of the lease's schedule at `share`'s part of its
    /// rate, capped at `share`'s part of its capacity. A share that was idle
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
    fn fill(&self, share: Share, bucket: &mut ShareBucket, now: Timestamp, current: Schedule) {
        let to = Timestamp(bucket.last.0.max(now.0));
        if current.epoch != bucket.schedule.epoch {
            let change = Timestamp(current.since.0.clamp(bucket.last.0, to.0));
            if current.epoch == bucket.schedule.epoch + 1 {
                let before = bucket.schedule;
                self.replay(share, bucket, &before, bucket.last, change);
            } else {
                bucket.bucket.cap(self.share_capacity(share, Rate::ZERO));
            }
            bucket.last = change;
            if change < current.since {
                return;
            }
            bucket.schedule = current;
        }
        self.replay(share, bucket, &current, bucket.last, to);
        bucket.last = to;
    }

    /// Fills `bucket` over `[from, to)` on `schedule`.
    fn replay(
        &self,
        share: Share,
        bucket: &mut ShareBucket,
        schedule: &Schedule,
        from: Timestamp,
        to: Timestamp,
    ) {
        for (rate, micros) in schedule.stretches(from, to) {
            if micros == 0 {
                continue;
            }
            let capacity = self.share_capacity(share, rate);
            bucket
                .bucket
                .fill(self.fill_rate(share, rate), micros, capacity);
        }
    }

    /// The rate `share`'s bucket fills at while the lease's rate is `rate`:
    /// its part of it, milli-units per second.
    fn fill_rate(&self, share: Share, rate: Rate) -> u128 {
        let total = u128::from(self.inner.lease.rate().as_milli());
        let part = u128::from(self.share_rate(share).as_milli());
        u128::from(rate.as_milli()) * part / total
    }

    /// The lease every attempt is spent from.
    pub fn lease(&self) -> &RateLease<C> {
        &self.inner.lease
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> BudgetStats {
        self.inner.stats.snapshot()
    }

    /// A share's rate, as a part of the lease's whole rate.
    pub fn share_rate(&self, share: Share) -> Rate {
        let total = self.inner.lease.rate().as_milli();
        let retry = self.inner.retry.as_milli();
        Rate::from_milli(match share {
            Share::Normal => total - retry,
            Share::Retry => retry,
        })
    }

    /// Charges one attempt of `cost` to `share` at the lease's local now.
    pub fn try_acquire_now(&self, share: Share, cost: u64) -> Result<(), Refusal> {
        self.try_acquire_at(share, cost, self.inner.lease.now())
    }

    /// Charges one attempt of `cost` to `share` at local time `now`: from
    /// the share's bucket and the lease's, both or neither. Synchronous.
    pub fn try_acquire_at(&self, share: Share, cost: u64, now: Timestamp) -> Result<(), Refusal> {
        let result = self.charge_at(share, cost, now);
        if result.is_err() {
            self.inner.stats.refused();
        }
        result
    }

    /// [`try_acquire_at`](Self::try_acquire_at) without counting a refusal.
    fn charge_at(&self, share: Share, cost: u64, now: Timestamp) -> Result<(), Refusal> {
        let inner = &*self.inner;
        let lease = &inner.lease;
        let status = lease.status_at(now);
        if status.mode == LeaseMode::Released {
            return Err(RELEASED);
        }
        if cost > lease.max_cost() {
            lease.note_demand(cost);
            return Err(Refusal::CostExceedsBudget { share, cost });
        }
        if lease.fails_open() && status.mode == LeaseMode::Fallback {
            let result = lease.try_acquire_at(cost, now);
            return match result {
                Ok(()) => {
                    inner.stats.admitted(share);
                    Ok(())
                }
                Err(wait) => Err(Refusal::Unavailable { wait }),
            };
        }
        let mut shares = inner.shares.lock();
        let bucket = &mut shares[match share {
            Share::Normal => 0,
            Share::Retry => 1,
        }];
        // Read under the shares' lock, so fills see the schedules in order.
        let schedule = lease.schedule();
        self.fill(share, bucket, now, schedule);
        let current = schedule.rate_at(now);
        let rate = self.fill_rate(share, current);
        bucket.bucket.cap(self.share_capacity(share, current));
        if bucket.bucket.missing(cost) > 0 {
            let wait = if rate == 0 {
                lease.note_demand(cost);
                lease.wait_without_rate(now)
            } else {
                let micros = cap_at_refresh(
                    bucket.bucket.wait_us(cost, rate),
                    lease.status_at(now).next_refresh,
                    now,
                );
                lease.note_held_back(cost, now, micros);
                Duration::from_micros(micros)
            };
            return Err(Refusal::Exhausted { share, wait });
        }
        match lease.try_acquire_at(cost, now) {
            Ok(()) => {
                bucket.bucket.spend(cost);
                inner.stats.admitted(share);
                Ok(())
            }
            // Released since the status was read.
            Err(Duration::MAX) => Err(RELEASED),
            Err(wait) => Err(Refusal::Exhausted { share, wait }),
        }
    }
}

impl<C: Clock> AttemptBudget for LeasedBudget<C> {
    fn charge(
        &self,
        share: Share,
        cost: u64,
    ) -> impl std::future::Future<Output = Result<(), Refusal>> + Send {
        std::future::ready(self.charge_at(share, cost, self.inner.lease.now()))
    }

    fn record_refusal(&self) {
        self.inner.stats.refused();
    }

    fn record_wait(&self, waited: Duration) {
        self.inner.stats.waited(waited);
    }

    fn stats(&self) -> BudgetStats {
        LeasedBudget::stats(self)
    }
}
