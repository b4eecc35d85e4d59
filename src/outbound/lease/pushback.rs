//! Pushback from the dependency: recorded on the send path, reported with
//! the next refresh, and the effective budget the script answers with.

use super::state::State;
use super::{Rate, RateLease};
use crate::clock::{Clock, Timestamp};

impl<C: Clock> RateLease<C> {
    /// Records that the dependency pushed back on an attempt (a 429, a 503
    /// with `Retry-After`, a rate-limit field with nothing remaining; see
    /// [`PushbackLayer`](crate::outbound::PushbackLayer)). Synchronous: one lock.
    ///
    /// The next refresh reports it, and the script lowers the **effective
    /// budget** `E` that every instance's target is a share of: halved (at
    /// least to a tenth of the budget) at most once per 2 s for the whole
    /// fleet, growing back after 3 s without pushback, never above the
    /// budget (`docs/leases.md`, "Pushback"). The first pushback since the
    /// last refresh wakes the refresher at once, at most once per eighth of
    /// the refresh period; later ones ride on the next refresh, a quarter
    /// period away while `E` is below the budget.
    pub fn record_pushback(&self) {
        let now = Timestamp::now(&self.inner.clock);
        let wake = self
            .inner
            .state
            .lock()
            .note_pushback(now, self.inner.settings().refresh_us / 8);
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "tower_admission_dependency_pushback_total",
            "budget" => self.inner.budget.to_string()
        )
        .increment(1);
        if wake {
            self.inner.wake.notify_one();
        }
    }
}

impl State {
    /// Counts a pushback at `now`; true when it should wake the refresher:
    /// the first since the last refresh, and none woke it in the last
    /// `spacing_us`.
    pub(super) fn note_pushback(&mut self, now: Timestamp, spacing_us: u64) -> bool {
        self.pushbacks = self.pushbacks.saturating_add(1);
        let first = !self.pushed;
        self.pushed = true;
        let spaced =
            self.pushback_woke.0 == 0 || now.0.saturating_sub(self.pushback_woke.0) >= spacing_us;
        if first && spaced {
            self.pushback_woke = now;
            return true;
        }
        false
    }

    /// Takes in the effective budget of a reply.
    pub(super) fn note_effective(&mut self, effective: Rate, budget: &str) {
        self.effective = effective;
        #[cfg(feature = "metrics")]
        metrics::gauge!(
            "tower_admission_lease_effective_rate",
            "budget" => budget.to_owned()
        )
        .set(effective.as_f64());
        #[cfg(not(feature = "metrics"))]
        let _ = budget;
    }
}
