//! Live reconfiguration of the quota layer: every decision is one made
//! wholly under the old quota or wholly under the new, never a mix, also
//! while another thread reloads without pause; a bad configuration changes
//! nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use proptest::prelude::*;
use tower::ServiceExt;
use tower_admission::clock::ManualClock;
use tower_admission::identity::Identity;
use tower_admission::quota::{Limiter, MemoryStore, Policy, Quota, QuotaLayer, Quotas};
use tower_admission::reload::ReloadHandle;

const MINUTE: Duration = Duration::from_secs(60);
const SUBJECTS: [&str; 3] = ["alice", "bob", "carol"];

/// The numbers of one configuration: a burst bucket and a per-minute log,
/// the same names and kinds in every configuration, so state carries over.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Numbers {
    capacity: u64,
    refill: u64,
    per_minute: u64,
}

impl Numbers {
    fn quota(self) -> Quota {
        Quota::new(
            "free",
            [
                Policy::token_bucket("burst", self.capacity, self.refill, MINUTE).unwrap(),
                Policy::sliding_log("per-minute", self.per_minute, MINUTE).unwrap(),
            ],
        )
        .unwrap()
    }

    /// The `RateLimit-Policy` value the layer sends for this quota, as
    /// `Verdict::insert_headers` writes it for a fresh decision.
    fn policy_field(self) -> String {
        let quota = self.quota();
        let limiter = Limiter::new(MemoryStore::new());
        let verdict = runtime().block_on(limiter.check(&quota, &"probe".into(), 1));
        let mut fields = http::HeaderMap::new();
        verdict.insert_headers(&quota, &mut fields);
        fields["ratelimit-policy"].to_str().unwrap().to_owned()
    }
}

fn numbers() -> impl Strategy<Value = Numbers> {
    (1u64..8, 1u64..120, 1u64..12).prop_map(|(capacity, refill, per_minute)| Numbers {
        capacity,
        refill,
        per_minute,
    })
}

#[derive(Debug, Clone)]
enum Step {
    /// A request of `SUBJECTS[who]` costing `cost`, after `after_ms`.
    Request {
        who: usize,
        cost: u64,
        after_ms: u64,
    },
    /// Applies configuration `to` (0: old, 1: new).
    Reload { to: usize },
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        4 => (0..SUBJECTS.len(), 1u64..4, 0u64..4_000)
            .prop_map(|(who, cost, after_ms)| Step::Request { who, cost, after_ms }),
        1 => (0usize..2).prop_map(|to| Step::Reload { to }),
    ];
    prop::collection::vec(step, 1..80)
}

/// The app: the quota layer over a manual clock, with `RateLimit` fields on
/// every answer (they name the numbers that decided), a request's cost in
/// its `cost` header.
fn app(clock: &ManualClock, first: Numbers) -> (Router, ReloadHandle<Quotas>) {
    let store = MemoryStore::with_clock(clock.clone());
    let layer = QuotaLayer::builder(store)
        .quota(first.quota())
        .cost(cost_header)
        .headers_on_success(true)
        .build()
        .unwrap();
    let reload = layer.reload_handle();
    let router = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    (router, reload)
}

/// What a decision looked like from outside: status, `Retry-After`,
/// `RateLimit-Policy` (which names the numbers that decided) and `RateLimit`.
#[derive(Debug, PartialEq)]
struct Answer {
    status: StatusCode,
    retry_after: Option<String>,
    policy: Option<String>,
    state: Option<String>,
}

/// Sends `SUBJECTS[who]`'s request of `cost` to `router`.
async fn send(router: &Router, who: usize, cost: u64) -> Answer {
    let mut req = Request::builder()
        .uri("/")
        .header("cost", cost.to_string())
        .body(Body::empty())
        .unwrap();
    req.extensions_mut()
        .insert(Identity::new(SUBJECTS[who], "acme", "free"));
    let response = router.clone().oneshot(req).await.unwrap();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    Answer {
        status: response.status(),
        retry_after: header("retry-after"),
        policy: header("ratelimit-policy"),
        state: header("ratelimit"),
    }
}

/// The reference: one layer per configuration, built as a redeploy would
/// build it, over one store that keeps the state of both. A request sent to
/// the layer of `i` is decided wholly under configuration `i` from the state
/// every earlier decision left.
struct Reference {
    routers: [Router; 2],
    fields: [String; 2],
}

