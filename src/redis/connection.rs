//! The reconnecting connection slot: one live connection (single server or
//! cluster), or one connection attempt that every caller joins, or a backoff.
//!
//! A dropped connection (seen by a failed call, or reported at once by the
//! RESP3 connection's disconnect event) returns the slot to idle, and the
//! next call starts a new attempt, with exponential backoff between failed
//! attempts (calls during a backoff fail at once, nothing sent). A connection
//! on which calls keep going unanswered for `stall_reset` (at once when it is
//! zero) is dropped and replaced, so a stalled socket does not hold the
//! caller forever. Reconnection needs no action from the application.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, Shared};
use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use tokio::time::Instant;

use redis::FromRedisValue;

use super::{CallError, Request};

/// Where to connect.
pub(crate) enum Target {
    Single(redis::Client),
    Cluster(Box<redis::cluster::ClusterClient>),
}

impl Target {
    /// One server at `url`, spoken to in RESP3 (Redis 6 or later) so that the
    /// connection reports its own closing.
    pub(crate) fn single(url: &str) -> redis::RedisResult<Target> {
        let info = redis::IntoConnectionInfo::into_connection_info(url)?;
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(redis::ProtocolVersion::RESP3);
        Ok(Target::Single(redis::Client::open(
            info.set_redis_settings(settings),
        )?))
    }

    /// A cluster reached through `nodes`. The client's response timeout is
    /// only a backstop that frees requests stuck on a dead node (the
    /// caller's deadline bounds every call), and it retries nothing: it
    /// would resend a command whose connection dropped after sending, and a
    /// script that ran twice charges or refunds twice.
    pub(crate) fn cluster<'a>(
        nodes: impl IntoIterator<Item = &'a str>,
        timing: Timing,
    ) -> redis::RedisResult<Target> {
        let backstop = (timing.deadline * 20).max(Duration::from_secs(1));
        let client = redis::cluster::ClusterClientBuilder::new(nodes)
            .connection_timeout(timing.connect_timeout)
            .response_timeout(backstop)
            .retries(0)
            .build()?;
        Ok(Target::Cluster(Box::new(client)))
    }
}

/// A live connection: cheap to clone, clones share the socket(s).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Conn {
    /// Sends `request` and reads its reply. A script goes by EVALSHA, then
    /// SCRIPT LOAD and EVALSHA again on NOSCRIPT.
    pub(crate) async fn send<T: FromRedisValue>(
        &mut self,
        request: &Request<'_>,
    ) -> redis::RedisResult<T> {
        match (self, request) {
            (Conn::Single(c), Request::Script(s)) => s.invoke_async(c).await,
            (Conn::Single(c), Request::Cmd(cmd)) => cmd.query_async(c).await,
            (Conn::Cluster(c), Request::Script(s)) => s.invoke_async(c).await,
            (Conn::Cluster(c), Request::Cmd(cmd)) => cmd.query_async(c).await,
        }
    }
}

/// Timing settings of a [`Connector`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    /// The deadline of each call, connecting included.
    pub(crate) deadline: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) stall_reset: Duration,
}

impl Timing {
    /// One call's deadline for everything: connecting takes at most the
    /// deadline, a failed attempt is retried at the next call, and a call
    /// left unanswered drops its connection at once.
    pub(crate) fn per_call(deadline: Duration) -> Timing {
        Timing {
            deadline,
            connect_timeout: deadline,
            backoff_min: Duration::ZERO,
            backoff_max: Duration::ZERO,
            stall_reset: Duration::ZERO,
        }
    }
}

/// The connection slot, shared by every clone of its owner (a store, a
/// lease store, a region).
pub(crate) struct Connector {
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
    /// An attempt is running; calls wait for it until their deadline.
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
pub(crate) struct Checkout {
    pub(crate) conn: Conn,
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
    pub(crate) fn new(target: Target, timing: Timing) -> Self {
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

    /// The timing settings.
    pub(crate) fn timing(&self) -> Timing {
        self.inner.timing
    }

    /// True while a live connection is in the slot.
    pub(crate) fn is_connected(&self) -> bool {
        matches!(&*self.inner.slot.lock(), Slot::Connected { .. })
    }

    /// The live connection, waiting for a running attempt until `deadline`.
    /// Every error is [`CallError::Unavailable`]: nothing has been sent.
    pub(crate) async fn acquire(&self, deadline: Instant) -> Result<Checkout, CallError> {
        loop {
            let (gen, attempt) = {
                let mut slot = self.inner.slot.lock();
                match &*slot {
                    Slot::Connected { gen, conn, health } => {
                        return Ok(Checkout {
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
    /// gives up, so the next call finds it finished.
    fn start_attempt(&self) -> (u64, ConnectFuture) {
        let gen = self.inner.next_gen.fetch_add(1, Ordering::Relaxed);
        let inner: Weak<ConnectorInner> = Arc::downgrade(&self.inner);
        let attempt: ConnectFuture = {
            let inner = inner.clone();
            async move {
                let Some(me) = inner.upgrade() else {
                    return Err(Arc::from("connection owner dropped"));
                };
                // Holds the slot alive at most `connect_timeout` after its owner drops.
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

    /// The call on `checkout` was answered.
    pub(crate) fn answered(&self, checkout: &Checkout) {
        checkout.health.stalled_since.store(0, Ordering::Relaxed);
    }

    /// The call on `checkout` passed its deadline after sending (or was
    /// dropped unanswered). Replaces the connection once calls have kept
    /// timing out for `stall_reset`, at once when that is zero.
    pub(crate) fn timed_out(&self, checkout: &Checkout) {
        if self.inner.timing.stall_reset.is_zero() {
            self.broken(checkout, "a call on this connection went unanswered");
            return;
        }
        let now = u64::try_from(self.inner.epoch.elapsed().as_micros()).unwrap_or(u64::MAX);
        let since = match checkout.health.stalled_since.compare_exchange(
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
                checkout,
                "no answer on this connection for the stall reset period",
            );
        }
    }

    /// The connection of `checkout` is dead: drop it so the next call reconnects.
    pub(crate) fn broken(&self, checkout: &Checkout, reason: &str) {
        self.inner.broken(checkout.gen, reason);
    }
}

/// Marks connection `gen` broken as soon as the driver reports that the
/// server closed it, so a call after an idle drop is not sent into a
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
                "dropping redis connection; the next call reconnects"
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
                // No response timeout in the crate: the caller's deadline bounds
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

fn unavailable(message: String) -> CallError {
    CallError::Unavailable(message)
}
