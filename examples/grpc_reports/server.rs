//! The `reports.v1.Reports` service, written by hand (what `tonic-build`
//! would generate, for one unary method), and the server that wraps it in
//! the admission layers:
//!
//! ```text
//! authenticate -> per-user quota (plan free or pro) -> concurrency caps -> Reports
//! ```
//!
//! Every refusal is a gRPC status built by `tower_admission::reject`:
//! `UNAUTHENTICATED` without a known key, `RESOURCE_EXHAUSTED` with
//! `RetryInfo`, `QuotaFailure` and `grpc-retry-pushback-ms` when the quota is
//! used up, `UNAVAILABLE` with `RetryInfo` when the limiter cannot decide.

use std::convert::Infallible;
use std::future::Future;
use std::task::{Context, Poll};

use tonic::codegen::{BoxFuture, Service, StdError};
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tonic_types::{ErrorDetails, StatusExt};
use tower::ServiceBuilder;
use tower_admission::identity::{AuthenticateLayer, Identity};
use tower_admission::quota::{QuotaLayer, Store};

use crate::config;
use crate::proto::{ListReportsRequest, ListReportsResponse, Report, LIST_REPORTS, SERVICE};

/// Any error of building or running the server.
pub(crate) type Error = Box<dyn std::error::Error + Send + Sync>;

/// Serves `reports.v1.Reports` on `listener` behind the admission layers,
/// every quota in `store`, until `shutdown` completes.
pub(crate) async fn serve<St: Store>(
    store: St,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let shared = config::shared();
    let quotas = shared.quotas().map_err(|e| e.to_string())?;
    let per_user = quotas
        .requests
        .iter()
        .fold(QuotaLayer::builder(store), |layer, (plan, quota)| {
            if *plan == shared.default_plan {
                layer.quota(quota.clone())
            } else {
                layer.plan(plan, quota.clone())
            }
        })
        .build()?;
    let layers = ServiceBuilder::new()
        .layer(AuthenticateLayer::new(shared.api_keys()))
        .layer(per_user)
        .layer(shared.concurrency_layer()?);
    Server::builder()
        .layer(layers)
        .add_service(ReportsServer)
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), shutdown)
        .await?;
    Ok(())
}

/// The service: routes `ListReports`, answers `UNIMPLEMENTED` otherwise.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReportsServer;

impl NamedService for ReportsServer {
    const NAME: &'static str = SERVICE;
}

impl<B> Service<http::Request<B>> for ReportsServer
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != LIST_REPORTS {
            let path = request.uri().path().to_owned();
            return Box::pin(async move {
                Ok(Status::unimplemented(format!("no method {path}")).into_http())
            });
        }
        Box::pin(async move {
            let mut grpc = Grpc::new(ProstCodec::default())
                .apply_max_message_size_config(Some(config::MAX_MESSAGE_BYTES), None);
            Ok(grpc.unary(ListReports, request).await)
        })
    }
}

/// The `ListReports` handler as a tonic unary service.
struct ListReports;

impl UnaryService<ListReportsRequest> for ListReports {
    type Response = ListReportsResponse;
    type Future = BoxFuture<tonic::Response<ListReportsResponse>, Status>;

    fn call(&mut self, request: tonic::Request<ListReportsRequest>) -> Self::Future {
        Box::pin(async move { list_reports(request) })
    }
}

/// A page of fake hourly values for the authenticated caller.
fn list_reports(
    request: tonic::Request<ListReportsRequest>,
) -> Result<tonic::Response<ListReportsResponse>, Status> {
    // The authentication layer put the caller here; without it the call
    // never reaches the handler.
    let subject = request
        .extensions()
        .get::<Identity>()
        .map(|who| who.subject().to_owned())
        .ok_or_else(|| Status::unauthenticated("no identity"))?;
    let message = request.into_inner();
    let page_size = match message.page_size {
        0 => config::shared().query.default_page_size,
        n if n <= config::shared().query.max_page_size => n,
        n => {
            return Err(Status::with_error_details(
                Code::InvalidArgument,
                format!(
                    "page_size {n} is more than {}",
                    config::shared().query.max_page_size
                ),
                ErrorDetails::with_bad_request_violation(
                    "page_size",
                    format!("must be at most {}", config::shared().query.max_page_size),
                ),
            ))
        }
    };
    let metric = if message.metric.is_empty() {
        "requests".to_owned()
    } else {
        message.metric
    };
    let reports = (0..u64::from(page_size))
        .map(|hour| Report {
            value: (hour * 7919 + metric.len() as u64 * 31) % 1000,
            metric: metric.clone(),
            hour,
        })
        .collect();
    Ok(tonic::Response::new(ListReportsResponse {
        subject,
        reports,
    }))
}
