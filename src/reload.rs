#![doc = include_str!("../docs/reload.md")]

use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::ConfigError;

/// Changes the numbers of a running layer: [`check`](Self::check) a new
/// configuration, [`apply`](Self::apply) it. Taken from the layer (for
/// example [`QuotaLayer::reload_handle`](crate::quota::QuotaLayer::reload_handle));
/// `C` is what the layer's numbers are given as.
///
/// Clones share the layer and the generation count. Applies from several
/// clones at once run one after the other.
///
/// ```
/// use std::time::Duration;
/// use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer, Quotas};
///
/// let burst = |n| Quota::new("free", [Policy::token_bucket("burst", n, 100, Duration::from_secs(60))?]);
/// let layer = QuotaLayer::builder(MemoryStore::new()).quota(burst(20)?).build()?;
/// let reload = layer.reload_handle();
/// reload.apply(Quotas::new().quota(burst(5)?))?;
/// assert_eq!(reload.generation(), 1);
/// // A bad configuration changes nothing and names the field.
/// let err = reload.apply(Quotas::new()).unwrap_err();
/// assert_eq!(err.field(), "quota");
/// assert_eq!(reload.generation(), 1);
/// # Ok::<(), tower_admission::ConfigError>(())
/// ```
pub struct ReloadHandle<C> {
    target: Arc<dyn Target<C>>,
    /// The number of configurations applied; held while one is checked and
    /// applied.
    generation: Arc<Mutex<u64>>,
}

/// A layer's side of a [`ReloadHandle`].
pub(crate) trait Target<C>: Send + Sync {
    /// Every rule the layer's `build()` checks, and that nothing which cannot
    /// change while running differs; the same [`ConfigError`] as `build()`.
    fn check(&self, new: &C) -> Result<(), ConfigError>;

    /// Puts `new`, checked, in force: one swap that every later request
    /// reads whole.
    fn swap(&self, new: C);
}

impl<C> ReloadHandle<C> {
    pub(crate) fn new(target: Arc<dyn Target<C>>) -> Self {
        ReloadHandle {
            target,
            generation: Arc::new(Mutex::new(0)),
        }
    }

    /// Checks `new` whole, as the layer's `build()` would, against the
    /// running layer (see the [module docs](self) for what cannot change).
    /// Changes nothing.
    pub fn check(&self, new: &C) -> Result<(), ConfigError> {
        self.target.check(new)
    }

    /// Checks `new` whole, then puts it in force at once: a request that
    /// starts after this returns is decided under `new`, one that started
    /// before finishes under the numbers that admitted it. A bad `new`
    /// changes nothing and returns the error `build()` would.
    pub fn apply(&self, new: C) -> Result<(), ConfigError> {
        let mut generation = self.generation.lock();
        self.target.check(&new)?;
        self.target.swap(new);
        *generation += 1;
        Ok(())
    }

    /// How many configurations were applied through this handle and its
    /// clones; 0 for the one the layer was built with.
    pub fn generation(&self) -> u64 {
        *self.generation.lock()
    }
}

impl<C> Clone for ReloadHandle<C> {
    fn clone(&self) -> Self {
        ReloadHandle {
            target: Arc::clone(&self.target),
            generation: Arc::clone(&self.generation),
        }
    }
}

impl<C> fmt::Debug for ReloadHandle<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadHandle")
            .field("config", &std::any::type_name::<C>())
            .field("generation", &self.generation())
            .finish()
    }
}

/// Numbers that a [`ReloadHandle`] replaces: read with one atomic load per
/// request, replaced whole.
pub(crate) struct Live<T>(ArcSwap<T>);

impl<T> Live<T> {
    pub(crate) fn new(value: T) -> Self {
        Live(ArcSwap::from_pointee(value))
    }

    /// The numbers in force now; a request holds them for its decision.
    #[inline]
    pub(crate) fn load(&self) -> arc_swap::Guard<Arc<T>> {
        self.0.load()
    }

    /// The numbers in force now, to hold across an await.
    pub(crate) fn load_full(&self) -> Arc<T> {
        self.0.load_full()
    }

    /// Puts `value` in force.
    pub(crate) fn store(&self, value: T) {
        self.0.store(Arc::new(value));
    }
}

impl<T: fmt::Debug> fmt::Debug for Live<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.load().fmt(f)
    }
}
