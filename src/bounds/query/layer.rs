//! [`ValidateQueryLayer`].

use std::sync::Arc;

use tower::Layer;

use super::rules::QueryRules;
use super::service::ValidateQuery;
use crate::reload::{Live, ReloadHandle, Target};
use crate::ConfigError;

/// Validates the query string with [`QueryRules`] before the inner service
/// runs.
///
/// Clones, and the services built from them, share the rules in force.
#[derive(Debug, Clone)]
pub struct ValidateQueryLayer {
    rules: Arc<Live<QueryRules>>,
}

impl ValidateQueryLayer {
    /// A layer applying `rules`.
    pub fn new(rules: QueryRules) -> Self {
        ValidateQueryLayer {
            rules: Arc::new(Live::new(rules)),
        }
    }

    /// Replaces the rules of this layer, its clones and every service built
    /// from them while they run; a request is validated wholly under the
    /// old rules or wholly under the new. [`QueryRules`] are checked when
    /// they are built, so every apply succeeds.
    pub fn reload_handle(&self) -> ReloadHandle<QueryRules> {
        ReloadHandle::new(Arc::new(RulesTarget(Arc::clone(&self.rules))))
    }
}

/// The layer's side of its [`ReloadHandle`].
struct RulesTarget(Arc<Live<QueryRules>>);

impl Target<QueryRules> for RulesTarget {
    fn check(&self, _: &QueryRules) -> Result<(), ConfigError> {
        Ok(())
    }

    fn swap(&self, new: QueryRules) {
        self.0.store(new);
    }
}

impl<S> Layer<S> for ValidateQueryLayer {
    type Service = ValidateQuery<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ValidateQuery {
            inner,
            rules: Arc::clone(&self.rules),
        }
    }
}
