//! [`AdaptiveLimitLayer`]: the adaptive limit on its own, for any Tower
//! service, such as a client calling one dependency.

use std::error::Error as StdError;
use std::fmt;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tower::{Layer, Service};

use super::class::{checked_shares, Criticality};
use super::config::AdaptiveLimit;
use super::controller::Outcome;
use super::gate::{Gate, GateBegin, GateConfig, GateRefusal, Source};
use crate::concurrency::{ConcurrencyStats, OverloadReason};
use crate::ConfigError;

type ClassFn<Req> = Arc<dyn Fn(&Req) -> Criticality + Send + Sync>;
type TenantFn<Req> = Arc<dyn Fn(&Req) -> Option<Arc<str>> + Send + Sync>;

/// Reads a call's result as an [`Outcome`] of the limit: implemented by
/// `()`, the default (a response is a [`Success`](Outcome::Success), an
/// error an [`Overload`](Outcome::Overload): a timeout, a refused
/// connection), and by every `Fn(&Result<Res, E>) -> Outcome` given to
/// [`AdaptiveLimitLayerBuilder::outcome`].
pub(crate) trait ClassifyOutcome<Res, E> {
    /// The outcome of `result`.
    fn outcome(&self, result: &Result<Res, E>) -> Outcome;
}

impl<Res, E> ClassifyOutcome<Res, E> for () {
    fn outcome(&self, result: &Result<Res, E>) -> Outcome {
        match result {
            Ok(_) => Outcome::Success,
            Err(_) => Outcome::Overload,
        }
    }
}

impl<Res, E, F> ClassifyOutcome<Res, E> for F
where
    F: Fn(&Result<Res, E>) -> Outcome,
{
    fn outcome(&self, result: &Result<Res, E>) -> Outcome {
        self(result)
    }
}

/// The source of a [`LimitError::Overloaded`], whatever the inner error
/// type: what a retry policy finds in an error's chain of sources to tell a
/// call the limit never sent (see
/// [`RetryAttempts`](crate::outbound::RetryAttempts)).
#[derive(Debug)]
pub(crate) struct Overloaded;

impl fmt::Display for Overloaded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("refused by a concurrency limit; not sent")
    }
}

impl StdError for Overloaded {}

/// The error of the service an [`AdaptiveLimitLayer`] builds.
///
/// ```
/// use std::time::Duration;
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_admission::concurrency::{AdaptiveLimit, AdaptiveLimitLayer, LimitError, OverloadReason};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let limit = AdaptiveLimitLayer::<u32>::builder(AdaptiveLimit::default()).build().unwrap();
/// let svc = limit.layer(service_fn(|_: u32| async {
///     tokio::time::sleep(Duration::from_millis(10)).await;
///     Ok::<_, std::io::Error>(())
/// }));
/// // The first baseline probe admits 3 at a time: the 4th is refused.
/// let held: Vec<_> = (0..3).map(|n| tokio::spawn(svc.clone().oneshot(n))).collect();
/// tokio::task::yield_now().await;
/// match svc.clone().oneshot(4).await {
///     Err(LimitError::Overloaded { reason, retry_after, .. }) => {
///         assert_eq!(reason, OverloadReason::QueueFull);
///         assert_eq!(retry_after, Duration::from_secs(1));
///     }
///     other => panic!("{other:?}"),
/// }
/// for call in held {
///     call.await.unwrap().unwrap();
/// }
/// # }
/// ```
#[derive(Debug)]
pub enum LimitError<E> {
    /// Refused by the limit; the inner service was not called.
    #[non_exhaustive]
    Overloaded {
        /// Why.
        reason: OverloadReason,
        /// The request's class.
        class: Criticality,
        /// The limit when it was refused.
        limit: usize,
        /// Suggested wait: the queue deadline, at least 1 s.
        retry_after: Duration,
    },
    /// The inner service's error.
    Inner(E),
}

impl<E: fmt::Display> fmt::Display for LimitError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitError::Overloaded {
                reason,
                class,
                limit,
                ..
            } => write!(
                f,
                "concurrency limit of {limit} refused a {class} request: {reason}"
            ),
            LimitError::Inner(e) => e.fmt(f),
        }
    }
}

impl<E: StdError + 'static> StdError for LimitError<E> {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            LimitError::Overloaded { .. } => Some(&Overloaded),
            LimitError::Inner(e) => Some(e),
        }
    }
}

