//! Rate leases: a fleet shares one budget with no Redis call per send
//! (feature `redis`).
//!
//! The user-facing description is on [`RateLease`]; the grant rule is in
//! `scripts/lease.lua` and the proof of the bound in `docs/leases.md`.
//!
//! Layout: [`LeaseStore`] is the connection and the script (one call per
//! refresh, under a deadline); [`RateLease`] is the client: the local token
//! bucket in integer nano-tokens (a rate in milli-units per second times µs),
//! the demand window, the refresh schedule and the fallback.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use redis::{Script, Value};
use tokio::task::JoinHandle;

use crate::clock::{duration_to_micros, Clock, ManualClock, SystemClock, Timestamp};
use crate::outbound::bucket::{nano, whole, Bucket};
use crate::redis::{CallError, Connector, Request, Target, Timing};
use crate::ConfigError;

const LEASE_SCRIPT: &str = include_str!("scripts/lease.lua");

/// The argument the test-only clock reads the time from.
const CLOCK_ARG: u8 = 9;

/// A demand window is held back when refused attempts were waiting for at
/// least this part of it, as (numerator, denominator); see [`RateLease`].
const HELD_BACK: (u64, u64) = (3, 4);

/// `wait_us`, at least 1, but never past `next_refresh` when that is after
/// `now`: the refresh may change the rate the wait was computed at.
pub(crate) fn cap_at_refresh(wait_us: u64, next_refresh: Timestamp, now: Timestamp) -> u64 {
    let wait = wait_us.max(1);
    match next_refresh.0.saturating_sub(now.0) {
        0 => wait,
        until => wait.min(until),
    }
}

/// A measured demand: other instances' targets count it as it is (the
/// script's ARGV[4]).
const MEASURED: u8 = 0;
/// A guessed demand: other instances' targets count it as the whole budget.
const GUESS: u8 = 1;
/// A demand held back by its grant: other instances' targets count it as
/// twice itself, at most the whole budget.
const HELD_BACK_FLAG: u8 = 2;

/// The largest budget, in milli-units per second (about 10^9 per second),
/// so that every sum in the script stays exact in Lua's doubles.
const MAX_RATE_MILLI: u64 = 1 << 40;

/// A rate in thousandths of a unit per second: exact in the script, fine
/// enough for shares such as 240/s over 41 instances.
///
/// ```
/// use tower_admission::outbound::Rate;
/// assert_eq!(Rate::per_second(240).as_milli(), 240_000);
/// assert_eq!(Rate::from_milli(5_853).to_string(), "5.853/s");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Rate(u64);

impl Rate {
    /// Zero per second.
    pub const ZERO: Rate = Rate(0);

    /// `units` per second.
    pub const fn per_second(units: u64) -> Rate {
        Rate(units.saturating_mul(1_000))
    }

    /// `milli` thousandths of a unit per second.
    pub const fn from_milli(milli: u64) -> Rate {
        Rate(milli)
    }

    /// Thousandths of a unit per second.
    pub const fn as_milli(self) -> u64 {
        self.0
    }

    /// Units per second, as a float (for display and metrics).
    pub fn as_f64(self) -> f64 {
        self.0 as f64 / 1_000.0
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:03}/s", self.0 / 1_000, self.0 % 1_000)
    }
}

/// Why a call to the grant script failed. A failed refresh is always safe:
/// the instance keeps its current grant until it expires, and the script
/// keeps counting every grant it may have issued.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseError {
    /// No connection to Redis: nothing was sent.
    Unavailable {
        /// What went wrong.
        message: String,
    },
    /// The call was sent but failed (Redis answered an error, the connection
    /// dropped, or the reply was not the script's).
    Failed {
        /// What went wrong.
        message: String,
    },
    /// No answer before the deadline; the script may have run.
    Timeout,
    /// The lease was released; nothing was sent.
    Released,
    /// Refused: another live lease holds this instance id's grants (a second
    /// process configured with the same id, or the previous run of this one
    /// while its grants last). The script changed nothing; this lease
    /// spends the fallback capacity until a refresh succeeds, due when the
    /// other lease's grants expire unless it renews them.
    InstanceIdInUse {
        /// The instance id.
        id: String,
        /// Until the other lease's last grant expires (Redis time).
        free_in: Duration,
    },
}

impl fmt::Display for LeaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseError::Unavailable { message } => write!(f, "redis unavailable: {message}"),
            LeaseError::Failed { message } => write!(f, "lease call failed: {message}"),
            LeaseError::Timeout => f.write_str("no answer from redis before the deadline"),
            LeaseError::Released => f.write_str("the lease was released"),
            LeaseError::InstanceIdInUse { id, free_in } => write!(
                f,
                "instance id {id:?} is held by another live lease (two processes configured with one id?); free in {free_in:?} unless that lease renews"
            ),
        }
    }
}

impl std::error::Error for LeaseError {}

impl From<CallError> for LeaseError {
    fn from(error: CallError) -> Self {
        match error {
            CallError::Unavailable(message) => LeaseError::Unavailable { message },
            CallError::Rejected(message) | CallError::Unknown(message) => {
                LeaseError::Failed { message }
            }
            CallError::Timeout(_) => LeaseError::Timeout,
        }
    }
}

/// The connection to the grant script on one Redis server (feature `redis`).
/// Clones share the connection; many [`RateLease`]s (one per budget, or
/// several simulated instances in a test) can share one store.
///
/// The store connects on first use, reconnects after a failed call (or one
/// that timed out or was dropped unanswered by its caller), and bounds
/// every call by its deadline. The script is sent by `EVALSHA` (loaded
/// again on `NOSCRIPT`, e.g. after a restart). It talks to one server;
/// each budget is one key with a hash tag, `prefix:{lease:budget}`, so a
/// Redis Cluster variant needs no change of keys or script.
///
/// A call that fails is always safe for the budget: the script counts every
/// grant it issued until that grant's expiry, and an instance spends only
/// grants it has received.
#[derive(Clone)]
pub struct LeaseStore {
    inner: Arc<StoreInner>,
}

struct StoreInner {
    prefix: Box<str>,
    deadline: Duration,
    connector: Connector,
    script: Script,
    clock: Option<ManualClock>,
}

impl fmt::Debug for LeaseStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseStore")
            .field("prefix", &self.inner.prefix)
            .field("deadline", &self.inner.deadline)
            .field("connected", &self.inner.connector.is_connected())
            .field("test_clock", &self.inner.clock.is_some())
            .finish()
    }
}

/// Settings for a [`LeaseStore`]; [`build`](Self::build) checks them.
#[derive(Debug, Clone)]
pub struct LeaseStoreBuilder {
    url: String,
    prefix: String,
    deadline: Duration,
    clock: Option<ManualClock>,
}

