//! Item-count bound of a JSON batch `{"items": [...]}`.

#[cfg(feature = "axum")]
mod extract;
mod future;
mod layer;
mod parse;
mod service;

#[cfg(feature = "axum")]
pub use extract::Batch;
pub use layer::BatchItemsLayer;

/// The item count of a batch request, inserted into the request extensions
/// by [`BatchItemsLayer`]'s service so that later layers (a quota's cost function) and the
/// handler can read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ItemCount(pub usize);
