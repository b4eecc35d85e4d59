//! Quotas: policies, algorithms, stores and the quota layer.

pub mod algorithm;
mod decision;
mod limiter;
mod policy;
pub mod store;

pub use decision::{Decision, QuotaDecision};
pub use limiter::{Limiter, LimiterStats, Verdict};
pub use policy::{FailureMode, Policy, Quota};
pub use store::{MemoryConfig, MemoryStore, Store, StoreError};
