//! Adaptive limits, criticality classes and fair queues (documented in
//! `docs/adaptive.md`, part of the `concurrency` module's docs).

mod class;
mod config;
mod controller;
mod fair;
pub(crate) mod gate;
mod limit_layer;
pub(crate) mod stats;
mod telemetry;

pub use class::Criticality;
pub use config::AdaptiveLimit;
pub use controller::Outcome;
pub(crate) use limit_layer::Overloaded;
pub use limit_layer::{AdaptiveLimitLayer, AdaptiveLimitLayerBuilder, LimitError};

pub(crate) use limit_layer::{check_queue, gate_shares};
