//! A client for `reports.v1.Reports`, written by hand over tonic's generic
//! gRPC client: what `tonic-build` would generate for one unary method, plus
//! the API key as `authorization` metadata.

use tonic::client::Grpc;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

use crate::proto::{ListReportsRequest, ListReportsResponse, LIST_REPORTS};

/// A `reports.v1.Reports` client. Clones share the connection.
#[derive(Debug, Clone)]
pub(crate) struct ReportsClient {
    inner: Grpc<Channel>,
    key: Option<AsciiMetadataValue>,
}

impl ReportsClient {
    /// Connects to `url`, such as `http://127.0.0.1:50051`.
    pub(crate) async fn connect(url: String) -> Result<Self, tonic::transport::Error> {
        let channel = Endpoint::from_shared(url)?.connect().await?;
        Ok(ReportsClient {
            inner: Grpc::new(channel),
            key: None,
        })
    }

    /// Sends `authorization: Bearer KEY` with every call.
    pub(crate) fn with_key(mut self, key: &str) -> Result<Self, Status> {
        let value: AsciiMetadataValue = MetadataValue::try_from(format!("Bearer {key}"))
            .map_err(|_| Status::invalid_argument("the key must be visible ASCII"))?;
        self.key = Some(value);
        Ok(self)
    }

    /// `ListReports`.
    pub(crate) async fn list_reports(
        &mut self,
        message: ListReportsRequest,
    ) -> Result<Response<ListReportsResponse>, Status> {
        self.inner
            .ready()
            .await
            .map_err(|e| Status::unavailable(format!("not ready: {e}")))?;
        let mut request = Request::new(message);
        if let Some(key) = &self.key {
            request.metadata_mut().insert("authorization", key.clone());
        }
        let path = PathAndQuery::from_static(LIST_REPORTS);
        self.inner.unary(request, path, ProstCodec::default()).await
    }
}
