//! The lease's local state: its settings, its phase and grant, and the
//! bucket that fills at the grant until its local expiry, at the fallback
//! capacity after it.

use std::time::Duration;

use super::{LeaseStatus, Mode, Rate};
use crate::clock::Timestamp;
use crate::outbound::bucket::{nano, whole, Bucket};

#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    pub(super) rate: Rate,
    pub(super) fallback: Rate,
    pub(super) lease_us: u64,
    pub(super) refresh_us: u64,
    pub(super) retry_us: u64,
    pub(super) burst_us: u64,
    pub(super) margin_us: u64,
    pub(super) max_cost: u64,
    pub(super) min_demand: Rate,
    pub(super) initial_demand: Rate,
    pub(super) fail_open: bool,
}

impl Settings {
    /// The bucket capacity at `rate`, in nano-tokens.
    pub(super) fn capacity(&self, rate: Rate) -> u128 {
        let by_rate = u128::from(rate.0) * u128::from(self.burst_us);
        by_rate.max(nano(self.max_cost))
    }
}

/// Phase, grant, its expiry, kept grant, its expiry.
pub(super) type Shape = (Phase, Rate, Timestamp, Rate, Timestamp);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Starting,
    Active,
    Released,
}

/// Whether more grant brought more attempts: a window held back doubles
/// its demand, and the windows after a doubling that was granted tell
/// whether the grant was what held it back.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Trial {
    /// The grant when it last asked for a doubling, and the attempts per
    /// second it had measured then.
    pub(super) doubled_from: Option<(Rate, Rate)>,
    /// A doubling was granted and its attempts used less than three
    /// quarters of it: the waits come from bursts, not from a lack of rate,
    /// until the attempts reach this rate (those three quarters).
    pub(super) bursty_until: Option<Rate>,
}

#[derive(Debug)]
pub(super) struct State {
    pub(super) phase: Phase,
    pub(super) grant: Rate,
    /// Local end of `grant`; zero for none.
    pub(super) until: Timestamp,
    /// An older grant above `grant`, spent until its own local expiry
    /// `kept_until` (before `until`): the script counts it until then
    /// anyway. Zero for none.
    pub(super) kept: Rate,
    pub(super) kept_until: Timestamp,
    /// Whether the fallback was entered (and logged).
    pub(super) fallback: bool,
    pub(super) bucket: Bucket,
    pub(super) last: Timestamp,
    pub(super) window_start: Timestamp,
    pub(super) attempted: u64,
    /// What each share of a [`LeasedBudget`](crate::outbound::LeasedBudget)
    /// asked of the lease since the window started, in milli-units of the
    /// lease: an attempt of cost c on a share of rate r out of the lease's
    /// R asks c·R/r, the grant that share needs to send it.
    pub(super) share_attempted: [u64; 2],
    /// The last doubling asked while held back, and what it showed.
    pub(super) trial: Trial,
    /// The µs of the window during which a refused attempt was waiting for
    /// the bucket to fill: the union of the waits the refusals gave.
    pub(super) held_back_us: u64,
    /// The end of the latest of those waits.
    pub(super) held_back_until: Timestamp,
    /// The demand reported is a guess: nothing measured yet, or back from
    /// the fallback.
    pub(super) guessing: bool,
    pub(super) demand: Rate,
    /// The demand last reported is no measurement: a guess, a doubling
    /// while held back, or an ask carried over a zero grant.
    pub(super) unmeasured: bool,
    /// The demand last reported was carried over a zero grant: its first
    /// grant is measured a quarter period later, as a guess's is.
    pub(super) carried: bool,
    pub(super) target: Rate,
    pub(super) next_refresh: Timestamp,
    pub(super) failures: u32,
    /// Counts the changes of the rate schedule (phase, grant, local
    /// expiry), each made by a refresh's reply or a release.
    pub(super) epoch: u64,
    /// The local time of the latest change.
    pub(super) changed_at: Timestamp,
    /// The last refresh was refused: another live lease holds the id (logged
    /// once, until a refresh succeeds).
    pub(super) id_taken: bool,
    /// Refreshes refused so, in all.
    pub(super) id_in_use: u64,
    /// The effective budget of the last reply: the budget, lowered while the
    /// dependency pushes back.
    pub(super) effective: Rate,
    /// The dependency pushed back since the last refresh was sent.
    pub(super) pushed: bool,
    /// Pushbacks recorded, in all.
    pub(super) pushbacks: u64,
    /// When a pushback last woke the refresher (zero: never).
    pub(super) pushback_woke: Timestamp,
    /// Grant calls sent, in all: the number of the latest.
    pub(super) calls: u64,
}

