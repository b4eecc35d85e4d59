//! [`RateLease`]: a share of a fleet-wide budget, spent locally.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::builder::check_rate;
use super::schedule::cap_at_refresh;
use super::state::{Phase, Settings, State};
use super::{Asked, LeaseStatus, LeaseStore, Mode, Rate};
use crate::clock::{duration_to_micros, Clock, SystemClock, Timestamp};
use crate::reload::{Live, ReloadHandle, Target};
use crate::ConfigError;

/// A share of a fleet-wide rate budget, leased from Redis and spent locally
/// (feature `redis`).
///
/// Every instance leases a *rate* from a grant script on Redis and spends it
/// from a local token bucket: a send attempt is one lock and a few integer
/// operations, never a network call. Refreshes run in the background, and
/// shares follow the measured demand. Clones share one lease: one bucket,
/// one grant, one demand measure. Build one per budget per process with
/// [`RateLease::builder`], start [`spawn_refresher`](Self::spawn_refresher)
/// (or call [`refresh`](Self::refresh) yourself), and call
/// [`try_acquire`](Self::try_acquire) before every send attempt.
///
/// # The grant rule (on Redis, one atomic script)
///
/// The budget is one Redis hash, `prefix:{lease:budget}` (one hash tag, so
/// Redis Cluster keeps it on one slot; it expires with the last grant). For
/// every instance it keeps the reported demand and its *steps*: every grant
/// `(rate, expiry)` the instance may still be spending. An instance's
/// commitment at Redis time `t` is the highest rate among its steps that
/// expire after `t`. A refresh of instance `j` at Redis time `now`:
///
/// 1. computes **max-min fair** targets over the live instances' demands:
///    each gets `min(demand, λ)`, where `λ` is the water level at which the
///    targets sum to `R`, so what small demands leave goes to larger ones.
///    Another instance's demand that is still a guess (its first refresh,
///    nothing measured) counts as `R` here: a guess must not let `j` take
///    what the other may need. A held-back one (below) counts as twice
///    itself, at most `R`: what its grant can grow to by its next report;
/// 2. grants `g = min(target_j, R − Σ_{i≠j} commitment_i(now))`, valid for
///    the lease length `L` (`expiry = now + L`, default 5 s);
/// 3. adds the step `(g, now + L)` and keeps `j`'s older steps: **a lowered
///    grant frees its surplus only when the old grant expires**, because the
///    instance keeps spending the old rate until the reply reaches it (or,
///    if the reply is lost, until the old lease ends). An instance that
///    stopped spending above a rate before sending says so, and its steps
///    are cut to that rate first: its surplus is free at once.
///
/// Here `R` is the lowest budget of `j` and the live instances: during a
/// deploy that lowers it, the instances still on the old one are held to
/// the new one; a raised one applies once no live instance has the old.
///
/// Every commitment profile is non-increasing in time, so their sum is
/// highest at the present, and the check in step 2 keeps it `≤ R` at every
/// later Redis time. `docs/leases.md` has the proof and the bound on send
/// starts: with the defaults, at most `n + R·25 ms + R·T` in any interval
/// `T` (n instances), 286 per second for 40 instances and `R` = 240/s.
///
/// A new instance gets what is free at once, and its fair share as soon as
/// the others' older grants run out: at most one lease length after the
/// script learns its demand (the reply says when, and the instance
/// refreshes then). No sound rule is faster without holding capacity back,
/// since a grant issued just before the newcomer arrived may be spent until
/// it expires. A dead instance's share returns when its last grant expires;
/// [`release`](Self::release) returns it at once on a clean shutdown.
///
/// # The local side
///
/// The bucket's rate is the current grant and its capacity
/// `max(max_cost, grant × burst)` (defaults 1 and 25 ms); it starts empty.
/// A grant is used until `send_instant + (expiry − now_in_reply) −
/// expiry_margin` on the local clock: only durations, so an offset between
/// the instance's clock and Redis's changes nothing, and the instance stops
/// no later than Redis's expiry. When the grant expires without renewal
/// (Redis unreachable), the bucket runs at the fallback capacity
/// `R / expected_instances` until a refresh succeeds again; entering and
/// leaving the fallback are logged once each (`warn`, `info`).
///
/// Demand is the rate of attempts, refused ones included, over the window
/// since the last measurement (at least a quarter of the refresh period),
/// at least `min_demand`. The first refresh reports `initial_demand` as a
/// guess, and so does the first one from the fallback (the instance holds
/// no grant, and Redis may have restarted empty: the first instance back
/// must not take the whole budget); the next, a quarter period later,
/// reports a measurement.
///
/// A window is **held back** by its grant when, for at least three quarters of
/// it, a refused attempt was still inside the wait it was told (for the bucket,
/// or a [`LeasedBudget`](crate::outbound::LeasedBudget) share, to fill, or with
/// no rate to spend, for the next refresh) and its attempts asked at least nine
/// tenths of the grant (fewer, with such waits, is a queue draining or bursts).
/// Callers that queue and wait then attempt about as fast as the grant lets
/// them, so the count understates what they want. Such a window reports at
/// least twice the grant, flagged as held back once or, the second such window
/// in a row, twice (an ask carried over from the last report, above the
/// doubling, is unflagged). Other instances' targets count one held back once
/// as half its report, about the grant it was held back at (one such window is
/// as often a burst as growth), and one held back twice as twice its report (at
/// most `R`), room for its next doubling, unless they are held back twice too.
/// Held back twice, an instance may also take its part of what no demand asks,
/// shared with every other held-back one, up to twice its report: the share
/// that others leave (a scale-down) is taken at the next call, not one doubling
/// per refresh. It never reports less than it reported last time: a grant below
/// that is no sign that it needs less (a newcomer's first grant is next to
/// nothing while the others' older grants run out, and its callers, told to
/// wait for the next refresh, attempt little: it keeps asking for its guess,
/// and gets it when those grants expire, instead of doubling from `min_demand`
/// once per refresh). A held-back window at a zero grant reports that figure
/// unflagged, and its first grant is measured a quarter period later, as a
/// guess's is. Not counted as `R`, as a guess is: a small held-back instance
/// would strand the difference for every other one. Not reported as `R`: after
/// Redis restarts empty, the first instance back would be granted all of it
/// while the others still spend their grants. Waits shorter than that (an
/// instance at or below its need) leave the measured figure. A doubling that
/// was granted (the grant rose by half) and whose next window used less than
/// three quarters of it shows that the waits came from bursts, not from the
/// grant: the instance then reports its measured rate and an eighth, unflagged,
/// until its attempts reach three quarters of the doubled grant (a window that
/// holds more of its bursts than the last is no growth). A grant asked for by a
/// guess or a doubling that the next measure finds larger than needed is given
/// back at once, down to that measure and a quarter, instead of at its expiry.
/// Through a [`LeasedBudget`](crate::outbound::LeasedBudget) the rate is in the
/// lease's units: what the share that asks most needs of the whole grant.
///
/// # One id, one holder
///
/// Each lease draws a random *life* when it is built, and the script keeps it
/// beside the id's grants. A refresh of another life while those grants last (a
/// second live process configured with the same id, or a restarted one while
/// its previous run's grants run out) is refused with
/// [`LeaseError::InstanceIdInUse`](super::LeaseError::InstanceIdInUse): that
/// lease stops spending any grant it holds, spends the fallback capacity `R /
/// expected_instances` (even after
/// [`fail_open`](super::RateLeaseBuilder::fail_open)), logs one `error` naming
/// the id, counts the refusal in [`LeaseStatus::id_in_use`] and refreshes again
/// when the other's last grant expires. So two processes with one id send at
/// most one grant plus one fallback share, and a restarted process takes its id
/// at most one lease length after its previous run's last refresh (at once
/// after a [`release`](Self::release)).
///
/// A bucket whose capacity is one unit loses what it would accrue while it
/// is full, so callers that retry only on their own schedule use a little
/// less than the grant (one attempt per millisecond at 24/s: 23.8/s).
/// Callers that wait the returned duration lose nothing.
///
/// ```no_run
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use tower_admission::outbound::{LeaseStore, Rate, RateLease};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = LeaseStore::new("redis://127.0.0.1:6379/", "myapp", Duration::from_millis(100))?;
/// let lease = RateLease::builder(store, "billing-api", Rate::per_second(240), NonZeroU32::new(40).unwrap())
///     .build()?;
/// let _refresher = lease.spawn_refresher();
/// match lease.try_acquire(1) {
///     Ok(()) => { /* send */ }
///     Err(wait) => println!("budget spent, retry in {wait:?}"),
/// }
/// # Ok(())
/// # }
/// ```
pub struct RateLease<C: Clock = SystemClock> {
    pub(super) inner: Arc<Shared<C>>,
}