/// Limits the requests in flight to a service with an adaptive limit (or a
/// [`fixed`](Self::fixed) one), criticality classes and fair queues.
///
/// `Req` is the request type, read by the class and tenant functions; `O`
/// is the function given to [`outcome`](AdaptiveLimitLayerBuilder::outcome),
/// or `()` without one (a response is a success, an error an overload). A
/// slot is held from admission until the inner future answers or is
/// dropped. Clones share the limit.
///
/// ```
/// use std::time::Duration;
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_admission::concurrency::{AdaptiveLimit, AdaptiveLimitLayer, Criticality};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // Calls to one dependency: the limit follows its latency between 2 and 200.
/// let limit = AdaptiveLimitLayer::<String>::builder(AdaptiveLimit::default().bounds(2, 200))
///     .queue(32, Duration::from_millis(50))
///     .classify(|req: &String| {
///         if req.starts_with("export") { Criticality::Sheddable } else { Criticality::Default }
///     })
///     .build()
///     .unwrap();
/// let client = limit.layer(service_fn(|req: String| async move {
///     Ok::<_, std::io::Error>(req.len())
/// }));
/// assert_eq!(client.oneshot("report 7".to_string()).await.unwrap(), 8);
/// assert_eq!(limit.stats().global_in_flight, 0);
/// # }
/// ```
pub struct AdaptiveLimitLayer<Req, O = ()> {
    gate: Arc<Gate>,
    class: Option<ClassFn<Req>>,
    tenant: Option<TenantFn<Req>>,
    outcome: O,
}

impl<Req, O: Clone> Clone for AdaptiveLimitLayer<Req, O> {
    fn clone(&self) -> Self {
        AdaptiveLimitLayer {
            gate: Arc::clone(&self.gate),
            class: self.class.clone(),
            tenant: self.tenant.clone(),
            outcome: self.outcome.clone(),
        }
    }
}

impl<Req, O> fmt::Debug for AdaptiveLimitLayer<Req, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveLimitLayer")
            .field("stats", &self.gate.stats())
            .finish_non_exhaustive()
    }
}

impl<Req> AdaptiveLimitLayer<Req> {
    /// Starts a configuration with the limit's parameters.
    pub fn builder(limit: AdaptiveLimit) -> AdaptiveLimitLayerBuilder<Req> {
        Self::with_source(Source::Adaptive(limit))
    }

    /// Starts a configuration with a fixed cap of `limit` in flight instead
    /// of an adaptive one (at least 1): the classes, their shares, the fair
    /// queues, the refusals and the metrics are the same, and the limit
    /// never moves.
    ///
    /// ```
    /// use tower_admission::concurrency::AdaptiveLimitLayer;
    ///
    /// let cap = AdaptiveLimitLayer::<()>::fixed(16).build().unwrap();
    /// assert_eq!(cap.stats().limit, Some(16));
    /// assert_eq!(AdaptiveLimitLayer::<()>::fixed(0).build().unwrap_err().field(), "limit");
    /// ```
    pub fn fixed(limit: usize) -> AdaptiveLimitLayerBuilder<Req> {
        Self::with_source(Source::Fixed(limit))
    }

    fn with_source(source: Source) -> AdaptiveLimitLayerBuilder<Req> {
        AdaptiveLimitLayerBuilder {
            source,
            queue: 0,
            deadline: Duration::ZERO,
            shares: None,
            class: None,
            tenant: None,
            outcome: (),
            scope: "outbound".into(),
        }
    }
}

impl<Req, O> AdaptiveLimitLayer<Req, O> {
    /// A snapshot of the limit and its counts, as the global cap's.
    pub fn stats(&self) -> ConcurrencyStats {
        self.gate.stats().into_layer_stats()
    }
}

impl<S, Req, O: Clone> Layer<S> for AdaptiveLimitLayer<Req, O> {
    type Service = AdaptiveLimitService<S, Req, O>;

    fn layer(&self, inner: S) -> Self::Service {
        AdaptiveLimitService {
            inner,
            layer: self.clone(),
        }
    }
}

