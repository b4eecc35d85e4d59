use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use tokio::time::Instant;
use tower::{Layer, Service};

use crate::outbound::{Attempt, AttemptBudget};

type CostFn<B> = Arc<dyn Fn(&Request<B>) -> u64 + Send + Sync>;

/// Charges an [`AttemptBudget`] right before every send attempt of an
/// outbound `Service<http::Request<B>>` (a hyper-util client, a tonic
/// channel, a reqwest-based service).
///
/// - **Share.** The attempt's [`Attempt`] extension, set by
///   [`RetryAttempts`](crate::outbound::RetryAttempts) under `tower::retry`,
///   picks the share: first attempts draw on the normal share, retries on
///   the retry share. Put this layer **inside** the retry layer, so that
///   every attempt passes through it. A request without the extension is a
///   first attempt.
/// - **Cost.** A function of the request, default 1; a batch call can cost
///   its item count. Every attempt costs at least 1, since it is a send
///   whatever its item count: a cost of 0 is charged as 1.
/// - **Exhausted budget.** By default the attempt waits for capacity up to
///   [`wait_up_to`](Self::wait_up_to) (1 s), in arrival order per share (a
///   later attempt never takes capacity an earlier one is waiting for, from
///   the moment the earlier one first looked at the budget), among this
///   layer and its clones: two layers over one budget keep separate orders;
///   [`fail_fast`](Self::fail_fast) refuses at once. An attempt whose
///   deadline passes while it waits behind another never looks: it is
///   refused with the refusal the one ahead last got and the wait that one
///   still has (at least 1 ms), a lower bound on its own. Either way the caller gets
///   a refusal ([`BudgetError::Exhausted`], say) carrying the wait, never a response. To keep
///   that order, a share's attempts look at the budget one at a time: with
///   a budget that answers over the network (a `DependencyBudget` over a
///   Redis store) one layer sends at most one attempt per round trip of
///   each share, about 1,000 a second at 1 ms; `LeasedBudget` and a memory
///   store answer in place. `fail_fast` attempts do not queue.
///
/// - **Charged at send, never before.** `poll_ready` readies the inner
///   service; the budget is charged in the response future, and the attempt
///   is sent the moment it is admitted. An attempt dropped before it is
///   admitted (while the inner is not ready, or while it waits for the
///   budget) is charged nothing, and so is a request that `tower::retry`
///   cloned but never sent. The ready inner is held while the attempt waits
///   for the budget, so a concurrency cap inside this layer counts waiting
///   attempts as in flight.
/// - **Outside the retry layer by mistake**, the budget would see one call
///   per request and let its retries pass uncharged. With
///   [`RetryAttempts`](crate::outbound::RetryAttempts) that order does not
///   compile: the policy retries only a service whose error is
///   [`BudgetError`]. A policy of your own must mark its retries
///   ([`Attempt::next`]) to reach the retry share.
/// - **Several budgets on one client** (stacked layers): an attempt that an
///   inner budget refuses is not sent, but the outer budgets keep its
///   charge. Put the budget most likely to refuse outermost; a refusal
///   there charges no other.
///
/// The budget is a [`DependencyBudget`](crate::outbound::DependencyBudget)
/// over any store, or a lease spent locally (`LeasedBudget`, feature
/// `redis`). A bound on send starts is not a bound on arrivals at the
/// receiver; see [`DependencyBudget`](crate::outbound::DependencyBudget).
///
/// ```
/// use std::time::Duration;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_admission::outbound::{DependencyBudget, DependencyBudgetLayer, RetryAttempts};
/// use tower_admission::quota::{MemoryStore, Policy};
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let budget = DependencyBudget::builder(MemoryStore::new(), "reports-db")
///     .normal(Policy::token_bucket("normal", 20, 200, Duration::from_secs(1))?)
///     .retry(Policy::token_bucket("retry", 4, 40, Duration::from_secs(1))?)
///     .build()?;
/// let client = tower::service_fn(|_req: http::Request<String>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(String::from("ok")))
/// });
/// let client = ServiceBuilder::new()
///     .retry(RetryAttempts::new(3))
///     .layer(DependencyBudgetLayer::new(budget))
///     .service(client);
/// let response = client.oneshot(http::Request::new(String::new())).await.unwrap();
/// assert_eq!(response.body(), "ok");
/// # Ok::<(), tower_admission::ConfigError>(())
/// # })?;
/// # Ok::<(), tower_admission::ConfigError>(())
/// ```
///
/// The same layers in the wrong order, the budget outside the retries, are
/// refused by the compiler:
///
/// ```compile_fail
/// # use std::time::Duration;
/// # use tower::{ServiceBuilder, ServiceExt};
/// # use tower_admission::outbound::{DependencyBudget, DependencyBudgetLayer, RetryAttempts};
/// # use tower_admission::quota::{MemoryStore, Policy};
/// # async fn wrong() -> Result<(), Box<dyn std::error::Error>> {
/// # let budget = DependencyBudget::builder(MemoryStore::new(), "reports-db")
/// #     .normal(Policy::token_bucket("normal", 20, 200, Duration::from_secs(1))?)
/// #     .retry(Policy::token_bucket("retry", 4, 40, Duration::from_secs(1))?)
/// #     .build()?;
/// # let client = tower::service_fn(|_req: http::Request<String>| async {
/// #     Ok::<_, std::convert::Infallible>(http::Response::new(String::from("ok")))
/// # });
/// let client = ServiceBuilder::new()
///     .layer(DependencyBudgetLayer::new(budget))
///     .retry(RetryAttempts::new(3))
///     .service(client);
/// let _ = client.oneshot(http::Request::new(String::new())).await;
/// # Ok(())
/// # }
/// ```
pub struct DependencyBudgetLayer<Bu, B> {
    budget: Bu,
    cost: Option<CostFn<B>>,
    wait: Option<Duration>,
    queues: Arc<Queues>,
}