impl<C: Clock> Clone for RateLease<C> {
    fn clone(&self) -> Self {
        RateLease {
            inner: self.inner.clone(),
        }
    }
}

impl<C: Clock> fmt::Debug for RateLease<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLease")
            .field("budget", &self.inner.budget)
            .field("instance", &self.inner.id)
            .field("status", &self.status())
            .finish()
    }
}

pub(super) struct Shared<C> {
    pub(super) store: LeaseStore,
    pub(super) key: String,
    pub(super) budget: Box<str>,
    pub(super) id: Box<str>,
    /// This lease's life, random (from the thread-local CSPRNG, seeded by
    /// the OS): the script records it beside the id's grants and refuses a
    /// refresh of another life while they last; after a release, Redis
    /// ignores a refresh of this life that was still on its way, not one of
    /// a new lease under the same id.
    pub(super) life: u64,
    /// The settings in force; a reload of the rate replaces them whole.
    pub(super) cfg: Live<Settings>,
    /// The largest fleet, which divides the rate into the fallback.
    pub(super) expected: std::num::NonZeroU32,
    /// Caps the budget reported at each refresh, if set.
    pub(super) ceiling: Option<super::Ceiling>,
    pub(super) clock: C,
    pub(super) state: Mutex<State>,
    pub(super) refreshing: tokio::sync::Mutex<()>,
    /// Wakes the refresher when the lease is released.
    pub(super) wake: Arc<tokio::sync::Notify>,
    /// True once the first refresh has finished.
    pub(super) ready: tokio::sync::watch::Sender<bool>,
}

