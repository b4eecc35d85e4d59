//! The four HTTP stacks the request benches compare. Every quota and cap
//! admits every request: they measure the admitted path, which every served
//! request pays.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::Request;
use tower_admission::concurrency::ConcurrencyLayer;
use tower_admission::identity::{ApiKeys, AuthenticateLayer, Identity};
use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer, Scope};
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::GlobalKeyExtractor;
use tower_governor::GovernorLayer;

/// A stack: its name, the router, and whether requests carry an API key.
pub(crate) struct Stack {
    pub(crate) name: &'static str,
    pub(crate) app: Router,
    pub(crate) auth: bool,
}

impl Stack {
    /// One request to this stack.
    pub(crate) fn request(&self) -> Request<Body> {
        let mut req = Request::get("/").body(Body::empty()).unwrap();
        if self.auth {
            req.headers_mut()
                .insert("authorization", "Bearer demo-free".parse().unwrap());
        }
        req
    }
}

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

/// Bare axum, axum + tower_governor, axum + one quota layer, and the
/// reporting stack (auth + per-user quota + concurrency caps).
pub(crate) fn stacks() -> [Stack; 4] {
    let governor_config = Arc::new(
        GovernorConfigBuilder::default()
            .per_nanosecond(1)
            .burst_size(NonZeroU32::MAX.get())
            .key_extractor(GlobalKeyExtractor)
            .finish()
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
    [
        Stack {
            name: "bare_axum",
            app: base(),
            auth: false,
        },
        Stack {
            name: "tower_governor",
            app: base().layer(GovernorLayer::new(governor_config)),
            auth: false,
        },
        Stack {
            name: "quota_layer",
            app: base().layer(
                QuotaLayer::builder(MemoryStore::new())
                    .quota(huge_bucket())
                    .scope(Scope::Aggregate)
                    .build()
                    .unwrap(),
            ),
            auth: false,
        },
        Stack {
            name: "auth_quota_concurrency",
            app: full,
            auth: true,
        },
    ]
}
