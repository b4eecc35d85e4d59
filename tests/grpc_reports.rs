//! The gRPC reporting example, in-process, through a real tonic client:
//! exact admissions on a frozen clock, and the statuses, details and
//! pushback a gRPC client sees when it is refused.
#![cfg(feature = "tonic")]

#[path = "support/down_store.rs"]
mod down_store;

#[path = "../examples/grpc_reports/client.rs"]
mod client;
#[path = "../examples/grpc_reports/config.rs"]
mod config;
#[path = "../examples/grpc_reports/proto.rs"]
mod proto;
#[path = "../examples/grpc_reports/server.rs"]
mod server;

use std::time::Duration;

use client::ReportsClient;
use down_store::Down;
use proto::ListReportsRequest;
use tokio::sync::oneshot;
use tonic::{Code, Status};
use tonic_types::StatusExt;
use tower_admission::clock::ManualClock;
use tower_admission::quota::{MemoryStore, Store};

/// The server on a free port; dropping it shuts the server down.
struct Running {
    url: String,
    _stop: oneshot::Sender<()>,
}

async fn start<St: Store>(store: St) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        server::serve(store, listener, shutdown).await.unwrap();
    });
    Running { url, _stop: stop }
}

fn frozen() -> (MemoryStore<ManualClock>, ManualClock) {
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000));
    (MemoryStore::with_clock(clock.clone()), clock)
}

async fn client(server: &Running, key: Option<&str>) -> ReportsClient {
    let client = ReportsClient::connect(server.url.clone()).await.unwrap();
    match key {
        Some(key) => client.with_key(key).unwrap(),
        None => client,
    }
}

fn page(page_size: u32) -> ListReportsRequest {
    ListReportsRequest {
        page_size,
        metric: String::new(),
    }
}

/// `n` immediate calls: how many were admitted, and the refusals.
async fn calls(client: &mut ReportsClient, n: usize) -> (usize, Vec<Status>) {
    let mut admitted = 0;
    let mut refused = Vec::new();
    for _ in 0..n {
        match client.list_reports(page(5)).await {
            Ok(_) => admitted += 1,
            Err(status) => refused.push(status),
        }
    }
    (admitted, refused)
}

fn metadata<'a>(status: &'a Status, name: &str) -> &'a str {
    status
        .metadata()
        .get(name)
        .unwrap_or_else(|| panic!("no {name} in {status:?}"))
        .to_str()
        .unwrap()
}

/// The burst's refusal: RESOURCE_EXHAUSTED, one token (0.6 s) away, which
/// every signal rounds up to 1 s.
fn assert_burst_refusal(status: &Status) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        status.message(),
        "quota policy burst refused; retry after 1 s"
    );
    let details = status.get_error_details();
    let retry = details.retry_info().expect("RetryInfo");
    assert_eq!(retry.retry_delay, Some(Duration::from_secs(1)));
    let failure = details.quota_failure().expect("QuotaFailure");
    let violated: Vec<(&str, &str)> = failure
        .violations
        .iter()
        .map(|v| (v.subject.as_str(), v.quota_id.as_str()))
        .collect();
    assert_eq!(violated, [("burst", "burst")]);
    assert_eq!(metadata(status, "grpc-retry-pushback-ms"), "1000");
    assert_eq!(metadata(status, "retry-after"), "1");
    assert_eq!(
        metadata(status, "ratelimit"),
        "\"per-minute\";r=80;t=60, \"burst\";r=0;t=12"
    );
}

#[tokio::test]
async fn free_key_gets_exactly_the_burst_then_resource_exhausted() {
    let (store, clock) = frozen();
    let server = start(store).await;
    let mut alice = client(&server, Some("demo-free")).await;

    let (admitted, refused) = calls(&mut alice, 25).await;
    assert_eq!(admitted, 20);
    assert_eq!(refused.len(), 5);
    refused.iter().for_each(assert_burst_refusal);

    // Waiting as told (one token, 0.6 s) admits exactly one more call.
    clock.advance(Duration::from_millis(600));
    let (admitted, refused) = calls(&mut alice, 2).await;
    assert_eq!(admitted, 1);
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0].code(), Code::ResourceExhausted);

    // The quota is per user: carol (free) has her own burst, bob is pro.
    let mut carol = client(&server, Some("demo-globex")).await;
    assert_eq!(calls(&mut carol, 25).await.0, 20);
    let mut bob = client(&server, Some("demo-pro")).await;
    assert_eq!(calls(&mut bob, 25).await.0, 25);
}

