//! `RateLimit-Policy` and `RateLimit` structured fields, per the IETF httpapi
//! ratelimit-headers draft: one list member per policy, named by the policy.
//!
//! ```text
//! RateLimit-Policy: "per-minute";q=100;w=60, "burst";q=20;w=12
//! RateLimit: "per-minute";r=0;t=57, "burst";r=3;t=10
//! ```
//!
//! `q` is the quota, `w` the window in seconds (for a token bucket, the time to
//! refill from empty), `r` the remaining quota and `t` the seconds until it is
//! whole again, rounded up.
//!
//! When the store could not decide and the policies fail closed (a 503), no
//! policy has a current state: each enforcing policy is advertised with its
//! configured numbers, `r=0`, and `t` the refusal's `Retry-After`.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::quota::{Outcome, Quota, Verdict};
use crate::reject::ceil_secs;

/// `RateLimit-Policy`.
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`.
pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

impl Verdict {
    /// Appends the `RateLimit-Policy` and `RateLimit` fields for this verdict
    /// on `quota`: its enforcing policies only, since shadow policies never
    /// shape the answer. [`QuotaLayer`](crate::quota::QuotaLayer) sends them
    /// itself; a handler that checks a [`Limiter`](crate::quota::Limiter)
    /// itself calls this on its own refusal.
    ///
    /// ```text
    /// RateLimit-Policy: "per-minute";q=100;w=60, "burst";q=20;w=12
    /// RateLimit: "per-minute";r=0;t=57, "burst";r=3;t=10
    /// ```
    ///
    /// `q` is the quota, `w` the window in seconds (for a token bucket, the
    /// time to refill from empty), `r` the remaining quota and `t` the
    /// seconds until it is whole again, rounded up (IETF httpapi
    /// ratelimit-headers draft). When the store could not decide and the
    /// policies fail closed (a 503), each enforcing policy is advertised with
    /// its configured numbers, `r=0`, and `t` the refusal's `Retry-After`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::quota::{Limiter, MemoryStore, Policy, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let quota = Quota::new("items", [Policy::fixed_window("per-minute", 10, Duration::from_secs(60))?])?;
    /// let limiter = Limiter::new(MemoryStore::new());
    /// let verdict = limiter.check(&quota, &"alice".into(), 11).await;
    /// let mut fields = http::HeaderMap::new();
    /// verdict.insert_headers(&quota, &mut fields);
    /// assert!(fields["ratelimit-policy"].to_str().unwrap().starts_with("\"per-minute\";q=10"));
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// # })?;
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn insert_headers(&self, quota: &Quota, headers: &mut HeaderMap) {
        append(headers, values(quota, self, None));
    }
}

/// Appends the `RateLimit-Policy` and `RateLimit` values that [`values`]
/// made, keeping the fields already there: those of a quota further in, or
/// of the handler, stay beside them.
pub(crate) fn append(headers: &mut HeaderMap, values: Option<[HeaderValue; 2]>) {
    if let Some([policy, state]) = values {
        headers.append(RATELIMIT_POLICY.clone(), policy);
        headers.append(RATELIMIT.clone(), state);
    }
}

/// The `RateLimit-Policy` value of `quota` as configured: each enforcing
/// policy with its limit and window. `None` when every policy is a shadow.
pub(crate) fn policy_field(quota: &Quota) -> Option<HeaderValue> {
    let mut policy = Field::default();
    for p in quota.policies().iter().filter(|p| !p.is_shadow()) {
        policy.policy(p.name(), p.algorithm().limit(), p.algorithm().window());
    }
    if policy.is_empty() {
        return None;
    }
    policy.value()
}