impl Reference {
    fn new(clock: &ManualClock, configs: [Numbers; 2]) -> Self {
        let store = MemoryStore::with_clock(clock.clone());
        let build = |n: Numbers| {
            let layer = QuotaLayer::builder(store.clone())
                .quota(n.quota())
                .cost(cost_header)
                .headers_on_success(true)
                .build()
                .unwrap();
            Router::new()
                .route("/", get(|| async { "ok" }))
                .layer(layer)
        };
        Reference {
            routers: configs.map(build),
            fields: configs.map(Numbers::policy_field),
        }
    }

    /// The configuration whose `RateLimit-Policy` `answer` sent.
    fn named(&self, answer: &Answer) -> usize {
        let policy = answer
            .policy
            .as_deref()
            .expect("RateLimit-Policy on every answer");
        assert_ne!(
            self.fields[0], self.fields[1],
            "the configurations send one field"
        );
        self.fields
            .iter()
            .position(|f| f == policy)
            .unwrap_or_else(|| panic!("{policy:?} names neither configuration"))
    }
}

fn cost_header(parts: &http::request::Parts) -> u64 {
    parts.headers["cost"]
        .to_str()
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(1)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Reloads interleaved with decisions: each answer equals the one the
    /// configuration in force alone gives from the state so far, and that
    /// configuration is the one last applied.
    #[test]
    fn every_decision_is_made_wholly_under_the_old_or_the_new_quota(
        old in numbers(),
        new in numbers(),
        steps in steps(),
    ) {
        let quotas = [old, new].map(Numbers::quota);
        let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
        let (router, reload) = app(&clock, old);
        let reference = Reference::new(&clock, [old, new]);
        let mut in_force = 0;
        let mut applied = 0;
        runtime().block_on(async {
            for step in steps {
                match step {
                    Step::Reload { to } => {
                        reload.apply(Quotas::new().quota(quotas[to].clone())).unwrap();
                        applied += 1;
                        in_force = to;
                    }
                    Step::Request { who, cost, after_ms } => {
                        clock.advance(Duration::from_millis(after_ms));
                        let answer = send(&router, who, cost).await;
                        let expected = send(&reference.routers[in_force], who, cost).await;
                        prop_assert_eq!(answer, expected);
                    }
                }
            }
            prop_assert_eq!(reload.generation(), applied);
            Ok(())
        })?;
    }
}

/// Another thread reloads without pause between two quotas while requests
/// are decided: every answer is one of the two quotas' whole answers from
/// the state so far, both quotas decide some, and the state carries over.
#[test]
fn decisions_under_a_reload_storm_are_each_wholly_old_or_new() {
    let configs = [
        Numbers {
            capacity: 3,
            refill: 30,
            per_minute: 10,
        },
        Numbers {
            capacity: 6,
            refill: 90,
            per_minute: 7,
        },
    ];
    let quotas = configs.map(Numbers::quota);
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let (router, reload) = app(&clock, configs[0]);
    let reference = Reference::new(&clock, configs);
    let stop = Arc::new(AtomicBool::new(false));
    let storm = {
        let (stop, quotas, reload) = (stop.clone(), quotas.clone(), reload.clone());
        std::thread::spawn(move || {
            let mut to = 1;
            while !stop.load(Ordering::Relaxed) {
                reload
                    .apply(Quotas::new().quota(quotas[to].clone()))
                    .unwrap();
                to = 1 - to;
            }
        })
    };
    let mut by_config = [0u32; 2];
    let mut admitted = 0u32;
    runtime().block_on(async {
        for i in 0..4_000u64 {
            clock.advance(Duration::from_millis(i % 7 * 150));
            let who = (i % 3) as usize;
            let cost = 1 + i % 2;
            let answer = send(&router, who, cost).await;
            let decided = reference.named(&answer);
            by_config[decided] += 1;
            admitted += u32::from(answer.status == StatusCode::OK);
            let expected = send(&reference.routers[decided], who, cost).await;
            assert_eq!(answer, expected, "request {i}, decided by {decided}");
        }
    });
    stop.store(true, Ordering::Relaxed);
    storm.join().unwrap();
    assert!(
        by_config[0] > 0 && by_config[1] > 0,
        "both quotas decided: {by_config:?}"
    );
    assert!(admitted > 0 && admitted < 4_000, "admitted {admitted}");
    assert!(reload.generation() > 0);
}

