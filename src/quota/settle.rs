use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::quota::limiter::Recorded;
use crate::quota::{Decision, Limiter, MemoryStore, Quota, QuotaDecision, Store, StoreError};

/// A handle, in the request extensions, to settle the real cost of a request
/// after the work is done.
///
/// Each [`QuotaLayer`](crate::quota::QuotaLayer) with a
/// [`cost`](crate::quota::QuotaLayerBuilder::cost) function that admitted the
/// request adds the charge it made; layers that count requests (no cost
/// function) never take part. [`settle`](Self::settle) moves every charge to
/// the actual cost. The rules:
///
/// - **Only where it was recorded.** A charge is settled in the store that
///   recorded it: the shared store, or the local store when
///   [`fail_to_local_share`](crate::quota::Policy::fail_to_local_share)
///   decided. An admission by
///   [`fail_open`](crate::quota::Policy::fail_open), or one whose
///   outcome is unknown, was recorded nowhere that can be settled: settling
///   it changes nothing.
/// - **More.** `actual > charged` charges the difference at the time of the
///   settle, capped at what each policy has left: a settle never drives a
///   policy below empty or locks a key out.
/// - **Less.** `actual < charged` refunds the difference, but each policy
///   gives back at most what *this* charge still holds in it:
///   - token bucket: the charge's tokens that have not refilled yet;
///   - sliding log: the charge's own entry, while it is in the window and
///     among the newest 1,024 entries (so a refund's work stays bounded);
///   - fixed and weighted windows: only while the charge's window is the
///     current one (a window of another length that ends at the same time,
///     after a redeploy and its rollback, is not).
///
///   A refund therefore never creates capacity that the policy's bound
///   forbids. Extra cost charged by an earlier settle is not refunded.
/// - **After a redeploy.** A charge settles under the quota that admitted
///   it, also once a quota of the same name and kinds but other numbers
///   has replaced it on the same store. It still gives back only its own
///   charge, and never brings the state the new numbers decided since to
///   its own numbers: no trim to its shorter window, no realigned window,
///   no bucket clamped to its smaller capacity, no earlier expiry.
/// - Settling again is relative to the last settled cost, also when clones
///   settle at once: they settle one after the other.
/// - **Unknown outcome.** A settle that timed out after it was sent
///   ([`StoreError::outcome_unknown`]), or whose future was dropped before
///   the store answered, may have been applied. It is counted as applied:
///   the charge moves to `actual`, and after a refund it holds that much
///   less. A later settle never gives the same cost back twice; at worst the
///   store keeps a cost that was not refunded.
///
/// ```
/// use axum::Extension;
/// use tower_admission::quota::Settlement;
///
/// async fn handler(Extension(settlement): Extension<Settlement>) -> &'static str {
///     // The request was charged its page size; only 12 rows existed.
///     let _ = settlement.settle(12).await;
///     "ok"
/// }
/// ```
#[derive(Clone, Default)]
pub struct Settlement {
    charges: Vec<Arc<Charge>>,
}

/// One quota layer's charge of one request, shared by the request's
/// [`Settlement`] and, with
/// [`refund_inner_refusals`](crate::quota::QuotaLayerBuilder::refund_inner_refusals),
/// the layer's response future.
pub(crate) struct Charge {
    target: Target,
    quota: Quota,
    key: Arc<str>,
    /// The cost settled so far, and the admission's decision holding what
    /// the charge still holds.
    state: Mutex<(u64, QuotaDecision)>,
    /// Held from reading `state` to writing it back: two settles of one
    /// charge (from clones of a settlement) that both read it before either
    /// wrote would both apply their delta, refunding the same tokens twice.
    settling: tokio::sync::Mutex<()>,
}

enum Target {
    Shared(Box<dyn SettleShared>),
    Local(MemoryStore),
    Nowhere,
}

type SettleFuture<'a> =
    Pin<Box<dyn Future<Output = Result<QuotaDecision, StoreError>> + Send + 'a>>;

