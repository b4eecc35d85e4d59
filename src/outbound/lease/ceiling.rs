//! A ceiling on the budget a lease asks for, set at run time by its owner
//! (a region's lease follows its region's spendable allocation through it).

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::Rate;

/// The highest budget `R` the lease's next refreshes report, below the
/// configured rate, and until when it holds; shared by its clones. A
/// refresh after that instant reports zero (fail closed): lowering it lowers
/// every grant issued after (old grants run out at their expiry), and zero
/// stops new grants.
#[derive(Debug, Clone)]
pub(crate) struct Ceiling(Arc<Mutex<(Rate, Option<Instant>)>>);

impl Ceiling {
    /// A ceiling of zero until [`set`](Self::set).
    pub(crate) fn closed() -> Self {
        Ceiling(Arc::new(Mutex::new((Rate::ZERO, None))))
    }

    /// `rate` until `valid_until`, zero after.
    pub(crate) fn set(&self, rate: Rate, valid_until: Instant) {
        *self.0.lock() = (rate, Some(valid_until));
    }

    /// The ceiling now.
    pub(crate) fn get(&self) -> Rate {
        match *self.0.lock() {
            (rate, Some(until)) if Instant::now() < until => rate,
            _ => Rate::ZERO,
        }
    }
}
