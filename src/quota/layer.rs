use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use http::{Extensions, HeaderValue};
use tower::Layer;

use super::service::QuotaService;
use crate::identity::Identity;
use crate::quota::{headers, Limiter, Quota, Store};
use crate::reload::{Live, ReloadHandle, Target};
use crate::ConfigError;

/// What a quota is keyed on: see [`QuotaLayerBuilder::per_tenant`],
/// [`aggregate`](QuotaLayerBuilder::aggregate) and
/// [`key`](QuotaLayerBuilder::key); the subject by default.
#[derive(Clone)]
pub(crate) enum Scope {
    /// The authenticated subject: a per-user quota. The default.
    Subject,
    /// The authenticated tenant: one quota shared by a tenant's users.
    Tenant,
    /// One key for everyone: an aggregate quota.
    Aggregate,
    /// A function of the request; `None` skips the quota.
    Custom(KeyFn),
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Scope::Subject => "Subject",
            Scope::Tenant => "Tenant",
            Scope::Aggregate => "Aggregate",
            Scope::Custom(_) => "Custom(..)",
        })
    }
}

type CostFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;

/// A key function of [`QuotaLayerBuilder::key`].
type KeyFn = Arc<dyn Fn(&Parts) -> Option<Arc<str>> + Send + Sync>;

/// Applies a [`Quota`] to every request, answering 429 with an exact
/// `Retry-After` when it refuses.
///
/// - **Key**: per subject (default), [per tenant](QuotaLayerBuilder::per_tenant),
///   [aggregate](QuotaLayerBuilder::aggregate), or [a function](QuotaLayerBuilder::key).
///   A key of more than 64 bytes, or one that begins with `#`, is kept in
///   the store as `#` and its SHA-256 in hex (65 bytes): a store holds a
///   bounded number of bytes per key however long the subjects or the key
///   function's answers, and no key can spell another's digest.
/// - **Limits**: one quota, or one per identity plan ([`QuotaLayerBuilder::plan`]).
/// - **Cost**: a function of the request (default 1); handlers can settle the
///   real cost later through [`Settlement`](crate::quota::Settlement).
/// - **Refusal**: 429, `Retry-After` = `ceil(wait)` seconds (≥ 1),
///   `RateLimit-Policy` and `RateLimit` headers (IETF httpapi draft), and a
///   problem+json body naming the refusing policies.
///
/// Works under `axum::Router::layer` and `route_layer` and in
/// `tower::ServiceBuilder`. Clones share the store and its state.
///
/// ```
/// use axum::{routing::get, Router};
/// use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer};
/// use std::time::Duration;
///
/// let free = Quota::new("free", [
///     Policy::sliding_log("per-minute", 100, Duration::from_secs(60))?,
///     Policy::token_bucket("burst", 20, 100, Duration::from_secs(60))?,
/// ])?;
/// let app: Router = Router::new()
///     .route("/v1/reports", get(|| async { "ok" }))
///     .layer(QuotaLayer::builder(MemoryStore::new()).quota(free).build()?);
/// # Ok::<(), tower_admission::ConfigError>(())
/// ```
pub struct QuotaLayer<St> {
    pub(crate) config: Arc<Config<St>>,
}

pub(crate) struct Config<St> {
    pub(crate) limiter: Limiter<St>,
    /// The quotas in force; a [`ReloadHandle`] replaces them whole.
    pub(crate) quotas: Live<Quotas>,
    pub(crate) scope: Scope,
    pub(crate) cost: Option<CostFn>,
    pub(crate) headers_on_success: bool,
    pub(crate) refund_inner_refusals: bool,
}

impl<St> Clone for QuotaLayer<St> {
    fn clone(&self) -> Self {
        QuotaLayer {
            config: self.config.clone(),
        }
    }
}

impl<St> fmt::Debug for QuotaLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaLayer")
            .field("quotas", &self.config.quotas)
            .field("scope", &self.config.scope)
            .field("headers_on_success", &self.config.headers_on_success)
            .field("refund_inner_refusals", &self.config.refund_inner_refusals)
            .finish_non_exhaustive()
    }
}

impl<St: Store> QuotaLayer<St> {
    /// Starts a layer over `store`.
    pub fn builder(store: St) -> QuotaLayerBuilder<St> {
        QuotaLayerBuilder::new(Limiter::new(store))
    }