trait SettleShared: Send + Sync {
    fn settle<'a>(
        &'a self,
        quota: &'a Quota,
        key: &'a Arc<str>,
        decision: &'a QuotaDecision,
        delta: i64,
    ) -> SettleFuture<'a>;
}

impl<St: Store> SettleShared for Limiter<St> {
    fn settle<'a>(
        &'a self,
        quota: &'a Quota,
        key: &'a Arc<str>,
        decision: &'a QuotaDecision,
        delta: i64,
    ) -> SettleFuture<'a> {
        Box::pin(self.settle_shared(quota, key, decision, delta))
    }
}

impl Charge {
    /// The charge of an admission recorded where `recorded` says, whose
    /// policies decided `decisions`.
    pub(crate) fn new<St: Store>(
        limiter: &Limiter<St>,
        quota: &Quota,
        key: Arc<str>,
        charged: u64,
        recorded: Recorded,
        decisions: &[Decision],
    ) -> Arc<Charge> {
        let (target, quota, holds) = match recorded {
            Recorded::Shared(holds) => (
                Target::Shared(Box::new(limiter.clone())),
                quota.clone(),
                holds,
            ),
            Recorded::Local(local) => {
                let (local, holds) = *local;
                (Target::Local(limiter.local_store().clone()), local, holds)
            }
            Recorded::Nowhere => (Target::Nowhere, quota.clone(), Default::default()),
        };
        let decision = QuotaDecision {
            admitted: true,
            decisions: decisions.iter().cloned().collect(),
            holds,
        };
        Arc::new(Charge {
            target,
            quota,
            key,
            state: Mutex::new((charged, decision)),
            settling: tokio::sync::Mutex::new(()),
        })
    }

    /// Moves this charge to `actual` (see [`Settlement::settle`]).
    pub(crate) async fn settle_to(&self, actual: u64) -> Result<(), StoreError> {
        let _one = self.settling.lock().await;
        let (before, decision) = self.state.lock().clone();
        let delta =
            i64::try_from(actual).unwrap_or(i64::MAX) - i64::try_from(before).unwrap_or(i64::MAX);
        if delta == 0 {
            return Ok(());
        }
        // Counted as applied until the store answers: a settle dropped
        // midway, like one whose outcome is unknown, may have been
        // applied, and is never given back twice.
        *self.state.lock() = (actual, decision.holding(decision.holds.refunded(delta)));
        let settled = match &self.target {
            Target::Shared(limiter) => {
                limiter
                    .settle(&self.quota, &self.key, &decision, delta)
                    .await
            }
            Target::Local(store) => store
                .settle(&self.quota, &self.key, &decision, delta)
                .into_inner(),
            Target::Nowhere => Ok(decision.clone()),
        };
        match settled {
            Ok(settled) => *self.state.lock() = (actual, settled),
            Err(e) if e.outcome_unknown() => return Err(e),
            Err(e) => {
                *self.state.lock() = (before, decision);
                return Err(e);
            }
        }
        Ok(())
    }
}

impl Settlement {
    pub(crate) fn push(&mut self, charge: Arc<Charge>) {
        self.charges.push(charge);
    }

    /// The cost each quota charged so far, in layer order (outermost first).
    pub fn charged(&self) -> Vec<u64> {
        self.charges.iter().map(|c| c.state.lock().0).collect()
    }

    /// Moves every charge to `actual`. Stops at the first store error; a
    /// settle known to have failed leaves that charge as it was, one whose
    /// outcome is unknown is counted as applied.
    pub async fn settle(&self, actual: u64) -> Result<(), StoreError> {
        for charge in &self.charges {
            charge.settle_to(actual).await?;
        }
        Ok(())
    }
}

impl fmt::Debug for Settlement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(
                self.charges
                    .iter()
                    .map(|c| (c.quota.name(), &*c.key, c.state.lock().0)),
            )
            .finish()
    }
}
