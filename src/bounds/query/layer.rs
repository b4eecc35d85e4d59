//! [`ValidateQueryLayer`].

use tower::Layer;

use super::rules::QueryRules;
use super::service::ValidateQuery;

/// Validates the query string with [`QueryRules`] before the inner service
/// runs. Builds [`ValidateQuery`].
#[derive(Debug, Clone)]
pub struct ValidateQueryLayer {
    rules: QueryRules,
}

impl ValidateQueryLayer {
    /// A layer applying `rules`.
    pub fn new(rules: QueryRules) -> Self {
        ValidateQueryLayer { rules }
    }
}

impl<S> Layer<S> for ValidateQueryLayer {
    type Service = ValidateQuery<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ValidateQuery {
            inner,
            rules: self.rules.clone(),
        }
    }
}