    /// Starts a layer over a [`Limiter`], to share its counters or local fallback.
    pub fn with_limiter(limiter: Limiter<St>) -> QuotaLayerBuilder<St> {
        QuotaLayerBuilder::new(limiter)
    }

    /// The limiter: store, failure modes and counters.
    pub fn limiter(&self) -> &Limiter<St> {
        &self.config.limiter
    }

    /// Changes the quotas and plans of this layer, its clones and every
    /// service built from them while they run. A new [`Quotas`] is checked
    /// as [`build`](QuotaLayerBuilder::build) checks it; state kept under
    /// the old numbers is read under the new by the redeploy rules (see
    /// [`reload`](crate::reload)).
    pub fn reload_handle(&self) -> ReloadHandle<Quotas> {
        ReloadHandle::new(Arc::new(QuotaTarget(Arc::clone(&self.config))))
    }
}

/// The quota layer's side of its [`ReloadHandle`].
struct QuotaTarget<St>(Arc<Config<St>>);

impl<St: Store> Target<Quotas> for QuotaTarget<St> {
    fn check(&self, new: &Quotas) -> Result<(), ConfigError> {
        new.check(&self.0.limiter)
    }

    fn swap(&self, new: Quotas) {
        self.0.quotas.store(new);
    }
}

/// The quotas of a [`QuotaLayer`]: a default and one per plan. What
/// [`QuotaLayer::reload_handle`] applies; the builder's
/// [`quota`](QuotaLayerBuilder::quota) and [`plan`](QuotaLayerBuilder::plan)
/// fill one too.
#[derive(Clone, Default)]
pub struct Quotas {
    default_quota: Option<Planned>,
    plans: HashMap<Arc<str>, Planned>,
}

impl fmt::Debug for Quotas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut plans: Vec<_> = self.plans.iter().map(|(k, p)| (k, &p.quota)).collect();
        plans.sort_unstable_by(|a, b| a.0.cmp(b.0));
        f.debug_struct("Quotas")
            .field("default", &self.default_quota.as_ref().map(|p| &p.quota))
            .field("plans", &plans)
            .finish()
    }
}

impl Quotas {
    /// No quota yet: add a default, plans, or both.
    pub fn new() -> Self {
        Quotas::default()
    }

    /// The quota for identities whose plan has none of its own, and for
    /// requests without an identity under [`aggregate`](QuotaLayerBuilder::aggregate)
    /// or a [`key`](QuotaLayerBuilder::key) function.
    pub fn quota(mut self, quota: Quota) -> Self {
        self.default_quota = Some(Planned::new(quota));
        self
    }

    /// The quota for identities on `plan`.
    pub fn plan(mut self, plan: &str, quota: Quota) -> Self {
        self.plans.insert(plan.into(), Planned::new(quota));
        self
    }

    /// Fails when there is no quota at all, when two quotas share a name
    /// (they would share keys), or when the store cannot decide one of them
    /// (see [`Store::validate`]).
    fn check<St: Store>(&self, limiter: &Limiter<St>) -> Result<(), ConfigError> {
        if self.default_quota.is_none() && self.plans.is_empty() {
            return Err(ConfigError::new(
                "quota",
                "set a default quota or at least one plan",
            ));
        }
        let quotas = || self.default_quota.iter().chain(self.plans.values());
        let mut names: Vec<&str> = quotas().map(|p| p.quota.name()).collect();
        names.sort_unstable();
        if names.windows(2).any(|w| w[0] == w[1]) {
            return Err(ConfigError::new(
                "quota",
                "two different quotas share a name, so they would share keys",
            ));
        }
        quotas().try_for_each(|p| limiter.validate(&p.quota))
    }
}

impl<S, St> Layer<S> for QuotaLayer<St> {
    type Service = QuotaService<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        QuotaService::new(inner, self.config.clone())
    }
}

/// Builds a [`QuotaLayer`].
pub struct QuotaLayerBuilder<St> {
    limiter: Limiter<St>,
    quotas: Quotas,
    scope: Scope,
    cost: Option<CostFn>,
    headers_on_success: bool,
    refund_inner_refusals: bool,
}

impl<St> fmt::Debug for QuotaLayerBuilder<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaLayerBuilder").finish_non_exhaustive()
    }
}

