//! The cost of the stack per HTTP request, in process (no sockets): bare
//! axum, axum + tower_governor, axum + our quota layer, and the whole
//! inbound stack (`benches/common/inbound.rs`).
//!
//! ```text
//! cargo bench --bench http
//! ```
//! Every quota here is large enough to admit every request: this measures the
//! admitted path, which is what every served request pays. Each stack is
//! timed on its own; `benches/paired.rs` measures their ratios in
//! alternating batches.

mod common;

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use tower::ServiceExt;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("http");
    for stack in common::stacks::stacks() {
        group.bench_function(stack.name, |b| {
            b.to_async(&rt).iter(|| {
                let response = stack.app.clone().oneshot(stack.request());
                async move {
                    assert_eq!(response.await.unwrap().status(), 200);
                }
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
