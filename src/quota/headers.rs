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

use http::{HeaderMap, HeaderName, HeaderValue};
use std::fmt::Write;

use crate::quota::{Quota, Verdict};

/// `RateLimit-Policy`.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Appends both fields for a verdict on `quota`: its enforcing policies
/// only, since shadow policies never shape the answer.
pub(crate) fn insert(headers: &mut HeaderMap, quota: &Quota, verdict: &Verdict) {
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
        return;
    }
    for (header, value) in [(&RATELIMIT_POLICY, policy), (&RATELIMIT, state)] {
        if let Ok(value) = HeaderValue::try_from(value) {
            headers.append(header.clone(), value);
        }
    }
}

fn ceil_secs(d: std::time::Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}
