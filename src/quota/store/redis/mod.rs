//! The Redis and Redis Cluster store (feature `redis`); see [`RedisStore`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use redis::{RedisError, Script};

use crate::clock::{Clock, ManualClock};
use crate::quota::algorithm::Hold;
use crate::quota::{Decision, Holds, Quota, QuotaDecision, Store, StoreError};
use crate::redis::{check_prefix, CallError, Connector, Request, Target, Timing};
use crate::ConfigError;

const FIXED_WINDOW: &str = include_str!("scripts/fixed_window.lua");
const SLIDING_LOG: &str = include_str!("scripts/sliding_log.lua");
const TOKEN_BUCKET: &str = include_str!("scripts/token_bucket.lua");
const SLIDING_WINDOW: &str = include_str!("scripts/sliding_window.lua");
const DRIVER: &str = include_str!("scripts/driver.lua");

/// The full decision script: the prelude (a clock and the integer helpers,
/// `src/redis/scripts/`), the four algorithms, the driver.
///
/// `injected_clock` selects the test-only clock that reads the time from
/// `ARGV[3]`; production scripts read Redis `TIME` and ignore `ARGV[3]`.
fn script_source(injected_clock: bool) -> String {
    let prelude = crate::redis::prelude(injected_clock.then_some(3));
    [
        prelude.as_str(),
        FIXED_WINDOW,
        SLIDING_LOG,
        TOKEN_BUCKET,
        SLIDING_WINDOW,
        DRIVER,
    ]
    .join("\n")
}

