//! [`BatchItemsLayer`].

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tower::Layer;

use super::service::BatchItems;
use crate::reject::Rejection;
use crate::reload::{ReloadHandle, Target};
use crate::ConfigError;

/// Counts the items of a JSON batch `{"items": [...]}` before the inner
/// service runs, refusing more than `max` with 413 (cap `items`) and bad
/// JSON with 400.
///
/// Place it inside [`BodyLimitsLayer`](crate::bounds::BodyLimitsLayer)
/// (which bounds the bytes it buffers) and outside the quota layers, so
/// that a quota can charge per item ([`item_cost`](Self::item_cost)). It
/// reads the whole (capped) body, counts items without building them (as
/// [`parse`](Self::parse) does, without building the items), records the
/// count in the request extensions and hands the same bytes on as a
/// `Full<Bytes>` body; the handler then reads the items with
/// [`parse`](Self::parse). Apply it only to batch routes (axum's
/// `route_layer` or a method router's `layer`): a request without a JSON
/// object body is refused. The content type is not checked.
///
/// A body read error is answered with 400 naming `body`; when that error is
/// a byte cap of [`BodyLimitsLayer`](crate::bounds::BodyLimitsLayer), that layer replaces the
/// answer with its 413.
///
/// Clones, and the services built from them, share the cap in force.
#[derive(Debug, Clone)]
pub struct BatchItemsLayer {
    max: Arc<AtomicUsize>,
}

impl BatchItemsLayer {
    /// Refuses batches of more than `max` items.
    pub fn new(max: NonZeroUsize) -> Self {
        BatchItemsLayer {
            max: Arc::new(AtomicUsize::new(max.get())),
        }
    }

    /// Parses a batch `{"items": [...]}`, refusing it once the array has
    /// more than `max` items: what a handler behind this layer reads the
    /// items with.
    ///
    /// The count is checked while the array is read: the parser stops at
    /// the first item past the cap, so at most `max` values of `T` are ever
    /// built, and a refused batch builds none that reach the caller. Other
    /// members of the object are ignored; a second `items` member is
    /// refused. The refusal is the one this layer answers with:
    /// [`TooManyItems`](crate::reject::Rejection::TooManyItems) (413), or
    /// [`InvalidParameters`](crate::reject::Rejection::InvalidParameters)
    /// naming `body`, or `items[i]` for a bad item (400).
    ///
    /// ```
    /// use tower_admission::bounds::BatchItemsLayer;
    /// use tower_admission::reject::Rejection;
    ///
    /// let ok: Vec<u32> = BatchItemsLayer::parse(br#"{"items":[1,2,3]}"#, 3).unwrap();
    /// assert_eq!(ok.len(), 3);
    /// let over = BatchItemsLayer::parse::<u32>(br#"{"items":[1,2,3,4]}"#, 3);
    /// assert_eq!(over, Err(Rejection::TooManyItems { limit: 3 }));
    /// ```
    pub fn parse<T>(json: &[u8], max: usize) -> Result<Vec<T>, Rejection>
    where
        T: for<'de> serde::Deserialize<'de>,
    {
        super::parse::parse_batch(json, max)
    }

    /// The item count this layer's service recorded for the request: the
    /// cost function of a quota layer inside it that charges per item
    /// (0 for a request this layer did not count).
    ///
    /// ```
    /// use std::num::NonZeroUsize;
    /// use std::time::Duration;
    /// use tower_admission::bounds::BatchItemsLayer;
    /// use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer};
    ///
    /// let items = Quota::new("items", [Policy::token_bucket("items", 1000, 1000, Duration::from_secs(60))?])?;
    /// let charge = QuotaLayer::builder(MemoryStore::new())
    ///     .quota(items)
    ///     .cost(BatchItemsLayer::item_cost)
    ///     .build()?;
    /// let count = BatchItemsLayer::new(NonZeroUsize::new(1000).unwrap());
    /// // A request meets `count` first, then `charge`.
    /// let stack = tower::ServiceBuilder::new().layer(count).layer(charge);
    /// # let _ = stack;
    /// # Ok::<(), tower_admission::ConfigError>(())
    /// ```
    pub fn item_cost(parts: &http::request::Parts) -> u64 {
        parts
            .extensions
            .get::<super::ItemCount>()
            .map_or(0, |n| u64::try_from(n.0).unwrap_or(u64::MAX))
    }

    /// Changes the most items of this layer, its clones and every service
    /// built from them while they run; a batch is counted against the cap
    /// in force when it arrives.
    pub fn reload_handle(&self) -> ReloadHandle<NonZeroUsize> {
        ReloadHandle::new(Arc::new(MaxTarget(Arc::clone(&self.max))))
    }
}

/// The layer's side of its [`ReloadHandle`].
struct MaxTarget(Arc<AtomicUsize>);

impl Target<NonZeroUsize> for MaxTarget {
    fn check(&self, _: &NonZeroUsize) -> Result<(), ConfigError> {
        Ok(())
    }

    fn swap(&self, new: NonZeroUsize) {
        self.0.store(new.get(), Ordering::Relaxed);
    }
}

impl<S> Layer<S> for BatchItemsLayer {
    type Service = BatchItems<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BatchItems {
            inner,
            max: Arc::clone(&self.max),
        }
    }
}
