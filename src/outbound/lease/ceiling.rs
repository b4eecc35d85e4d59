//! A ceiling on the budget a lease asks for, read from a source at run
//! time beside the lease's refresher (a region's lease follows its region's
//! spendable allocation through it).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use tokio::task::JoinHandle;

use super::Rate;

/// Where a ceiling's value comes from (a region's view of its spendable
/// allocation).
pub(crate) trait Source: Send + Sync + 'static {
    /// Reads the value once: the rate and until when it holds, or `None`
    /// (the source logs why; the ceiling keeps its value until it expires).
    fn read(&self) -> BoxFuture<'_, Option<(Rate, Instant)>>;

    /// The time between two reads.
    fn every(&self) -> Duration;
}

/// The highest budget `R` the lease's next refreshes report, below the
/// configured rate, and until when it holds; shared by its clones. A
/// refresh after that instant reports zero (fail closed): lowering it lowers
/// every grant issued after (old grants run out at their expiry), and zero
/// stops new grants. Zero until the first read.
#[derive(Clone)]
pub(crate) struct Ceiling {
    value: Arc<Mutex<(Rate, Option<Instant>)>>,
    source: Arc<dyn Source>,
}

impl std::fmt::Debug for Ceiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Ceiling").field(&*self.value.lock()).finish()
    }
}

impl Ceiling {
    /// A ceiling read from `source`, zero until the first read.
    pub(crate) fn new(source: impl Source) -> Self {
        Ceiling {
            value: Arc::new(Mutex::new((Rate::ZERO, None))),
            source: Arc::new(source),
        }
    }

    /// The ceiling now.
    pub(crate) fn get(&self) -> Rate {
        match *self.value.lock() {
            (rate, Some(until)) if Instant::now() < until => rate,
            _ => Rate::ZERO,
        }
    }

    /// Reads the source once and keeps what it answered.
    async fn update(&self) {
        if let Some((rate, until)) = self.source.read().await {
            *self.value.lock() = (rate, Some(until));
        }
    }

    /// Reads the source, then starts `refresher` and reads again every
    /// [`Source::every`] until the refresher ends. Dropping (aborting) this
    /// future aborts the refresher.
    pub(crate) async fn follow(self, refresher: impl Future<Output = ()> + Send + 'static) {
        self.update().await;
        let mut refresher = AbortOnDrop(tokio::spawn(refresher));
        let mut tick = tokio::time::interval(self.source.every());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.update().await,
                _ = &mut refresher.0 => return,
            }
        }
    }
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