/// A [`Store`] in Redis or Redis Cluster (feature `redis`): one atomic Lua
/// decision per call, in Redis time, with a deadline.
///
/// A fleet shares one authoritative state: every instance's [`RedisStore`]
/// decides in the same Redis, so ten instances enforce one limit, not ten.
///
/// Clones share the connection and settings.
///
/// # How a decision runs
///
/// **One script, one round trip, atomic.** Each algorithm is one Lua file
/// (`scripts/fixed_window.lua`, `sliding_log.lua`, `token_bucket.lua`,
/// `sliding_window.lua`), loaded with `include_str!`. Each defines the same
/// steps as its Rust reference (`src/quota/algorithm/`, used by the memory store):
/// load, check (cleanup + decide), record, adjust, save. `driver.lua` runs
/// them for every policy of the quota: it checks all policies, records in
/// the ones that admitted only if no enforcing policy refused, and writes
/// back. The store sends the concatenation of these files by `EVALSHA`
/// (loading it on `NOSCRIPT`), so one decision is one round trip and Redis
/// runs it atomically: no other command sees a half-made decision. A refusal
/// consumes nothing. The scripts are compared decision for decision with the
/// Rust state machines by the differential tests.
///
/// **Keys.** The policy at position `i` (algorithm `a`) of quota `q` for
/// key `k` lives in `prefix:{q:k}:i:a`. Each policy's state follows its
/// position and kind, not its name: a redeploy that renames a policy keeps
/// its state, one that adds or removes a policy after it keeps it too, and a
/// settlement's holds (one per position) meet the state they were charged
/// to. Every key of one decision shares the hash tag
/// `{q:k}`, so Redis Cluster puts them on one slot and never answers
/// `CROSSSLOT`. The algorithm code in the name keeps a changed algorithm
/// from reading the old one's state. A quota with a sliding log or weighted
/// window also keeps its key's expiry in `prefix:{q:k}:x` (the latest time
/// a policy's state becomes fresh); a single-policy quota of the
/// other two touches exactly one key. A decision sets each key's expiry
/// (`PEXPIRE`, rounded up to the millisecond) to the moment its state
/// becomes equivalent to fresh, and deletes a state that already is; a
/// settle only ever moves an expiry out, and deletes a state it leaves
/// fresh: no key lives forever.
///
/// | algorithm | key holds |
/// |---|---|
/// | fixed window | hash `{s, e, c, g}`: window start and end (µs), count, epoch |
/// | sliding log | sorted set of `"<t>:<seq>:<cost>:<cum>"` scored by `t` (µs): one entry per admission, with its sequence number, the cost it still holds and the running total |
/// | token bucket | string `"tat:frac:den:off:last:born"`: GCRA theoretical arrival time (µs and a fraction), settlement offset, last write (µs), the state's life (the µs of its first write since fresh) |
/// | weighted window | **one** hash `{s, e, c, p, g}`: window start and end (µs), current and previous counts, epoch |
/// | the quota key's expiry | string: µs, the latest time a policy's state becomes fresh |
///
/// **Time** is the Redis server's `TIME`, read inside the script, in
/// microseconds: one clock for the whole fleet. State never moves
/// backwards (`max(state, now)`), so a server clock stepped back inflates
/// nothing. All arithmetic is on integers below 2^53, exact in Lua's
/// doubles; products that could exceed that are computed exactly in limbs.
/// Because of that bound, [`Store::validate`] refuses, when the layer is
/// built, a policy whose numbers exceed 2^45 (a limit of 35 trillion, or a
/// span of a year is far below it).
///
/// # Deadline and errors
///
/// Every call has a deadline ([`RedisStoreBuilder::deadline`], 50 ms by
/// default), enforced by the store with a tokio timer around the whole call.
/// The redis crate's own response timeout is off on single-server
/// connections; on a cluster it is only a backstop far above the deadline.
/// Calls go through the crate's one Redis call module (`src/redis/`), whose
/// connection slot (see below) knows whether a failed call had been sent:
///
/// | what happened | error | consumed? |
/// |---|---|---|
/// | no connection, connection refused, still connecting at the deadline, reconnect backoff | [`StoreError::Unavailable`] | no, nothing was sent |
/// | Redis answered with an error (script error, `BUSY`, `OOM`, `LOADING`, ...) | [`StoreError::Unavailable`] | no, the script writes only after all checks |
/// | deadline passed after the command was handed to a live connection | [`StoreError::Timeout`] | **unknown** |
/// | the connection dropped after the command was handed to it | [`StoreError::Timeout`] | **unknown** (the bytes may have arrived) |
///
/// An unknown outcome must be counted as consumed, never as free; the
/// [`Limiter`](crate::quota::Limiter) does so and resolves every error by
/// each policy's failure mode ([`Policy::fail_open`](crate::quota::Policy::fail_open),
/// `fail_closed` or `fail_to_local_share`). On a cluster the
/// client hides its own routing and reconnects, so a deadline there is always
/// reported as [`StoreError::Timeout`], the conservative answer. The cluster
/// client sends each call at most once: it follows no `MOVED` or `ASK`
/// redirect and retries nothing (a redirect is `Unavailable`; a `MOVED`
/// refreshes the slot map for the next call), since a call resent after its
/// connection dropped may run twice, and a refund applied twice gives back
/// another charge's cost.
///
/// The single-server connection speaks RESP3 (Redis 6 or later) so that the
/// client reports a closed connection at once: a decision after an idle
/// drop reconnects instead of being sent into a dead socket.
///
/// **Reconnection is automatic.** A dropped connection is replaced on the
/// next decision, with exponential backoff between failed attempts
/// ([`RedisStoreBuilder::reconnect_backoff`]); decisions during a backoff fail
/// at once with `Unavailable`. A connection on which calls keep timing out
/// for [`RedisStoreBuilder::reconnect_after_stall`] is replaced too. The
/// application never rebuilds the store.
///
/// # State loss
///
/// Script atomicity does not survive the loss of the data. A Redis restarted
/// without persistence, or a failover to a replica that had not received the
/// latest writes, **forgets recent admissions: the affected quotas reset**
/// and clients get up to a full extra limit. So does eviction: every key
/// has an expiry, so any `maxmemory-policy` but `noeviction` (the
/// `volatile-*` ones included) may drop live quota state under memory
/// pressure. Persistence (AOF with `fsync`) and `WAIT`-based replication
/// narrow the window; nothing here closes it.
/// The fault tests show the reset. A refund of a charge made before the
/// loss never reaches a window, log entry or bucket made after it (a
/// window's first state begins a new epoch, an entry is named by its time,
/// a bucket's first write begins a new life, named by its time), as long as
/// the new state is first written at another µs than the lost one was.
///
/// # Example
///
/// ```no_run
/// use tower_admission::quota::{Limiter, Policy, Quota, RedisStore};
/// use std::{sync::Arc, time::Duration};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::builder("redis://127.0.0.1:6379/")
///     .prefix("myapp")
///     .deadline(Duration::from_millis(30))
///     .build()?;
/// let quota = Quota::new("api", [
///     Policy::sliding_log("per-minute", 100, Duration::from_secs(60))?,
///     Policy::token_bucket("burst", 20, 100, Duration::from_secs(60))?,
/// ])?;
/// let limiter = Limiter::new(store);
/// let alice: Arc<str> = "alice".into();
/// let verdict = limiter.check(&quota, &alice, 1).await;
/// println!("admitted: {}", verdict.is_admitted());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    prefix: Box<str>,
    deadline: Duration,
    script: Script,
    clock: Option<ManualClock>,
    cluster: bool,
    connector: Connector,
}

