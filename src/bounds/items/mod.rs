//! Item-count bound of a JSON batch `{"items": [...]}`.

mod future;
mod layer;
mod parse;
mod service;

pub use layer::BatchItemsLayer;

/// The item count of a batch request, inserted into the request extensions
/// by [`BatchItemsLayer`]'s service; read with [`BatchItemsLayer::item_cost`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ItemCount(pub(crate) usize);
