//! Demo keys, plans and limits: the same as the HTTP reporting API's.

use std::time::Duration;

use tower_admission::concurrency::ConcurrencyLayer;
use tower_admission::identity::{ApiKeys, Identity};
use tower_admission::quota::{Policy, Quota};
use tower_admission::ConfigError;

const MINUTE: Duration = Duration::from_secs(60);

/// Where the service listens unless `--listen` says otherwise.
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
/// Largest page of reports.
pub(crate) const MAX_PAGE_SIZE: u32 = 100;
/// Page size when the request gives none (0).
pub(crate) const DEFAULT_PAGE_SIZE: u32 = 20;
/// Largest request message, in bytes (the gRPC counterpart of the body cap).
pub(crate) const MAX_MESSAGE_BYTES: usize = 64 << 10;

/// The demo API keys, as `(key, subject, tenant, plan)`.
pub(crate) const DEMO_KEYS: [(&str, &str, &str, &str); 3] = [
    ("demo-free", "alice", "acme", "free"),
    ("demo-pro", "bob", "acme", "pro"),
    ("demo-globex", "carol", "globex", "free"),
];

/// The demo keys as an authenticator's key table.
pub(crate) fn api_keys() -> ApiKeys {
    DEMO_KEYS
        .iter()
        .fold(ApiKeys::new(), |keys, (key, subject, tenant, plan)| {
            keys.with_key(*key, Identity::new(*subject, *tenant, *plan))
        })
}

/// Calls per user: free is 100 per 60 s exactly (sliding log) and bursts of
/// at most 20 refilled at 100 per minute (token bucket); pro is ten times
/// that.
pub(crate) fn request_quotas() -> Result<(Quota, Quota), ConfigError> {
    let free = Quota::new(
        "requests-free",
        [
            Policy::sliding_log("per-minute", 100, MINUTE)?,
            Policy::token_bucket("burst", 20, 100, MINUTE)?,
        ],
    )?;
    let pro = Quota::new(
        "requests-pro",
        [
            Policy::sliding_log("per-minute", 1_000, MINUTE)?,
            Policy::token_bucket("burst", 100, 1_000, MINUTE)?,
        ],
    )?;
    Ok((free, pro))
}

/// At most 64 calls in the handler (128 more may wait up to 500 ms), and 4
/// per user (4 more may wait up to 250 ms).
pub(crate) fn concurrency() -> Result<ConcurrencyLayer, ConfigError> {
    ConcurrencyLayer::builder()
        .global(64, 128, Duration::from_millis(500))
        .per_identity(4, 4, Duration::from_millis(250))
        .build()
}