/// Settings for a [`RedisStore`]; [`build`](Self::build) checks them.
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    nodes: Vec<String>,
    cluster: bool,
    prefix: String,
    deadline: Duration,
    connect_timeout: Duration,
    backoff: (Duration, Duration),
    stall_reset: Duration,
    clock: Option<ManualClock>,
}

impl RedisStore {
    /// Settings for a store on one Redis server, e.g. `redis://127.0.0.1:6379/`.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(vec![url.into()], false)
    }

    /// Settings for a store on a Redis Cluster, from one or more of its nodes.
    pub fn cluster_builder<I, S>(nodes: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder::new(nodes.into_iter().map(Into::into).collect(), true)
    }

    /// The per-decision deadline.
    pub fn deadline(&self) -> Duration {
        self.inner.deadline
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// True when built for a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner.cluster
    }

    /// The SHA-1 of the decision script, as sent with `EVALSHA`.
    pub fn script_sha(&self) -> &str {
        self.inner.script.get_hash()
    }

    /// The production decision script (reading Redis `TIME`), for loading
    /// it by hand or benchmarking it with `redis-benchmark` (feature
    /// `test-hooks`). Its arguments are documented in `scripts/driver.lua`.
    #[cfg(feature = "test-hooks")]
    pub fn script_source() -> String {
        script_source(false)
    }

    /// The script's arguments (ARGV) for a decision of `cost` under `quota`,
    /// as the store sends them with the production clock: for loading the
    /// script by hand or running it under `redis-benchmark` (feature
    /// `test-hooks`).
    #[cfg(feature = "test-hooks")]
    pub fn decision_args(quota: &Quota, cost: u64) -> Vec<String> {
        script_argv(quota, "d", cost.to_string(), "-".to_owned(), None)
    }

    /// The Redis keys holding `quota`'s state for `key`, in policy order,
    /// named by each policy's position and algorithm, in one hash tag
    /// (feature `test-hooks`).
    #[cfg(feature = "test-hooks")]
    pub fn keys(&self, quota: &Quota, key: &str) -> Vec<String> {
        self.state_keys(quota, key)
    }

    /// The Redis key holding the expiry of `quota`'s state for `key`, in the
    /// same hash tag, when the quota has a sliding log or weighted window
    /// (feature `test-hooks`).
    #[cfg(feature = "test-hooks")]
    pub fn expiry_key(&self, quota: &Quota, key: &str) -> Option<String> {
        self.state_expiry_key(quota, key)
    }

    /// The Redis keys holding `quota`'s state for `key`, in policy order,
    /// named by each policy's position and algorithm.
    /// They share one hash tag, so they live on one cluster slot. The script
    /// takes them, then the [`state_expiry_key`](Self::state_expiry_key) if
    /// there is one.
    pub(crate) fn state_keys(&self, quota: &Quota, key: &str) -> Vec<String> {
        quota
            .policies()
            .iter()
            .enumerate()
            .map(|(position, p)| {
                format!(
                    "{}:{{{}:{}}}:{}:{}",
                    self.inner.prefix,
                    quota.name(),
                    key,
                    position,
                    p.algorithm().code()
                )
            })
            .collect()
    }

    /// The Redis key holding the expiry of `quota`'s state for `key`, in the
    /// same hash tag, when the quota has a sliding log or weighted window:
    /// the latest time a policy's state becomes fresh, never brought forward
    /// by a settle. A settle reads a log or weighted window as fresh only
    /// once it has passed, since their freshness depends on the window and
    /// a settle's numbers may be older than those that decided the state
    /// since (the memory store keeps the same expiry for its slot).
    pub(crate) fn state_expiry_key(&self, quota: &Quota, key: &str) -> Option<String> {
        let windowed = quota
            .policies()
            .iter()
            .any(|p| matches!(p.algorithm().code(), "sl" | "sw"));
        windowed.then(|| format!("{}:{{{}:{}}}:x", self.inner.prefix, quota.name(), key))
    }

    /// Runs one script call under the deadline; see the module docs for how
    /// errors are classified.
    async fn call(
        &self,
        quota: &Quota,
        key: &str,
        op: &str,
        amount: String,
        holds: Option<&Holds>,
    ) -> Result<Vec<i64>, StoreError> {
        let now = match &self.inner.clock {
            Some(clock) => clock.now().as_micros().to_string(),
            None => "-".to_owned(),
        };
        let mut invocation = self.inner.script.prepare_invoke();
        for k in self
            .state_keys(quota, key)
            .into_iter()
            .chain(self.state_expiry_key(quota, key))
        {
            invocation.key(k);
        }
        for arg in script_argv(quota, op, amount, now, holds) {
            invocation.arg(arg);
        }
        match self
            .inner
            .connector
            .call(Request::Script(&invocation))
            .await
        {
            Ok(reply) => Ok(reply),
            Err(CallError::Timeout(deadline)) => {
                tracing::warn!(
                    quota = quota.name(),
                    ?deadline,
                    unknown_outcome = true,
                    "redis store deadline passed after sending"
                );
                Err(StoreError::Timeout)
            }
            Err(CallError::Unavailable(message)) => {
                let error = StoreError::Unavailable { message };
                tracing::warn!(quota = quota.name(), %error, "redis store unavailable");
                Err(error)
            }
            Err(error) => {
                let error = match error {
                    CallError::Rejected(message) => StoreError::Unavailable { message },
                    _ => StoreError::Timeout,
                };
                tracing::warn!(quota = quota.name(), %error, unknown_outcome = error.outcome_unknown(), "redis store call failed");
                Err(error)
            }
        }
    }
}

