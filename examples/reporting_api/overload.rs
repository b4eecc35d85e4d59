//! Overload protection of the dependency calls: every call holds a slot of
//! an adaptive concurrency limit, outside its retries and the budget (so
//! that what the budget admits is sent at once).
//!
//! ```text
//! AdaptiveLimitLayer -> tower::retry -> DependencyBudgetLayer -> HTTP client
//! ```
//!
//! The budget bounds how many attempts *start* per second; it cannot see
//! that the dependency got slower. A dependency that serves 2 calls at once
//! in 20 ms serves 100 calls per second, below the 200/s budget: without a
//! limit on the calls in flight, every call of every batch is sent at once
//! and each waits behind all the others. The limit follows the dependency's
//! latency against its measured no-load latency (see
//! `tower_admission::concurrency`), so the calls beyond what it
//! serves in time wait here, in a queue with a deadline, instead of there.
//!
//! Each call carries its caller ([`Caller`]): the class of the caller's plan
//! (`class` in `[plans.NAME]`) and its tenant. Under overload a sheddable
//! (free) call is refused first, a critical (pro) one keeps a reserved
//! share of the limit and is served first from the queue, and within a
//! class tenants are queued fairly. A refused call is not retried (nothing
//! was sent, and the limit is outside the retries), and its batch is
//! answered 503 with `Retry-After`.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use serde::Deserialize;
use tower_admission::concurrency::{AdaptiveLimit, AdaptiveLimitLayer, Criticality, Outcome};
use tower_admission::identity::Identity;
use tower_admission::outbound::BudgetError;
use tower_admission::ConfigError;

use super::config::{Config, Span};

/// A plan's class, as `reporting.toml` spells it (`class = "sheddable"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Class {
    /// Refused first under overload.
    Sheddable,
    /// Neither: the class of a plan that names none.
    #[default]
    Default,
    /// Keeps a reserved share of the limit; served first.
    Critical,
}

impl Class {
    fn criticality(self) -> Criticality {
        match self {
            Class::Sheddable => Criticality::Sheddable,
            Class::Default => Criticality::Default,
            Class::Critical => Criticality::Critical,
        }
    }
}

/// Which limit the dependency calls pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Mode {
    /// Follows the dependency's latency between `floor` and `ceiling`.
    Adaptive,
    /// At most `fixed` calls in flight, with the same classes and queues.
    Fixed,
    /// No limit: every call is sent at once (the budget still applies).
    Off,
}

/// `[dependency.concurrency]`: the limit on calls in flight to the
/// dependency, and the queue of the calls over it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Settings {
    pub(crate) mode: Mode,
    /// The cap in mode `fixed`.
    pub(crate) fixed: usize,
    /// The adaptive limit's bounds.
    pub(crate) floor: usize,
    pub(crate) ceiling: usize,
    /// The latency the adaptive limit aims at, as a share above the
    /// measured baseline.
    pub(crate) tolerance: f64,
    /// Calls waiting for a slot, per class.
    pub(crate) queue: usize,
    /// The longest a call waits for a slot.
    pub(crate) deadline: Span,
}

impl Default for Settings {
    /// As shipped: adaptive between 1 and 64 aiming at 1.5 × the baseline,
    /// 32 calls waiting per class for at most 400 ms.
    fn default() -> Self {
        Settings {
            mode: Mode::Adaptive,
            fixed: 16,
            floor: 1,
            ceiling: 64,
            tolerance: 0.5,
            queue: 32,
            deadline: Span(std::time::Duration::from_millis(400)),
        }
    }
}

/// The limit before its first measurement, within the bounds.
const INITIAL_LIMIT: usize = 20;

/// The `metrics` scope of the limit's series.
pub(crate) const SCOPE: &str = "dependency";

/// How a call's answer moves the limit: an error of the client (a timeout,
/// a refused connection) or a 429 or 5xx is an overload; the budget's own
/// refusal says nothing of the dependency and is no sample; anything else
/// is a success.
pub(crate) type ReadOutcome = fn(&Result<Response<Bytes>, BudgetError<reqwest::Error>>) -> Outcome;

/// The limit of `settings` on calls in flight.
pub(crate) type Limit = AdaptiveLimitLayer<Request<String>, ReadOutcome>;

fn outcome(answer: &Result<Response<Bytes>, BudgetError<reqwest::Error>>) -> Outcome {
    match answer {
        Ok(r) if r.status() == StatusCode::TOO_MANY_REQUESTS || r.status().is_server_error() => {
            Outcome::Overload
        }
        Ok(_) => Outcome::Success,
        Err(BudgetError::Inner(_)) => Outcome::Overload,
        Err(_) => Outcome::Ignore,
    }
}

impl Settings {
    /// The limit, or `None` in mode `off`. The error names the key under
    /// `[dependency.concurrency]`.
    pub(crate) fn limit(&self) -> Result<Option<Limit>, ConfigError> {
        let builder = match self.mode {
            Mode::Off => return Ok(None),
            Mode::Fixed => AdaptiveLimitLayer::fixed(self.fixed),
            Mode::Adaptive => {
                let adaptive = AdaptiveLimit::default()
                    .bounds(self.floor, self.ceiling)
                    .tolerance(self.tolerance)
                    .initial(INITIAL_LIMIT.clamp(self.floor, self.ceiling.max(self.floor)));
                AdaptiveLimitLayer::builder(adaptive)
            }
        };
        let limit = builder
            .queue(self.queue, self.deadline.0)
            .classify(|req: &Request<String>| {
                req.extensions()
                    .get::<Caller>()
                    .map_or(Criticality::Default, |caller| caller.class)
            })
            .tenant(|req: &Request<String>| {
                req.extensions()
                    .get::<Caller>()
                    .map(|caller| Arc::clone(&caller.tenant))
            })
            .scope(SCOPE)
            .outcome(outcome as ReadOutcome)
            .build()
            .map_err(|e| {
                let key = match e.field() {
                    "limit" => "fixed",
                    "adaptive.floor" => "floor",
                    "adaptive.ceiling" | "adaptive.initial" => "ceiling",
                    "adaptive.tolerance" => "tolerance",
                    "queue.deadline" => "deadline",
                    other => other,
                };
                ConfigError::new(key, e.reason())
            })?;
        Ok(Some(limit))
    }
}

/// Who a dependency call is made for, in its request's extensions: the
/// class of the caller's plan and the caller's tenant.
#[derive(Debug, Clone)]
pub(crate) struct Caller {
    class: Criticality,
    tenant: Arc<str>,
}

impl Caller {
    /// The caller `who`, whose plan's class `classes` knows.
    pub(crate) fn new(classes: &Classes, who: &Identity) -> Self {
        Caller {
            class: classes.of(who.plan()),
            tenant: Arc::clone(who.tenant_arc()),
        }
    }
}

/// The class of every plan; a plan without a table of its own is the
/// default plan.
#[derive(Debug, Clone)]
pub(crate) struct Classes {
    by_plan: Arc<std::collections::BTreeMap<String, Criticality>>,
    default_plan: Criticality,
}

impl Classes {
    pub(crate) fn new(config: &Config) -> Self {
        let by_plan: std::collections::BTreeMap<_, _> = config
            .plans
            .iter()
            .map(|(name, plan)| (name.clone(), plan.class.criticality()))
            .collect();
        let default_plan = by_plan
            .get(&config.default_plan)
            .copied()
            .unwrap_or_default();
        Classes {
            by_plan: Arc::new(by_plan),
            default_plan,
        }
    }

    fn of(&self, plan: &str) -> Criticality {
        self.by_plan.get(plan).copied().unwrap_or(self.default_plan)
    }
}
