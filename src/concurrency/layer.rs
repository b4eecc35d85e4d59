use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tower::Layer;

use super::adaptive::gate::{Gate, GateConfig, Source};
use super::adaptive::{check_queue, gate_shares, AdaptiveLimit, Criticality};
use super::permits::Limits;
use super::reason::ConcurrencyStats;
use super::service::Concurrency;
use super::state::{CapLimits, GlobalGate, PartsFn, Shared};
use crate::reload::{ReloadHandle, Target};
use crate::ConfigError;

/// Default for [`ConcurrencyLayerBuilder::max_identities`].
const DEFAULT_MAX_IDENTITIES: usize = 10_000;

/// Layer that bounds requests in flight.
///
/// Clones share all state (permit counts, queues, the per-identity map and the
/// counters), and so do the services built from one layer: apply one layer
/// value to an axum `Router` and every route shares the same caps.
#[derive(Clone)]
pub struct ConcurrencyLayer {
    pub(crate) shared: Arc<Shared>,
}

impl ConcurrencyLayer {
    /// Starts a configuration.
    pub fn builder() -> ConcurrencyLayerBuilder {
        ConcurrencyLayerBuilder::default()
    }

    /// Number of requests holding a global permit (running, or still
    /// sending their response body). 0 without a global cap.
    pub fn in_flight(&self) -> usize {
        self.stats().global_in_flight
    }

    /// Number of requests waiting in the global queue. 0 without a global
    /// cap.
    pub fn queued(&self) -> usize {
        self.stats().global_queued
    }

    /// Requests of `subject` holding its per-identity permit.
    pub fn identity_in_flight(&self, subject: &str) -> usize {
        self.shared.identity_counts(subject).0
    }

    /// Requests of `subject` waiting in its per-identity queue.
    pub fn identity_queued(&self, subject: &str) -> usize {
        self.shared.identity_counts(subject).1
    }

    /// Number of identities the per-identity map tracks now: those with a
    /// request queued, running or sending its body.
    pub fn tracked_identities(&self) -> usize {
        self.shared.tracked_identities()
    }

    /// A snapshot of every counter.
    pub fn stats(&self) -> ConcurrencyStats {
        self.shared.stats()
    }

    /// Changes the caps of this layer, its clones and every service built
    /// from them while they run. A new configuration is given as a builder,
    /// checked as [`build`](ConcurrencyLayerBuilder::build) checks it, and
    /// must keep the layer's shape: the same caps (global, per identity),
    /// fixed or adaptive as before, with or without classes and tenants.
    /// What applies: each fixed cap's limit, queue and deadline, the most
    /// identities tracked, `Retry-After`; a gate's limit (fixed) or floor
    /// and ceiling (adaptive). The classifier and tenant functions in
    /// force are kept. See [`reload`](crate::reload) for what requests in
    /// flight and waiters see.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::concurrency::ConcurrencyLayer;
    ///
    /// let second = Duration::from_secs(1);
    /// let layer = ConcurrencyLayer::builder().global(64, 128, second).build()?;
    /// let reload = layer.reload_handle();
    /// reload.apply(ConcurrencyLayer::builder().global(8, 16, second))?;
    /// // Adding a cap changes the shape: refused, nothing changes.
    /// let err = reload
    ///     .apply(ConcurrencyLayer::builder().global(8, 16, second).per_identity(2, 2, second))
    ///     .unwrap_err();
    /// assert_eq!(err.field(), "per_identity");
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn reload_handle(&self) -> ReloadHandle<ConcurrencyLayerBuilder> {
        ReloadHandle::new(Arc::new(CapsTarget(Arc::clone(&self.shared))))
    }
}

/// The concurrency layer's side of its [`ReloadHandle`].
struct CapsTarget(Arc<Shared>);

/// What a checked reload puts in force.
struct Reloaded {
    limits: CapLimits,
    gate: Option<Source>,
}

impl CapsTarget {
    /// `new`, checked as `build()` checks it and against the running
    /// layer's shape.
    fn reloaded(&self, new: &ConcurrencyLayerBuilder) -> Result<Reloaded, ConfigError> {
        let plan = new.plan()?;
        let running = &*self.0;
        let same = |field: &'static str, before: bool, after: bool, what: &str| {
            if before == after {
                Ok(())
            } else {
                Err(ConfigError::new(
                    field,
                    format!(
                        "{what} cannot be added or removed while running; restart to change it"
                    ),
                ))
            }
        };
        same(
            "global",
            running.global.is_some(),
            plan.global.is_some(),
            "a fixed global cap",
        )?;
        same(
            "global_adaptive",
            running.gate.is_some(),
            plan.gate.is_some(),
            "an adaptive or classified global cap",
        )?;
        same(
            "per_identity",
            running.per_identity.is_some(),
            plan.per_identity.is_some(),
            "a per-identity cap",
        )?;
        let gate = match (&running.gate, &plan.gate) {
            (Some(old), Some(new)) => Some(gate_change(old, new)?),
            _ => None,
        };
        let kept = running.limits();
        Ok(Reloaded {
            limits: CapLimits {
                global: plan.global.unwrap_or(kept.global),
                identity: plan.per_identity.unwrap_or(kept.identity),
                map: plan.identity_map,
            },
            gate,
        })
    }
}