/// The attempts of one share, served in arrival order: an attempt looks at
/// the budget only while it holds the head, which it takes on arrival when
/// no other attempt holds it, and otherwise waits for in turn (the lock is
/// fair). An attempt that arrives while another is looking or waiting goes
/// behind it, even while the other's refusal is still on its way. Without
/// it, waiters that wake together race for one token, and an unlucky one
/// can lose until its deadline.
#[derive(Debug, Default)]
struct Queue {
    head: tokio::sync::Mutex<()>,
    /// The refusal the head is sleeping on and the instant its wait ends.
    head_wait: parking_lot::Mutex<Option<(BudgetError, Instant)>>,
}

impl Queue {
    /// The refusal of an attempt whose deadline passed behind the head:
    /// the head's last refusal with the wait it still has, at least 1 ms.
    fn refusal_behind_head(&self, retry: bool) -> BudgetError {
        let remaining = |until: Instant| {
            until
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        match self.head_wait.lock().clone() {
            Some((BudgetError::Unavailable { .. }, until)) => BudgetError::Unavailable {
                wait: remaining(until),
            },
            Some((_, until)) => BudgetError::Exhausted {
                retry,
                wait: remaining(until),
            },
            // The head has not been refused yet.
            None => BudgetError::Exhausted {
                retry,
                wait: Duration::from_millis(1),
            },
        }
    }
}

/// Holds the head of a [`Queue`]; forgets the head's wait when released.
struct Head<'a> {
    queue: &'a Queue,
    _lock: tokio::sync::MutexGuard<'a, ()>,
}

impl Drop for Head<'_> {
    fn drop(&mut self) {
        *self.queue.head_wait.lock() = None;
    }
}

/// One queue per share, so a retry waiting for the retry share never holds
/// up first attempts.
type Queues = [Queue; 2];