#[tokio::test]
async fn admitted_calls_reach_the_handler_as_the_caller() {
    let (store, _clock) = frozen();
    let server = start(store).await;
    let mut bob = client(&server, Some("demo-pro")).await;
    let response = bob.list_reports(page(0)).await.unwrap().into_inner();
    assert_eq!(response.subject, "bob");
    assert_eq!(
        response.reports.len(),
        config::shared().query.default_page_size as usize
    );
    assert_eq!(response.reports[0].metric, "requests");

    // A page over the maximum is the handler's INVALID_ARGUMENT, naming it.
    let status = bob.list_reports(page(101)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let bad = status.get_details_bad_request().expect("BadRequest");
    assert_eq!(bad.field_violations[0].field, "page_size");
    assert_eq!(config::DEFAULT_LISTEN, "127.0.0.1:50051");
}

#[tokio::test]
async fn without_a_known_key_calls_are_unauthenticated() {
    let (store, _clock) = frozen();
    let server = start(store).await;
    for key in [None, Some("demo-nope")] {
        let mut anonymous = client(&server, key).await;
        let status = anonymous.list_reports(page(5)).await.unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{key:?}");
        // No wait helps: a client with a retry policy must not retry.
        assert_eq!(metadata(&status, "grpc-retry-pushback-ms"), "-1");
        assert!(status.metadata().get("retry-after").is_none());
    }
}

#[tokio::test]
async fn a_down_limiter_fails_closed_with_unavailable() {
    let server = start(Down).await;
    let mut alice = client(&server, Some("demo-free")).await;
    let (admitted, refused) = calls(&mut alice, 3).await;
    assert_eq!(admitted, 0);
    for status in refused {
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert_eq!(
            status.message(),
            "the rate limiter could not decide in time"
        );
        let details = status.get_error_details();
        assert_eq!(
            details.retry_info().expect("RetryInfo").retry_delay,
            Some(Duration::from_secs(1))
        );
        assert!(details.quota_failure().is_none());
        assert_eq!(metadata(&status, "grpc-retry-pushback-ms"), "1000");
        assert_eq!(metadata(&status, "retry-after"), "1");
        assert_eq!(
            metadata(&status, "ratelimit"),
            "\"per-minute\";r=0;t=1, \"burst\";r=0;t=1"
        );
    }
}

/// The example's service behind body caps and a global concurrency cap of
/// one with a queue of one, its handler held until `release` fires.
mod capped {
    use super::*;
    use std::sync::Arc;
    use std::task::{Context, Poll};
    use tokio::sync::Semaphore;
    use tonic::codegen::{BoxFuture, Service};
    use tonic::server::NamedService;
    use tonic::transport::server::TcpIncoming;
    use tonic::transport::Server;
    use tower::ServiceBuilder;
    use tower_admission::bounds::BodyLimitsLayer;
    use tower_admission::concurrency::ConcurrencyLayer;

    /// [`server::ReportsServer`] that waits for a permit of `gate` first.
    #[derive(Clone)]
    pub(super) struct Gated {
        pub(super) gate: Arc<Semaphore>,
    }

    impl NamedService for Gated {
        const NAME: &'static str = proto::SERVICE;
    }

    impl Service<http::Request<tonic::body::Body>> for Gated {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
            let gate = self.gate.clone();
            Box::pin(async move {
                let _permit = gate.acquire().await.unwrap();
                server::ReportsServer.call(request).await
            })
        }
    }

    pub(super) const WIRE_CAP: usize = 1024;
    pub(super) const QUEUE_DEADLINE: Duration = Duration::from_secs(3);

    pub(super) async fn start(gate: Arc<Semaphore>) -> (Running, ConcurrencyLayer) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let concurrency = ConcurrencyLayer::builder()
            .global(1, 1, QUEUE_DEADLINE)
            .build()
            .unwrap();
        let layers = ServiceBuilder::new()
            .layer(BodyLimitsLayer::new(WIRE_CAP, 4 * WIRE_CAP))
            .layer(concurrency.clone());
        tokio::spawn(async move {
            Server::builder()
                .layer(layers)
                .add_service(Gated { gate })
                .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        (Running { url, _stop: stop }, concurrency)
    }
}

/// A message over the wire cap (sent without `content-length`, as every
/// HTTP/2 gRPC client does) is RESOURCE_EXHAUSTED with no retry, whatever
/// the handler made of its failed read; one under it is served.
#[tokio::test]
async fn a_message_over_the_wire_cap_is_resource_exhausted() {
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(100));
    let (server, _) = capped::start(gate).await;
    let mut client = client(&server, None).await;
    let small = ListReportsRequest {
        page_size: 1,
        metric: "m".repeat(capped::WIRE_CAP / 2),
    };
    let status = client.list_reports(small).await.unwrap_err();
    // No authentication layer here: the handler itself finds no identity.
    assert_eq!(status.code(), Code::Unauthenticated);
    assert_eq!(status.message(), "no identity");

    let big = ListReportsRequest {
        page_size: 1,
        metric: "m".repeat(capped::WIRE_CAP * 2),
    };
    let status = client.list_reports(big).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        status.message(),
        format!("the wire-bytes cap of {} was exceeded", capped::WIRE_CAP)
    );
    assert_eq!(metadata(&status, "grpc-retry-pushback-ms"), "-1");
    assert!(status.metadata().get("retry-after").is_none());
}

