//! Instructions per decision, counted by callgrind: a repeatable companion to
//! the timed `decisions` bench on a shared, noisy machine.
//!
//! ```text
//! benches/instructions.sh     # builds this, runs each variant under callgrind, prints the table
//! ```
//!
//! Each run makes `WARMUP` decisions over 10k keys, then `MEASURED` more; the
//! script runs it twice per variant (with `MEASURED` and with 0) and divides
//! the difference, so setup and warm-up cancel out.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::{Quota as GQuota, RateLimiter};
use tower_admission::quota::{MemoryStore, Policy, Quota};

const KEYS: usize = 10_000;
const WARMUP: usize = 200_000;

fn main() {
    let mut args = std::env::args().skip(1);
    let variant = args.next().unwrap_or_else(|| "governor".into());
    let measured: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(100_000);
    let keys: Vec<Arc<str>> = (0..KEYS).map(|i| Arc::from(format!("user-{i}"))).collect();
    let minute = Duration::from_secs(60);
    let total = WARMUP + measured;
    if variant == "governor" {
        let limiter = RateLimiter::keyed(
            GQuota::per_minute(NonZeroU32::new(100).unwrap())
                .allow_burst(NonZeroU32::new(20).unwrap()),
        );
        for i in 0..total {
            black_box(limiter.check_key(&keys[i % KEYS]).is_ok());
        }
        return;
    }
    let policy = match variant.as_str() {
        "token_bucket" => Policy::token_bucket("token_bucket", 20, 100, minute),
        "sliding_log" => Policy::sliding_log("sliding_log", 100, minute),
        "fixed_window" => Policy::fixed_window("fixed_window", 100, minute),
        "sliding_window" => Policy::sliding_window("sliding_window", 100, minute),
        other => panic!("unknown variant {other}"),
    }
    .unwrap();
    let quota = Quota::new(policy.name(), [policy.clone()]).unwrap();
    let store = MemoryStore::new();
    for i in 0..total {
        black_box(
            store
                .decide_now(&quota, &keys[i % KEYS], 1)
                .map(|d| d.admitted)
                .ok(),
        );
    }
}
