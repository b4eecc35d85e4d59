//! A dependency budget spent from one rate lease (feature `redis`).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::clock::{Clock, SystemClock, Timestamp};
use crate::outbound::budget::Counters;
use crate::outbound::lease::Asked;
use crate::outbound::{
    Attempt, AttemptBudget, BudgetError, BudgetShares, BudgetStats, Rate, RateLease,
};
use crate::reload::{ReloadHandle, Target};
use crate::ConfigError;

mod share;

use share::{Part, ShareBucket};

/// Which look an attempt takes at the budget: only the first counts
/// toward the demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Look {
    First,
    Again,
}

/// The refusal of a released lease: this budget never admits again.
const RELEASED: BudgetError = BudgetError::Unavailable {
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
///   refuses every attempt at once with [`BudgetError::Unavailable`](crate::outbound::BudgetError::Unavailable) and
///   `Duration::MAX`: the budget never admits again.
/// - **Fail-open** leases ([`RateLeaseBuilder::fail_open`](crate::outbound::RateLeaseBuilder::fail_open))
///   admit every attempt, share or not, while they are in the fallback.
/// - **Demand** reported to the grant script counts every attempt, refused
///   by a share or by the lease, so a starved share asks for more, and in
///   the lease's units: an attempt on a share of rate `r` asks `cost × R /
///   r` (20 first attempts a second ask 24/s of a 240/s lease whose retry
///   share is 40/s), the grant under which that share sends it; the demand
///   is what the share that asks most needs. A share's waits count toward
///   the time the lease was held back, as the lease's do.
///   An attempt counts once: a look again after a refusal
///   ([`AttemptBudget::charge_again`], the layer's queue) adds nothing, or
///   an instance whose attempts wait briefly would report more than it
///   sends and be granted a surplus that no other instance can use. One
///   that queues behind the layer's head counts when it joins the queue
///   ([`AttemptBudget::note_arrival`]), not when it reaches the head.
///
/// Clones share the lease, the share buckets and the counters. Start the
/// lease's refresher ([`RateLease::spawn_refresher`]) yourself.
///
/// ```no_run
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use tower_admission::outbound::{LeaseStore, LeasedBudget, Rate, RateLease};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = LeaseStore::new("redis://127.0.0.1:6379/", "myapp", Duration::from_millis(100))?;
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
            .field("retry", &self.retry())
            .field("stats", &self.inner.stats.snapshot())
            .finish()
    }
}

struct Inner<C: Clock> {
    lease: RateLease<C>,
    /// The retry share in thousandths per second; the normal share is the
    /// rest of the lease's rate. A reload changes it.
    retry: std::sync::atomic::AtomicU64,
    /// The share buckets, normal then retry.
    shares: Mutex<[ShareBucket; 2]>,
    stats: Counters,
}

impl<C: Clock> LeasedBudget<C> {
    /// Spends `lease` with `retry` of its rate kept for retries and the rest
    /// for first attempts. Fails unless `0 < retry < lease.rate()`.
    pub fn new(lease: RateLease<C>, retry: Rate) -> Result<Self, ConfigError> {
        check_retry(retry, lease.rate())?;
        let now = lease.now();
        let stats = Counters::new(lease.budget());
        // The buckets fill from now on the schedule the lease has now.
        let empty = ShareBucket::new(now, lease.schedule());
        Ok(LeasedBudget {
            inner: Arc::new(Inner {
                lease,
                retry: retry.as_milli().into(),
                shares: Mutex::new([empty; 2]),
                stats,
            }),
        })
    }