/// Charges `budget` for one attempt in arrival order, sleeping the waits
/// the budget gives, until `deadline`. No deadline: never waits.
async fn acquire<Bu: AttemptBudget>(
    budget: &Bu,
    queues: &Queues,
    attempt: Attempt,
    cost: u64,
    deadline: Option<Instant>,
) -> Result<(), BudgetError> {
    let queue = &queues[usize::from(attempt.is_retry())];
    let Some(deadline) = deadline else {
        return budget.charge(attempt, cost).await;
    };
    // An attempt that finds the head taken is counted toward the demand as
    // it arrives, whether it reaches the head or not; one that is the head
    // at once is counted by its first look.
    let (lock, mut looked) = match queue.head.try_lock() {
        Ok(lock) => (lock, false),
        Err(_) => {
            budget.note_arrival(attempt, cost);
            match tokio::time::timeout_at(deadline, queue.head.lock()).await {
                Ok(lock) => (lock, true),
                Err(_) => return Err(queue.refusal_behind_head(attempt.is_retry())),
            }
        }
    };
    let _head = Head { queue, _lock: lock };
    loop {
        let charged = if looked {
            budget.charge_again(attempt, cost).await
        } else {
            budget.charge(attempt, cost).await
        };
        looked = true;
        match charged {
            Ok(()) => return Ok(()),
            Err(refusal) => match refusal.wait().and_then(|w| Instant::now().checked_add(w)) {
                Some(until) if until <= deadline => {
                    *queue.head_wait.lock() = Some((refusal, until));
                    tokio::time::sleep_until(until).await;
                }
                _ => return Err(refusal),
            },
        }
    }
}

