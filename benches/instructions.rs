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
//!
//! A variant named after one of the HTTP stacks of `benches/common/stacks.rs`
//! (`bare_axum`, `tower_governor`, `quota_layer`, `whole_stack`) counts
//! requests instead, one per 10 decisions, each through `Router::oneshot`
//! on a current-thread runtime:
//!
//! ```text
//! VARIANTS="bare_axum tower_governor quota_layer whole_stack" benches/instructions.sh
//! ```
//!
//! `stack_1` to `stack_5` are the whole stack cut after its first N layers
//! (`benches/common/inbound.rs`), for the cost of each layer;
//! `passthrough_1` and `passthrough_6` are bare axum behind layers that only
//! pass through, for what `Router::layer` and nesting cost.

mod common;

use std::hint::black_box;

use tower::ServiceExt;
use tower_admission::quota::MemoryStore;

use common::KEYS;

/// Decisions before the measured ones; `WARMUP` in the environment
/// overrides it (the smoke form uses a small one).
const WARMUP: usize = 200_000;

fn main() {
    let mut args = std::env::args().skip(1);
    let variant = args.next().unwrap_or_else(|| "governor".into());
    let measured: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(100_000);
    let keys = common::keys();
    let warmup = std::env::var("WARMUP")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(WARMUP);
    let total = warmup + measured;
    if variant == "governor" {
        let limiter = common::governor();
        for i in 0..total {
            black_box(limiter.check_key(&keys[i % KEYS]).is_ok());
        }
        return;
    }
    if let Some(stack) = common::stacks::stacks()
        .into_iter()
        .find(|s| s.name == variant)
    {
        return requests(&stack, total / 10);
    }
    if let Some(n) = variant
        .strip_prefix("passthrough_")
        .and_then(|n| n.parse().ok())
    {
        return requests(&common::stacks::passthrough(n), total / 10);
    }
    if let Some(n) = variant.strip_prefix("stack_").and_then(|n| n.parse().ok()) {
        return requests(&common::stacks::first_layers(n), total / 10);
    }
    let quota = common::quotas()
        .into_iter()
        .find(|q| q.name() == variant)
        .unwrap_or_else(|| panic!("unknown variant {variant}"));
    let store = MemoryStore::new();
    for i in 0..total {
        black_box(common::decide(&store, &quota, &keys[i % KEYS]));
    }
}

/// `n` requests to `stack`, one after another.
fn requests(stack: &common::stacks::Stack, n: usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for _ in 0..n {
            let response = stack.app.clone().oneshot(stack.request()).await.unwrap();
            assert_eq!(response.status(), 200);
        }
    });
}
