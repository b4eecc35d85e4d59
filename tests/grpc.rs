//! The same layers around real tonic services (the gRPC health service, and
//! a streaming one): refusals are gRPC statuses, RESOURCE_EXHAUSTED carries
//! RetryInfo, QuotaFailure and the `grpc-retry-pushback-ms` trailer, and a
//! streaming call is one quota decision whose messages share the body cap.
#![cfg(feature = "tonic")]

use std::time::Duration;

use tonic::metadata::MetadataValue;
use tonic::transport::{Endpoint, Server};
use tonic::{Code, Status};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_types::StatusExt;
use tower::ServiceBuilder;
use tower_admission::clock::ManualClock;
use tower_admission::identity::{ApiKeys, AuthenticateLayer, Identity};
use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer};

#[tokio::test]
async fn health_service_behind_auth_and_quota() {
    let (_reporter, health) = tonic_health::server::health_reporter();
    // 100 s into an hour.
    let clock = ManualClock::new(Duration::from_secs(1_800_000_000 / 3600 * 3600 + 100));
    let store = MemoryStore::with_clock(clock);
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

/// A hand-written `test.Streams` service over the health messages:
/// `Count` (client streaming) answers how many messages it read, `Echo`
/// (bidirectional) answers each message with the count so far.
mod streams {
    use std::convert::Infallible;
    use std::task::{Context, Poll};

    use futures_util::StreamExt;
    use tonic::codegen::{BoxFuture, BoxStream, Service};
    use tonic::server::{ClientStreamingService, Grpc, NamedService, StreamingService};
    use tonic::{Request, Response, Status, Streaming};
    use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
    use tonic_prost::ProstCodec;

    pub(super) const COUNT: &str = "/test.Streams/Count";
    pub(super) const ECHO: &str = "/test.Streams/Echo";

    #[derive(Clone)]
    pub(super) struct Streams;

    impl NamedService for Streams {
        const NAME: &'static str = "test.Streams";
    }

    struct Count;

    impl ClientStreamingService<HealthCheckRequest> for Count {
        type Response = HealthCheckResponse;
        type Future = BoxFuture<Response<HealthCheckResponse>, Status>;

        fn call(&mut self, request: Request<Streaming<HealthCheckRequest>>) -> Self::Future {
            Box::pin(async move {
                let mut stream = request.into_inner();
                let mut count = 0;
                while let Some(message) = stream.next().await {
                    message?;
                    count += 1;
                }
                Ok(Response::new(HealthCheckResponse { status: count }))
            })
        }
    }

    struct Echo;

    impl StreamingService<HealthCheckRequest> for Echo {
        type Response = HealthCheckResponse;
        type ResponseStream = BoxStream<HealthCheckResponse>;
        type Future = BoxFuture<Response<Self::ResponseStream>, Status>;

        fn call(&mut self, request: Request<Streaming<HealthCheckRequest>>) -> Self::Future {
            let stream = request.into_inner();
            let echoes = stream.scan(0, |count, message| {
                *count += 1;
                let status = *count;
                std::future::ready(Some(message.map(|_| HealthCheckResponse { status })))
            });
            Box::pin(async move { Ok(Response::new(Box::pin(echoes) as Self::ResponseStream)) })
        }
    }

    impl Service<http::Request<tonic::body::Body>> for Streams {
        type Response = http::Response<tonic::body::Body>;
        type Error = Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
            Box::pin(async move {
                let mut grpc = Grpc::new(ProstCodec::default());
                Ok(match request.uri().path() {
                    COUNT => grpc.client_streaming(Count, request).await,
                    ECHO => grpc.streaming(Echo, request).await,
                    path => Status::unimplemented(path.to_owned()).into_http(),
                })
            })
        }
    }
}

