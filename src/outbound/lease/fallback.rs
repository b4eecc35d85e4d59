//! The fallback: what a lease spends when its grant expired without renewal.

use super::state::{Phase, Settings, State};
use crate::clock::Timestamp;

impl State {
    /// Logs the entry into the fallback once.
    pub(super) fn note_fallback(&mut self, x: Timestamp, cfg: &Settings, budget: &str, id: &str) {
        if self.phase == Phase::Active && x >= self.until && !self.fallback {
            self.fallback = true;
            if cfg.fail_open {
                tracing::warn!(
                    budget,
                    instance = id,
                    failures = self.failures,
                    "rate lease expired without renewal; FAILING OPEN: every attempt is admitted, with no limit, until a refresh succeeds"
                );
                return;
            }
            tracing::warn!(
                budget,
                instance = id,
                fallback = %cfg.fallback,
                failures = self.failures,
                "rate lease expired without renewal; spending the fallback capacity until a refresh succeeds"
            );
        }
    }
}
