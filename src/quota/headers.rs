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

use http::{HeaderMap, HeaderName, HeaderValue};
use std::fmt::Write;

use crate::quota::{Outcome, Quota, Verdict};

/// `RateLimit-Policy`.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Appends both fields for a verdict on `quota`: its enforcing policies
/// only, since shadow policies never shape the answer. [`QuotaLayer`](crate::quota::QuotaLayer)
/// calls it; a handler that checks a [`Limiter`](crate::quota::Limiter)
/// itself calls it on its own refusal.
///
/// ```
/// use std::time::Duration;
/// use tower_admission::quota::{headers, Limiter, MemoryStore, Policy, Quota};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let quota = Quota::new("items", [Policy::fixed_window("per-minute", 10, Duration::from_secs(60))?])?;
/// let limiter = Limiter::new(MemoryStore::new());
/// let verdict = limiter.check(&quota, &"alice".into(), 11).await;
/// let mut fields = http::HeaderMap::new();
/// headers::insert(&mut fields, &quota, &verdict);
/// assert!(fields[&headers::RATELIMIT_POLICY].to_str().unwrap().starts_with("\"per-minute\";q=10"));
/// # Ok::<(), tower_admission::ConfigError>(())
/// # })?;
/// # Ok::<(), tower_admission::ConfigError>(())
/// ```
pub fn insert(headers: &mut HeaderMap, quota: &Quota, verdict: &Verdict) {
    let mut policy = String::new();
    let mut state = String::new();
    for (p, d) in verdict.named(quota) {
        let name = p.name();
        let window = ceil_secs(p.algorithm().window());
        let sep = if policy.is_empty() { "" } else { ", " };
        // Policy names are [A-Za-z0-9._-], safe inside an sf-string.
        let _ = write!(policy, "{sep}\"{name}\";q={};w={window}", d.limit);
        let _ = write!(
            state,
            "{sep}\"{name}\";r={};t={}",
            d.remaining,
            ceil_secs(d.reset)
        );
    }
    if policy.is_empty() {
        // No policy decided: the store failed and the policies fail closed.
        // Advertise them with nothing remaining until the refusal's wait.
        let Outcome::Unavailable { wait } = verdict.outcome() else {
            return;
        };
        let t = ceil_secs(*wait).max(1);
        for p in quota.policies().iter().filter(|p| !p.is_shadow()) {
            let name = p.name();
            let window = ceil_secs(p.algorithm().window());
            let sep = if policy.is_empty() { "" } else { ", " };
            let _ = write!(
                policy,
                "{sep}\"{name}\";q={};w={window}",
                p.algorithm().limit()
            );
            let _ = write!(state, "{sep}\"{name}\";r=0;t={t}");
        }
        if policy.is_empty() {
            return;
        }
    }
    for (header, value) in [(&RATELIMIT_POLICY, policy), (&RATELIMIT, state)] {
        if let Ok(value) = HeaderValue::try_from(value) {
            headers.append(header.clone(), value);
        }
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

fn ceil_secs(d: std::time::Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}