impl RedisStoreBuilder {
    fn new(nodes: Vec<String>, cluster: bool) -> Self {
        RedisStoreBuilder {
            nodes,
            cluster,
            prefix: "admission".to_owned(),
            deadline: Duration::from_millis(50),
            connect_timeout: Duration::from_secs(1),
            backoff: (Duration::from_millis(10), Duration::from_secs(1)),
            stall_reset: Duration::from_secs(1),
            clock: None,
        }
    }

    /// The key prefix, default `admission`: 1 to 64 characters of
    /// `[A-Za-z0-9._:-]` (no braces, which would change the hash tag).
    pub fn prefix(mut self, prefix: &str) -> Self {
        prefix.clone_into(&mut self.prefix);
        self
    }

    /// The deadline of each decision, default 50 ms, at most 60 s. A call
    /// still unanswered at the deadline fails with [`StoreError::Timeout`]
    /// (or [`StoreError::Unavailable`] if it was never sent).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// How long one connection attempt may take, default 1 s. Attempts run in
    /// the background; a decision waits for one only until its deadline.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The wait between failed connection attempts: `min`, doubling up to
    /// `max`. Default 10 ms to 1 s. Zero retries on every decision.
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff = (min, max);
        self
    }

    /// Replace a connection on which calls have kept timing out (or been
    /// dropped unanswered by their callers) for this long, default 1 s;
    /// zero replaces it at the first.
    pub fn reconnect_after_stall(mut self, after: Duration) -> Self {
        self.stall_reset = after;
        self
    }

    /// Reads the time from `clock` and injects it into a separate test
    /// script instead of using Redis `TIME`, so tests can set the time
    /// exactly (feature `test-hooks`). Never use it in production: every
    /// instance would trust its own clock.
    #[cfg(feature = "test-hooks")]
    pub fn test_clock(mut self, clock: ManualClock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Checks the settings and creates the store. No connection is made
    /// here: the first decision connects, and a Redis that is down at start
    /// gives [`StoreError::Unavailable`] until it is up.
    pub fn build(self) -> Result<RedisStore, ConfigError> {
        check_prefix(&self.prefix)?;
        crate::error::redis_deadline("deadline", self.deadline)?;
        if self.connect_timeout.is_zero() {
            return Err(ConfigError::new(
                "connect_timeout",
                "must be more than zero",
            ));
        }
        if self.backoff.0 > self.backoff.1 {
            return Err(ConfigError::new(
                "reconnect_backoff",
                "min must not be more than max",
            ));
        }
        if self.nodes.is_empty() {
            return Err(ConfigError::new(
                "nodes",
                "a cluster needs at least one node",
            ));
        }
        let bad_url = |e: RedisError| ConfigError::new("url", e.to_string());
        let timing = Timing {
            deadline: self.deadline,
            connect_timeout: self.connect_timeout,
            backoff_min: self.backoff.0,
            backoff_max: self.backoff.1,
            stall_reset: self.stall_reset,
        };
        let target = if self.cluster {
            Target::cluster(self.nodes.iter().map(String::as_str), timing)
        } else {
            Target::single(&self.nodes[0])
        }
        .map_err(bad_url)?;
        Ok(RedisStore {
            inner: Arc::new(Inner {
                prefix: self.prefix.into(),
                deadline: self.deadline,
                script: Script::new(&script_source(self.clock.is_some())),
                clock: self.clock,
                cluster: self.cluster,
                connector: Connector::new(target, timing),
            }),
        })
    }
}