/// A call that waits out the queue deadline is UNAVAILABLE with RetryInfo
/// and pushback of the deadline; one that finds the queue full is refused at
/// once the same way.
#[tokio::test(start_paused = true)]
async fn a_call_past_the_queue_deadline_is_unavailable_with_pushback() {
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let (server, concurrency) = capped::start(gate.clone()).await;
    let first = client(&server, None).await;
    let held = tokio::spawn({
        let mut first = first.clone();
        async move { first.list_reports(page(1)).await }
    });
    // Let the first call reach the handler and hold the only permit.
    assert!(yielding_until(|| concurrency.in_flight() == 1).await);
    let mut queued = first.clone();
    let status = queued.list_reports(page(1)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(status.message(), "the service is at its concurrency limit");
    let retry = status.get_details_retry_info().expect("RetryInfo");
    assert_eq!(retry.retry_delay, Some(capped::QUEUE_DEADLINE));
    assert_eq!(metadata(&status, "grpc-retry-pushback-ms"), "3000");
    assert_eq!(metadata(&status, "retry-after"), "3");
    gate.add_permits(1);
    let held = held.await.unwrap().unwrap_err();
    assert_eq!(held.code(), Code::Unauthenticated);
}

/// A queued call whose `grpc-timeout` ends before the queue deadline ends
/// at its own deadline, CANCELLED by tonic's server (which enforces the
/// timeout around the layers), and it leaves the queue then.
#[tokio::test(start_paused = true)]
async fn a_queued_call_leaves_the_queue_at_its_grpc_timeout() {
    use tonic::codegen::http::uri::PathAndQuery;

    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let (server, concurrency) = capped::start(gate.clone()).await;
    let first = client(&server, None).await;
    let held = tokio::spawn({
        let mut first = first.clone();
        async move { first.list_reports(page(1)).await }
    });
    assert!(yielding_until(|| concurrency.in_flight() == 1).await);
    let channel = tonic::transport::Endpoint::from_shared(server.url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(page(1));
    request.set_timeout(Duration::from_millis(500));
    let started = tokio::time::Instant::now();
    let status = grpc
        .unary::<_, proto::ListReportsResponse, _>(
            request,
            PathAndQuery::from_static(proto::LIST_REPORTS),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");
    assert_eq!(started.elapsed(), Duration::from_millis(500));
    assert!(yielding_until(|| concurrency.queued() == 0).await);
    assert_eq!(concurrency.in_flight(), 1);
    gate.add_permits(2);
    assert_eq!(
        held.await.unwrap().unwrap_err().code(),
        Code::Unauthenticated
    );
}

/// Yields to the server's tasks until `done`, without advancing a paused
/// clock; false if it never happened.
async fn yielding_until(done: impl Fn() -> bool) -> bool {
    for _ in 0..100_000 {
        if done() {
            return true;
        }
        tokio::task::yield_now().await;
    }
    done()
}
