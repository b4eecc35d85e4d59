//! Quotas: policies, algorithms, stores and the quota layer.

pub(crate) mod algorithm;
mod decision;
pub(crate) mod headers;
mod layer;
mod limiter;
mod policy;
mod service;
mod settle;
mod store;

#[cfg(all(test, feature = "axum"))]
mod oracle_tests;

pub use decision::{Decision, QuotaDecision};
pub(crate) use decision::{Decisions, Holds};
pub use layer::{QuotaLayer, QuotaLayerBuilder, Quotas};
pub(crate) use limiter::Outcome;
pub use limiter::{Limiter, LimiterStats, Verdict};
pub(crate) use policy::FailureMode;
pub use policy::{Policy, Quota};
pub use settle::Settlement;
pub use store::{MemoryStore, Store, StoreError};
#[cfg(feature = "redis")]
pub use store::{RedisStore, RedisStoreBuilder};