impl<C: Clock> RateLease<C> {
    /// Spends `cost` from the local bucket now; see
    /// [`try_acquire_at`](Self::try_acquire_at).
    #[inline]
    pub fn try_acquire(&self, cost: u64) -> Result<(), Duration> {
        let now = Timestamp::now(&self.inner.clock);
        self.acquire_counting(cost, Asked::Cost(cost), now)
    }

    /// Spends `cost` at local time `now` (since the Unix epoch), or refuses with the wait until it
    /// would fit at the current rate. Synchronous: one lock, no I/O.
    ///
    /// Every attempt, refused or not, counts toward the demand reported at the
    /// next refresh, and a refusal's wait at a rate above zero toward the time
    /// held back. With no rate to spend (starting, or a zero grant) the wait is
    /// the time to the next refresh; a cost above
    /// [`max_cost`](super::RateLeaseBuilder::max_cost), or a released lease, is
    /// refused with `Duration::MAX`. No wait runs past a refresh that is due
    /// later, which may change the rate: a caller told to wait until then looks
    /// again then. While a refresh is overdue or in flight, no wait runs past
    /// [`retry_every`](super::RateLeaseBuilder::retry_every).
    pub fn try_acquire_at(&self, cost: u64, now: Duration) -> Result<(), Duration> {
        self.acquire_counting(cost, Asked::Cost(cost), Timestamp::from_duration(now))
    }