fn micros(v: i64) -> Duration {
    Duration::from_micros(u64::try_from(v).unwrap_or(0))
}

/// ARGV of one script call; the layout is documented in `scripts/driver.lua`.
fn script_argv(
    quota: &Quota,
    op: &str,
    amount: String,
    now: String,
    holds: Option<&Holds>,
) -> Vec<String> {
    let mut argv = vec![op.to_owned(), amount, now];
    for policy in quota.policies() {
        let [a, b, c] = policy.algorithm().script_args();
        argv.extend([
            policy.algorithm().code().to_owned(),
            if policy.is_shadow() { "1" } else { "0" }.to_owned(),
            a.to_string(),
            b.to_string(),
            c.to_string(),
        ]);
    }
    if let Some(holds) = holds {
        for i in 0..quota.policies().len() {
            let hold = holds.0.get(i).copied().unwrap_or_default();
            argv.extend([hold.mark, hold.frac, hold.amount, hold.life].map(|n| n.to_string()));
        }
    }
    argv
}

/// A reply number as a u64 (the scripts never answer a negative one but -1).
fn unsigned(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// The script's answer was not what it promises: the script ran, so the
/// outcome is unknown and counted as consumed.
fn unreadable(quota: &Quota, len: usize) -> StoreError {
    tracing::warn!(quota = quota.name(), len, "unexpected redis script reply");
    StoreError::Timeout
}

/// Turns the script's reply into a decision per policy.
fn decode(quota: &Quota, reply: &[i64]) -> Result<QuotaDecision, StoreError> {
    let policies = quota.policies();
    if reply.len() != 1 + 8 * policies.len() {
        return Err(unreadable(quota, reply.len()));
    }
    let admitted = reply[0] == 1;
    let mut holds = Holds::default();
    let decisions = policies
        .iter()
        .zip(reply[1..].chunks_exact(8))
        .map(|(policy, r)| {
            if admitted {
                holds.0.push(Hold {
                    mark: unsigned(r[4]),
                    frac: unsigned(r[5]),
                    amount: unsigned(r[6]),
                    life: unsigned(r[7]),
                });
            }
            Decision {
                admitted: r[0] == 1,
                limit: policy.algorithm().limit(),
                remaining: unsigned(r[1]),
                retry_after: (r[2] >= 0).then(|| micros(r[2])),
                reset: micros(r[3]),
            }
        })
        .collect();
    Ok(QuotaDecision {
        admitted,
        decisions,
        holds,
    })
}

/// Turns the settle script's reply into the holds after it.
fn decode_holds(quota: &Quota, reply: &[i64]) -> Result<Holds, StoreError> {
    if reply.len() != 4 * quota.policies().len() {
        return Err(unreadable(quota, reply.len()));
    }
    Ok(Holds(
        reply
            .chunks_exact(4)
            .map(|r| Hold {
                mark: unsigned(r[0]),
                frac: unsigned(r[1]),
                amount: unsigned(r[2]),
                life: unsigned(r[3]),
            })
            .collect(),
    ))
}

type Boxed<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send>>;

impl RedisStore {
    /// A decision (`op` "d") or a peek ("p") through the script.
    fn decide_as(
        &self,
        op: &'static str,
        quota: &Quota,
        key: &Arc<str>,
        cost: u64,
    ) -> Boxed<QuotaDecision> {
        let store = self.clone();
        let quota = quota.clone();
        let key = key.clone();
        Box::pin(async move {
            let reply = store.call(&quota, &key, op, cost.to_string(), None).await?;
            let mut decision = decode(&quota, &reply)?;
            if op == "p" {
                decision.holds = Holds::default();
            }
            Ok(decision)
        })
    }
}

impl Store for RedisStore {
    type DecideFuture = Boxed<QuotaDecision>;
    type SettleFuture = Boxed<QuotaDecision>;

    fn decide(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        self.decide_as("d", quota, key, cost)
    }

    fn peek(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
        self.decide_as("p", quota, key, cost)
    }

    fn settle(
        &self,
        quota: &Quota,
        key: &Arc<str>,
        decision: &QuotaDecision,
        delta: i64,
    ) -> Self::SettleFuture {
        let store = self.clone();
        let quota = quota.clone();
        let key = key.clone();
        let decision = decision.clone();
        Box::pin(async move {
            let reply = store
                .call(&quota, &key, "s", delta.to_string(), Some(&decision.holds))
                .await?;
            Ok(QuotaDecision {
                holds: decode_holds(&quota, &reply)?,
                ..decision
            })
        })
    }

    /// Every number of every policy must stay exact in Lua's doubles.
    fn validate(&self, quota: &Quota) -> Result<(), ConfigError> {
        for policy in quota.policies() {
            policy.algorithm().lua_exact().map_err(|e| {
                ConfigError::new(
                    e.field(),
                    format!("policy {:?}: {}", policy.name(), e.reason()),
                )
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::Policy;

    #[test]
    fn builder_names_the_bad_field() {
        let err = RedisStore::builder("redis://127.0.0.1:1/")
            .prefix("a{b}")
            .build()
            .unwrap_err();
        assert_eq!(err.field(), "prefix");
        for (store, deadline) in [
            (RedisStore::builder("redis://127.0.0.1:1/"), Duration::ZERO),
            (RedisStore::builder("redis://127.0.0.1:1/"), Duration::MAX),
            (
                RedisStore::cluster_builder(["redis://127.0.0.1:1/"]),
                Duration::MAX,
            ),
        ] {
            // Too long once panicked: at the first decision on one server,
            // in `build` for a cluster.
            let err = store.deadline(deadline).build().unwrap_err();
            assert_eq!(err.field(), "deadline");
        }
        let err = RedisStore::builder("not a url").build().unwrap_err();
        assert_eq!(err.field(), "url");
        let err = RedisStore::builder("redis://127.0.0.1:1/")
            .reconnect_backoff(Duration::from_secs(2), Duration::from_secs(1))
            .build()
            .unwrap_err();
        assert_eq!(err.field(), "reconnect_backoff");
        let err = RedisStore::cluster_builder(Vec::<String>::new())
            .build()
            .unwrap_err();
        assert_eq!(err.field(), "nodes");
    }

    #[test]
    fn keys_share_one_hash_tag() {
        let store = RedisStore::builder("redis://127.0.0.1:1/")
            .prefix("app")
            .build()
            .unwrap();
        let quota = Quota::new(
            "free",
            [
                Policy::sliding_log("per-minute", 100, Duration::from_secs(60)).unwrap(),
                Policy::token_bucket("burst", 20, 100, Duration::from_secs(60)).unwrap(),
            ],
        )
        .unwrap();
        assert_eq!(
            store.state_keys(&quota, "alice"),
            ["app:{free:alice}:0:sl", "app:{free:alice}:1:tb"]
        );
    }

    #[test]
    fn production_and_test_scripts_differ_only_by_clock() {
        let production = script_source(false);
        let test = script_source(true);
        assert!(production.contains("redis.call('TIME')"));
        assert!(!production.contains("ARGV[3])"));
        assert!(test.contains("local CLOCK_ARG = 3\n"));
        assert!(test.contains("tonumber(ARGV[CLOCK_ARG])"));
        assert_eq!(
            production.replace(&crate::redis::clock(None), ""),
            test.replace(&crate::redis::clock(Some(3)), "")
        );
    }

    #[test]
    fn numbers_beyond_double_precision_are_refused_when_validated() {
        let store = RedisStore::builder("redis://127.0.0.1:1/").build().unwrap();
        let big = Quota::new(
            "q",
            [Policy::fixed_window("p", (1 << 45) + 1, Duration::from_secs(1)).unwrap()],
        )
        .unwrap();
        let err = store.validate(&big).unwrap_err();
        assert_eq!(err.field(), "limit");
        let fine = Quota::new(
            "q",
            [Policy::fixed_window("p", 1 << 45, Duration::from_secs(1)).unwrap()],
        )
        .unwrap();
        assert_eq!(store.validate(&fine), Ok(()));
    }
}
