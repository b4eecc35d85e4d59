//! The store's own reconnecting connection slot.
//!
//! The redis crate's `ConnectionManager` reconnects inside the command future,
//! so a caller that gives up at its deadline cannot tell "still connecting,
//! nothing sent" from "sent, no answer yet". The two have opposite meanings
//! for a limiter ([`StoreError::Unavailable`]: nothing consumed;
//! [`StoreError::Timeout`]: outcome unknown), so the store keeps the phases
//! apart itself:
//!
//! 1. **Acquire**: take the live connection, or join (or start) a connection
//!    attempt. Any failure or deadline here is `Unavailable`: nothing was sent.
//! 2. **Send**: hand the command to the live multiplexed connection. From here
//!    on, a deadline or a dropped connection is `Timeout`: the bytes may have
//!    reached Redis.
//!
//! A dropped connection (seen by a failed call, or reported at once by the
//! RESP3 connection's disconnect event) returns the slot to idle, and the
//! next decision starts a new attempt, with exponential backoff between failed attempts (decisions
//! during a backoff fail at once with `Unavailable`). A connection on which
//! decisions keep timing out for `stall_reset` is dropped and replaced, so a
//! stalled socket does not hold the store forever. Reconnection needs no
//! action from the application.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, Shared};
use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use tokio::time::Instant;

use crate::quota::StoreError;

/// Where to connect.
pub(super) enum Target {
    Single(redis::Client),
    Cluster(Box<redis::cluster::ClusterClient>),
}

/// A live connection: cheap to clone, clones share the socket(s).
#[derive(Clone)]
pub(super) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Conn {
    /// Runs the script invocation (EVALSHA, then SCRIPT LOAD and EVALSHA again
    /// on NOSCRIPT).
    pub(super) async fn invoke(
        &mut self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> redis::RedisResult<Vec<i64>> {
        match self {
            Conn::Single(c) => invocation.invoke_async(c).await,
            Conn::Cluster(c) => invocation.invoke_async(c).await,
        }
    }
}

/// Timing settings of a [`Connector`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing {
    pub(super) connect_timeout: Duration,
    pub(super) backoff_min: Duration,
    pub(super) backoff_max: Duration,
    pub(super) stall_reset: Duration,
}

/// The connection slot, shared by every clone of a store.
pub(super) struct Connector {
    inner: Arc<ConnectorInner>,
}

struct ConnectorInner {
    target: Target,
    timing: Timing,
    slot: Mutex<Slot>,
    next_gen: AtomicU64,
    epoch: Instant,
}

type ConnectFuture = Shared<BoxFuture<'static, Result<Conn, Arc<str>>>>;

enum Slot {
    /// No connection and no attempt running.
    Idle { failures: u32 },
    /// An attempt is running; decisions wait for it until their deadline.
    Connecting {
        gen: u64,
        failures: u32,
        attempt: ConnectFuture,
    },
    /// A live connection.
    Connected {
        gen: u64,
        conn: Conn,
        health: Arc<Health>,
    },
    /// The last attempt failed; no new attempt before `until`.
    Backoff {
        until: Instant,
        failures: u32,
        error: Arc<str>,
    },
}

/// Per-connection stall tracking.
#[derive(Default)]
struct Health {
    /// µs since the connector's epoch, plus one, of the first timeout since
    /// the last answer; zero when the last call was answered.
    stalled_since: AtomicU64,
}

/// A connection taken from the slot for one call.
pub(super) struct Lease {
    pub(super) conn: Conn,
    gen: u64,
    health: Arc<Health>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &*self.inner.slot.lock() {
            Slot::Idle { .. } => "idle",
            Slot::Connecting { .. } => "connecting",
            Slot::Connected { .. } => "connected",
            Slot::Backoff { .. } => "backoff",
        };
        f.debug_struct("Connector")
            .field("state", &state)
            .field("timing", &self.inner.timing)
            .finish()
    }
}

impl Connector {
    pub(super) fn new(target: Target, timing: Timing) -> Self {
        Connector {
            inner: Arc::new(ConnectorInner {
                target,
                timing,
                slot: Mutex::new(Slot::Idle { failures: 0 }),
                next_gen: AtomicU64::new(1),
                epoch: Instant::now(),
            }),
        }
    }

    /// The live connection, waiting for a running attempt until `deadline`.
    /// Every error is [`StoreError::Unavailable`]: nothing has been sent.
    pub(super) async fn acquire(&self, deadline: Instant) -> Result<Lease, StoreError> {
        loop {
            let (gen, attempt) = {
                let mut slot = self.inner.slot.lock();
                match &*slot {
                    Slot::Connected { gen, conn, health } => {
                        return Ok(Lease {
                            conn: conn.clone(),
                            gen: *gen,
                            health: health.clone(),
                        })
                    }
                    Slot::Backoff { until, error, .. } if Instant::now() < *until => {
                        return Err(unavailable(format!("redis unreachable: {error}")));
                    }
                    Slot::Connecting { gen, attempt, .. } => (*gen, attempt.clone()),
                    Slot::Idle { failures } | Slot::Backoff { failures, .. } => {
                        let failures = *failures;
                        let (gen, attempt) = self.start_attempt();
                        *slot = Slot::Connecting {
                            gen,
                            failures,
                            attempt: attempt.clone(),
                        };
                        (gen, attempt)
                    }
                }
            };
            match tokio::time::timeout_at(deadline, attempt).await {
                Ok(Ok(conn)) => {
                    self.inner.finish(gen, Ok(conn));
                }
                Ok(Err(error)) => {
                    self.inner.finish(gen, Err(error.clone()));
                    return Err(unavailable(format!("redis unreachable: {error}")));
                }
                Err(_) => {
                    return Err(unavailable(
                        "still connecting to redis at the deadline; nothing was sent".into(),
                    ))
                }
            }
        }
    }

