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
use tower_admission::clock::{ManualClock, Timestamp};
use tower_admission::quota::{MemoryConfig, MemoryStore, Store};

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
    let clock = ManualClock::new(Timestamp::from_secs(1_800_000_000));
    (
        MemoryStore::with_config(MemoryConfig::default(), clock.clone()),
        clock,
    )
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
