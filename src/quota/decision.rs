use std::time::Duration;

use smallvec::SmallVec;

use crate::quota::Quota;

/// One policy's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// True if this policy admits the request.
    pub admitted: bool,
    /// The most cost the policy admits at once (limit or capacity).
    pub limit: u64,
    /// Cost still available now, after this request if admitted.
    pub remaining: u64,
    /// On a refusal, the exact wait until the same request can succeed.
    /// `None` when admitted, or when the cost exceeds the limit so no wait helps.
    pub retry_after: Option<Duration>,
    /// Time until the policy is back to its full limit.
    pub reset: Duration,
}

impl Decision {
    /// True when refused because the cost is more than the policy can ever admit.
    pub fn cost_exceeds_limit(&self) -> bool {
        !self.admitted && self.retry_after.is_none()
    }
}

/// Decisions of a quota's policies, in policy order. Inline up to two.
pub type Decisions = SmallVec<[Decision; 2]>;

/// The answer of every policy of a quota to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaDecision {
    /// True if the request is admitted: no enforcing (non-shadow) policy refused.
    pub admitted: bool,
    /// Each policy's decision, in the order of [`Quota::policies`].
    pub decisions: Decisions,
}

impl QuotaDecision {
    /// The answer of a quota of one policy: admitted if the policy admits,
    /// or if it only watches (shadow).
    #[inline]
    pub(crate) fn single(decision: Decision, shadow: bool) -> Self {
        let mut decisions = Decisions::new();
        decisions.push(decision);
        QuotaDecision {
            admitted: decisions[0].admitted || shadow,
            decisions,
        }
    }

    /// The longest wait among the refusing policies: the exact wait until all
    /// of them could admit the request. `None` if admitted.
    pub fn retry_after(&self) -> Option<Duration> {
        if self.admitted {
            return None;
        }
        self.decisions.iter().filter_map(|d| d.retry_after).max()
    }

    /// Each decision with the name of its policy.
    pub fn named<'a>(&'a self, quota: &'a Quota) -> impl Iterator<Item = (&'a str, &'a Decision)> {
        quota
            .policies()
            .iter()
            .map(|p| p.name())
            .zip(&self.decisions)
    }
}