/// The instant `wait` from now, or one far beyond any wait when the clock
/// cannot represent it.
fn deadline_after(wait: Duration) -> Instant {
    /// About 30 years: far beyond any wait, and representable.
    const FAR: Duration = Duration::from_secs(30 * 365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(wait).unwrap_or(now + FAR)
}

impl<Bu: Clone, B> Clone for DependencyBudgetLayer<Bu, B> {
    fn clone(&self) -> Self {
        DependencyBudgetLayer {
            budget: self.budget.clone(),
            cost: self.cost.clone(),
            wait: self.wait,
            queues: self.queues.clone(),
        }
    }
}

impl<Bu, B> fmt::Debug for DependencyBudgetLayer<Bu, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DependencyBudgetLayer")
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

impl<Bu: AttemptBudget, B> DependencyBudgetLayer<Bu, B> {
    /// Charges `budget`, cost 1 per attempt, waiting up to 1 s.
    pub fn new(budget: Bu) -> Self {
        DependencyBudgetLayer {
            budget,
            cost: None,
            wait: Some(Duration::from_secs(1)),
            queues: Arc::default(),
        }
    }

    /// The cost of an attempt, default 1; at least 1 is charged.
    pub fn cost(mut self, cost: impl Fn(&Request<B>) -> u64 + Send + Sync + 'static) -> Self {
        self.cost = Some(Arc::new(cost));
        self
    }

    /// Waits for capacity for at most `deadline` per attempt, then refuses.
    /// An attempt whose wait would end past the deadline is refused at once.
    /// A deadline the clock cannot represent (`Duration::MAX`) waits as long
    /// as it takes; only a wait that never ends is refused.
    pub fn wait_up_to(mut self, deadline: Duration) -> Self {
        self.wait = Some(deadline);
        self
    }

    /// Refuses at once when the share is exhausted.
    pub fn fail_fast(mut self) -> Self {
        self.wait = None;
        self
    }
}

impl<S, Bu: AttemptBudget, B> Layer<S> for DependencyBudgetLayer<Bu, B> {
    type Service = DependencyBudgetService<S, Bu, B>;

    fn layer(&self, inner: S) -> Self::Service {
        DependencyBudgetService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service built by [`DependencyBudgetLayer`].
pub struct DependencyBudgetService<S, Bu, B> {
    inner: S,
    layer: DependencyBudgetLayer<Bu, B>,
}

impl<S, Bu, B> DependencyBudgetService<S, Bu, B> {
    crate::macros::inner_accessors!(inner: S);
}

impl<S: Clone, Bu: Clone, B> Clone for DependencyBudgetService<S, Bu, B> {
    fn clone(&self) -> Self {
        DependencyBudgetService {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: fmt::Debug, Bu, B> fmt::Debug for DependencyBudgetService<S, Bu, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DependencyBudgetService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// Why an attempt failed at a dependency budget: the budget refused it
/// (nothing was sent), or, in the service a [`DependencyBudgetLayer`]
/// builds, the inner service failed ([`Inner`](Self::Inner)).
///
/// A budget's own answer ([`AttemptBudget::charge`],
/// [`DependencyBudget::try_acquire`](crate::outbound::DependencyBudget::try_acquire))
/// is a `BudgetError` with no inner error (`E` is
/// [`Infallible`](std::convert::Infallible)): one of the three refusals.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BudgetError<E = std::convert::Infallible> {
    /// The share is exhausted; it admits again after `wait`. Nothing was
    /// sent.
    Exhausted {
        /// The share that refused: the retry share if true, else the normal
        /// share.
        retry: bool,
        /// The exact wait until the attempt could be admitted.
        wait: Duration,
    },
    /// The cost is more than the share can ever admit at once. Nothing was
    /// sent.
    CostExceedsBudget {
        /// The share: the retry share if true, else the normal share.
        retry: bool,
        /// The attempt's cost.
        cost: u64,
    },
    /// The limiter store failed and its failure mode refuses. Nothing was
    /// sent.
    Unavailable {
        /// Suggested wait.
        wait: Duration,
    },
    /// The inner service's error.
    Inner(E),
}

impl<E> BudgetError<E> {
    /// The wait after which a refused attempt can succeed, if one can;
    /// `None` for a cost above the share and for an inner error.
    pub fn wait(&self) -> Option<Duration> {
        match self {
            BudgetError::Exhausted { wait, .. } | BudgetError::Unavailable { wait } => Some(*wait),
            BudgetError::CostExceedsBudget { .. } | BudgetError::Inner(_) => None,
        }
    }

    /// True if the budget refused the attempt (nothing was sent), false for
    /// an inner error.
    pub fn is_refusal(&self) -> bool {
        !matches!(self, BudgetError::Inner(_))
    }
}

impl BudgetError {
    /// This refusal as the error of a service whose inner error is `E`.
    pub(crate) fn widen<E>(self) -> BudgetError<E> {
        match self {
            BudgetError::Exhausted { retry, wait } => BudgetError::Exhausted { retry, wait },
            BudgetError::CostExceedsBudget { retry, cost } => {
                BudgetError::CostExceedsBudget { retry, cost }
            }
            BudgetError::Unavailable { wait } => BudgetError::Unavailable { wait },
            BudgetError::Inner(never) => match never {},
        }
    }
}

impl<E: fmt::Display> fmt::Display for BudgetError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BudgetError::Exhausted { retry, wait } => {
                write!(
                    f,
                    "dependency budget ({} share) exhausted; retry in {wait:?}",
                    share_name(*retry)
                )
            }
            BudgetError::CostExceedsBudget { retry, cost } => write!(
                f,
                "an attempt of cost {cost} exceeds the dependency budget's {} share",
                share_name(*retry)
            ),
            BudgetError::Unavailable { wait } => {
                write!(f, "dependency budget unavailable; retry in {wait:?}")
            }
            BudgetError::Inner(e) => e.fmt(f),
        }
    }
}

/// A share's name in messages and metrics labels.
pub(crate) fn share_name(retry: bool) -> &'static str {
    if retry {
        "retry"
    } else {
        "normal"
    }
}

impl<E: std::error::Error + 'static> std::error::Error for BudgetError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BudgetError::Inner(e) => Some(e),
            _ => None,
        }
    }
}

/// Response future of [`DependencyBudgetService`].
pub(crate) type ResponseFuture<T, E> =
    Pin<Box<dyn Future<Output = Result<T, BudgetError<E>>> + Send>>;

impl<S, Bu, B> Service<Request<B>> for DependencyBudgetService<S, Bu, B>
where
    S: Service<Request<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send,
    S::Error: Send,
    Bu: AttemptBudget,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = BudgetError<S::Error>;
    type Future = ResponseFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(BudgetError::Inner)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let attempt = req
            .extensions()
            .get::<Attempt>()
            .copied()
            .unwrap_or(Attempt::FIRST);
        let cost = self.layer.cost.as_ref().map_or(1, |f| f(&req)).max(1);
        let budget = self.layer.budget.clone();
        let queues = self.layer.queues.clone();
        let deadline = self.layer.wait.map(deadline_after);
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        Box::pin(async move {
            let started = Instant::now();
            if let Err(refusal) = acquire(&budget, &queues, attempt, cost, deadline).await {
                budget.record_refusal();
                tracing::debug!(%refusal, "dependency budget refused an attempt");
                return Err(refusal.widen());
            }
            budget.record_wait(started.elapsed());
            inner.call(req).await.map_err(BudgetError::Inner)
        })
    }
}
