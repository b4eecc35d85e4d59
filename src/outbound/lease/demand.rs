//! Demand measurement: the attempts per second since the last report, a
//! guess when nothing is measured, and a window held back by its grant.

use super::state::{Settings, State, Trial};
use super::{Mode, Rate};
use crate::clock::Timestamp;
use crate::outbound::bucket::nano;

/// A demand window is held back when refused attempts were waiting for at
/// least this part of it, as (numerator, denominator); see [`RateLease`].
pub(super) const HELD_BACK: (u64, u64) = (3, 4);

/// A window held back asked at least this part of its grant, as
/// (numerator, denominator).
const ASKED_OF_GRANT: (u64, u64) = (9, 10);

/// A measured demand: other instances' targets count it as it is (the
/// script's ARGV[4]).
pub(super) const MEASURED: u8 = 0;

/// A guessed demand: other instances' targets count it as the whole budget.
pub(super) const GUESS: u8 = 1;

/// A demand held back by its grant twice in a row: other instances'
/// targets count it as twice itself, at most the whole budget.
pub(super) const HELD_BACK_FLAG: u8 = 2;

/// A demand held back by its grant once (the window before was not): other
/// instances' targets count it as half itself, about the grant it was held
/// back at; it shares what no demand asks with the ones held back twice.
pub(super) const HELD_ONCE: u8 = 3;

/// What one attempt asks of the lease, counted toward the demand on its
/// first look only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Asked {
    /// Nothing: a look again at an attempt already counted.
    Nothing,
    /// Its cost, spent from the lease itself.
    Cost(u64),
    /// From share `share` (0 or 1) of a budget, `milli` milli-units of the
    /// lease (see [`State::share_attempted`]).
    Share { share: usize, milli: u64 },
}

impl State {
    /// Counts `asked` toward the window's demand.
    pub(super) fn count(&mut self, asked: Asked) {
        match asked {
            Asked::Nothing => {}
            Asked::Cost(cost) => self.attempted = self.attempted.saturating_add(cost),
            Asked::Share { share, milli } => {
                let counted = &mut self.share_attempted[share];
                *counted = counted.saturating_add(milli);
            }
        }
    }

    /// Counts the wait of `wait_us` given at `x` to a refused attempt (the
    /// bucket fills at a rate above zero) toward the time held back.
    pub(super) fn note_wait(&mut self, x: Timestamp, wait_us: u64) {
        let from = x.0.max(self.held_back_until.0).max(self.window_start.0);
        let end = x.0.saturating_add(wait_us);
        self.held_back_us += end.saturating_sub(from);
        self.held_back_until = Timestamp(self.held_back_until.0.max(end));
    }

    /// The demand to report at `x`: the guess `initial_demand` with no grant
    /// to spend (starting, or in the fallback); else attempts per second
    /// since the window started (in the lease's units: the most that one of
    /// a budget's shares asked, see [`State::share_attempted`]), at least
    /// twice the grant if the window was held back (a window shorter than a
    /// quarter of the refresh period is kept open and the previous figure
    /// reported). A doubling that was granted and brought no more attempts
    /// shows that the waits came from bursts: from then on, until the
    /// attempts reach what would have used it (three quarters of the
    /// doubled grant), the demand is the measured rate and an eighth.
    /// The flag says how others' targets count the demand: as measured, as
    /// half itself (held back once), as the whole budget (a guess) or as
    /// twice itself (held back twice in a row).
    pub(super) fn take_demand(&mut self, x: Timestamp, cfg: &Settings) -> (Rate, u8) {
        let mut held = None;
        let measured = if self.mode_at(x) != Mode::Granted {
            self.guessing = true;
            self.unmeasured = true;
            cfg.initial_demand
        } else {
            let elapsed = x.0.saturating_sub(self.window_start.0);
            if elapsed >= cfg.refresh_us / 4 && elapsed > 0 {
                // A wait that runs past `x` counts in the next window.
                let ahead = self.held_back_until.0.saturating_sub(x.0);
                let held_back = self.held_back_us.saturating_sub(ahead);
                let measured = self.take_attempted(elapsed);
                self.window_start = x;
                self.held_back_us = ahead;
                self.guessing = false;
                let waited = at_least(held_back, elapsed, HELD_BACK);
                // Waits while asking less than the grant are a queue
                // draining or bursts, not a grant too small (a window
                // without attempts, one wait spanning it, says nothing).
                let waited = waited
                    && (self.grant.0 == 0
                        || measured.0 == 0
                        || at_least(measured.0, self.grant.0, ASKED_OF_GRANT));
                if waited && self.grant.0 == 0 {
                    // Held back by a zero grant (a newcomer while the
                    // others' older grants run out): its callers waited for
                    // the next refresh, so the count says nothing; it wants
                    // what it asked for last time, as it asked it.
                    self.unmeasured = self.demand > measured;
                    self.carried = self.unmeasured;
                    measured.max(self.demand)
                } else {
                    self.carried = false;
                    let (demand, doubled, again) = self.trial.next(measured, self.grant, waited);
                    self.unmeasured = doubled;
                    if doubled {
                        // Held back, it wants at least twice its grant, and
                        // no less than it asked for last time: a grant below
                        // that is no sign that it needs less. Flagged as
                        // held back twice in a row (room for its next
                        // doubling in the others' targets) or once: a single
                        // held-back window is as often a burst as growth, so
                        // others count that doubling at half, about what it
                        // holds. An ask carried over from the last report
                        // and above the doubling (a newcomer keeping its
                        // guess) is no trial: unflagged, counted whole.
                        let asked = demand.max(self.demand);
                        held = match (again, asked == demand) {
                            (true, _) => Some(true),
                            (false, true) => Some(false),
                            (false, false) => None,
                        };
                        asked
                    } else {
                        demand
                    }
                }
            } else {
                self.demand
            }
        };
        let demand = measured.max(cfg.min_demand).min(cfg.rate);
        self.demand = demand;
        let flag = match (self.guessing, held) {
            (true, _) => GUESS,
            (false, Some(true)) => HELD_BACK_FLAG,
            (false, Some(false)) => HELD_ONCE,
            (false, None) => MEASURED,
        };
        (demand, flag)
    }