/// The arguments of a script call (ARGV 1 and 3 to 8).
#[derive(Debug, Clone, Copy)]
struct Args {
    op: &'static str,
    /// The calling lease's life (0 for a snapshot).
    life: u64,
    demand: Rate,
    /// How others count the demand: `MEASURED`, `GUESS` or
    /// `HELD_BACK_FLAG`.
    flag: u8,
    budget: Rate,
    lease_us: u64,
    /// The grant held by the instance's own account: rate, µs left.
    held: (Rate, u64),
}

impl Args {
    const fn op_only(op: &'static str) -> Args {
        Args {
            op,
            life: 0,
            demand: Rate::ZERO,
            flag: MEASURED,
            budget: Rate::ZERO,
            lease_us: 0,
            held: (Rate::ZERO, 0),
        }
    }
}

/// The reply of a grant call, on Redis time.
#[derive(Debug, Clone, Copy)]
struct GrantReply {
    rate: Rate,
    expiry: u64,
    now: u64,
    recheck: u64,
    target: Rate,
}

/// The grants of one budget as the script counts them, read by
/// [`LeaseStore::grants`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GrantTable {
    /// The script's time (Redis time, µs).
    pub now: Timestamp,
    /// Every live instance.
    pub instances: Vec<InstanceGrant>,
}

/// One instance's entry in a [`GrantTable`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InstanceGrant {
    /// The instance id.
    pub id: String,
    /// The demand it last reported.
    pub demand: Rate,
    /// Whether that demand was a guess (its first refresh, nothing measured
    /// yet) or held back by its grant. Others' targets count a guess as the
    /// whole budget and a held-back demand as twice itself, at most that.
    pub guessed: bool,
    /// The grants it may still be spending, by expiry, rates decreasing; the
    /// last one is its latest grant.
    pub steps: Vec<GrantStep>,
}

/// A grant counted until its expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct GrantStep {
    /// The granted rate.
    pub rate: Rate,
    /// Its expiry on Redis time.
    pub expires_at: Timestamp,
}

impl InstanceGrant {
    /// The rate counted for this instance at Redis time `t`: the highest
    /// rate among its steps that expire after `t`.
    pub fn committed_at(&self, t: Timestamp) -> Rate {
        self.steps
            .iter()
            .filter(|s| s.expires_at > t)
            .map(|s| s.rate)
            .max()
            .unwrap_or(Rate::ZERO)
    }

    /// Its latest grant.
    pub fn latest(&self) -> Option<GrantStep> {
        self.steps.last().copied()
    }
}

impl GrantTable {
    /// The sum of all instances' commitments at Redis time `t`.
    pub fn committed_at(&self, t: Timestamp) -> Rate {
        Rate(self.instances.iter().map(|i| i.committed_at(t).0).sum())
    }

    /// The highest sum of commitments at any time from [`now`](Self::now)
    /// on, checked at `now` and at every step's expiry.
    pub fn peak(&self) -> Rate {
        let times = std::iter::once(self.now).chain(
            self.instances
                .iter()
                .flat_map(|i| i.steps.iter().map(|s| s.expires_at)),
        );
        times
            .filter(|t| *t >= self.now)
            .map(|t| self.committed_at(t))
            .max()
            .unwrap_or(Rate::ZERO)
    }

    /// The entry of instance `id`.
    pub fn instance(&self, id: &str) -> Option<&InstanceGrant> {
        self.instances.iter().find(|i| i.id == id)
    }
}

fn valid_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

impl LeaseStore {
    /// Settings for a store on one Redis server, e.g. `redis://127.0.0.1:6379/`.
    pub fn builder(url: impl Into<String>) -> LeaseStoreBuilder {
        LeaseStoreBuilder {
            url: url.into(),
            prefix: "admission".to_owned(),
            deadline: Duration::from_millis(100),
            clock: None,
        }
    }

    /// The Redis key of `budget`: `prefix:{lease:budget}`.
    pub fn key(&self, budget: &str) -> String {
        format!("{}:{{lease:{budget}}}", self.inner.prefix)
    }

    /// The per-call deadline.
    pub fn deadline(&self) -> Duration {
        self.inner.deadline
    }

    /// The grant script as Redis runs it in production (reading `TIME`), for
    /// loading it by hand or benchmarking it. Its arguments are documented at
    /// the top of `scripts/lease.lua`.
    pub fn script_source() -> String {
        script(None)
    }

    /// Reads the grants of `budget` as the script counts them (read only).
    pub async fn grants(&self, budget: &str) -> Result<GrantTable, LeaseError> {
        let reply = self
            .call(&self.key(budget), "-", &Args::op_only("s"))
            .await?;
        parse_table(&reply).ok_or_else(|| bad_reply("snapshot"))
    }

    async fn grant(&self, key: &str, id: &str, args: &Args) -> Result<GrantReply, LeaseError> {
        let reply = self.call(key, id, args).await?;
        let nums = ints(&reply).filter(|n| n.len() == 7);
        let Some(n) = nums else {
            return Err(bad_reply("grant"));
        };
        let u = |i: usize| u64::try_from(n[i]).unwrap_or(0);
        if u(6) > 0 {
            return Err(LeaseError::InstanceIdInUse {
                id: id.to_owned(),
                free_in: Duration::from_micros(u(6).saturating_sub(u(2))),
            });
        }
        Ok(GrantReply {
            rate: Rate(u(0)),
            expiry: u(1),
            now: u(2),
            recheck: u(3),
            target: Rate(u(4)),
        })
    }

    /// Deletes instance `id`'s grants if `life` holds them; for `lease_us`
    /// after, a refresh of its `life` that reaches Redis late changes
    /// nothing.
    async fn release(
        &self,
        key: &str,
        id: &str,
        life: u64,
        lease_us: u64,
    ) -> Result<(), LeaseError> {
        let args = Args {
            life,
            lease_us,
            ..Args::op_only("r")
        };
        self.call(key, id, &args).await.map(drop)
    }

    /// One script call under the deadline. The arguments (and the injected
    /// test time) are fixed before anything is awaited.
    async fn call(&self, key: &str, id: &str, args: &Args) -> Result<Value, LeaseError> {
        let now = self.inner.clock.as_ref().map_or(0, |c| c.now().as_micros());
        let mut invocation = self.inner.script.prepare_invoke();
        invocation
            .key(key)
            .arg(args.op)
            .arg(id)
            .arg(args.demand.0)
            .arg(args.flag)
            .arg(args.budget.0)
            .arg(args.lease_us)
            .arg(args.held.0 .0)
            .arg(args.held.1)
            .arg(now)
            .arg(format!("{:016x}", args.life));
        let reply = self
            .inner
            .connector
            .call(Request::Script(&invocation))
            .await?;
        Ok(reply)
    }
}

