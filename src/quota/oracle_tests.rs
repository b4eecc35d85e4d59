//! The quota layer against the pure state machines replayed beside it (moved
//! from `tests/quota_layer.rs`: the state machines are crate-private).

use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;

use crate::clock::{ManualClock, Timestamp};
use crate::identity::Identity;
use crate::quota::{MemoryStore, Policy, Quota, QuotaLayer};
use crate::reject::{retry_after_secs, Rejection};

const MINUTE: Duration = Duration::from_secs(60);

fn store(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::with_clock(clock.clone())
}

fn request(identity: Option<Identity>, uri: &str) -> Request<Body> {
    let mut req = Request::builder().uri(uri).body(Body::empty()).unwrap();
    if let Some(id) = identity {
        req.extensions_mut().insert(id);
    }
    req
}

#[tokio::test]
async fn retry_after_on_every_refusal_is_the_exact_wait_rounded_up() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let quota = Quota::new(
        "free",
        [
            Policy::sliding_log("per-minute", 100, MINUTE).unwrap(),
            Policy::token_bucket("burst", 20, 100, MINUTE).unwrap(),
        ],
    )
    .unwrap();
    let layer = QuotaLayer::builder(store(&clock))
        .quota(quota.clone())
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let alice = Identity::new("alice", "acme", "free");
    // The oracle: the pure state machines, replayed beside the layer.
    let mut model: Vec<_> = quota
        .policies()
        .iter()
        .map(|p| p.algorithm().fresh_state())
        .collect();
    let (mut admitted, mut refused) = (0, 0);
    // One request every 70 ms for 61 s: a mix of bucket and log refusals.
    for _ in 0..(61_000 / 70) {
        let now = Timestamp::now(&clock);
        let decisions: Vec<_> = quota
            .policies()
            .iter()
            .zip(model.iter_mut())
            .map(|(p, state)| p.algorithm().check(&mut state.clone(), now, 1))
            .collect();
        let expected_wait = decisions.iter().filter_map(|d| d.retry_after).max();
        if expected_wait.is_none() {
            for (p, state) in quota.policies().iter().zip(model.iter_mut()) {
                *state = p.algorithm().step(state, now, 1).0;
            }
        }
        let response = app
            .clone()
            .oneshot(request(Some(alice.clone()), "/"))
            .await
            .unwrap();
        match (response.status(), expected_wait) {
            (StatusCode::OK, None) => admitted += 1,
            (StatusCode::TOO_MANY_REQUESTS, Some(wait)) => {
                refused += 1;
                let header: u64 = response.headers()["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert_eq!(header, retry_after_secs(wait));
                assert!(header >= 1);
                let rejection = response.extensions().get::<Rejection>().unwrap();
                assert_eq!(rejection.retry_after(), Some(wait));
            }
            (status, wait) => panic!("layer said {status}, oracle wait {wait:?}"),
        }
        clock.advance(Duration::from_millis(70));
    }
    // Every decision matched the oracle above; these are its totals. The log
    // stops the first minute at 100, then its oldest entries expire from 60 s.
    assert_eq!(admitted, 113);
    assert_eq!(refused, 61_000 / 70 - 113);
}
