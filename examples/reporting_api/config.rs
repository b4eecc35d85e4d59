//! Demo keys, plans and limits.

use std::time::Duration;

use tower_admission::concurrency::ConcurrencyLayer;
use tower_admission::identity::{ApiKeys, Identity};
use tower_admission::quota::{Policy, Quota};
use tower_admission::ConfigError;

const MINUTE: Duration = Duration::from_secs(60);

/// Wire-byte cap.
pub(crate) const MAX_WIRE_BYTES: usize = 1 << 20;
/// Decoded-byte cap.
pub(crate) const MAX_DECODED_BYTES: usize = 8 << 20;
/// Largest page.
pub(crate) const MAX_PAGE_SIZE: u32 = 100;
/// Page size when none is given.
pub(crate) const DEFAULT_PAGE_SIZE: u32 = 20;
/// Longest `from`..`to` span.
pub(crate) const MAX_SPAN: Duration = Duration::from_secs(31 * 24 * 3600);
/// Batches up to this many items are answered at once.
pub(crate) const SYNC_BATCH_ITEMS: usize = 100;
/// Batches up to this many items are accepted as jobs; more get 413.
pub(crate) const MAX_BATCH_ITEMS: usize = 1000;

/// The dependency budget, first attempts per second.
pub(crate) const DEPENDENCY_NORMAL: u64 = 200;
/// The dependency budget, retries per second.
pub(crate) const DEPENDENCY_RETRY: u64 = 40;
/// Attempts per dependency call, the first included.
pub(crate) const DEPENDENCY_ATTEMPTS: u32 = 3;
/// The longest an attempt waits for the budget before the call fails.
pub(crate) const DEPENDENCY_WAIT: Duration = Duration::from_secs(2);
/// The longest one attempt waits for the dependency's answer.
pub(crate) const DEPENDENCY_TIMEOUT: Duration = Duration::from_secs(10);
/// Batch items calling the dependency at once, per request.
pub(crate) const ACTIVE_ITEMS: usize = 5;

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

/// At most 64 requests in the handlers (128 more may wait up to 500 ms),
/// and 4 per user (4 more may wait up to 250 ms).
pub(crate) fn concurrency() -> Result<ConcurrencyLayer, ConfigError> {
    ConcurrencyLayer::builder()
        .global(64, 128, Duration::from_millis(500))
        .per_identity(4, 4, Duration::from_millis(250))
        .build()
}

/// Requests per user: free is 100 per 60 s exactly (sliding log) and bursts
/// of at most 20 refilled at 100 per minute (token bucket).
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

/// Work per user: rows read (cost = page size) and batch items, per minute.
pub(crate) fn work_quotas() -> Result<(Quota, Quota), ConfigError> {
    let free = Quota::new(
        "work-free",
        [Policy::sliding_window("units-per-minute", 2_000, MINUTE)?],
    )?;
    let pro = Quota::new(
        "work-pro",
        [Policy::sliding_window("units-per-minute", 20_000, MINUTE)?],
    )?;
    Ok((free, pro))
}

/// The whole service: an aggregate cap shared by every caller.
pub(crate) fn aggregate_quota() -> Result<Quota, ConfigError> {
    Quota::new(
        "all-callers",
        [Policy::token_bucket(
            "per-second",
            500,
            250,
            Duration::from_secs(1),
        )?],
    )
}