impl LeaseStoreBuilder {
    /// The key prefix, default `admission`: 1 to 64 characters of
    /// `[A-Za-z0-9._:-]` (no braces, which would change the hash tag).
    pub fn prefix(mut self, prefix: &str) -> Self {
        prefix.clone_into(&mut self.prefix);
        self
    }

    /// The deadline of each call (connecting included), default 100 ms, at
    /// most 60 s. Calls run in the background, never on the send path.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// **Test only.** Injects the time of `clock` into a separate test
    /// script instead of Redis `TIME`. Never use it in production: every
    /// instance would trust its own clock.
    #[doc(hidden)]
    pub fn test_clock(mut self, clock: ManualClock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Checks the settings and creates the store; no connection is made here.
    pub fn build(self) -> Result<LeaseStore, ConfigError> {
        if !valid_name(&self.prefix, 64) {
            return Err(ConfigError::new(
                "prefix",
                format!(
                    "{:?} must be 1 to 64 characters of [A-Za-z0-9._:-]",
                    self.prefix
                ),
            ));
        }
        crate::error::redis_deadline("deadline", self.deadline)?;
        let target =
            Target::single(&self.url).map_err(|e| ConfigError::new("url", e.to_string()))?;
        let injected = self.clock.is_some().then_some(CLOCK_ARG);
        Ok(LeaseStore {
            inner: Arc::new(StoreInner {
                prefix: self.prefix.into(),
                deadline: self.deadline,
                connector: Connector::new(target, Timing::per_call(self.deadline)),
                script: Script::new(&script(injected)),
                clock: self.clock,
            }),
        })
    }
}

/// The grant script: the prelude (clock and integer helpers), then
/// `scripts/lease.lua`.
fn script(injected: Option<u8>) -> String {
    format!("{}{LEASE_SCRIPT}", crate::redis::prelude(injected))
}

fn bad_reply(op: &str) -> LeaseError {
    LeaseError::Failed {
        message: format!("unexpected reply from the lease script ({op})"),
    }
}

fn ints(v: &Value) -> Option<Vec<i64>> {
    match v {
        Value::Array(items) => items
            .iter()
            .map(|i| match i {
                Value::Int(n) => Some(*n),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

fn parse_table(v: &Value) -> Option<GrantTable> {
    let Value::Array(items) = v else {
        return None;
    };
    let int = |i: usize| match items.get(i)? {
        Value::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    };
    let now = int(0)?;
    let n = int(1)?;
    let mut at = 2;
    let mut instances = Vec::new();
    for _ in 0..n {
        let id = match items.get(at)? {
            Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            Value::SimpleString(s) => s.clone(),
            _ => return None,
        };
        let demand = int(at + 1)?;
        let guessed = int(at + 2)? != 0;
        let count = int(at + 3)?;
        at += 4;
        let mut steps = Vec::new();
        for _ in 0..count {
            steps.push(GrantStep {
                rate: Rate(int(at)?),
                expires_at: Timestamp(int(at + 1)?),
            });
            at += 2;
        }
        instances.push(InstanceGrant {
            id,
            demand: Rate(demand),
            guessed,
            steps,
        });
    }
    Some(GrantTable {
        now: Timestamp(now),
        instances,
    })
}

/// What a [`RateLease`] is spending.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LeaseMode {
    /// No refresh has finished yet: nothing is spent.
    Starting,
    /// A grant from the script, until its local expiry.
    Granted,
    /// The grant expired without renewal (Redis unreachable): the fallback
    /// capacity `R / expected_instances`, or no limit at all after
    /// [`fail_open`](RateLeaseBuilder::fail_open).
    Fallback,
    /// Released: nothing is spent, ever again.
    Released,
}

/// A snapshot of a [`RateLease`], from [`RateLease::status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseStatus {
    /// The mode at the time asked.
    pub mode: LeaseMode,
    /// The rate the local bucket fills at now.
    pub rate: Rate,
    /// The latest grant (zero before the first).
    pub grant: Rate,
    /// The local time the latest grant stops being spent (zero if none).
    pub expires_at: Timestamp,
    /// The max-min fair target the script computed at the last refresh.
    pub target: Rate,
    /// The demand reported at the last refresh.
    pub demand: Rate,
    /// The local bucket's capacity now, in cost units.
    pub capacity: u64,
    /// When the next refresh is due, local time.
    pub next_refresh: Timestamp,
    /// Refreshes that failed in a row.
    pub failures: u32,
    /// Refreshes refused since the lease was built because another live
    /// lease held its instance id ([`LeaseError::InstanceIdInUse`]).
    pub id_in_use: u64,
}

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
///    if the reply is lost, until the old lease ends).
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
/// A window is **held back** by its grant when, for at least three quarters
/// of it, a refused attempt was still inside the wait it was told (for the
/// bucket, or a [`LeasedBudget`](crate::outbound::LeasedBudget) share, to
/// fill at a rate above zero). Callers that queue and wait then attempt
/// about as fast as the grant lets them, so the count understates what
/// they want. Such a window reports at least twice the grant, flagged: other
/// instances' targets count it as twice that report (at most `R`), room for
/// its next doubling, and its own grant at most doubles per refresh. Not
/// counted as `R`, as a guess is: a small held-back instance would strand
/// the difference for every other one. Not reported as `R`: after Redis
/// restarts empty, the first instance back would be granted all of it while
/// the others still spend their grants. Waits shorter than that (an
/// instance at or below its need) leave the measured figure, and so does a
/// refusal with no rate to spend (starting, a zero grant): its wait is the
/// time to the next refresh.
///
/// # One id, one holder
///
/// Each lease draws a random *life* when it is built, and the script keeps
/// it beside the id's grants. A refresh of another life while those grants
/// last (a second live process configured with the same id, or a restarted
/// one while its previous run's grants run out) is refused with
/// [`LeaseError::InstanceIdInUse`]: that lease stops spending any grant it
/// holds, spends the fallback capacity `R / expected_instances` (even after
/// [`fail_open`](RateLeaseBuilder::fail_open)), logs one `error` naming the
/// id, counts the refusal in [`LeaseStatus::id_in_use`] and refreshes again
/// when the other's last grant expires. So two processes with one id send
/// at most one grant plus one fallback share, and a restarted process takes
/// its id at most one lease length after its previous run's last refresh
/// (at once after a [`release`](Self::release)).
///
/// A bucket whose capacity is one unit loses what it would accrue while it
/// is full, so callers that retry only on their own schedule use a little
/// less than the grant (one attempt per millisecond at 24/s: 23.8/s).
/// Callers that wait the returned duration lose nothing.
///
/// ```no_run
/// use std::num::NonZeroU32;
/// use tower_admission::outbound::{LeaseStore, Rate, RateLease};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = LeaseStore::builder("redis://127.0.0.1:6379/").prefix("myapp").build()?;
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
    inner: Arc<Shared<C>>,
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

struct Shared<C> {
    store: LeaseStore,
    key: String,
    budget: Box<str>,
    id: Box<str>,
    /// This lease's life, random (from the thread-local CSPRNG, seeded by
    /// the OS): the script records it beside the id's grants and refuses a
    /// refresh of another life while they last; after a release, Redis
    /// ignores a refresh of this life that was still on its way, not one of
    /// a new lease under the same id.
    life: u64,
    cfg: Settings,
    clock: C,
    state: Mutex<State>,
    refreshing: tokio::sync::Mutex<()>,
    /// Wakes the refresher when the lease is released.
    wake: Arc<tokio::sync::Notify>,
    /// True once the first refresh has finished.
    ready: tokio::sync::watch::Sender<bool>,
}

#[derive(Debug, Clone, Copy)]
struct Settings {
    rate: Rate,
    fallback: Rate,
    lease_us: u64,
    refresh_us: u64,
    retry_us: u64,
    burst_us: u64,
    margin_us: u64,
    max_cost: u64,
    min_demand: Rate,
    initial_demand: Rate,
    fail_open: bool,
}

impl Settings {
    /// The bucket capacity at `rate`, in nano-tokens.
    fn capacity(&self, rate: Rate) -> u128 {
        let by_rate = u128::from(rate.0) * u128::from(self.burst_us);
        by_rate.max(nano(self.max_cost))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Starting,
    Active,
    Released,
}

#[derive(Debug)]
struct State {
    phase: Phase,
    grant: Rate,
    /// Local end of `grant`; zero for none.
    until: Timestamp,
    /// Whether the fallback was entered (and logged).
    fallback: bool,
    bucket: Bucket,
    last: Timestamp,
    window_start: Timestamp,
    attempted: u64,
    /// The µs of the window during which a refused attempt was waiting for
    /// the bucket to fill: the union of the waits the refusals gave.
    held_back_us: u64,
    /// The end of the latest of those waits.
    held_back_until: Timestamp,
    /// The demand reported is a guess: nothing measured yet, or back from
    /// the fallback.
    guessing: bool,
    demand: Rate,
    target: Rate,
    next_refresh: Timestamp,
    failures: u32,
    /// Counts the changes of the rate schedule (phase, grant, local
    /// expiry), each made by a refresh's reply or a release.
    epoch: u64,
    /// The local time of the latest change.
    changed_at: Timestamp,
    /// The last refresh was refused: another live lease holds the id (logged
    /// once, until a refresh succeeds).
    id_taken: bool,
    /// Refreshes refused so, in all.
    id_in_use: u64,
}

/// The lease's rate over time between two changes (refresh replies or a
/// release): the grant until its local expiry, the fallback after it, zero
/// while starting or released. A [`LeasedBudget`](crate::outbound::LeasedBudget)
/// share bucket replays it to fill as the lease's own bucket does, at the
/// rate of each stretch and capped at that stretch's capacity, however long
/// the share was idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Schedule {
    /// Spending at all: false while starting or released.
    active: bool,
    grant: Rate,
    until: Timestamp,
    fallback: Rate,
    /// Which schedule this is: the lease's change count when it was read.
    pub(crate) epoch: u64,
    /// The local time this schedule took effect.
    pub(crate) since: Timestamp,
}

impl Schedule {
    /// The rate at local time `x`.
    pub(crate) fn rate_at(&self, x: Timestamp) -> Rate {
        if !self.active {
            Rate::ZERO
        } else if x < self.until {
            self.grant
        } else {
            self.fallback
        }
    }

    /// The stretches of `[from, to)` at one rate each, in order, as
    /// (rate, µs); a stretch of zero length is 0 µs.
    pub(crate) fn stretches(&self, from: Timestamp, to: Timestamp) -> [(Rate, u64); 2] {
        if !self.active || to <= from {
            return [(Rate::ZERO, to.0.saturating_sub(from.0)), (Rate::ZERO, 0)];
        }
        let split = self.until.0.clamp(from.0, to.0);
        [(self.grant, split - from.0), (self.fallback, to.0 - split)]
    }
}

impl State {
    /// The rate schedule in force now.
    fn schedule(&self, cfg: &Settings) -> Schedule {
        Schedule {
            active: self.phase == Phase::Active,
            grant: self.grant,
            until: self.until,
            fallback: cfg.fallback,
            epoch: self.epoch,
            since: self.changed_at,
        }
    }

    /// Counts a change of the schedule made at local time `x`, if the
    /// schedule differs from `before`.
    fn note_change(&mut self, before: (Phase, Rate, Timestamp), x: Timestamp) {
        if (self.phase, self.grant, self.until) != before {
            self.epoch += 1;
            self.changed_at = Timestamp(self.changed_at.0.max(x.0));
        }
    }

    fn rate_at(&self, x: Timestamp, cfg: &Settings) -> Rate {
        match self.phase {
            Phase::Starting | Phase::Released => Rate::ZERO,
            Phase::Active if x < self.until => self.grant,
            Phase::Active => cfg.fallback,
        }
    }

    /// The wait at `x` with no rate to spend (starting, or a zero grant):
    /// the time to the next refresh, or `retry_every` when one is due.
    fn wait_without_rate(&self, x: Timestamp, cfg: &Settings) -> Duration {
        match self.next_refresh.0.saturating_sub(x.0) {
            0 => Duration::from_micros(cfg.retry_us),
            until => Duration::from_micros(until),
        }
    }

    fn mode_at(&self, x: Timestamp) -> LeaseMode {
        match self.phase {
            Phase::Starting => LeaseMode::Starting,
            Phase::Released => LeaseMode::Released,
            Phase::Active if x < self.until => LeaseMode::Granted,
            Phase::Active => LeaseMode::Fallback,
        }
    }

    fn accrue(&mut self, rate: Rate, micros: u64, cfg: &Settings) {
        self.bucket
            .fill(u128::from(rate.0), micros, cfg.capacity(rate));
    }

    /// Fills the bucket up to `x`: at the grant until its local expiry, at
    /// the fallback capacity after it.
    fn advance(&mut self, x: Timestamp, cfg: &Settings) {
        if x <= self.last {
            return;
        }
        if self.phase != Phase::Active {
            self.bucket.clear();
            self.last = x;
            return;
        }
        if self.last < self.until {
            let end = x.min(self.until);
            self.accrue(self.grant, end.0 - self.last.0, cfg);
            self.last = end;
        }
        if self.last < x {
            self.accrue(cfg.fallback, x.0 - self.last.0, cfg);
            self.last = x;
        }
    }

    /// Logs the entry into the fallback once.
    fn note_fallback(&mut self, x: Timestamp, cfg: &Settings, budget: &str, id: &str) {
        if self.phase == Phase::Active && x >= self.until && !self.fallback {
            self.fallback = true;
            if cfg.fail_open {
                tracing::warn!(
                    budget,
                    instance = id,
                    failures = self.failures,
                    "rate lease expired without renewal; FAILING OPEN: every attempt is admitted, with no limit, until a refresh succeeds"
                );
                return;
            }
            tracing::warn!(
                budget,
                instance = id,
                fallback = %cfg.fallback,
                failures = self.failures,
                "rate lease expired without renewal; spending the fallback capacity until a refresh succeeds"
            );
        }
    }

    /// Counts the wait of `wait_us` given at `x` to a refused attempt (the
    /// bucket fills at a rate above zero) toward the time held back.
    fn note_wait(&mut self, x: Timestamp, wait_us: u64) {
        let from = x.0.max(self.held_back_until.0).max(self.window_start.0);
        let end = x.0.saturating_add(wait_us);
        self.held_back_us += end.saturating_sub(from);
        self.held_back_until = Timestamp(self.held_back_until.0.max(end));
    }

    /// The demand to report at `x`: the guess `initial_demand` with no grant
    /// to spend (starting, or in the fallback); else attempts per second
    /// since the window started, at least twice the grant if the window was
    /// held back (a window shorter than a quarter of the refresh period is
    /// kept open and the previous figure reported).
    /// The flag says how others' targets count the demand: as measured, as
    /// the whole budget (a guess) or as twice itself (held back).
    fn take_demand(&mut self, x: Timestamp, cfg: &Settings) -> (Rate, u8) {
        let mut held = false;
        let measured = if self.mode_at(x) != LeaseMode::Granted {
            self.guessing = true;
            cfg.initial_demand
        } else {
            let elapsed = x.0.saturating_sub(self.window_start.0);
            if elapsed >= cfg.refresh_us / 4 && elapsed > 0 {
                // A wait that runs past `x` counts in the next window.
                let ahead = self.held_back_until.0.saturating_sub(x.0);
                let held_back = self.held_back_us.saturating_sub(ahead);
                let milli = nano(self.attempted) / u128::from(elapsed);
                self.window_start = x;
                self.attempted = 0;
                self.held_back_us = ahead;
                self.guessing = false;
                let measured = Rate(u64::try_from(milli).unwrap_or(u64::MAX));
                held = held_back.saturating_mul(HELD_BACK.1) >= elapsed.saturating_mul(HELD_BACK.0);
                if held {
                    measured.max(Rate(self.grant.0.saturating_mul(2)))
                } else {
                    measured
                }
            } else {
                self.demand
            }
        };
        let demand = measured.max(cfg.min_demand).min(cfg.rate);
        self.demand = demand;
        let flag = if self.guessing {
            GUESS
        } else if held {
            HELD_BACK_FLAG
        } else {
            MEASURED
        };
        (demand, flag)
    }

    fn status(&self, x: Timestamp, cfg: &Settings) -> LeaseStatus {
        let rate = self.rate_at(x, cfg);
        LeaseStatus {
            mode: self.mode_at(x),
            rate,
            grant: self.grant,
            expires_at: self.until,
            target: self.target,
            demand: self.demand,
            capacity: whole(cfg.capacity(rate)),
            next_refresh: self.next_refresh,
            failures: self.failures,
            id_in_use: self.id_in_use,
        }
    }
}

/// Settings for a [`RateLease`]; [`build`](Self::build) checks them.
#[derive(Debug, Clone)]
pub struct RateLeaseBuilder<C: Clock = SystemClock> {
    store: LeaseStore,
    budget: String,
    rate: Rate,
    expected: NonZeroU32,
    id: Option<String>,
    lease: Duration,
    refresh_every: Duration,
    retry_every: Duration,
    burst: Duration,
    expiry_margin: Duration,
    max_cost: NonZeroU32,
    min_demand: Option<Rate>,
    initial_demand: Option<Rate>,
    fail_open: bool,
    clock: C,
}

impl RateLease<SystemClock> {
    /// Settings for a lease on `budget` (1 to 64 characters of
    /// `[A-Za-z0-9._:-]`), a fleet-wide `rate`, shared by up to
    /// `expected_instances` instances: the fallback capacity is
    /// `rate / expected_instances`, so it must be the largest fleet size.
    pub fn builder(
        store: LeaseStore,
        budget: &str,
        rate: Rate,
        expected_instances: NonZeroU32,
    ) -> RateLeaseBuilder<SystemClock> {
        RateLeaseBuilder {
            store,
            budget: budget.to_owned(),
            rate,
            expected: expected_instances,
            id: None,
            lease: Duration::from_secs(5),
            refresh_every: Duration::from_secs(4),
            retry_every: Duration::from_millis(250),
            burst: Duration::from_millis(25),
            expiry_margin: Duration::from_millis(5),
            max_cost: NonZeroU32::MIN,
            min_demand: None,
            initial_demand: None,
            fail_open: false,
            clock: SystemClock::new(),
        }
    }
}

impl<C: Clock> RateLeaseBuilder<C> {
    /// This instance's id, unique in the fleet: 1 to 128 characters of
    /// `[A-Za-z0-9._:-]`. Default: 16 random hex digits.
    ///
    /// An id in use by another live lease (a copied config) is detected: its
    /// refreshes are refused with [`LeaseError::InstanceIdInUse`] while the
    /// other's grants last, logged once at `error`, and it spends the
    /// fallback capacity meanwhile (see [`RateLease`], "One id, one
    /// holder").
    pub fn instance_id(mut self, id: &str) -> Self {
        self.id = Some(id.to_owned());
        self
    }

    /// The lease length `L` on Redis time, default 5 s: how long a grant
    /// lasts without renewal, how late a dead instance's share returns and
    /// how late a new instance may get its full share.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The refresh period `P`, default 4 s, less than the lease. Redis
    /// sees `instances / P` calls per second; at 40 instances and 240/s that
    /// is 10 calls/s, 0.042 per admitted send.
    pub fn refresh_every(mut self, every: Duration) -> Self {
        self.refresh_every = every;
        self
    }

    /// The wait after a failed refresh, default 250 ms.
    pub fn retry_every(mut self, every: Duration) -> Self {
        self.retry_every = every;
        self
    }

    /// The local burst as a span of the current rate, default 25 ms: the
    /// bucket holds `max(max_cost, rate × burst)` cost units.
    pub fn burst(mut self, burst: Duration) -> Self {
        self.burst = burst;
        self
    }

    /// The largest cost of one attempt, default 1; the bucket always holds
    /// at least this much, so every attempt up to it can pass. Costs above it
    /// are refused with `Duration::MAX`.
    pub fn max_cost(mut self, max_cost: NonZeroU32) -> Self {
        self.max_cost = max_cost;
        self
    }

    /// Taken off every grant's local lifetime, default 5 ms: covers a local
    /// clock that runs up to `margin / lease` (1,000 ppm) slower than
    /// Redis's.
    pub fn expiry_margin(mut self, margin: Duration) -> Self {
        self.expiry_margin = margin;
        self
    }

    /// The least demand reported, default a tenth of the fallback capacity:
    /// an idle instance keeps a small grant, so its first send after a quiet
    /// spell does not wait for a refresh.
    pub fn min_demand(mut self, rate: Rate) -> Self {
        self.min_demand = Some(rate);
        self
    }

    /// The demand of the first refresh, before anything was measured;
    /// default the fallback capacity `rate / expected_instances`.
    pub fn initial_demand(mut self, rate: Rate) -> Self {
        self.initial_demand = Some(rate);
        self
    }

    /// **Breaks the budget during an outage.** When the grant expires
    /// without renewal, admit every attempt, with no limit at all, until a
    /// refresh succeeds, instead of spending the fallback capacity
    /// `rate / expected_instances`. A fleet that loses Redis then sends as
    /// fast as its callers ask, which is what the budget exists to prevent;
    /// choose it only for a dependency that protects itself. Entering this
    /// mode is logged at `warn` each time.
    pub fn fail_open(mut self) -> Self {
        self.fail_open = true;
        self
    }

    /// The local clock (default [`SystemClock`]); a
    /// [`ManualClock`] makes the send path testable.
    pub fn clock<C2: Clock>(self, clock: C2) -> RateLeaseBuilder<C2> {
        RateLeaseBuilder {
            store: self.store,
            budget: self.budget,
            rate: self.rate,
            expected: self.expected,
            id: self.id,
            lease: self.lease,
            refresh_every: self.refresh_every,
            retry_every: self.retry_every,
            burst: self.burst,
            expiry_margin: self.expiry_margin,
            max_cost: self.max_cost,
            min_demand: self.min_demand,
            initial_demand: self.initial_demand,
            fail_open: self.fail_open,
            clock,
        }
    }

    /// Checks the settings and creates the lease in [`LeaseMode::Starting`];
    /// nothing is sent until the first refresh.
    pub fn build(self) -> Result<RateLease<C>, ConfigError> {
        if !valid_name(&self.budget, 64) {
            return Err(ConfigError::new(
                "budget",
                format!(
                    "{:?} must be 1 to 64 characters of [A-Za-z0-9._:-]",
                    self.budget
                ),
            ));
        }
        if self.rate.0 == 0 || self.rate.0 > MAX_RATE_MILLI {
            return Err(ConfigError::new(
                "rate",
                format!(
                    "must be more than zero and at most {}",
                    Rate(MAX_RATE_MILLI)
                ),
            ));
        }
        let id = match self.id {
            Some(id) if valid_name(&id, 128) => id,
            Some(id) => {
                return Err(ConfigError::new(
                    "instance_id",
                    format!("{id:?} must be 1 to 128 characters of [A-Za-z0-9._:-]"),
                ))
            }
            None => format!("{:016x}", rand::random::<u64>()),
        };
        let us = duration_to_micros;
        let (lease, refresh, margin) = (
            us(self.lease),
            us(self.refresh_every),
            us(self.expiry_margin),
        );
        if lease == 0 || lease > 86_400_000_000 {
            return Err(ConfigError::new(
                "lease",
                "must be more than zero and at most a day",
            ));
        }
        if margin >= lease {
            return Err(ConfigError::new(
                "expiry_margin",
                "must be less than the lease, which it is taken off",
            ));
        }
        if refresh == 0 || refresh.saturating_add(margin) >= lease {
            return Err(ConfigError::new(
                "refresh_every",
                "must be more than zero and less than the lease minus the expiry margin",
            ));
        }
        if us(self.retry_every) == 0 {
            return Err(ConfigError::new("retry_every", "must be more than zero"));
        }
        let fallback = Rate(self.rate.0 / u64::from(self.expected.get()));
        let cfg = Settings {
            rate: self.rate,
            fallback,
            lease_us: lease,
            refresh_us: refresh,
            retry_us: us(self.retry_every),
            burst_us: us(self.burst),
            margin_us: margin,
            max_cost: u64::from(self.max_cost.get()),
            min_demand: self.min_demand.unwrap_or(Rate(fallback.0 / 10)),
            initial_demand: self.initial_demand.unwrap_or(fallback),
            fail_open: self.fail_open,
        };
        let now = self.clock.now();
        let state = State {
            phase: Phase::Starting,
            grant: Rate::ZERO,
            until: Timestamp(0),
            fallback: false,
            bucket: Bucket::EMPTY,
            last: now,
            window_start: now,
            attempted: 0,
            held_back_us: 0,
            held_back_until: now,
            guessing: true,
            demand: Rate::ZERO,
            target: Rate::ZERO,
            next_refresh: now,
            failures: 0,
            epoch: 0,
            changed_at: now,
            id_taken: false,
            id_in_use: 0,
        };
        Ok(RateLease {
            inner: Arc::new(Shared {
                key: self.store.key(&self.budget),
                store: self.store,
                budget: self.budget.into(),
                id: id.into(),
                life: rand::random(),
                cfg,
                clock: self.clock,
                state: Mutex::new(state),
                refreshing: tokio::sync::Mutex::new(()),
                wake: Arc::new(tokio::sync::Notify::new()),
                ready: tokio::sync::watch::Sender::new(false),
            }),
        })
    }
}

impl<C: Clock> RateLease<C> {
    /// Spends `cost` from the local bucket now; see
    /// [`try_acquire_at`](Self::try_acquire_at).
    #[inline]
    pub fn try_acquire(&self, cost: u64) -> Result<(), Duration> {
        self.try_acquire_at(cost, self.inner.clock.now())
    }

    /// Spends `cost` at local time `now`, or refuses with the wait until it
    /// would fit at the current rate. Synchronous: one lock, no I/O.
    ///
    /// Every attempt, refused or not, counts toward the demand reported at
    /// the next refresh, and a refusal's wait at a rate above zero toward
    /// the time held back. With no rate to spend (starting, or a zero grant)
    /// the wait is the time to the next refresh; a cost above
    /// [`max_cost`](RateLeaseBuilder::max_cost), or a released lease, is
    /// refused with `Duration::MAX`. No wait runs past a refresh that is due
    /// later, which may change the rate: a caller told to wait until then
    /// looks again then. While a refresh is overdue or in flight, the wait
    /// is the one the current rate gives.
    pub fn try_acquire_at(&self, cost: u64, now: Timestamp) -> Result<(), Duration> {
        let cfg = &self.inner.cfg;
        let mut s = self.inner.state.lock();
        if s.phase == Phase::Released {
            return Err(Duration::MAX);
        }
        s.attempted = s.attempted.saturating_add(cost);
        if cost > cfg.max_cost {
            return Err(Duration::MAX);
        }
        s.advance(now, cfg);
        s.note_fallback(now, cfg, &self.inner.budget, &self.inner.id);
        if cfg.fail_open && !s.id_taken && s.mode_at(now) == LeaseMode::Fallback {
            return Ok(());
        }
        if s.bucket.missing(cost) == 0 {
            s.bucket.spend(cost);
            return Ok(());
        }
        let rate = s.rate_at(now, cfg);
        if rate.0 == 0 {
            return Err(s.wait_without_rate(now, cfg));
        }
        let micros = s.bucket.wait_us(cost, u128::from(rate.0));
        let wait = cap_at_refresh(micros, s.next_refresh, now);
        s.note_wait(now, wait);
        Err(Duration::from_micros(wait))
    }

    /// The lease's state at the local time now.
    pub fn status(&self) -> LeaseStatus {
        self.status_at(self.inner.clock.now())
    }

    /// The lease's state at local time `now` (the bucket is not touched).
    pub fn status_at(&self, now: Timestamp) -> LeaseStatus {
        self.inner.state.lock().status(now, &self.inner.cfg)
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
        self.inner.cfg.rate
    }

    /// The fallback capacity, `rate / expected_instances`.
    pub fn fallback_rate(&self) -> Rate {
        self.inner.cfg.fallback
    }

    /// The rate schedule in force now.
    pub(crate) fn schedule(&self) -> Schedule {
        self.inner.state.lock().schedule(&self.inner.cfg)
    }

    /// The bucket's capacity at `rate`, in whole cost units (as
    /// [`LeaseStatus::capacity`] gives it).
    pub(crate) fn capacity_at(&self, rate: Rate) -> u64 {
        whole(self.inner.cfg.capacity(rate))
    }

    /// The local time now, on the lease's clock.
    pub(crate) fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    /// The wait [`try_acquire_at`](Self::try_acquire_at) gives at `now`
    /// when there is no rate to spend.
    pub(crate) fn wait_without_rate(&self, now: Timestamp) -> Duration {
        self.inner
            .state
            .lock()
            .wait_without_rate(now, &self.inner.cfg)
    }

    /// Whether the fallback admits without limit now
    /// ([`RateLeaseBuilder::fail_open`], and the id is not held by another
    /// lease).
    pub(crate) fn fails_open(&self) -> bool {
        self.inner.cfg.fail_open && !self.inner.state.lock().id_taken
    }

    /// Counts `cost` toward the demand of an attempt that a caller refused
    /// before it reached the bucket (a share of the lease was spent).
    pub(crate) fn note_demand(&self, cost: u64) {
        let mut s = self.inner.state.lock();
        s.attempted = s.attempted.saturating_add(cost);
    }

    /// [`note_demand`](Self::note_demand) for an attempt refused at `now`
    /// and told to wait `wait_us` for its part of a rate above zero: the
    /// wait counts toward the time held back.
    pub(crate) fn note_held_back(&self, cost: u64, now: Timestamp, wait_us: u64) {
        let mut s = self.inner.state.lock();
        s.attempted = s.attempted.saturating_add(cost);
        s.note_wait(now, wait_us);
    }

    /// The largest cost one attempt may have.
    pub fn max_cost(&self) -> u64 {
        self.inner.cfg.max_cost
    }

    /// Refreshes the grant now with the measured demand, whatever the
    /// schedule. One refresh runs at a time per lease (a second call waits).
    ///
    /// The local send instant is read before anything is sent; the old grant
    /// stays in use until the reply arrives, and the new one lasts
    /// `expiry − now_in_reply` from that send instant. On failure the
    /// current grant is kept until it expires, then the fallback applies,
    /// and the next refresh is due after `retry_every`. A refresh dropped
    /// before its reply (an outer timeout, an aborted refresher) has failed:
    /// a grant the script may have issued for it is never spent.
    pub async fn refresh(&self) -> Result<LeaseStatus, LeaseError> {
        let inner = &*self.inner;
        let cfg = &inner.cfg;
        let _one = inner.refreshing.lock().await;
        let (sent_at, args) = {
            let mut s = inner.state.lock();
            if s.phase == Phase::Released {
                return Err(LeaseError::Released);
            }
            let x = inner.clock.now();
            s.advance(x, cfg);
            let (demand, flag) = s.take_demand(x, cfg);
            let held = if s.phase == Phase::Active && x < s.until {
                (s.grant, s.until.0 - x.0)
            } else {
                (Rate::ZERO, 0)
            };
            let args = Args {
                op: "g",
                life: self.inner.life,
                demand,
                flag,
                budget: cfg.rate,
                lease_us: cfg.lease_us,
                held,
            };
            (x, args)
        };
        let unfinished = UnfinishedRefresh {
            lease: self,
            sent_at,
        };
        let result = inner.store.grant(&inner.key, &inner.id, &args).await;
        std::mem::forget(unfinished);
        self.finish(sent_at, result)
    }

    /// Takes in the outcome of a refresh sent at `sent_at`, answered now; the
    /// lease is ready from then on.
    fn finish(
        &self,
        sent_at: Timestamp,
        result: Result<GrantReply, LeaseError>,
    ) -> Result<LeaseStatus, LeaseError> {
        let outcome = self.apply(sent_at, self.inner.clock.now(), result);
        self.inner.ready.send_replace(true);
        outcome
    }

    /// Takes in the outcome of a refresh sent at `sent_at`, answered at `recv`.
    fn apply(
        &self,
        sent_at: Timestamp,
        recv: Timestamp,
        result: Result<GrantReply, LeaseError>,
    ) -> Result<LeaseStatus, LeaseError> {
        let inner = &*self.inner;
        let cfg = &inner.cfg;
        let mut s = inner.state.lock();
        if s.phase == Phase::Released {
            return Err(LeaseError::Released);
        }
        s.advance(recv, cfg);
        let before = (s.phase, s.grant, s.until);
        let outcome = match result {
            Ok(reply) => {
                let life = reply.expiry.saturating_sub(reply.now);
                s.phase = Phase::Active;
                s.grant = reply.rate;
                s.until = Timestamp(sent_at.0.saturating_add(life).saturating_sub(cfg.margin_us));
                s.target = reply.target;
                s.failures = 0;
                s.id_taken = false;
                let cap = cfg.capacity(s.rate_at(recv, cfg));
                s.bucket.cap(cap);
                // A guess is followed a quarter period later by a measure.
                let period = if s.guessing {
                    cfg.refresh_us / 4
                } else {
                    cfg.refresh_us
                };
                let mut next = sent_at.0.saturating_add(period);
                if reply.recheck > reply.now {
                    next = next.min(recv.0.saturating_add(reply.recheck - reply.now));
                }
                s.next_refresh = Timestamp(next);
                if s.fallback && recv < s.until {
                    s.fallback = false;
                    tracing::info!(
                        budget = &*inner.budget,
                        instance = &*inner.id,
                        grant = %s.grant,
                        "rate lease renewed; the fallback capacity no longer applies"
                    );
                }
                s.note_fallback(recv, cfg, &inner.budget, &inner.id);
                Ok(s.status(recv, cfg))
            }
            Err(LeaseError::InstanceIdInUse { ref id, free_in }) => {
                // The script counts another lease's grants under this id,
                // not this one's: whatever this lease holds stops now, and
                // it spends the fallback capacity, as when Redis is
                // unreachable (never without limit, even when failing
                // open: Redis is reachable and said no). It tries again
                // when the other's grants expire.
                if s.phase == Phase::Starting {
                    s.phase = Phase::Active;
                    s.last = recv;
                }
                s.until = Timestamp(s.until.0.min(recv.0));
                s.bucket.cap(cfg.capacity(cfg.fallback));
                s.failures = s.failures.saturating_add(1);
                s.id_in_use = s.id_in_use.saturating_add(1);
                let wait = duration_to_micros(free_in).max(1);
                s.next_refresh = Timestamp(recv.0.saturating_add(wait));
                #[cfg(feature = "metrics")]
                metrics::counter!(
                    "tower_admission_lease_id_in_use_total",
                    "budget" => inner.budget.to_string()
                )
                .increment(1);
                if !s.id_taken {
                    s.id_taken = true;
                    // Logged here, not as an expiry.
                    s.fallback = true;
                    tracing::error!(
                        budget = &*inner.budget,
                        instance = &**id,
                        fallback = %cfg.fallback,
                        free_in = ?free_in,
                        "rate lease refused: instance id {id:?} is held by another live lease (is it configured in two processes?); spending the fallback capacity until the id is free"
                    );
                }
                Err(LeaseError::InstanceIdInUse {
                    id: id.clone(),
                    free_in,
                })
            }
            Err(error) => {
                if s.phase == Phase::Starting {
                    s.phase = Phase::Active;
                    s.until = Timestamp(0);
                    s.last = recv;
                }
                s.failures = s.failures.saturating_add(1);
                s.next_refresh = Timestamp(recv.0.saturating_add(cfg.retry_us));
                tracing::debug!(
                    budget = &*inner.budget,
                    instance = &*inner.id,
                    %error,
                    failures = s.failures,
                    "rate lease refresh failed; keeping the current grant until it expires"
                );
                s.note_fallback(recv, cfg, &inner.budget, &inner.id);
                Err(error)
            }
        };
        s.note_change(before, recv);
        outcome
    }

    /// Waits until the first refresh has finished, successful or not (one
    /// dropped before its reply has failed), or the lease was released: it
    /// has left [`LeaseMode::Starting`] (for a readiness check).
    pub async fn ready(&self) {
        let mut ready = self.inner.ready.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = ready.wait_for(|r| *r).await;
    }

    /// The time from the local now to the next refresh.
    pub fn until_next_refresh(&self) -> Duration {
        let now = self.inner.clock.now();
        self.inner.state.lock().next_refresh.since(now)
    }

    /// Spawns the background refresher on the current tokio runtime: it
    /// refreshes at once, a quarter period later with the first measured
    /// demand (likewise after the fallback), then every `refresh_every`
    /// (earlier when the script says a larger share frees up; every
    /// `retry_every` after a failure). It sleeps on tokio's timer and holds
    /// the lease weakly: it ends when every clone of the lease is dropped,
    /// or at once when the lease is released. Abort the handle to stop it
    /// sooner.
    pub fn spawn_refresher(&self) -> JoinHandle<()> {
        let weak: Weak<Shared<C>> = Arc::downgrade(&self.inner);
        let wake = self.inner.wake.clone();
        tokio::spawn(async move {
            loop {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                let lease = RateLease { inner };
                if matches!(lease.refresh().await, Err(LeaseError::Released)) {
                    return;
                }
                let wait = lease.until_next_refresh().max(Duration::from_millis(1));
                drop(lease);
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = wake.notified() => {}
                }
            }
        })
    }

    /// Stops spending (every later attempt is refused) and then deletes this
    /// instance's grants in Redis, so its share returns at once instead of
    /// at expiry. Call it on a clean shutdown; it is final: for a lease
    /// length after it, a refresh of this lease that reaches Redis late (sent
    /// on a connection that hung) changes nothing there. A new lease under
    /// the same instance id is not held back by it.
    pub async fn release(&self) -> Result<(), LeaseError> {
        {
            let mut s = self.inner.state.lock();
            let before = (s.phase, s.grant, s.until);
            s.phase = Phase::Released;
            s.grant = Rate::ZERO;
            s.until = Timestamp(0);
            s.bucket.clear();
            let now = self.inner.clock.now();
            s.note_change(before, now);
        }
        self.inner.wake.notify_one();
        self.inner.ready.send_replace(true);
        // A refresh in flight finishes first (its reply is ignored), so the
        // release is the last word on this instance.
        let _one = self.inner.refreshing.lock().await;
        let inner = &self.inner;
        inner
            .store
            .release(&inner.key, &inner.id, inner.life, inner.cfg.lease_us)
            .await
    }
}

/// A refresh sent at `sent_at` and not finished yet. Dropped before its
/// reply (an outer timeout, an aborted refresher), it finishes as a failed
/// refresh: still holding the refresh lock, so before the next one starts.
struct UnfinishedRefresh<'a, C: Clock> {
    lease: &'a RateLease<C>,
    sent_at: Timestamp,
}

impl<C: Clock> Drop for UnfinishedRefresh<'_, C> {
    fn drop(&mut self) {
        let dropped = LeaseError::Failed {
            message: "the refresh was dropped before its reply".to_owned(),
        };
        let _ = self.lease.finish(self.sent_at, Err(dropped));
    }
}