/// Builder of an [`AdaptiveLimitLayer`]; the layer's docs have an example.
pub struct AdaptiveLimitLayerBuilder<Req, O = ()> {
    source: Source,
    queue: usize,
    deadline: Duration,
    shares: Option<(f64, f64)>,
    class: Option<ClassFn<Req>>,
    tenant: Option<TenantFn<Req>>,
    outcome: O,
    scope: String,
}

impl<Req, O> fmt::Debug for AdaptiveLimitLayerBuilder<Req, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveLimitLayerBuilder")
            .field("source", &self.source)
            .field("queue", &self.queue)
            .field("deadline", &self.deadline)
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl<Req, O> AdaptiveLimitLayerBuilder<Req, O> {
    /// Up to `places` requests per class wait for a slot, at most
    /// `deadline` each (default: no queue, refuse at once).
    pub fn queue(mut self, places: usize, deadline: Duration) -> Self {
        self.queue = places;
        self.deadline = deadline;
        self
    }

    /// The share of the limit sheddable and default requests may fill
    /// (defaults 0.8 and 0.9 with a classifier, 1 and 1 without).
    pub fn class_shares(mut self, sheddable: f64, default: f64) -> Self {
        self.shares = Some((sheddable, default));
        self
    }

    /// The class of a request (without it every request is
    /// [`Criticality::Default`] and may fill the whole limit).
    pub fn classify(mut self, class: impl Fn(&Req) -> Criticality + Send + Sync + 'static) -> Self {
        self.class = Some(Arc::new(class));
        self
    }

    /// The tenant a request is queued fairly under (without it, or for
    /// `None`, one queue in arrival order).
    pub fn tenant(
        mut self,
        tenant: impl Fn(&Req) -> Option<Arc<str>> + Send + Sync + 'static,
    ) -> Self {
        self.tenant = Some(Arc::new(tenant));
        self
    }

    /// The `scope` label of the metrics (default `"outbound"`).
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }

    /// How a call's result moves the limit: `outcome` reads the inner
    /// service's `&Result<Response, Error>` as an [`Outcome`]. By default
    /// a response is a [`Success`](Outcome::Success) and an error an
    /// [`Overload`](Outcome::Overload) (a timeout, a refused connection).
    /// Here a dependency's 429 and 503 back the limit off, its 404 says
    /// nothing of its load:
    ///
    /// ```
    /// use tower_admission::concurrency::{AdaptiveLimit, AdaptiveLimitLayer, Outcome};
    ///
    /// type Answer = Result<http::Response<String>, std::io::Error>;
    /// let limit = AdaptiveLimitLayer::<http::Request<String>>::builder(AdaptiveLimit::default())
    ///     .outcome(|answer: &Answer| match answer {
    ///         Ok(r) if r.status() == 429 || r.status() == 503 => Outcome::Overload,
    ///         Ok(r) if r.status() == 404 => Outcome::Ignore,
    ///         Ok(_) => Outcome::Success,
    ///         Err(_) => Outcome::Overload,
    ///     })
    ///     .build()
    ///     .unwrap();
    /// # let _ = limit;
    /// ```
    pub fn outcome<P>(self, outcome: P) -> AdaptiveLimitLayerBuilder<Req, P> {
        AdaptiveLimitLayerBuilder {
            source: self.source,
            queue: self.queue,
            deadline: self.deadline,
            shares: self.shares,
            class: self.class,
            tenant: self.tenant,
            outcome,
            scope: self.scope,
        }
    }

    /// Checks the configuration and builds the layer.
    pub fn build(self) -> Result<AdaptiveLimitLayer<Req, O>, ConfigError> {
        match self.source {
            Source::Adaptive(limit) => limit.validate()?,
            Source::Fixed(0) => return Err(ConfigError::new("limit", "must be at least 1")),
            Source::Fixed(_) => {}
        }
        let shares = gate_shares(self.shares, self.class.is_some())?;
        check_queue(self.queue, self.deadline)?;
        let gate = Gate::new(GateConfig {
            source: self.source,
            shares,
            queue: self.queue,
            deadline: self.deadline,
            scope: self.scope.into(),
        });
        Ok(AdaptiveLimitLayer {
            gate,
            class: self.class,
            tenant: self.tenant,
            outcome: self.outcome,
        })
    }
}