    /// The retry share's part of the lease if `retry`, else the normal
    /// share's.
    fn part(&self, retry: bool) -> Part<'_, C> {
        Part {
            lease: &self.inner.lease,
            rate: self.rate_of(retry),
        }
    }

    /// The lease every attempt is spent from.
    pub fn lease(&self) -> &RateLease<C> {
        &self.inner.lease
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> BudgetStats {
        self.inner.stats.snapshot()
    }

    /// The rate of the share `attempt` draws on (the retry share for a
    /// retry), as a part of the lease's whole rate.
    pub fn share_rate(&self, attempt: Attempt) -> Rate {
        self.rate_of(attempt.is_retry())
    }

    /// The retry share's rate if `retry`, else the normal share's.
    fn rate_of(&self, retry: bool) -> Rate {
        let total = self.inner.lease.rate().as_milli();
        let retry_rate = self.retry().as_milli();
        Rate::from_milli(if retry {
            retry_rate
        } else {
            total.saturating_sub(retry_rate)
        })
    }

    /// What an attempt of `cost` on the retry share (if `retry`) or the
    /// normal one asks of the lease, in milli-units: `cost × R / r` for a
    /// share of rate `r` out of the lease's `R`, the grant under which the
    /// share sends it (a share of no rate asks its cost).
    fn asked(&self, retry: bool, cost: u64) -> u64 {
        let total = u128::from(self.inner.lease.rate().as_milli());
        let part = u128::from(self.rate_of(retry).as_milli());
        let milli = u128::from(cost) * 1_000;
        let asked = (milli * total).checked_div(part).unwrap_or(milli);
        u64::try_from(asked).unwrap_or(u64::MAX)
    }

    fn retry(&self) -> Rate {
        Rate::from_milli(self.inner.retry.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Changes the shares while they run: the lease's rate `R` becomes
    /// their sum, and the retry share its part, checked as
    /// [`RateLeaseBuilder::build`](crate::outbound::RateLeaseBuilder::build)
    /// and [`new`](Self::new) check them (errors name the field `rate` or
    /// `retry`). `R` reaches the fleet with the lease's next refresh (see
    /// [`RateLease::reload_handle`]); the shares take their new split from
    /// the next attempt on.
    pub fn reload_handle(&self) -> ReloadHandle<BudgetShares<Rate>> {
        ReloadHandle::new(Arc::new(RatesTarget {
            budget: self.clone(),
            rate: self.inner.lease.reload_handle(),
        }))
    }

    /// Charges `attempt` of `cost` to its share at the lease's local now.
    pub fn try_acquire_now(&self, attempt: Attempt, cost: u64) -> Result<(), BudgetError> {
        self.try_acquire_at(attempt, cost, self.inner.lease.now().as_duration())
    }

    /// Charges `attempt` of `cost` at local time `now` (since the Unix
    /// epoch): from its share's bucket (the retry share's for a retry) and
    /// the lease's, both or neither. Synchronous.
    pub fn try_acquire_at(
        &self,
        attempt: Attempt,
        cost: u64,
        now: Duration,
    ) -> Result<(), BudgetError> {
        let now = Timestamp::from_duration(now);
        let result = self.charge_at(attempt.is_retry(), cost, now, Look::First);
        if result.is_err() {
            self.inner.stats.refused();
        }
        result
    }

    /// [`try_acquire_at`](Self::try_acquire_at) without counting a refusal:
    /// the whole share path, in order. An attempt counts toward the demand
    /// on its first look only. To the retry share if `retry`.
    fn charge_at(
        &self,
        retry: bool,
        cost: u64,
        now: Timestamp,
        look: Look,
    ) -> Result<(), BudgetError> {
        let inner = &*self.inner;
        let lease = &inner.lease;
        // 1. A released lease never admits again.
        let status = lease.status_at(now.as_duration());
        if status.is_released() {
            return Err(RELEASED);
        }
        // 2. The attempt's demand, counted by whichever lease call comes
        //    next, on its first look only: what its share needs of the
        //    lease to send it (cost × R / the share's rate).
        let asked = match look {
            Look::First => Asked::Share {
                share: usize::from(retry),
                milli: self.asked(retry, cost),
            },
            Look::Again => Asked::Nothing,
        };
        // 3. A cost no bucket holds: refused, counted as demand.
        if cost > lease.max_cost() {
            lease.note_demand(asked);
            return Err(BudgetError::CostExceedsBudget { retry, cost });
        }
        // 4. A fail-open lease in its fallback admits every attempt, share
        //    or not.
        if lease.fails_open() && status.is_fallback() {
            let result = lease.acquire_counting(cost, asked, now);
            return match result {
                Ok(()) => {
                    inner.stats.admitted(retry);
                    Ok(())
                }
                Err(wait) => Err(BudgetError::Unavailable { wait }),
            };
        }
        // 5. The share's bucket fills on the lease's schedule up to now (read
        //    under the shares' lock, so fills see the schedules in order),
        //    held to its capacity at the current rate.
        let part = self.part(retry);
        let mut shares = inner.shares.lock();
        let bucket = &mut shares[usize::from(retry)];
        let schedule = lease.schedule();
        bucket.fill(&part, now, schedule);
        let current = schedule.rate_at(now);
        let rate = part.fill_rate(current);
        bucket.bucket.cap(part.capacity(current));
        // 6. Short of the cost: refused with the wait until it fits (never
        //    past the next refresh), which counts toward the time the lease
        //    was held back; with no rate, the lease's own wait.
        if bucket.bucket.missing(cost) > 0 {
            let wait = if rate == 0 {
                let wait = lease.wait_without_rate(now);
                lease.note_held_back(asked, now, crate::clock::duration_to_micros(wait));
                wait
            } else {
                let micros = lease.cap_wait(bucket.bucket.wait_us(cost, rate), now);
                lease.note_held_back(asked, now, micros);
                Duration::from_micros(micros)
            };
            return Err(BudgetError::Exhausted { retry, wait });
        }
        // 7. The lease's own bucket: both are charged, or neither.
        match lease.acquire_counting(cost, asked, now) {
            Ok(()) => {
                bucket.bucket.spend(cost);
                inner.stats.admitted(retry);
                Ok(())
            }
            // Released since the status was read.
            Err(Duration::MAX) => Err(RELEASED),
            Err(wait) => Err(BudgetError::Exhausted { retry, wait }),
        }
    }
}

impl<C: Clock> AttemptBudget for LeasedBudget<C> {
    fn charge(
        &self,
        attempt: Attempt,
        cost: u64,
    ) -> impl std::future::Future<Output = Result<(), BudgetError>> + Send {
        let now = self.inner.lease.now();
        std::future::ready(self.charge_at(attempt.is_retry(), cost, now, Look::First))
    }

    fn charge_again(
        &self,
        attempt: Attempt,
        cost: u64,
    ) -> impl std::future::Future<Output = Result<(), BudgetError>> + Send {
        let now = self.inner.lease.now();
        std::future::ready(self.charge_at(attempt.is_retry(), cost, now, Look::Again))
    }

    fn note_arrival(&self, attempt: Attempt, cost: u64) {
        let retry = attempt.is_retry();
        self.inner.lease.note_demand(Asked::Share {
            share: usize::from(retry),
            milli: self.asked(retry, cost),
        });
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

    fn record_pushback(&self) {
        self.inner.lease.record_pushback();
    }
}

/// `retry` within `rate`: more than zero, less than the whole.
fn check_retry(retry: Rate, rate: Rate) -> Result<(), ConfigError> {
    if retry.as_milli() == 0 || retry.as_milli() >= rate.as_milli() {
        return Err(ConfigError::new(
            "retry",
            format!("{retry} must be more than zero and less than the lease's rate {rate}"),
        ));
    }
    Ok(())
}

/// The leased budget's side of its [`ReloadHandle`].
struct RatesTarget<C: Clock> {
    budget: LeasedBudget<C>,
    rate: ReloadHandle<Rate>,
}

impl<C: Clock> Target<BudgetShares<Rate>> for RatesTarget<C> {
    fn check(&self, new: &BudgetShares<Rate>) -> Result<(), ConfigError> {
        let rate = whole(new);
        self.rate.check(&rate)?;
        check_retry(new.retry, rate)
    }

    fn swap(&self, new: BudgetShares<Rate>) {
        // The retry share first when it shrinks, last when it grows: the
        // normal share, the rest of the rate, never reads a retry share
        // above the rate.
        let retry = &self.budget.inner.retry;
        let smaller = new.retry < self.budget.retry();
        if smaller {
            retry.store(new.retry.as_milli(), std::sync::atomic::Ordering::Relaxed);
        }
        let _ = self.rate.apply(whole(&new));
        if !smaller {
            retry.store(new.retry.as_milli(), std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The lease's rate `R` of `shares`: their sum.
fn whole(shares: &BudgetShares<Rate>) -> Rate {
    Rate::from_milli(
        shares
            .normal
            .as_milli()
            .saturating_add(shares.retry.as_milli()),
    )
}
