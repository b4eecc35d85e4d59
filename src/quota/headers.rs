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
use smallvec::SmallVec;

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
    append(headers, values(quota, verdict));
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

/// The values of `RateLimit-Policy` and `RateLimit` for a verdict on
/// `quota`, as [`insert`] appends them; `None` when there is nothing to
/// advertise. Written into a buffer on the stack with no formatting
/// machinery: one allocation per value, the value's own.
pub(crate) fn values(quota: &Quota, verdict: &Verdict) -> Option<[HeaderValue; 2]> {
    let mut policy = Field::default();
    let mut state = Field::default();
    for (p, d) in verdict.named(quota) {
        let name = p.name();
        let window = ceil_secs(p.algorithm().window());
        // Policy names are [A-Za-z0-9._-], safe inside an sf-string.
        policy.member(name);
        policy.param(b";q=", d.limit);
        policy.param(b";w=", window);
        state.member(name);
        state.param(b";r=", d.remaining);
        state.param(b";t=", ceil_secs(d.reset));
    }
    if policy.is_empty() {
        // No policy decided: the store failed and the policies fail closed.
        // Advertise them with nothing remaining until the refusal's wait.
        let Outcome::Unavailable { wait } = verdict.outcome() else {
            return None;
        };
        let t = ceil_secs(*wait).max(1);
        for p in quota.policies().iter().filter(|p| !p.is_shadow()) {
            let name = p.name();
            policy.member(name);
            policy.param(b";q=", p.algorithm().limit());
            policy.param(b";w=", ceil_secs(p.algorithm().window()));
            state.member(name);
            state.param(b";r=", 0);
            state.param(b";t=", t);
        }
        if policy.is_empty() {
            return None;
        }
    }
    Some([policy.value()?, state.value()?])
}

/// A structured field list being written: `"name";k=v;k=v, "name";...`.
#[derive(Default)]
struct Field(SmallVec<[u8; 128]>);

impl Field {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Starts a list member named `name`.
    fn member(&mut self, name: &str) {
        if !self.0.is_empty() {
            self.0.extend_from_slice(b", ");
        }
        self.0.push(b'"');
        self.0.extend_from_slice(name.as_bytes());
        self.0.push(b'"');
    }

    /// Appends `key` (such as `;q=`) and `n` in decimal.
    fn param(&mut self, key: &[u8], n: u64) {
        self.0.extend_from_slice(key);
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut n = n;
        loop {
            at -= 1;
            digits[at] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.0.extend_from_slice(&digits[at..]);
    }

    fn value(&self) -> Option<HeaderValue> {
        HeaderValue::from_maybe_shared(Bytes::copy_from_slice(&self.0)).ok()
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