    /// Starts a connection attempt that runs to its end even if every waiter
    /// gives up, so the next decision finds it finished.
    fn start_attempt(&self) -> (u64, ConnectFuture) {
        let gen = self.inner.next_gen.fetch_add(1, Ordering::Relaxed);
        let inner: Weak<ConnectorInner> = Arc::downgrade(&self.inner);
        let attempt: ConnectFuture = {
            let inner = inner.clone();
            async move {
                let Some(me) = inner.upgrade() else {
                    return Err(Arc::from("store dropped"));
                };
                // Holds the slot alive at most `connect_timeout` after the store drops.
                let (conn, pushes) = connect(&me.target, me.timing).await?;
                if let Some(pushes) = pushes {
                    tokio::spawn(watch_disconnect(pushes, inner, gen));
                }
                Ok(conn)
            }
            .boxed()
            .shared()
        };
        let driver = attempt.clone();
        tokio::spawn(async move {
            let result = driver.await;
            if let Some(me) = inner.upgrade() {
                me.finish(gen, result);
            }
        });
        (gen, attempt)
    }

    /// The call on `lease` was answered.
    pub(super) fn answered(&self, lease: &Lease) {
        lease.health.stalled_since.store(0, Ordering::Relaxed);
    }

    /// The call on `lease` passed its deadline after sending. Replaces the
    /// connection once calls have kept timing out for `stall_reset`.
    pub(super) fn timed_out(&self, lease: &Lease) {
        let now = u64::try_from(self.inner.epoch.elapsed().as_micros()).unwrap_or(u64::MAX);
        let since = match lease.health.stalled_since.compare_exchange(
            0,
            now.saturating_add(1),
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            Ok(_) => return,
            Err(since) => since - 1,
        };
        let stalled = Duration::from_micros(now.saturating_sub(since));
        if stalled >= self.inner.timing.stall_reset {
            self.broken(
                lease,
                "no answer on this connection for the stall reset period",
            );
        }
    }

    /// The connection of `lease` is dead: drop it so the next call reconnects.
    pub(super) fn broken(&self, lease: &Lease, reason: &str) {
        self.inner.broken(lease.gen, reason);
    }
}

/// Marks connection `gen` broken as soon as the driver reports that the
/// server closed it, so a decision after an idle drop is not sent into a
/// dead socket (and reported as an unknown outcome) but reconnects.
async fn watch_disconnect(
    mut pushes: tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>,
    inner: Weak<ConnectorInner>,
    gen: u64,
) {
    while let Some(push) = pushes.recv().await {
        if push.kind == redis::PushKind::Disconnection {
            if let Some(me) = inner.upgrade() {
                me.broken(gen, "redis closed the connection");
            }
            return;
        }
    }
}

impl ConnectorInner {
    fn broken(&self, gen: u64, reason: &str) {
        let mut slot = self.slot.lock();
        if matches!(&*slot, Slot::Connected { gen: current, .. } if *current == gen) {
            tracing::warn!(
                reason,
                "dropping redis connection; the next decision reconnects"
            );
            *slot = Slot::Idle { failures: 0 };
        }
    }

    /// Records the end of attempt `gen`, if it is still the current one.
    fn finish(&self, gen: u64, result: Result<Conn, Arc<str>>) {
        let mut slot = self.slot.lock();
        let failures = match &*slot {
            Slot::Connecting {
                gen: current,
                failures,
                ..
            } if *current == gen => *failures,
            _ => return,
        };
        *slot = match result {
            Ok(conn) => {
                tracing::debug!(gen, "connected to redis");
                Slot::Connected {
                    gen,
                    conn,
                    health: Arc::default(),
                }
            }
            Err(error) => {
                let failures = failures.saturating_add(1);
                let wait = backoff(self.timing, failures);
                tracing::warn!(%error, failures, retry_in = ?wait, "connecting to redis failed");
                Slot::Backoff {
                    until: Instant::now() + wait,
                    failures,
                    error,
                }
            }
        };
    }
}

/// `min * 2^(failures - 1)`, at most `max`.
fn backoff(timing: Timing, failures: u32) -> Duration {
    let factor = 1u32 << failures.saturating_sub(1).min(20);
    timing
        .backoff_min
        .saturating_mul(factor)
        .min(timing.backoff_max)
}

type Pushes = Option<tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>>;

async fn connect(target: &Target, timing: Timing) -> Result<(Conn, Pushes), Arc<str>> {
    let attempt = async {
        match target {
            Target::Single(client) => {
                // No response timeout in the crate: the store's deadline bounds
                // every call, and the crate's timeout would blur the phases.
                // The push channel (RESP3) reports a closed connection.
                let (pushes_tx, pushes) = tokio::sync::mpsc::unbounded_channel();
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(timing.connect_timeout))
                    .set_response_timeout(None)
                    .set_push_sender(pushes_tx);
                client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map(|c| (Conn::Single(c), Some(pushes)))
            }
            Target::Cluster(client) => client
                .get_async_connection()
                .await
                .map(|c| (Conn::Cluster(c), None)),
        }
    };
    match tokio::time::timeout(timing.connect_timeout, attempt).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(error)) => Err(Arc::from(error.to_string())),
        Err(_) => Err(Arc::from(format!(
            "connecting took longer than {:?}",
            timing.connect_timeout
        ))),
    }
}

fn unavailable(message: String) -> StoreError {
    StoreError::Unavailable { message }
}
