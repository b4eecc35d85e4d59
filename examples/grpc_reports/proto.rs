//! The messages of `reports.v1`, written by hand with `prost`'s derive so
//! that building the example needs no `protoc`. `reports.proto` beside this
//! file is the same schema, for tools such as grpcurl.

/// `reports.v1.ListReportsRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ListReportsRequest {
    /// Reports per page, 1 to 100; 0 means the default, 20.
    #[prost(uint32, tag = "1")]
    pub(crate) page_size: u32,
    /// Which metric; empty means `requests`.
    #[prost(string, tag = "2")]
    pub(crate) metric: String,
}

/// `reports.v1.Report`: one hourly value of a metric.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Report {
    /// The metric.
    #[prost(string, tag = "1")]
    pub(crate) metric: String,
    /// The hour, as an index from the start of the series.
    #[prost(uint64, tag = "2")]
    pub(crate) hour: u64,
    /// The value.
    #[prost(uint64, tag = "3")]
    pub(crate) value: u64,
}

/// `reports.v1.ListReportsResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ListReportsResponse {
    /// Who asked: the authenticated subject.
    #[prost(string, tag = "1")]
    pub(crate) subject: String,
    /// The page.
    #[prost(message, repeated, tag = "2")]
    pub(crate) reports: Vec<Report>,
}

/// The service's full name.
pub(crate) const SERVICE: &str = "reports.v1.Reports";
/// The path of `ListReports`.
pub(crate) const LIST_REPORTS: &str = "/reports.v1.Reports/ListReports";
