use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::quota::{Limiter, Quota, Store, StoreError};

/// A handle, in the request extensions, to settle the real cost of a request
/// after the work is done.
///
/// Each [`QuotaLayer`](crate::quota::QuotaLayer) with a
/// [`cost`](crate::quota::QuotaLayerBuilder::cost) function that admitted the
/// request adds the charge it made; layers that count requests (no cost
/// function) never take part. [`settle`](Self::settle) moves every charge to
/// the actual cost:
///
/// - `actual > charged` charges the difference, capped at what the policy has
///   left: a settle never drives a policy below empty or locks a key out.
/// - `actual < charged` refunds the difference, capped at what was held.
/// - Settling again is relative to the last settled cost.
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

struct Charge {
    target: Box<dyn Adjust>,
    quota: Quota,
    key: Arc<str>,
    charged: AtomicU64,
}

type AdjustFuture<'a> = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;

trait Adjust: Send + Sync {
    fn adjust<'a>(&'a self, quota: &'a Quota, key: &'a Arc<str>, delta: i64) -> AdjustFuture<'a>;
}

impl<St: Store> Adjust for Limiter<St> {
    fn adjust<'a>(&'a self, quota: &'a Quota, key: &'a Arc<str>, delta: i64) -> AdjustFuture<'a> {
        Box::pin(Limiter::adjust(self, quota, key, delta))
    }
}

impl Settlement {
    pub(crate) fn push<St: Store>(
        &mut self,
        limiter: Limiter<St>,
        quota: Quota,
        key: Arc<str>,
        charged: u64,
    ) {
        self.charges.push(Arc::new(Charge {
            target: Box::new(limiter),
            quota,
            key,
            charged: AtomicU64::new(charged),
        }));
    }

    /// The cost each quota charged so far, in layer order (outermost first).
    pub fn charged(&self) -> Vec<u64> {
        self.charges
            .iter()
            .map(|c| c.charged.load(Ordering::SeqCst))
            .collect()
    }

    /// Moves every charge to `actual`. Stops at the first store error.
    pub async fn settle(&self, actual: u64) -> Result<(), StoreError> {
        for charge in &self.charges {
            let before = charge.charged.swap(actual, Ordering::SeqCst);
            let delta = i64::try_from(actual).unwrap_or(i64::MAX)
                - i64::try_from(before).unwrap_or(i64::MAX);
            if delta != 0 {
                charge
                    .target
                    .adjust(&charge.quota, &charge.key, delta)
                    .await?;
            }
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
                    .map(|c| (c.quota.name(), &*c.key, c.charged.load(Ordering::SeqCst))),
            )
            .finish()
    }
}