/// The values of `RateLimit-Policy` and `RateLimit` for a verdict on
/// `quota`, as [`insert`] appends them; `None` when there is nothing to
/// advertise. Written into a buffer on the stack with no formatting
/// machinery: one allocation per value written, the value's own.
///
/// `configured` is [`policy_field`] of `quota`, when the caller keeps it:
/// a verdict that decided every policy under its configured limit (not a
/// local share) advertises exactly that, so it is cloned, not written.
pub(crate) fn values(
    quota: &Quota,
    verdict: &Verdict,
    configured: Option<&HeaderValue>,
) -> Option<[HeaderValue; 2]> {
    let mut state = Field::default();
    let mut as_configured =
        verdict.local_quota().is_none() && verdict.decisions().len() == quota.policies().len();
    for (p, d) in verdict.named(quota) {
        // Policy names are [A-Za-z0-9._-], safe inside an sf-string.
        state.member(p.name());
        state.param(b";r=", d.remaining);
        state.param(b";t=", ceil_secs(d.reset));
        as_configured &= d.limit == p.algorithm().limit();
    }
    if !state.is_empty() {
        let policy = match configured {
            Some(value) if as_configured => value.clone(),
            _ => {
                let mut policy = Field::default();
                for (p, d) in verdict.named(quota) {
                    policy.policy(p.name(), d.limit, p.algorithm().window());
                }
                policy.value()?
            }
        };
        return Some([policy, state.value()?]);
    }
    // No policy decided: the store failed and the policies fail closed.
    // Advertise them as configured, with nothing remaining until the
    // refusal's wait.
    let Outcome::Unavailable { wait } = verdict.outcome() else {
        return None;
    };
    let t = crate::reject::retry_after_secs(*wait);
    for p in quota.policies().iter().filter(|p| !p.is_shadow()) {
        state.member(p.name());
        state.param(b";r=", 0);
        state.param(b";t=", t);
    }
    if state.is_empty() {
        return None;
    }
    let policy = match configured {
        Some(value) => value.clone(),
        None => policy_field(quota)?,
    };
    Some([policy, state.value()?])
}

/// A structured field list being written: `"name";k=v;k=v, "name";...`.
/// On the stack up to [`Field::STACK`] bytes (two members of the longest
/// names and numbers), on the heap beyond.
struct Field {
    stack: [u8; Field::STACK],
    len: usize,
    /// Everything written, once it outgrew `stack`.
    heap: Vec<u8>,
}

impl Default for Field {
    fn default() -> Self {
        Field {
            stack: [0; Field::STACK],
            len: 0,
            heap: Vec::new(),
        }
    }
}

impl Field {
    const STACK: usize = 256;

    fn is_empty(&self) -> bool {
        self.len == 0 && self.heap.is_empty()
    }

    fn bytes(&self) -> &[u8] {
        if self.heap.is_empty() {
            &self.stack[..self.len]
        } else {
            &self.heap
        }
    }

    // Inlined, so that the constant pieces are written as stores of their
    // own size rather than through a call to `memcpy`.
    #[inline(always)]
    fn put(&mut self, bytes: &[u8]) {
        if self.heap.is_empty() {
            let end = self.len + bytes.len();
            if let Some(free) = self.stack.get_mut(self.len..end) {
                free.copy_from_slice(bytes);
                self.len = end;
                return;
            }
            self.heap.extend_from_slice(&self.stack[..self.len]);
        }
        self.heap.extend_from_slice(bytes);
    }

    /// Starts a list member named `name`.
    fn member(&mut self, name: &str) {
        if !self.is_empty() {
            self.put(b", ");
        }
        self.put(b"\"");
        self.put(name.as_bytes());
        self.put(b"\"");
    }

    /// Appends a `RateLimit-Policy` member: `"name";q=LIMIT;w=WINDOW`.
    fn policy(&mut self, name: &str, limit: u64, window: std::time::Duration) {
        self.member(name);
        self.param(b";q=", limit);
        self.param(b";w=", ceil_secs(window));
    }

    /// Appends `key` (such as `;q=`) and `n` in decimal.
    fn param(&mut self, key: &[u8], n: u64) {
        self.put(key);
        self.put(itoa::Buffer::new().format(n).as_bytes());
    }

    fn value(&self) -> Option<HeaderValue> {
        HeaderValue::from_maybe_shared(Bytes::copy_from_slice(self.bytes())).ok()
    }
}

