//! [`LeaseStore`]: the grant script's client, one call per refresh through
//! the crate's one Redis call module.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::{Script, Value};

use super::demand::MEASURED;
use super::table::parse_table;
use super::{GrantTable, LeaseError, Rate};
use crate::clock::{ManualClock, Timestamp};
use crate::redis::{check_prefix, Connector, Request, Target, Timing};
use crate::ConfigError;

pub(super) const LEASE_SCRIPT: &str = include_str!("scripts/lease.lua");

/// The argument the test-only clock reads the time from.
pub(super) const CLOCK_ARG: u8 = 9;

/// The connection to the grant script on one Redis server (feature `redis`).
/// Clones share the connection; many [`RateLease`](super::RateLease)s (one per
/// budget, or several simulated instances in a test) can share one store.
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
    pub(super) inner: Arc<StoreInner>,
}

pub(super) struct StoreInner {
    pub(super) prefix: Box<str>,
    pub(super) deadline: Duration,
    pub(super) connector: Connector,
    pub(super) script: Script,
    pub(super) clock: Option<ManualClock>,
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

/// The arguments of a script call (ARGV 1 and 3 to 15 but 9).
#[derive(Debug, Clone, Copy)]
pub(super) struct Args {
    pub(super) op: &'static str,
    /// The calling lease's life (0 for a snapshot).
    pub(super) life: u64,
    pub(super) demand: Rate,
    /// How others count the demand: `MEASURED`, `GUESS`, `HELD_BACK_FLAG`
    /// or `HELD_ONCE`.
    pub(super) flag: u8,
    pub(super) budget: Rate,
    pub(super) lease_us: u64,
    /// The grant held by the instance's own account: rate, µs left.
    pub(super) held: (Rate, u64),
    /// An older, higher grant it still spends: rate, µs left (ARGV 12, 13).
    pub(super) kept: (Rate, u64),
    /// The dependency pushed back since the last call (ARGV 11).
    pub(super) pushed: bool,
    /// The rate the caller stopped spending above before sending, zero
    /// for none (ARGV 14).
    pub(super) lowered: Rate,
    /// The call's number in its lease's life, from 1; 0 for none (ARGV 15).
    pub(super) number: u64,
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
            kept: (Rate::ZERO, 0),
            pushed: false,
            lowered: Rate::ZERO,
            number: 0,
        }
    }
}

/// The reply of a grant call, on Redis time.
#[derive(Debug, Clone, Copy)]
pub(super) struct GrantReply {
    pub(super) rate: Rate,
    pub(super) expiry: u64,
    pub(super) now: u64,
    pub(super) recheck: u64,
    pub(super) target: Rate,
    /// The effective budget the targets shared: the budget, lowered by
    /// pushback.
    pub(super) effective: Rate,
}

impl LeaseStore {
    /// A store on one Redis server, e.g. `redis://127.0.0.1:6379/`; no
    /// connection is made here.
    ///
    /// - `prefix`, of every key: 1 to 64 characters of `[A-Za-z0-9._:-]` (no
    ///   braces, which would change the hash tag).
    /// - `deadline`, of each call (connecting included): more than zero, at
    ///   most 60 s; 100 ms suits a Redis nearby. Calls run in the
    ///   background, never on the send path.
    ///
    /// Errors name the field: `url`, `prefix` or `deadline`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::outbound::LeaseStore;
    ///
    /// let store = LeaseStore::new("redis://127.0.0.1:6379/", "myapp", Duration::from_millis(100))?;
    /// assert_eq!(store.deadline(), Duration::from_millis(100));
    /// let err = LeaseStore::new("redis://127.0.0.1:6379/", "my app", Duration::from_millis(100));
    /// assert_eq!(err.unwrap_err().field(), "prefix");
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn new(url: &str, prefix: &str, deadline: Duration) -> Result<Self, ConfigError> {
        Self::with_clock(url, prefix, deadline, None)
    }