/// The source a reload gives a running gate: only a fixed limit, or an
/// adaptive limit's floor and ceiling, may change.
fn gate_change(old: &GlobalGate, new: &GatePlan) -> Result<Source, ConfigError> {
    let refuse = |field: &'static str, what: &str| {
        Err(ConfigError::new(
            field,
            format!("{what} cannot change while running; restart to change it"),
        ))
    };
    let config = &old.gate.config;
    match (config.source, new.source) {
        (Source::Fixed(_), Source::Fixed(_)) => {}
        (Source::Adaptive(before), Source::Adaptive(after)) => {
            let bounds_only = AdaptiveLimit {
                floor: before.floor,
                ceiling: before.ceiling,
                initial: before.initial,
                ..after
            };
            if bounds_only != before {
                return refuse(
                    "global_adaptive",
                    "an adaptive limit's settings other than its floor and ceiling",
                );
            }
        }
        _ => return refuse("global_adaptive", "a global cap's kind (fixed or adaptive)"),
    }
    if (new.limits.queue, new.limits.deadline) != (config.queue, config.deadline) {
        return refuse(
            "global",
            "the queue and deadline of a classified or adaptive cap",
        );
    }
    if new.shares != config.shares {
        return refuse("class_shares", "class shares");
    }
    if (new.class.is_some(), new.tenant.is_some()) != (old.class.is_some(), old.tenant.is_some()) {
        return refuse("criticality", "classes and tenants");
    }
    Ok(new.source)
}

impl Target<ConcurrencyLayerBuilder> for CapsTarget {
    fn check(&self, new: &ConcurrencyLayerBuilder) -> Result<(), ConfigError> {
        self.reloaded(new).map(drop)
    }

    fn swap(&self, new: ConcurrencyLayerBuilder) {
        let Ok(reloaded) = self.reloaded(&new) else {
            unreachable!("swapped after a check")
        };
        self.0.set_limits(reloaded.limits);
        if let (Some(gate), Some(source)) = (&self.0.gate, reloaded.gate) {
            gate.gate.set_source(source);
        }
    }
}

impl<S> Layer<S> for ConcurrencyLayer {
    type Service = Concurrency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Concurrency::from_shared(inner, Arc::clone(&self.shared))
    }
}

impl fmt::Debug for ConcurrencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let limits = self.shared.limits();
        f.debug_struct("ConcurrencyLayer")
            .field(
                "global",
                &self.shared.global.as_ref().map(|_| limits.global),
            )
            .field("gate", &self.shared.gate)
            .field(
                "per_identity",
                &self.shared.per_identity.as_ref().map(|_| limits.identity),
            )
            .field("stats", &self.stats())
            .finish()
    }
}

#[derive(Debug, Clone, Copy)]
struct CapConfig {
    limit: usize,
    queue: usize,
    deadline: Duration,
}

/// Builder of a [`ConcurrencyLayer`]; see [`ConcurrencyLayer::builder`].
#[derive(Clone)]
pub struct ConcurrencyLayerBuilder {
    global: Option<CapConfig>,
    adaptive: Option<(AdaptiveLimit, usize, Duration)>,
    per_identity: Option<CapConfig>,
    max_identities: usize,
    retry_after: Option<Duration>,
    class: Option<PartsFn<Criticality>>,
    tenant: Option<PartsFn<Option<Arc<str>>>>,
    shares: Option<(f64, f64)>,
}

impl fmt::Debug for ConcurrencyLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLayerBuilder")
            .field("global", &self.global)
            .field("adaptive", &self.adaptive)
            .field("per_identity", &self.per_identity)
            .field("max_identities", &self.max_identities)
            .field("retry_after", &self.retry_after)
            .field("classified", &self.class.is_some())
            .field("fair", &self.tenant.is_some())
            .field("shares", &self.shares)
            .finish()
    }
}

