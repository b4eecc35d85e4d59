//! tower-admission
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

pub mod bounds;
pub mod clock;
pub mod concurrency;
mod error;
pub mod identity;
pub mod jobs;
pub mod outbound;
pub mod quota;
pub mod reject;

pub use error::ConfigError;