/// Streaming calls behind a body cap of 1 KiB and an aggregate quota of 2
/// calls per hour.
async fn streaming_server() -> (
    tonic::client::Grpc<tonic::transport::Channel>,
    tokio::task::JoinHandle<()>,
) {
    use tower_admission::bounds::BodyLimitsLayer;

    let clock = ManualClock::new(Duration::from_secs(1_800_000_000 / 3600 * 3600));
    let store = MemoryStore::with_clock(clock);
    let quota = Quota::new(
        "streams",
        [Policy::fixed_window("per-hour", 2, Duration::from_secs(3600)).unwrap()],
    )
    .unwrap();
    let layers = ServiceBuilder::new()
        .layer(BodyLimitsLayer::new(1024, 4096))
        .layer(
            QuotaLayer::builder(store)
                .quota(quota)
                .aggregate()
                .build()
                .unwrap(),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        Server::builder()
            .layer(layers)
            .add_service(streams::Streams)
            .serve_with_incoming(tokio_stream_from(listener))
            .await
            .unwrap();
    });
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    (tonic::client::Grpc::new(channel), server)
}

fn messages(n: usize, bytes: usize) -> impl futures_util::Stream<Item = HealthCheckRequest> {
    futures_util::stream::iter((0..n).map(move |_| HealthCheckRequest {
        service: "s".repeat(bytes),
    }))
}

/// A streaming call is one quota decision however many messages it sends,
/// and the wire cap counts all its messages together.
#[tokio::test]
async fn a_client_stream_costs_one_call_and_its_messages_share_the_body_cap() {
    use tonic::codegen::http::uri::PathAndQuery;
    use tonic_health::pb::HealthCheckResponse;

    let (mut client, server) = streaming_server().await;
    let count = |n: usize, bytes: usize| {
        let mut client = client.clone();
        async move {
            client.ready().await.unwrap();
            client
                .client_streaming::<_, _, HealthCheckResponse, _>(
                    tonic::Request::new(messages(n, bytes)),
                    PathAndQuery::from_static(streams::COUNT),
                    tonic_prost::ProstCodec::default(),
                )
                .await
                .map(|r| r.into_inner().status)
        }
    };
    // Five messages of 200 bytes each are within the cap one by one, not
    // together: the fifth crosses 1024 bytes.
    let status = count(5, 200).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "the wire-bytes cap of 1024 was exceeded");
    assert_eq!(
        status.metadata().get("grpc-retry-pushback-ms").unwrap(),
        "-1"
    );
    // That call took the first of the two quota units; 4 messages fit.
    assert_eq!(count(4, 200).await.unwrap(), 4);
    let status = count(1, 1).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        status.message(),
        "quota policy per-hour refused; retry after 3600 s"
    );
    client.ready().await.unwrap();
    server.abort();
}

/// Once a bidirectional call has answered, a cap tripped later cannot
/// replace the response headers: the handler sees the failed read of its
/// request stream, and the status in the trailers becomes the cap's refusal.
#[tokio::test]
async fn a_cap_tripped_after_a_streaming_answer_ends_the_call_with_the_cap_refusal() {
    use futures_util::StreamExt;
    use tonic::codegen::http::uri::PathAndQuery;
    use tonic_health::pb::HealthCheckResponse;

    let (mut client, server) = streaming_server().await;
    client.ready().await.unwrap();
    let response = client
        .streaming::<_, _, HealthCheckResponse, _>(
            tonic::Request::new(messages(5, 200)),
            PathAndQuery::from_static(streams::ECHO),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .unwrap();
    let results: Vec<Result<i32, Status>> = response
        .into_inner()
        .map(|r| r.map(|m| m.status))
        .collect()
        .await;
    // Every message before the one that crossed the cap in its chunk of the
    // stream is echoed (how many depends on how the stream was chunked),
    // then the call ends with the wire cap's refusal, not the handler's
    // status for the failed read.
    let (last, echoed) = results.split_last().unwrap();
    let echoed: Vec<i32> = echoed.iter().map(|r| *r.as_ref().unwrap()).collect();
    assert_eq!(echoed, (1..=echoed.len() as i32).collect::<Vec<_>>());
    assert!(echoed.len() < 5, "{echoed:?}");
    let status = last.as_ref().unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "the wire-bytes cap of 1024 was exceeded");
    assert_eq!(
        status.metadata().get("grpc-retry-pushback-ms").unwrap(),
        "-1"
    );
    assert!(status.details().is_empty(), "{status:?}");
    server.abort();
}