impl<St: Store> QuotaLayerBuilder<St> {
    fn new(limiter: Limiter<St>) -> Self {
        QuotaLayerBuilder {
            limiter,
            quotas: Quotas::new(),
            scope: Scope::Subject,
            cost: None,
            headers_on_success: false,
            refund_inner_refusals: false,
        }
    }

    /// The quota for identities whose plan has none of its own, and for
    /// requests without an identity under [`aggregate`](QuotaLayerBuilder::aggregate)
    /// or a [`key`](QuotaLayerBuilder::key) function.
    pub fn quota(mut self, quota: Quota) -> Self {
        self.quotas = self.quotas.quota(quota);
        self
    }

    /// The quota for identities on `plan`.
    pub fn plan(mut self, plan: &str, quota: Quota) -> Self {
        self.quotas = self.quotas.plan(plan, quota);
        self
    }

    /// Every quota at once, replacing those given before.
    pub fn quotas(mut self, quotas: Quotas) -> Self {
        self.quotas = quotas;
        self
    }

    /// Keys the quota on the authenticated tenant: one quota shared by a
    /// tenant's users. By default it is keyed on the subject, a per-user
    /// quota.
    pub fn per_tenant(mut self) -> Self {
        self.scope = Scope::Tenant;
        self
    }

    /// Keys the quota on one key for everyone: an aggregate quota.
    pub fn aggregate(mut self) -> Self {
        self.scope = Scope::Aggregate;
        self
    }

    /// Keys the quota on a function of the request; `None` skips the quota.
    ///
    /// Key only on authenticated context (request extensions set by
    /// authentication, or the trusted [`ClientIp`](crate::identity::ClientIp)),
    /// never on a header the caller can invent.
    pub fn key(mut self, key: impl Fn(&Parts) -> Option<Arc<str>> + Send + Sync + 'static) -> Self {
        self.scope = Scope::Custom(Arc::new(key));
        self
    }

    /// The cost of a request, default 1. Read validated values (such as a
    /// page size from [`crate::bounds`]) from the request extensions.
    pub fn cost(mut self, cost: impl Fn(&Parts) -> u64 + Send + Sync + 'static) -> Self {
        self.cost = Some(Arc::new(cost));
        self
    }

    /// Adds `RateLimit-Policy` and `RateLimit` headers to admitted responses
    /// too, not only to refusals. Off by default. They let a client pace
    /// itself before it is refused, at a price on every admitted response:
    /// for a quota of two policies, about 1,400 instructions to write them
    /// and 138 bytes to send, which cost a server whose handler only answers
    /// `ok` about 3% of its requests per second.
    pub fn headers_on_success(mut self, yes: bool) -> Self {
        self.headers_on_success = yes;
        self
    }

    /// Gives this layer's charge back when the request is refused further
    /// in before any work: by another quota layer, a concurrency cap, or a
    /// handler's refused [`JobQueue::submit`](crate::jobs::JobQueue::submit) (a response whose
    /// extensions hold a [`Rejection`](crate::reject::Rejection) of
    /// `QuotaExceeded`, `CostExceedsCapacity`, `Overloaded` or
    /// `LimiterUnavailable`). Without it a per-user quota keeps the charge of
    /// a request the aggregate quota refused, so a refused request costs its
    /// caller. The refund follows the [`Settlement`](crate::quota::Settlement)
    /// rules, and with a cost function it is the same charge: a handler's
    /// settle and this refund never give back twice. Default off: it costs
    /// two allocations per admitted request, about 700 instructions.
    pub fn refund_inner_refusals(mut self, yes: bool) -> Self {
        self.refund_inner_refusals = yes;
        self
    }

    /// The layer. Fails when no quota at all was configured, or when the
    /// store cannot decide one of the quotas (see [`Store::validate`]).
    pub fn build(self) -> Result<QuotaLayer<St>, ConfigError> {
        self.quotas.check(&self.limiter)?;
        Ok(QuotaLayer {
            config: Arc::new(Config {
                limiter: self.limiter,
                quotas: Live::new(self.quotas),
                scope: self.scope,
                cost: self.cost,
                headers_on_success: self.headers_on_success,
                refund_inner_refusals: self.refund_inner_refusals,
            }),
        })
    }
}