impl Default for ConcurrencyLayerBuilder {
    fn default() -> Self {
        ConcurrencyLayerBuilder {
            global: None,
            adaptive: None,
            per_identity: None,
            max_identities: DEFAULT_MAX_IDENTITIES,
            retry_after: None,
            class: None,
            tenant: None,
            shares: None,
        }
    }
}

impl ConcurrencyLayerBuilder {
    /// A service-wide cap of `limit` requests in flight, with at most
    /// `queue` more waiting up to `deadline` each. Refusals are 503.
    ///
    /// `queue == 0` is the load-shedding form: a request that finds every
    /// permit taken is refused at once and `deadline` is not used. A
    /// `deadline` is at most one day.
    pub fn global(mut self, limit: usize, queue: usize, deadline: Duration) -> Self {
        self.global = Some(CapConfig {
            limit,
            queue,
            deadline,
        });
        self
    }

    /// A service-wide cap whose limit adapts to the latency (see
    /// [the adaptive limit](crate::concurrency#adaptive-limits-criticality-classes-and-fair-queues-in-detail)), with at most `queue`
    /// more requests *per class* waiting up to `deadline` each. Refusals are
    /// 503, with the limit in force advertised in the `RateLimit` fields.
    /// Use it instead of [`global`](Self::global), not beside it.
    ///
    /// A request of an identity takes its identity permit first and then
    /// waits for the adaptive limit, in two steps: unlike the fixed cap, a
    /// permit freed here goes to the gate's own queue only.
    pub fn global_adaptive(
        mut self,
        limit: AdaptiveLimit,
        queue: usize,
        deadline: Duration,
    ) -> Self {
        self.adaptive = Some((limit, queue, deadline));
        self
    }

    /// The [`Criticality`] of a request, from its head (its
    /// [`Identity`](crate::identity::Identity)'s plan, its route): each
    /// class may fill only its share of the global limit (see
    /// [`class_shares`](Self::class_shares)), and waiters are served most
    /// critical first. Needs a global cap, fixed or adaptive; with a fixed
    /// one, `queue` places are kept per class.
    pub fn criticality(
        mut self,
        class: impl Fn(&http::request::Parts) -> Criticality + Send + Sync + 'static,
    ) -> Self {
        self.class = Some(Arc::new(class));
        self
    }

    /// The tenant a request is queued fairly under in the global queue (for
    /// example the [`Identity`](crate::identity::Identity)'s tenant): each
    /// tenant waits in its own sub-queue, served round-robin, holding at
    /// most its fair share of the places. Needs a global cap.
    pub fn fair_by(
        mut self,
        tenant: impl Fn(&http::request::Parts) -> Option<Arc<str>> + Send + Sync + 'static,
    ) -> Self {
        self.tenant = Some(Arc::new(tenant));
        self
    }

    /// The share of the global limit sheddable and default requests may
    /// fill (defaults 0.8 and 0.9 with [`criticality`](Self::criticality)).
    pub fn class_shares(mut self, sheddable: f64, default: f64) -> Self {
        self.shares = Some((sheddable, default));
        self
    }

    /// A cap of `limit` requests in flight per authenticated subject, with
    /// at most `queue` more of that subject waiting up to `deadline` each.
    /// Refusals are 429. Requests without an
    /// [`Identity`](crate::identity::Identity) are not subject to it.
    pub fn per_identity(mut self, limit: usize, queue: usize, deadline: Duration) -> Self {
        self.per_identity = Some(CapConfig {
            limit,
            queue,
            deadline,
        });
        self
    }

    /// Most distinct identities tracked at once (default 10 000). A request of a new identity that finds
    /// the map full is refused at once with 503.
    pub fn max_identities(mut self, max: usize) -> Self {
        self.max_identities = max;
        self
    }

    /// Overrides the `Retry-After` of every refusal (at most one day). By
    /// default it is the refusing cap's queue deadline (rounded up to whole
    /// seconds, at least 1 s); 1 s for a full identity map, which has no
    /// queue.
    pub fn retry_after(mut self, wait: Duration) -> Self {
        self.retry_after = Some(wait);
        self
    }

    /// Checks the configuration and builds the layer.
    pub fn build(self) -> Result<ConcurrencyLayer, ConfigError> {
        let plan = self.plan()?;
        let gate = plan.gate.map(|plan| GlobalGate {
            gate: Gate::new(GateConfig {
                source: plan.source,
                shares: plan.shares,
                queue: plan.limits.queue,
                deadline: plan.limits.deadline,
                scope: Arc::from("global"),
            }),
            class: plan.class,
            tenant: plan.tenant,
            limits: plan.limits,
        });
        Ok(ConcurrencyLayer {
            shared: Shared::new(plan.global, gate, plan.per_identity, plan.identity_map),
        })
    }

