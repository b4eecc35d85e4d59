#![doc = include_str!("../../docs/reject.md")]

use std::time::Duration;

mod base64;
mod body;
mod grpc;
mod grpc_web;
mod problem;
mod protocol;
mod rejection;

pub use body::RefusalBody;
#[cfg(test)]
use grpc::GRPC_RETRY_PUSHBACK_MS;
#[cfg(test)]
use problem::{PROBLEM_TYPE_BASE, QUOTA_EXCEEDED_TYPE, TEMPORARY_REDUCED_CAPACITY_TYPE};
pub(crate) use protocol::Protocol;
pub use rejection::{InvalidParameter, Rejection};

pub(crate) use base64::{base64, unbase64_group};
pub(crate) use grpc_web::grpc_web_trailer_frame;
use rejection::names;

/// `ceil(wait)` in whole seconds, at least 1 and saturating at `u64::MAX`
/// (a wait of `Duration::MAX`): the value of `Retry-After`.
pub(crate) fn retry_after_secs(wait: Duration) -> u64 {
    ceil_secs(wait).max(1)
}

/// `ceil(d)` in whole seconds, saturating at `u64::MAX`: `Retry-After` and
/// the `RateLimit` fields' `t` and `w`.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0))
}

#[cfg(test)]
mod tests;