/// A configured quota with its `RateLimit-Policy` value, written once.
#[derive(Clone)]
pub(crate) struct Planned {
    pub(crate) quota: Quota,
    /// The value for a verdict that decided every policy of `quota` under
    /// its configured limits, the usual case: see [`headers::values`].
    pub(crate) policy_field: Option<HeaderValue>,
}

impl Planned {
    fn new(quota: Quota) -> Self {
        Planned {
            policy_field: headers::policy_field(&quota),
            quota,
        }
    }
}

impl<St> Config<St> {
    /// True when resolving a request reads more than its extensions: a key
    /// or cost function, which takes the request's [`Parts`].
    pub(crate) fn reads_parts(&self) -> bool {
        matches!(self.scope, Scope::Custom(_)) || self.cost.is_some()
    }

    /// The quota of `quotas` and the key for a request, or why there is
    /// none. `parts` is the request's head, needed only when
    /// [`Config::reads_parts`]; its extensions are `extensions`.
    pub(crate) fn resolve<'q>(
        &self,
        quotas: &'q Quotas,
        extensions: &Extensions,
        parts: Option<&Parts>,
    ) -> Resolved<'q> {
        // An aggregate or custom key with no plans reads no identity: a
        // lookup in the extensions saved.
        let identity =
            if quotas.plans.is_empty() && !matches!(self.scope, Scope::Subject | Scope::Tenant) {
                None
            } else {
                extensions.get::<Identity>()
            };
        let planned = identity
            .and_then(|id| quotas.plans.get(id.plan()))
            .or(quotas.default_quota.as_ref());
        let key = match (&self.scope, parts) {
            (Scope::Subject, _) => identity.map(|id| Cow::Owned(bounded(id.subject_arc()))),
            (Scope::Tenant, _) => identity.map(|id| Cow::Owned(bounded(id.tenant_arc()))),
            (Scope::Aggregate, _) => Some(Cow::Borrowed(aggregate_key())),
            (Scope::Custom(f), Some(parts)) => match f(parts) {
                Some(key) => Some(Cow::Owned(bounded(&key))),
                None => return Resolved::Skip,
            },
            (Scope::Custom(_), None) => unreachable!("a key function reads the parts"),
        };
        match (planned, key) {
            (_, None) => Resolved::NoIdentity,
            (None, _) => Resolved::Skip,
            (Some(planned), Some(key)) => {
                let cost = match (&self.cost, parts) {
                    (Some(f), Some(parts)) => f(parts),
                    (Some(_), None) => unreachable!("a cost function reads the parts"),
                    (None, _) => 1,
                };
                Resolved::Apply { planned, key, cost }
            }
        }
    }
}

/// Keys longer than this many bytes are stored by their digest.
const MAX_KEY_BYTES: usize = 64;

/// What begins a stored digest.
const DIGEST_MARK: char = '#';

/// The key a store keeps for `key`: the key itself when it has at most
/// [`MAX_KEY_BYTES`] bytes, else `#` and its SHA-256 in hex (65 bytes). A
/// key that begins with `#` is always digested, so no key as given can
/// spell another's digest.
#[inline]
fn bounded(key: &Arc<str>) -> Arc<str> {
    if key.len() <= MAX_KEY_BYTES && !key.starts_with(DIGEST_MARK) {
        return key.clone();
    }
    use sha2::Digest;
    use std::fmt::Write;
    let mut digested = String::with_capacity(1 + 64);
    digested.push(DIGEST_MARK);
    for byte in sha2::Sha256::digest(key.as_bytes()) {
        let _ = write!(digested, "{byte:02x}");
    }
    digested.into()
}

/// The one key of [`QuotaLayerBuilder::aggregate`], shared by every request without a
/// count of its users: requests on every core would contend on that count.
fn aggregate_key() -> &'static Arc<str> {
    static KEY: std::sync::OnceLock<Arc<str>> = std::sync::OnceLock::new();
    KEY.get_or_init(|| "*".into())
}

pub(crate) enum Resolved<'a> {
    Apply {
        planned: &'a Planned,
        key: Cow<'static, Arc<str>>,
        cost: u64,
    },
    /// No quota applies (no plan quota and no default).
    Skip,
    /// The scope needs an identity and there is none.
    NoIdentity,
}
