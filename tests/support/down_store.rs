//! A store whose every decision fails: the limiter is down.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tower_admission::quota::{Quota, QuotaDecision, Store, StoreError};

/// Every `decide` fails with `StoreError::Unavailable`; `settle` answers the
/// decision it is given.
#[derive(Debug, Clone)]
pub(crate) struct Down;

type Boxed<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send>>;

impl Store for Down {
    type DecideFuture = Boxed<QuotaDecision>;
    type SettleFuture = Boxed<QuotaDecision>;

    fn decide(&self, _: &Quota, _: &Arc<str>, _: u64) -> Self::DecideFuture {
        Box::pin(async {
            Err(StoreError::Unavailable {
                message: "down".into(),
            })
        })
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
        let decision = decision.clone();
        Box::pin(async move { Ok(decision) })
    }
}
