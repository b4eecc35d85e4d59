use std::time::Duration;

use smallvec::SmallVec;

use crate::quota::algorithm::Hold;
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
pub(crate) type Decisions = SmallVec<[Decision; 2]>;

/// What one admission holds in each policy of a quota, in policy order:
/// the store's receipt, so that a settlement gives back only what this
/// charge still holds. Empty when nothing was recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Holds(pub(crate) SmallVec<[Hold; 2]>);

impl Holds {
    /// These holds as if a settle of `delta` had given back all it asked
    /// for: a refund of `-delta` taken off each policy's hold. A store gives
    /// back at most that, so the result never holds more than the store
    /// does. A charge (`delta > 0`) leaves them as they are.
    pub(crate) fn refunded(&self, delta: i64) -> Holds {
        let refund = delta.min(0).unsigned_abs();
        Holds(
            self.0
                .iter()
                .map(|hold| Hold {
                    amount: hold.amount.saturating_sub(refund),
                    ..*hold
                })
                .collect(),
        )
    }
}

/// The answer of every policy of a quota to one request, and the store's
/// receipt of what the admission holds in each policy, which
/// [`Store::settle`](crate::quota::Store::settle) reads. Equal decisions
/// hold the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaDecision {
    /// True if the request is admitted: no enforcing (non-shadow) policy refused.
    pub admitted: bool,
    /// Each policy's decision, in the order of [`Quota::policies`].
    pub decisions: Decisions,
    /// What the admission holds in each policy; empty on a refusal.
    pub(crate) holds: Holds,
}

impl QuotaDecision {
    /// A decision with no receipt of what it holds: the answer of a store of
    /// another backend, which keeps its own record for its settle.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_admission::quota::{Decision, QuotaDecision};
    ///
    /// let decision = Decision {
    ///     admitted: true,
    ///     limit: 10,
    ///     remaining: 9,
    ///     retry_after: None,
    ///     reset: Duration::from_secs(6),
    /// };
    /// let answer = QuotaDecision::new(true, [decision]);
    /// assert_eq!(answer.decisions[0].remaining, 9);
    /// ```
    pub fn new(admitted: bool, decisions: impl IntoIterator<Item = Decision>) -> Self {
        QuotaDecision {
            admitted,
            decisions: decisions.into_iter().collect(),
            holds: Holds::default(),
        }
    }

    /// This decision holding `holds` instead.
    pub(crate) fn holding(&self, holds: Holds) -> Self {
        QuotaDecision {
            admitted: self.admitted,
            decisions: self.decisions.clone(),
            holds,
        }
    }

    /// The answer of a quota of one policy: admitted if the policy admits,
    /// or if it only watches (shadow).
    #[inline]
    pub(crate) fn single(decision: Decision, shadow: bool, hold: Option<Hold>) -> Self {
        let admitted = decision.admitted || shadow;
        let mut decisions = Decisions::new();
        decisions.push(decision);
        // Like every admitted decision: one hold per policy, empty for a
        // shadow policy that refused and so recorded nothing.
        let mut holds = Holds::default();
        if admitted {
            holds.0.push(hold.unwrap_or_default());
        }
        QuotaDecision {
            admitted,
            decisions,
            holds,
        }
    }

    /// The longest wait among the refusing **enforcing** policies of `quota`:
    /// the exact wait until all of them could admit the request. Shadow
    /// policies never count. `None` if admitted.
    pub fn retry_after(&self, quota: &Quota) -> Option<Duration> {
        if self.admitted {
            return None;
        }
        quota
            .policies()
            .iter()
            .zip(&self.decisions)
            .filter(|(p, _)| !p.is_shadow())
            .filter_map(|(_, d)| d.retry_after)
            .max()
    }

    /// Each decision with the name of its policy, shadow policies included.
    pub fn named<'a>(&'a self, quota: &'a Quota) -> impl Iterator<Item = (&'a str, &'a Decision)> {
        quota
            .policies()
            .iter()
            .map(|p| p.name())
            .zip(&self.decisions)
    }
}