    /// Every cap's settings, checked; the gate not yet built.
    fn plan(&self) -> Result<Plan, ConfigError> {
        if self.retry_after.is_some_and(|wait| wait > MAX_WAIT) {
            return Err(ConfigError::new("retry_after", "must be at most one day"));
        }
        let global = self
            .global
            .map(|c| limits(c, self.retry_after, ["global.limit", "global.deadline"]))
            .transpose()?;
        let gate = self.gate(global)?;
        let global = if gate.is_some() { None } else { global };
        let per_identity = self
            .per_identity
            .map(|c| {
                limits(
                    c,
                    self.retry_after,
                    ["per_identity.limit", "per_identity.deadline"],
                )
            })
            .transpose()?;
        if global.is_none() && gate.is_none() && per_identity.is_none() {
            return Err(ConfigError::new(
                "global",
                "configure a global cap, a per-identity cap, or both",
            ));
        }
        if per_identity.is_some() && self.max_identities == 0 {
            return Err(ConfigError::new("max_identities", "must be at least 1"));
        }
        // The map refuses a new subject at once: a load-shedding cap of
        // identities.
        let identity_map = Limits {
            limit: self.max_identities,
            queue: 0,
            deadline: Duration::ZERO,
            retry_after: retry_after(self.retry_after, Duration::ZERO),
        };
        Ok(Plan {
            global,
            gate,
            per_identity,
            identity_map,
        })
    }

    /// The global gate's settings, when the global cap is adaptive or has
    /// classes or tenants.
    fn gate(&self, fixed: Option<Limits>) -> Result<Option<GatePlan>, ConfigError> {
        let shaped = self.class.is_some() || self.tenant.is_some() || self.shares.is_some();
        let (source, limits) = match (self.adaptive, fixed) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    "global_adaptive",
                    "configure either a fixed or an adaptive global cap",
                ))
            }
            (Some((limit, queue, deadline)), None) => {
                limit.validate()?;
                check_queue(queue, deadline)?;
                let limits = Limits {
                    limit: limit.initial,
                    queue,
                    deadline,
                    retry_after: retry_after(self.retry_after, deadline),
                };
                (Source::Adaptive(limit), limits)
            }
            (None, Some(limits)) if shaped => (Source::Fixed(limits.limit), limits),
            (None, Some(_)) => return Ok(None),
            (None, None) if shaped => {
                return Err(ConfigError::new(
                    "criticality",
                    "classes, tenants and class shares need a global cap",
                ))
            }
            (None, None) => return Ok(None),
        };
        Ok(Some(GatePlan {
            source,
            shares: gate_shares(self.shares, self.class.is_some())?,
            class: self.class.clone(),
            tenant: self.tenant.clone(),
            limits,
        }))
    }
}

/// A builder's settings, checked: what [`ConcurrencyLayerBuilder::build`]
/// builds and a reload applies.
struct Plan {
    global: Option<Limits>,
    gate: Option<GatePlan>,
    per_identity: Option<Limits>,
    identity_map: Limits,
}

/// A global gate's settings, checked.
struct GatePlan {
    source: Source,
    shares: [f64; 3],
    class: Option<PartsFn<Criticality>>,
    tenant: Option<PartsFn<Option<Arc<str>>>>,
    limits: Limits,
}

/// The longest queue deadline and `Retry-After` override: one day. A
/// request waits in a queue only while its caller stays connected, so a
/// longer wait (`Duration::MAX`, say, which would be sent as a
/// `Retry-After` of 18446744073709551615) is a mistake.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

fn limits(
    c: CapConfig,
    override_wait: Option<Duration>,
    [limit_field, deadline_field]: [&'static str; 2],
) -> Result<Limits, ConfigError> {
    if c.limit == 0 {
        return Err(ConfigError::new(limit_field, "must be at least 1"));
    }
    if c.deadline > MAX_WAIT {
        return Err(ConfigError::new(deadline_field, "must be at most one day"));
    }
    if c.queue > 0 && c.deadline.is_zero() {
        return Err(ConfigError::new(
            deadline_field,
            "must be above zero when the queue is not empty; use queue 0 to shed load",
        ));
    }
    Ok(Limits {
        limit: c.limit,
        queue: c.queue,
        deadline: c.deadline,
        retry_after: retry_after(override_wait, c.deadline),
    })
}

/// The `Retry-After` of a cap's refusals: the override, or else the cap's
/// queue deadline; at least 1 s.
fn retry_after(override_wait: Option<Duration>, deadline: Duration) -> Duration {
    override_wait
        .unwrap_or(deadline)
        .max(Duration::from_secs(1))
}