    /// [`new`](Self::new), with the time of `clock` injected into a separate
    /// test script instead of Redis `TIME` (feature `test-hooks`). Never
    /// use it in production: every instance would trust its own clock.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn with_test_clock(
        url: &str,
        prefix: &str,
        deadline: Duration,
        clock: ManualClock,
    ) -> Result<Self, ConfigError> {
        Self::with_clock(url, prefix, deadline, Some(clock))
    }

    fn with_clock(
        url: &str,
        prefix: &str,
        deadline: Duration,
        clock: Option<ManualClock>,
    ) -> Result<Self, ConfigError> {
        check_prefix(prefix)?;
        crate::error::redis_deadline("deadline", deadline)?;
        let target = Target::single(url).map_err(|e| ConfigError::new("url", e.to_string()))?;
        let injected = clock.is_some().then_some(CLOCK_ARG);
        Ok(LeaseStore {
            inner: Arc::new(StoreInner {
                prefix: prefix.into(),
                deadline,
                connector: Connector::new(target, Timing::per_call(deadline)),
                script: Script::new(&script(injected)),
                clock,
            }),
        })
    }

    /// The Redis key of `budget`: `prefix:{lease:budget}`.
    pub(crate) fn key(&self, budget: &str) -> String {
        format!("{}:{{lease:{budget}}}", self.inner.prefix)
    }

    /// The per-call deadline.
    pub fn deadline(&self) -> Duration {
        self.inner.deadline
    }

    /// The grant script as Redis runs it in production (reading `TIME`).
    /// Its arguments are documented at the top of `scripts/lease.lua`.
    #[cfg(test)]
    pub(crate) fn script_source() -> String {
        script(None)
    }

    /// The rate the instances sharing `budget` may spend now: the sum of
    /// their unexpired grants, on Redis time (read only).
    ///
    /// ```no_run
    /// # async fn run(store: tower_admission::outbound::LeaseStore) -> Result<(), tower_admission::outbound::LeaseError> {
    /// let now = store.committed("dependency").await?;
    /// println!("{:.1}/s of the budget is granted", now.as_f64());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn committed(&self, budget: &str) -> Result<Rate, LeaseError> {
        let table = self.grants(budget).await?;
        Ok(table.committed_at(table.now))
    }

    /// The highest rate the instances sharing `budget` may spend at any time
    /// from now until their grants expire (read only). A lowered grant stays
    /// counted until its old expiry, so this is what bounds the fleet's
    /// spending now: it never exceeds the budget.
    ///
    /// ```no_run
    /// # async fn run(store: tower_admission::outbound::LeaseStore) -> Result<(), tower_admission::outbound::LeaseError> {
    /// let (now, peak) = (store.committed("dependency").await?, store.peak("dependency").await?);
    /// assert!(now <= peak);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn peak(&self, budget: &str) -> Result<Rate, LeaseError> {
        Ok(self.grants(budget).await?.peak())
    }

    /// Reads the grants of `budget` as the script counts them (read only).
    pub(crate) async fn grants(&self, budget: &str) -> Result<GrantTable, LeaseError> {
        let reply = self
            .call(&self.key(budget), "-", &Args::op_only("s"))
            .await?;
        parse_table(&reply).ok_or_else(|| bad_reply("snapshot"))
    }

    pub(super) async fn grant(
        &self,
        key: &str,
        id: &str,
        args: &Args,
    ) -> Result<GrantReply, LeaseError> {
        let reply = self.call(key, id, args).await?;
        let nums = ints(&reply).filter(|n| n.len() == 8);
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
            effective: Rate(u(7)),
        })
    }

    /// Deletes instance `id`'s grants if `life` holds them; for `lease_us`
    /// after, a refresh of its `life` that reaches Redis late changes
    /// nothing.
    pub(super) async fn release(
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
    pub(super) async fn call(&self, key: &str, id: &str, args: &Args) -> Result<Value, LeaseError> {
        let now = self.inner.clock.as_ref().map_or(0, |c| Timestamp::now(c).0);
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
            .arg(format!("{:016x}", args.life))
            .arg(u8::from(args.pushed))
            .arg(args.kept.0 .0)
            .arg(args.kept.1)
            .arg(args.lowered.0)
            .arg(args.number);
        let reply = self
            .inner
            .connector
            .call(Request::Script(&invocation))
            .await?;
        Ok(reply)
    }
}

/// The grant script: the prelude (clock and integer helpers), then
/// `scripts/lease.lua`.
pub(super) fn script(injected: Option<u8>) -> String {
    format!("{}{LEASE_SCRIPT}", crate::redis::prelude(injected))
}

pub(super) fn bad_reply(op: &str) -> LeaseError {
    LeaseError::Failed {
        message: format!("unexpected reply from the lease script ({op})"),
    }
}

pub(super) fn ints(v: &Value) -> Option<Vec<i64>> {
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
