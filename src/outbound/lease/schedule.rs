//! The lease's rate schedule, which a leased budget's share buckets replay,
//! and the cap that keeps a wait from running past the next refresh.

use super::state::{Phase, Settings, State};
use super::Rate;
use crate::clock::Timestamp;

/// `wait_us`, at least 1, but never past `next_refresh` when that is after
/// `now`, nor past `retry_us` when it is not (a refresh due or in flight):
/// the refresh may change the rate the wait was computed at.
pub(crate) fn cap_at_refresh(
    wait_us: u64,
    next_refresh: Timestamp,
    now: Timestamp,
    retry_us: u64,
) -> u64 {
    let wait = wait_us.max(1);
    match next_refresh.0.saturating_sub(now.0) {
        0 => wait.min(retry_us.max(1)),
        until => wait.min(until),
    }
}

/// The lease's rate over time between two changes (refresh replies or a
/// release): the grant until its local expiry (or an older, higher grant
/// until its own, earlier expiry), the fallback after it, zero while
/// starting or released. A [`LeasedBudget`](crate::outbound::LeasedBudget)
/// share bucket replays it to fill as the lease's own bucket does, at the
/// rate of each stretch and capped at that stretch's capacity, however long
/// the share was idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Schedule {
    /// Spending at all: false while starting or released.
    pub(super) active: bool,
    pub(super) grant: Rate,
    pub(super) until: Timestamp,
    /// An older, higher grant still spent until `kept_until`.
    pub(super) kept: Rate,
    pub(super) kept_until: Timestamp,
    pub(super) fallback: Rate,
    /// Which schedule this is: the lease's change count when it was read.
    pub(crate) epoch: u64,
    /// The local time this schedule took effect.
    pub(crate) since: Timestamp,
}

impl Schedule {
    /// The rate at local time `x`.
    pub(crate) fn rate_at(&self, x: Timestamp) -> Rate {
        let base = if !self.active {
            return Rate::ZERO;
        } else if x < self.until {
            self.grant
        } else {
            self.fallback
        };
        if x < self.kept_until {
            base.max(self.kept)
        } else {
            base
        }
    }

    /// The stretches of `[from, to)` at one rate each, in order, as
    /// (rate, µs); a stretch of zero length is 0 µs.
    pub(crate) fn stretches(&self, from: Timestamp, to: Timestamp) -> [(Rate, u64); 3] {
        if !self.active || to <= from {
            let idle = (Rate::ZERO, 0);
            return [(Rate::ZERO, to.0.saturating_sub(from.0)), idle, idle];
        }
        let (a, b) = (
            self.kept_until.min(self.until).0.clamp(from.0, to.0),
            self.kept_until.max(self.until).0.clamp(from.0, to.0),
        );
        [
            (self.rate_at(from), a - from.0),
            (self.rate_at(Timestamp(a)), b - a),
            (self.rate_at(Timestamp(b)), to.0 - b),
        ]
    }
}

impl State {
    /// The rate schedule in force now.
    pub(super) fn schedule(&self, cfg: &Settings) -> Schedule {
        Schedule {
            active: self.phase == Phase::Active,
            grant: self.grant,
            until: self.until,
            kept: self.kept,
            kept_until: self.kept_until,
            fallback: cfg.fallback,
            epoch: self.epoch,
            since: self.changed_at,
        }
    }
}