    /// The attempts per second of the window of `elapsed` µs, in the
    /// lease's units, and a new window.
    fn take_attempted(&mut self, elapsed: u64) -> Rate {
        let own = nano(self.attempted) / u128::from(elapsed);
        let shares = self
            .share_attempted
            .iter()
            .map(|&milli| u128::from(milli) * 1_000_000 / u128::from(elapsed));
        let milli = shares.fold(own, u128::max);
        self.attempted = 0;
        self.share_attempted = [0; 2];
        Rate(u64::try_from(milli).unwrap_or(u64::MAX))
    }
}

/// A raised grant used at least this part, as (numerator, denominator), was
/// needed.
const USED_AFTER_DOUBLING: (u64, u64) = (3, 4);

/// Whether `part` is at least `n/d` of `whole`, for `(n, d)`.
fn at_least(part: u64, whole: u64, (n, d): (u64, u64)) -> bool {
    u128::from(part) * u128::from(d) >= u128::from(whole) * u128::from(n)
}

/// `n/d` of `x`, for `(n, d)`.
fn scaled(x: u64, (n, d): (u64, u64)) -> u64 {
    u64::try_from(u128::from(x) * u128::from(n) / u128::from(d)).unwrap_or(u64::MAX)
}

impl Trial {
    /// The demand after a window that measured `measured` under `grant`,
    /// `waited` or not, whether it is a doubling (held back), and whether
    /// the window before asked one too.
    pub(super) fn next(&mut self, measured: Rate, grant: Rate, waited: bool) -> (Rate, bool, bool) {
        let again = self.doubled_from.is_some();
        // A doubling judged: granted (the grant rose by half at least) and
        // the attempts did not grow with it: they used less than
        // `USED_AFTER_DOUBLING` of the raised grant (a queue that built up
        // under the old grant drains in this window, so a count against the
        // attempts before would call its catch-up growth). A window without
        // attempts on either side judges nothing: its callers were told to
        // wait for a refresh.
        if let Some((from_grant, from_measured)) = self.doubled_from.take() {
            let granted = at_least(grant.0, from_grant.0, (3, 2));
            let counted = from_measured.0 > 0 && measured.0 > 0;
            let used = at_least(measured.0, grant.0, USED_AFTER_DOUBLING);
            if granted && counted && !used {
                self.bursty_until = Some(Rate(scaled(grant.0, USED_AFTER_DOUBLING)));
            }
        }
        // Bursts until the attempts reach what would have used the doubling:
        // a window with more of the bursts than the last is no growth.
        if self.bursty_until.is_some_and(|until| measured >= until) {
            self.bursty_until = None;
        }
        if self.bursty_until.is_some() {
            return (
                Rate(measured.0.saturating_add(measured.0 / 8)),
                false,
                false,
            );
        }
        if waited {
            self.doubled_from = Some((grant, measured));
            return (measured.max(Rate(grant.0.saturating_mul(2))), true, again);
        }
        (measured, false, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn per_s(x: u64) -> Rate {
        Rate(x * 1000)
    }

    /// A doubling granted at 16/s that the next window (9/s) used less than
    /// three quarters of: the instance is bursty, and asks its measured
    /// rate and an eighth.
    fn judged_bursty() -> Trial {
        let mut trial = Trial::default();
        assert_eq!(
            trial.next(per_s(8), per_s(8), true),
            (per_s(16), true, false)
        );
        assert_eq!(
            trial.next(per_s(9), per_s(16), false),
            (Rate(10_125), false, false)
        );
        trial
    }

    #[test]
    fn a_window_with_more_of_a_bursty_instances_bursts_is_no_growth() {
        // 10.5/s held back: a window that caught one burst more than the
        // last. Growth "a tenth past the most measured" (9.9/s) doubled
        // again here, to 20.25/s, and the grant fell back a period later.
        let mut trial = judged_bursty();
        assert_eq!(
            trial.next(Rate(10_500), Rate(10_125), true),
            (Rate(11_812), false, false)
        );
    }

    #[test]
    fn attempts_that_reach_three_quarters_of_the_doubled_grant_are_growth() {
        let mut trial = judged_bursty();
        assert_eq!(
            trial.next(per_s(12), Rate(11_250), true),
            (Rate(22_500), true, false)
        );
    }

    #[test]
    fn a_second_held_back_window_in_a_row_is_flagged_again() {
        let mut trial = Trial::default();
        assert_eq!(
            trial.next(per_s(8), per_s(8), true),
            (per_s(16), true, false)
        );
        // The doubling was not granted: held back again.
        assert_eq!(
            trial.next(per_s(8), per_s(10), true),
            (per_s(20), true, true)
        );
    }
}
