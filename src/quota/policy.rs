use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::duration_to_micros;
use crate::quota::algorithm::{Algorithm, FixedWindow, SlidingLog, SlidingWindow, TokenBucket};
use crate::ConfigError;

/// What a policy does when its store cannot decide in time, as chosen by
/// [`Policy::fail_open`], [`Policy::fail_closed`] (the default) or
/// [`Policy::fail_to_local_share`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum FailureMode {
    /// Admit.
    Open,
    /// Refuse with 503 and `Retry-After`.
    #[default]
    Closed,
    /// Decide against an in-memory limiter holding `1 / divisor` of the budget.
    LocalShare { divisor: NonZeroU64 },
}

/// One named limit: an algorithm, its numbers, and how it behaves.
///
/// ```
/// use tower_admission::quota::Policy;
/// use std::time::Duration;
///
/// let per_minute = Policy::sliding_log("per-minute", 100, Duration::from_secs(60))?;
/// let burst = Policy::token_bucket("burst", 20, 100, Duration::from_secs(60))?;
/// assert_eq!(per_minute.name(), "per-minute");
/// # Ok::<(), tower_admission::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    name: Arc<str>,
    algorithm: Algorithm,
    shadow: bool,
    failure_mode: FailureMode,
}

impl Policy {
    /// At most `limit` per clock-aligned window `[kW, (k+1)W)`.
    ///
    /// The documented weakness: `limit` admissions just before a boundary and
    /// `limit` more just after it pass `2 * limit` in a very short interval.
    ///
    /// **Changed numbers.** The state records its window's start and end in
    /// µs, so it is read correctly under any later window length. A state
    /// built under another window carries its count into the new policy's
    /// aligned window that holds `now`: it never waits longer than the new
    /// window and never admits more than the new limit beyond what it has
    /// counted. A lower limit applies at once to the count already held. A
    /// settle never realigns a live window of another length (see
    /// [`Settlement`](crate::quota::Settlement)).
    pub fn fixed_window(name: &str, limit: u64, window: Duration) -> Result<Self, ConfigError> {
        let window = window_micros(window)?;
        Self::new(
            name,
            Algorithm::FixedWindow(FixedWindow::new(limit, window)?),
        )
    }

    /// Exactly `limit` in every interval `(t - window, t]`. A sliding log
    /// keeps one entry per admission, so `limit` is at most 1,000,000.
    ///
    #[doc = include_str!("../../docs/sliding_log.md")]
    pub fn sliding_log(name: &str, limit: u64, window: Duration) -> Result<Self, ConfigError> {
        let window = window_micros(window)?;
        Self::new(name, Algorithm::SlidingLog(SlidingLog::new(limit, window)?))
    }

    /// A bucket of `capacity` tokens refilled continuously with `refill` tokens
    /// per `period`, exactly (any positive rate, no rounding drift). One
    /// token per unit of cost.
    ///
    #[doc = include_str!("../../docs/token_bucket.md")]
    pub fn token_bucket(
        name: &str,
        capacity: u64,
        refill: u64,
        period: Duration,
    ) -> Result<Self, ConfigError> {
        let period = micros_of("period", period)?;
        Self::new(
            name,
            Algorithm::TokenBucket(TokenBucket::new(capacity, refill, period)?),
        )
    }

    /// About `limit` per `window`: a weighted window counter estimates the
    /// count over the last `W` as `previous * (1 - elapsed / W) + current`
    /// and admits while the estimate plus the cost stays at or below `limit`.
    ///
    /// **An approximation.** It assumes the previous window's admissions were
    /// spread evenly, so it can admit more than `limit` in some interval of
    /// length `W` (at most `2 * limit` in the worst case). Use
    /// [`sliding_log`](Self::sliding_log) when the cap must be exact. A
    /// refusal waits at most `2W`.
    ///
    /// **Changed numbers.** The state records its current window's start and
    /// end in µs. Under another window length, both counts carry into the new
    /// policy's aligned window that holds `now` (if the old window has ended,
    /// its count becomes the previous one when it ended less than a new window
    /// ago, and is dropped otherwise).
    pub fn sliding_window(name: &str, limit: u64, window: Duration) -> Result<Self, ConfigError> {
        let window = window_micros(window)?;
        Self::new(
            name,
            Algorithm::SlidingWindow(SlidingWindow::new(limit, window)?),
        )
    }