/// A bad configuration changes nothing: the same error as `build()`, the
/// generation unchanged, the old numbers still deciding.
#[tokio::test]
async fn a_bad_configuration_changes_nothing_and_says_what_build_would() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let five = Numbers {
        capacity: 5,
        refill: 1,
        per_minute: 100,
    };
    let (router, reload) = app(&clock, five);
    let empty = QuotaLayer::builder(MemoryStore::new())
        .quotas(Quotas::new())
        .build()
        .unwrap_err();
    assert_eq!(reload.check(&Quotas::new()), Err(empty.clone()));
    assert_eq!(reload.apply(Quotas::new()), Err(empty));
    // Two quotas of one name would share keys.
    let shared_name = Quotas::new().quota(five.quota()).plan("pro", five.quota());
    let err = reload.apply(shared_name).unwrap_err();
    assert_eq!(err.field(), "quota");
    assert!(err.reason().contains("share a name"), "{err}");
    assert_eq!(reload.generation(), 0);
    let mut codes = Vec::new();
    for _ in 0..6 {
        codes.push(send(&router, 0, 1).await.status.as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 200, 200, 429]);
}

/// Lowering a burst: a fresh key gets exactly the new burst, and a key
/// that used the old one gets nothing more than the new numbers allow.
#[tokio::test]
async fn a_lowered_burst_holds_for_fresh_and_spent_keys() {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    let burst = |capacity| Numbers {
        capacity,
        refill: 1,
        per_minute: 1_000,
    };
    let (router, reload) = app(&clock, burst(20));
    let admitted = |who| {
        let router = router.clone();
        async move {
            let mut n = 0;
            while send(&router, who, 1).await.status == StatusCode::OK {
                n += 1;
            }
            n
        }
    };
    assert_eq!(admitted(0).await, 20);
    reload.apply(Quotas::new().quota(burst(5).quota())).unwrap();
    assert_eq!(admitted(1).await, 5);
    assert_eq!(admitted(0).await, 0);
    // One token a minute refills, under the new numbers.
    clock.advance(MINUTE);
    assert_eq!(admitted(0).await, 1);
}

mod bounds {
    //! The bounds layers' caps and rules, changed while they run.

    use std::num::{NonZeroU32, NonZeroUsize};

    use axum::body::Body;
    use axum::routing::post;
    use axum::Router;
    use http::{Request, StatusCode};
    use tower::ServiceExt;
    use tower_admission::bounds::{
        BatchItemsLayer, BodyCaps, BodyLimitsLayer, QueryRules, ValidateQueryLayer,
    };

    async fn status(app: &Router, uri: &str, body: &str) -> StatusCode {
        let req = Request::post(uri)
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap();
        app.clone().oneshot(req).await.unwrap().status()
    }

    fn rules(max_page: u32) -> QueryRules {
        let page = |n| NonZeroU32::new(n).unwrap();
        QueryRules::new()
            .page_size(page(1), page(max_page))
            .unwrap()
    }

    #[tokio::test]
    async fn body_caps_query_rules_and_batch_items_change_while_running() {
        let body = BodyLimitsLayer::new(100, 100);
        let query = ValidateQueryLayer::new(rules(50));
        let items = BatchItemsLayer::new(NonZeroUsize::new(3).unwrap());
        let (body_reload, query_reload, items_reload) = (
            body.reload_handle(),
            query.reload_handle(),
            items.reload_handle(),
        );
        let app = Router::new()
            .route("/", post(|| async { "ok" }))
            .layer(items)
            .layer(query)
            .layer(body);
        let three = r#"{"items":[1,2,3]}"#;
        assert_eq!(status(&app, "/?page_size=50", three).await, StatusCode::OK);

        items_reload.apply(NonZeroUsize::new(2).unwrap()).unwrap();
        assert_eq!(
            status(&app, "/?page_size=50", three).await,
            StatusCode::PAYLOAD_TOO_LARGE
        );
        query_reload.apply(rules(10)).unwrap();
        let two = r#"{"items":[1,2]}"#;
        assert_eq!(
            status(&app, "/?page_size=50", two).await,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(status(&app, "/?page_size=10", two).await, StatusCode::OK);
        body_reload
            .apply(BodyCaps {
                wire_bytes: 10,
                decoded_bytes: 10,
            })
            .unwrap();
        assert_eq!(
            status(&app, "/?page_size=10", two).await,
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(
            [
                body_reload.generation(),
                query_reload.generation(),
                items_reload.generation()
            ],
            [1, 1, 1]
        );
    }
}
