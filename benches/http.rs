//! The cost of the stack per HTTP request, in process (no sockets), side by
//! side in one run: bare axum, axum + tower_governor, axum + our quota layer,
//! and the full reporting stack (auth + quota + concurrency).
//!
//! ```text
//! cargo bench --bench http
//! ```
//! Every quota here is large enough to admit every request: this measures the
//! admitted path, which is what every served request pays.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use criterion::{criterion_group, criterion_main, Criterion};
use http::Request;
use tower::ServiceExt;
use tower_admission::concurrency::ConcurrencyLayer;
use tower_admission::identity::{ApiKeys, AuthenticateLayer, Identity};
use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer, Scope};
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::GlobalKeyExtractor;
use tower_governor::GovernorLayer;

fn base() -> Router {
    Router::new().route("/", get(|| async { "ok" }))
}

fn huge_bucket() -> Quota {
    Quota::new(
        "bench",
        [
            Policy::token_bucket("bucket", 1_000_000_000, 1_000_000, Duration::from_secs(1))
                .unwrap(),
        ],
    )
    .unwrap()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("http");

    let bare = base();
    let governor_config = Arc::new(
        GovernorConfigBuilder::default()
            .per_nanosecond(1)
            .burst_size(NonZeroU32::MAX.get())
            .key_extractor(GlobalKeyExtractor)
            .finish()
            .unwrap(),
    );
    let governed = base().layer(GovernorLayer::new(governor_config));
    let ours = base().layer(
        QuotaLayer::builder(MemoryStore::new())
            .quota(huge_bucket())
            .scope(Scope::Aggregate)
            .build()
            .unwrap(),
    );
    let keys = ApiKeys::new().with_key("demo-free", Identity::new("alice", "acme", "free"));
    let full = base()
        .layer(
            ConcurrencyLayer::builder()
                .global(1024, 1024, Duration::from_secs(1))
                .per_identity(1024, 0, Duration::from_secs(1))
                .build()
                .unwrap(),
        )
        .layer(
            QuotaLayer::builder(MemoryStore::new())
                .quota(huge_bucket())
                .build()
                .unwrap(),
        )
        .layer(AuthenticateLayer::new(keys));

    for (name, app, auth) in [
        ("bare_axum", bare, false),
        ("tower_governor", governed, false),
        ("quota_layer", ours, false),
        ("auth_quota_concurrency", full, true),
    ] {
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                let mut req = Request::get("/").body(Body::empty()).unwrap();
                if auth {
                    req.headers_mut()
                        .insert("authorization", "Bearer demo-free".parse().unwrap());
                }
                let app = app.clone();
                async move {
                    let response = app.oneshot(req).await.unwrap();
                    assert_eq!(response.status(), 200);
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