/// The shares of a gate: those configured, or else the defaults with a
/// classifier and the whole limit for everyone without.
pub(crate) fn gate_shares(
    configured: Option<(f64, f64)>,
    classified: bool,
) -> Result<[f64; 3], ConfigError> {
    match configured {
        Some((sheddable, default)) => checked_shares(sheddable, default),
        None if classified => checked_shares(
            super::class::DEFAULT_SHEDDABLE_SHARE,
            super::class::DEFAULT_DEFAULT_SHARE,
        ),
        None => Ok([1.0; 3]),
    }
}

/// A queue longer than 0 needs a deadline, of at most one day.
pub(crate) fn check_queue(queue: usize, deadline: Duration) -> Result<(), ConfigError> {
    if deadline > Duration::from_secs(24 * 3600) {
        return Err(ConfigError::new(
            "queue.deadline",
            "must be at most one day",
        ));
    }
    if queue > 0 && deadline.is_zero() {
        return Err(ConfigError::new(
            "queue.deadline",
            "must be above zero when the queue is not empty; use queue 0 to shed load",
        ));
    }
    Ok(())
}

/// The `Retry-After` of a gate's refusals: its queue deadline, at least 1 s.
pub(crate) fn gate_retry_after(gate: &Gate) -> Duration {
    gate.config.deadline.max(Duration::from_secs(1))
}

fn overloaded<E>(gate: &Gate, refusal: GateRefusal) -> LimitError<E> {
    LimitError::Overloaded {
        reason: refusal.reason,
        class: refusal.class,
        limit: refusal.limit,
        retry_after: gate_retry_after(gate),
    }
}

/// A service behind an [`AdaptiveLimitLayer`]; the layer's docs have an
/// example.
pub struct AdaptiveLimitService<S, Req, O = ()> {
    inner: S,
    layer: AdaptiveLimitLayer<Req, O>,
}

impl<S, Req, O> AdaptiveLimitService<S, Req, O> {
    crate::macros::inner_accessors!(inner: S);
}

impl<S: Clone, Req, O: Clone> Clone for AdaptiveLimitService<S, Req, O> {
    fn clone(&self) -> Self {
        AdaptiveLimitService {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: fmt::Debug, Req, O> fmt::Debug for AdaptiveLimitService<S, Req, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveLimitService")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

/// The response future of an [`AdaptiveLimitService`] (boxed: an outbound
/// call costs far more than the allocation).
pub(crate) type LimitFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, LimitError<E>>> + Send>>;

impl<S, Req, O> Service<Req> for AdaptiveLimitService<S, Req, O>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
    Req: Send + 'static,
    O: ClassifyOutcome<S::Response, S::Error> + Clone + Send + 'static,
{
    type Response = S::Response;
    type Error = LimitError<S::Error>;
    type Future = LimitFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(LimitError::Inner)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let class = self
            .layer
            .class
            .as_ref()
            .map_or(Criticality::Default, |f| f(&req));
        let tenant = self.layer.tenant.as_ref().and_then(|f| f(&req));
        let gate = &self.layer.gate;
        let outcome = self.layer.outcome.clone();
        match gate.begin(class, tenant.as_ref()) {
            GateBegin::Ready(mut ticket) => {
                let fut = self.inner.call(req);
                Box::pin(async move {
                    let result = fut.await;
                    ticket.answered(outcome.outcome(&result));
                    drop(ticket);
                    result.map_err(LimitError::Inner)
                })
            }
            GateBegin::Refused(refusal) => {
                let err = overloaded(gate, refusal);
                Box::pin(async move { Err(err) })
            }
            GateBegin::Wait(waiter) => {
                // The waiter calls a clone once it holds its slot; the
                // service `poll_ready` made ready is given up meanwhile.
                let mut inner = self.inner.clone();
                self.inner = self.inner.clone();
                let gate = Arc::clone(gate);
                Box::pin(async move {
                    let mut ticket = match waiter.wait().await {
                        Ok(ticket) => ticket,
                        Err(refusal) => return Err(overloaded(&gate, refusal)),
                    };
                    if let Err(e) = poll_fn(|cx| inner.poll_ready(cx)).await {
                        // Not an answer of the dependency: no sample.
                        ticket.answered(Outcome::Ignore);
                        return Err(LimitError::Inner(e));
                    }
                    let result = inner.call(req).await;
                    ticket.answered(outcome.outcome(&result));
                    drop(ticket);
                    result.map_err(LimitError::Inner)
                })
            }
        }
    }
}
