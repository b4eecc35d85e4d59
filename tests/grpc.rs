//! The same layers around a real tonic service (the gRPC health service):
//! refusals are gRPC statuses, and RESOURCE_EXHAUSTED carries RetryInfo,
//! QuotaFailure and the `grpc-retry-pushback-ms` trailer.
#![cfg(feature = "tonic")]

use std::time::Duration;

use tonic::metadata::MetadataValue;
use tonic::transport::{Endpoint, Server};
use tonic::Code;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_types::StatusExt;
use tower::ServiceBuilder;
use tower_admission::clock::{ManualClock, Timestamp};
use tower_admission::identity::{ApiKeys, AuthenticateLayer, Identity};
use tower_admission::quota::{MemoryConfig, MemoryStore, Policy, Quota, QuotaLayer};

#[tokio::test]
async fn health_service_behind_auth_and_quota() {
    let (_reporter, health) = tonic_health::server::health_reporter();
    // 100 s into an hour.
    let clock = ManualClock::new(Timestamp::from_secs(1_800_000_000 / 3600 * 3600 + 100));
    let store = MemoryStore::with_config(MemoryConfig::default(), clock);
    let quota = Quota::new(
        "grpc",
        [Policy::fixed_window("per-hour", 2, Duration::from_secs(3600)).unwrap()],
    )
    .unwrap();
    let layers = ServiceBuilder::new()
        .layer(AuthenticateLayer::new(
            ApiKeys::new().with_key("demo-free", Identity::new("alice", "acme", "free")),
        ))
        .layer(QuotaLayer::builder(store).quota(quota).build().unwrap());

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        Server::builder()
            .layer(layers)
            .add_service(health)
            .serve_with_incoming(tokio_stream_from(listener)),
    );

    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();

    // No credential: UNAUTHENTICATED.
    let mut anonymous = HealthClient::new(channel.clone());
    let status = anonymous
        .check(HealthCheckRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);

    let token: MetadataValue<_> = "Bearer demo-free".parse().unwrap();
    let mut client = HealthClient::with_interceptor(channel, move |mut req: tonic::Request<()>| {
        req.metadata_mut().insert("authorization", token.clone());
        Ok(req)
    });
    for _ in 0..2 {
        client.check(HealthCheckRequest::default()).await.unwrap();
    }
    let status = client
        .check(HealthCheckRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    let retry = status.get_details_retry_info().expect("RetryInfo detail");
    let delay = retry.retry_delay.expect("retry delay");
    // The hourly window ends 3500 s from now.
    assert_eq!(delay, Duration::from_secs(3500));
    let failure = status.get_details_quota_failure().expect("QuotaFailure");
    let violated: Vec<&str> = failure
        .violations
        .iter()
        .map(|v| v.subject.as_str())
        .collect();
    assert_eq!(violated, ["per-hour"]);
    let pushback = status.metadata().get("grpc-retry-pushback-ms").unwrap();
    assert_eq!(pushback, "3500000");
    assert_eq!(status.metadata().get("retry-after").unwrap(), "3500");
    server.abort();
}

fn tokio_stream_from(
    listener: tokio::net::TcpListener,
) -> impl futures_util::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| stream);
        Some((accepted, listener))
    })
}