impl State {
    /// Counts a change of the schedule made at local time `x`, if the
    /// schedule differs from `before`.
    pub(super) fn note_change(&mut self, before: Shape, x: Timestamp) {
        if self.shape() != before {
            self.epoch += 1;
            self.changed_at = Timestamp(self.changed_at.0.max(x.0));
        }
    }

    /// What the rate schedule is made of: a change of it is a change of
    /// the schedule.
    pub(super) fn shape(&self) -> Shape {
        (
            self.phase,
            self.grant,
            self.until,
            self.kept,
            self.kept_until,
        )
    }

    pub(super) fn rate_at(&self, x: Timestamp, cfg: &Settings) -> Rate {
        self.schedule(cfg).rate_at(x)
    }

    /// The wait at `x` with no rate to spend (starting, or a zero grant):
    /// the time to the next refresh, or `retry_every` when one is due.
    pub(super) fn wait_without_rate(&self, x: Timestamp, cfg: &Settings) -> Duration {
        match self.next_refresh.0.saturating_sub(x.0) {
            0 => Duration::from_micros(cfg.retry_us),
            until => Duration::from_micros(until),
        }
    }

    /// Stops spending above `rate` at `x`: the grant, and an older one
    /// kept, are lowered to it before a call that says so is sent, so that
    /// the script may hand the surplus on at once. Whether it lowered any.
    pub(super) fn lower_to(&mut self, rate: Rate, x: Timestamp, cfg: &Settings) -> bool {
        if self.mode_at(x) != Mode::Granted || self.rate_at(x, cfg) <= rate {
            return false;
        }
        let before = self.shape();
        self.grant = self.grant.min(rate);
        self.kept = self.kept.min(rate);
        if self.kept <= self.grant {
            (self.kept, self.kept_until) = (Rate::ZERO, Timestamp(0));
        }
        self.bucket.cap(cfg.capacity(self.rate_at(x, cfg)));
        self.note_change(before, x);
        true
    }

    pub(super) fn mode_at(&self, x: Timestamp) -> Mode {
        match self.phase {
            Phase::Starting => Mode::Starting,
            Phase::Released => Mode::Released,
            Phase::Active if x < self.until => Mode::Granted,
            Phase::Active => Mode::Fallback,
        }
    }

    pub(super) fn accrue(&mut self, rate: Rate, micros: u64, cfg: &Settings) {
        self.bucket
            .fill(u128::from(rate.0), micros, cfg.capacity(rate));
    }

    /// Fills the bucket up to `x`: at the grant until its local expiry, at
    /// the fallback capacity after it.
    pub(super) fn advance(&mut self, x: Timestamp, cfg: &Settings) {
        if x <= self.last {
            return;
        }
        if self.phase != Phase::Active {
            self.bucket.clear();
            self.last = x;
            return;
        }
        for (rate, micros) in self.schedule(cfg).stretches(self.last, x) {
            if micros > 0 {
                self.accrue(rate, micros, cfg);
            }
        }
        self.last = x;
    }

    pub(super) fn status(&self, x: Timestamp, cfg: &Settings) -> LeaseStatus {
        let rate = self.rate_at(x, cfg);
        LeaseStatus {
            mode: self.mode_at(x),
            rate,
            grant: self.grant,
            expires_at: self.until.as_duration(),
            kept: self.kept,
            kept_expires_at: self.kept_until.as_duration(),
            target: self.target,
            demand: self.demand,
            capacity: whole(cfg.capacity(rate)),
            next_refresh: self.next_refresh.as_duration(),
            failures: self.failures,
            id_in_use: self.id_in_use,
            effective: self.effective,
            pushbacks: self.pushbacks,
        }
    }
}
