//! Limits of the gRPC service: the HTTP reporting API's keys, plans and
//! caps, plus what only gRPC has.

#[path = "../reporting_api/config.rs"]
#[allow(dead_code, reason = "the HTTP example's knobs, only some apply here")]
mod shared;

#[allow(
    unused_imports,
    reason = "the tests that include this file use only some"
)]
pub(crate) use shared::{
    api_keys, concurrency, request_quotas, DEFAULT_PAGE_SIZE, DEMO_KEYS, MAX_PAGE_SIZE,
};

/// Where the service listens unless `--listen` says otherwise.
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
/// Largest request message, in bytes (the gRPC counterpart of the body cap).
pub(crate) const MAX_MESSAGE_BYTES: usize = 64 << 10;