    /// A policy from a checked algorithm value, checking the name.
    fn new(name: &str, algorithm: Algorithm) -> Result<Self, ConfigError> {
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !valid {
            return Err(ConfigError::new(
                "name",
                format!("{name:?} must be 1 to 64 characters of [A-Za-z0-9._-]"),
            ));
        }
        Ok(Policy {
            name: name.into(),
            algorithm,
            shadow: false,
            failure_mode: FailureMode::default(),
        })
    }

    /// Shadow mode: decide, log and count, but never refuse.
    pub fn shadow(mut self) -> Self {
        self.shadow = true;
        self
    }

    /// When the store cannot decide in time, admit. **Breaks a strict cap**:
    /// while the store is down this policy limits nothing.
    pub fn fail_open(mut self) -> Self {
        self.failure_mode = FailureMode::Open;
        self
    }

    /// When the store cannot decide in time, refuse with 503 and
    /// `Retry-After`. The default.
    pub fn fail_closed(mut self) -> Self {
        self.failure_mode = FailureMode::Closed;
        self
    }

    /// When the store cannot decide in time, decide against an in-memory
    /// limiter holding `1 / divisor` of the budget: with the budget divided
    /// by the expected number of instances, the fleet as a whole stays near
    /// the cap.
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use std::time::Duration;
    /// use tower_admission::quota::Policy;
    ///
    /// let instances = NonZeroU64::new(10).unwrap();
    /// let per_minute = Policy::sliding_log("per-minute", 1_000, Duration::from_secs(60))?
    ///     .fail_to_local_share(instances);
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn fail_to_local_share(mut self, divisor: NonZeroU64) -> Self {
        self.failure_mode = FailureMode::LocalShare { divisor };
        self
    }

    /// The policy's name, used in headers, problem bodies and logs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name as a shared string.
    pub fn name_arc(&self) -> &Arc<str> {
        &self.name
    }

    /// The algorithm and its numbers.
    #[inline]
    pub(crate) fn algorithm(&self) -> &Algorithm {
        &self.algorithm
    }

    /// The most cost the policy can ever admit at once: the limit of a
    /// window or log, the capacity of a token bucket. The `q` of the
    /// `RateLimit-Policy` field.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::quota::Policy;
    ///
    /// let burst = Policy::token_bucket("burst", 20, 100, Duration::from_secs(60))?;
    /// assert_eq!(burst.limit(), 20);
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn limit(&self) -> u64 {
        self.algorithm.limit()
    }

    /// The window, or for a token bucket the time to refill from empty
    /// (here 20 tokens at 100 a minute: 12 s). The `w` of the
    /// `RateLimit-Policy` field.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::quota::Policy;
    ///
    /// let burst = Policy::token_bucket("burst", 20, 100, Duration::from_secs(60))?;
    /// assert_eq!(burst.window(), Duration::from_secs(12));
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn window(&self) -> Duration {
        self.algorithm.window()
    }

    /// True in shadow mode.
    #[inline]
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }

    /// What the policy does when its store cannot decide in time.
    #[inline]
    pub(crate) fn failure_mode(&self) -> FailureMode {
        self.failure_mode
    }

    /// This policy with its limit divided by `divisor` (at least 1).
    pub fn share(&self, divisor: NonZeroU64) -> Policy {
        Policy {
            algorithm: self.algorithm.share(divisor.get()),
            ..self.clone()
        }
    }
}

fn window_micros(window: Duration) -> Result<u64, ConfigError> {
    micros_of("window", window)
}

/// A span of at least 1 µs and at most one year, in µs.
fn micros_of(field: &'static str, span: Duration) -> Result<u64, ConfigError> {
    let micros = duration_to_micros(span);
    if micros == 0 {
        return Err(ConfigError::new(field, "must be at least 1 µs"));
    }
    if micros > 366 * 24 * 3600 * 1_000_000 {
        return Err(ConfigError::new(field, "must be at most one year"));
    }
    Ok(micros)
}

