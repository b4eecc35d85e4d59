//! Page and range validation of the query string.

#[cfg(feature = "axum")]
mod extract;
mod future;
mod layer;
mod pairs;
mod rules;
mod service;
mod stamp;

pub use layer::ValidateQueryLayer;
pub use rules::{QueryRules, ValidatedQuery};

/// Name of the page size parameter.
pub(crate) const PAGE_SIZE: &str = "page_size";
/// Name of the range start parameter (inclusive), RFC 3339.
pub(crate) const FROM: &str = "from";
/// Name of the range end parameter (exclusive), RFC 3339.
pub(crate) const TO: &str = "to";
/// Name of the opaque cursor parameter.
pub(crate) const CURSOR: &str = "cursor";

#[cfg(test)]
mod tests;