/// Both fields for a refusal by a concurrency cap of `cap` requests named
/// `name`: `"NAME";q=CAP;qu="concurrent-requests"`, none remaining until the
/// refusal's wait.
pub(crate) fn insert_concurrency(
    headers: &mut HeaderMap,
    name: &str,
    cap: usize,
    wait: std::time::Duration,
) {
    let policy = format!("\"{name}\";q={cap};qu=\"concurrent-requests\"");
    let state = format!("\"{name}\";r=0;t={}", ceil_secs(wait).max(1));
    for (header, value) in [(&RATELIMIT_POLICY, policy), (&RATELIMIT, state)] {
        if let Ok(value) = HeaderValue::try_from(value) {
            headers.append(header.clone(), value);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;
    use std::sync::Arc;
    use std::time::Duration;

    use futures_util::FutureExt;
    use proptest::prelude::*;

    use super::*;
    use crate::quota::{Limiter, MemoryStore, Policy, QuotaDecision, Store, StoreError};

    /// A store that cannot decide.
    #[derive(Clone)]
    struct Down;

    impl Store for Down {
        type DecideFuture = std::future::Ready<Result<QuotaDecision, StoreError>>;
        type SettleFuture = std::future::Ready<Result<QuotaDecision, StoreError>>;

        fn decide(&self, _: &Quota, _: &Arc<str>, _: u64) -> Self::DecideFuture {
            std::future::ready(Err(StoreError::Unavailable {
                message: "down".into(),
            }))
        }

        fn peek(&self, quota: &Quota, key: &Arc<str>, cost: u64) -> Self::DecideFuture {
            self.decide(quota, key, cost)
        }

        fn settle(
            &self,
            _: &Quota,
            _: &Arc<str>,
            decision: &QuotaDecision,
            _: i64,
        ) -> Self::SettleFuture {
            std::future::ready(Ok(decision.clone()))
        }
    }

    fn policy(i: usize, (kind, limit, secs, shadow, mode): (u8, u64, u64, bool, u8)) -> Policy {
        let name = format!("p{i}");
        let window = Duration::from_secs(secs);
        let policy = match kind {
            0 => Policy::fixed_window(&name, limit, window),
            1 => Policy::sliding_log(&name, limit, window),
            2 => Policy::token_bucket(&name, limit, limit, window),
            _ => Policy::sliding_window(&name, limit, window),
        }
        .unwrap();
        let policy = match mode {
            0 => policy.fail_open(),
            1 => policy.fail_closed(),
            _ => policy.fail_to_local_share(NonZeroU64::new(3).unwrap()),
        };
        if shadow {
            policy.shadow()
        } else {
            policy
        }
    }

    proptest! {
        /// The `RateLimit-Policy` written once per quota is exactly what
        /// each verdict would have written for itself: through admissions,
        /// refusals, costs over a limit, shadow policies, and a store that
        /// fails over to a local share, fails open or fails closed.
        #[test]
        fn the_configured_policy_field_is_what_every_verdict_advertises(
            policies in proptest::collection::vec(
                (0u8..4, 1u64..6, 1u64..120, any::<bool>(), 0u8..3),
                1..4,
            ),
            steps in proptest::collection::vec((0u64..8, any::<bool>()), 1..40),
        ) {
            let quota = Quota::new(
                "q",
                policies.into_iter().enumerate().map(|(i, p)| policy(i, p)),
            )
            .unwrap();
            let configured = policy_field(&quota);
            let up = Limiter::new(MemoryStore::new());
            let down = Limiter::new(Down);
            let key: Arc<str> = "alice".into();
            for (cost, store_up) in steps {
                let verdict = if store_up {
                    up.check(&quota, &key, cost).now_or_never().unwrap()
                } else {
                    down.check(&quota, &key, cost).now_or_never().unwrap()
                };
                prop_assert_eq!(
                    values(&quota, &verdict, configured.as_ref()),
                    values(&quota, &verdict, None),
                    "{:?}", verdict
                );
            }
        }
    }
}