/// The policies applied together to one key: a request is admitted only if
/// all of them admit it, and a refusal by one consumes nothing from the others.
///
/// Atomicity: a store keeps every policy of a quota in one entry (memory: one
/// map slot under one lock; Redis: one key decided by one script), checks them
/// all, and records the admission in all of them only if none refused.
///
/// ```
/// use tower_admission::quota::{Policy, Quota};
/// use std::time::Duration;
///
/// let free = Quota::new("free", [
///     Policy::sliding_log("per-minute", 100, Duration::from_secs(60))?,
///     Policy::token_bucket("burst", 20, 100, Duration::from_secs(60))?,
/// ])?;
/// assert_eq!(free.policies().len(), 2);
/// # Ok::<(), tower_admission::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota {
    name: Arc<str>,
    /// A fixed hash of the name and the policies' algorithm kinds, computed
    /// once: it identifies the quota's state layout in stores.
    layout: u64,
    policies: Arc<[Policy]>,
    /// Every policy is a shadow: the quota only watches.
    shadow_only: bool,
    /// The keys of `tower_admission_quota_decisions_total` for this quota,
    /// admitted then refused: built once, not at every decision.
    #[cfg(feature = "metrics")]
    decision_keys: Arc<[metrics::Key; 2]>,
}

/// A fixed hash of a quota's name and its policies' algorithm kinds. Two
/// quotas with the same name and kinds share state in a store (their numbers
/// may differ); any other change starts from fresh state.
pub(crate) fn layout_hash(name: &str, policies: &[Policy]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    name.hash(&mut hasher);
    for p in policies {
        std::mem::discriminant(p.algorithm()).hash(&mut hasher);
    }
    hasher.finish()
}

impl Quota {
    /// A quota named `name` (part of every key) with one or more policies.
    pub fn new(
        name: &str,
        policies: impl IntoIterator<Item = Policy>,
    ) -> Result<Self, ConfigError> {
        // Same character rules as policy names; the name is part of store keys.
        let name = Policy::new(name, Algorithm::FixedWindow(FixedWindow::new(1, 1)?))?.name;
        let policies: Arc<[Policy]> = policies.into_iter().collect();
        if policies.is_empty() {
            return Err(ConfigError::new(
                "policies",
                "a quota needs at least one policy",
            ));
        }
        if policies.len() > 16 {
            return Err(ConfigError::new(
                "policies",
                "a quota has at most 16 policies",
            ));
        }
        for (i, p) in policies.iter().enumerate() {
            if policies[..i].iter().any(|q| q.name == p.name) {
                return Err(ConfigError::new(
                    "policies",
                    format!("policy name {:?} is used twice", p.name()),
                ));
            }
        }
        Ok(Quota {
            layout: layout_hash(&name, &policies),
            shadow_only: policies.iter().all(Policy::is_shadow),
            #[cfg(feature = "metrics")]
            decision_keys: Arc::new(["admitted", "refused"].map(|result| {
                let labels = vec![
                    metrics::Label::new("quota", name.clone()),
                    metrics::Label::new("result", result),
                ];
                metrics::Key::from_parts("tower_admission_quota_decisions_total", labels)
            })),
            name,
            policies,
        })
    }

    /// The quota's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The quota's name as a shared string.
    pub fn name_arc(&self) -> &Arc<str> {
        &self.name
    }

    /// The key of this quota's `tower_admission_quota_decisions_total`
    /// counter for an admission or a refusal.
    #[cfg(feature = "metrics")]
    pub(crate) fn decision_key(&self, admitted: bool) -> &metrics::Key {
        &self.decision_keys[usize::from(!admitted)]
    }

    /// The layout hash, for stores: see [`layout_hash`].
    #[inline]
    pub(crate) fn layout(&self) -> u64 {
        self.layout
    }

    /// True when every policy is a shadow: the quota refuses nothing.
    #[inline]
    pub(crate) fn is_shadow_only(&self) -> bool {
        self.shadow_only
    }

    /// The policies, in order.
    #[inline]
    pub fn policies(&self) -> &[Policy] {
        &self.policies
    }

    /// This quota with every limit divided by `divisor` (at least 1 each).
    pub fn share(&self, divisor: NonZeroU64) -> Quota {
        Quota {
            name: self.name.clone(),
            layout: self.layout,
            policies: self.policies.iter().map(|p| p.share(divisor)).collect(),
            shadow_only: self.shadow_only,
            #[cfg(feature = "metrics")]
            decision_keys: self.decision_keys.clone(),
        }
    }
}