    /// [`try_acquire_at`](Self::try_acquire_at), counting `asked` toward
    /// the demand (nothing for an attempt already counted on an earlier
    /// look).
    pub(crate) fn acquire_counting(
        &self,
        cost: u64,
        asked: Asked,
        now: Timestamp,
    ) -> Result<(), Duration> {
        let cfg = &self.inner.settings();
        let mut s = self.inner.state.lock();
        if s.phase == Phase::Released {
            return Err(Duration::MAX);
        }
        s.count(asked);
        if cost > cfg.max_cost {
            return Err(Duration::MAX);
        }
        s.advance(now, cfg);
        s.note_fallback(now, cfg, &self.inner.budget, &self.inner.id);
        if cfg.fail_open && !s.id_taken && s.mode_at(now) == Mode::Fallback {
            return Ok(());
        }
        if s.bucket.missing(cost) == 0 {
            s.bucket.spend(cost);
            return Ok(());
        }
        let rate = s.rate_at(now, cfg);
        if rate.0 == 0 {
            let wait = s.wait_without_rate(now, cfg);
            s.note_wait(now, duration_to_micros(wait));
            return Err(wait);
        }
        let micros = s.bucket.wait_us(cost, u128::from(rate.0));
        let wait = cap_at_refresh(micros, s.next_refresh, now, cfg.retry_us);
        s.note_wait(now, wait);
        Err(Duration::from_micros(wait))
    }

    /// The lease's state at the local time now.
    pub fn status(&self) -> LeaseStatus {
        self.status_at(self.inner.clock.now())
    }

    /// The lease's state at local time `now`, since the Unix epoch (the
    /// bucket is not touched).
    pub fn status_at(&self, now: Duration) -> LeaseStatus {
        let now = Timestamp::from_duration(now);
        self.inner.state.lock().status(now, &self.inner.settings())
    }

    /// This instance's id.
    pub fn instance_id(&self) -> &str {
        &self.inner.id
    }

    /// The budget's name.
    pub fn budget(&self) -> &str {
        &self.inner.budget
    }

    /// The fleet-wide rate the lease is a share of.
    pub fn rate(&self) -> Rate {
        self.inner.settings().rate
    }

    /// The fallback capacity, `rate / expected_instances`.
    pub fn fallback_rate(&self) -> Rate {
        self.inner.settings().fallback
    }

    /// The largest cost one attempt may have.
    pub fn max_cost(&self) -> u64 {
        self.inner.settings().max_cost
    }

    /// Changes the fleet-wide rate `R` of this lease and its clones while
    /// they run; the fallback becomes `R / expected_instances`. A rate is
    /// checked as [`build`](super::RateLeaseBuilder::build) checks it. The
    /// next refresh sends it: the grant script takes the lowest `R` of the
    /// live instances, so a lowered `R` binds the whole fleet within one
    /// lease length of that refresh, and a raised one once no live instance
    /// sends a lower one.
    pub fn reload_handle(&self) -> ReloadHandle<Rate> {
        ReloadHandle::new(Arc::new(RateTarget(Arc::clone(&self.inner))))
    }
}

impl<C> Shared<C> {
    /// The settings in force.
    #[inline]
    pub(super) fn settings(&self) -> Settings {
        **self.cfg.load()
    }

    /// The settings with the rate `rate`, checked.
    fn with_rate(&self, rate: Rate) -> Result<Settings, ConfigError> {
        check_rate(rate)?;
        let mut cfg = self.settings();
        cfg.rate = rate;
        cfg.fallback = Rate(rate.0 / u64::from(self.expected.get()));
        Ok(cfg)
    }
}

/// The lease's side of its [`ReloadHandle`].
struct RateTarget<C>(Arc<Shared<C>>);

impl<C: Clock> Target<Rate> for RateTarget<C> {
    fn check(&self, new: &Rate) -> Result<(), ConfigError> {
        self.0.with_rate(*new).map(drop)
    }

    fn swap(&self, new: Rate) {
        if let Ok(cfg) = self.0.with_rate(new) {
            self.0.cfg.store(cfg);
        }
    }
}
