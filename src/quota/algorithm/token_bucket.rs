use crate::quota::algorithm::{micros, never, Hold};
use crate::quota::Decision;
use crate::ConfigError;

/// The longest time to refill from empty, in µs (2^62 µs, about 146,000
/// years): every time plus a span then stays far from `u64::MAX`.
const MAX_WINDOW: u64 = u64::MAX / 4;

/// The most refunded time a state may carry in its offset, in µs (2^51 µs,
/// about 71 years). A refund that would take the offset past it gives
/// nothing back. It keeps every number of the Redis script below 2^53.
const MAX_OFFSET: u64 = 1 << 51;

#[doc = include_str!("../../../docs/token_bucket.md")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TokenBucket {
    /// Bucket size `B`.
    capacity: u64,
    /// One token every `num / den` µs, reduced.
    num: u64,
    den: u32,
    /// `B * num`: the time to refill from empty in `1/den` µs.
    span: u128,
    /// `ceil(span / den)`: the time to refill from empty in whole µs.
    window: u64,
}

impl TokenBucket {
    /// The denominator as a state records it: 0 for whole µs.
    #[inline]
    fn unit(&self) -> u32 {
        if self.den == 1 {
            0
        } else {
            self.den
        }
    }
}

/// The state of one key: the theoretical arrival time, the settlement
/// offset and the latest write time. See [`TokenBucket`].
///
/// The fields a decision reads come first, so that they share a cache line
/// with the memory store's key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct TokenBucketState {
    /// TAT, whole µs.
    tat: u64,
    /// The TAT's fraction in `1/den` µs, `< den` (or 0).
    frac: u32,
    /// The denominator the state was written under, 0 for whole µs (an
    /// interval of whole µs, or a fresh state).
    den: u32,
    /// Refunded time not yet given back by idle time, whole µs: holds'
    /// marks are on the timeline `tat + off`.
    off: u64,
    /// Latest `now` at which the state was written.
    last: u64,
    /// The state's life: the time (µs) of its first write since it was
    /// fresh. Holds carry it, so a refund reaches only the life that
    /// recorded its charge; a change of numbers keeps it.
    born: u64,
}

impl TokenBucketState {
    /// A state equivalent to fresh at `now` becomes the fresh state, as a
    /// store that deletes such states would read it; `last` stays, so a
    /// clock set back later is still seen.
    #[inline]
    pub(crate) fn read_fresh(&mut self, now: u64) {
        if self.fresh_at() <= now {
            *self = TokenBucketState {
                last: self.last,
                ..TokenBucketState::default()
            };
        }
    }

    /// `(tat, last, born)` when the TAT is whole µs and there is no offset:
    /// then they are all of the state, and
    /// [`from_whole`](Self::from_whole) gives it back.
    #[inline]
    pub(crate) fn whole(&self) -> Option<(u64, u64, u64)> {
        ((u64::from(self.frac | self.den) | self.off) == 0)
            .then_some((self.tat, self.last, self.born))
    }

    /// The state of a whole-µs `tat` with no offset, written last at `last`,
    /// in the life that began at `born`.
    #[inline]
    pub(crate) fn from_whole(tat: u64, last: u64, born: u64) -> Self {
        TokenBucketState {
            tat,
            last,
            born,
            ..TokenBucketState::default()
        }
    }

    /// A write at `now` to a fresh state (nothing written since it was)
    /// begins a new life.
    #[inline]
    fn begin_life(&mut self, now: u64) {
        if (self.tat | u64::from(self.frac) | self.off) == 0 {
            self.born = now;
        }
    }

    /// From this time (µs) the state is equivalent to a fresh one: the bucket
    /// is full and every hold of it is spent.
    pub(crate) fn fresh_at(&self) -> u64 {
        self.tat
            .saturating_add(u64::from(self.frac != 0))
            .saturating_add(self.off)
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn sat_u64(x: u128) -> u64 {
    u64::try_from(x).unwrap_or(u64::MAX)
}

impl TokenBucket {
    /// A bucket of `capacity` tokens refilled with `refill` tokens per
    /// `period_micros` µs.
    pub(crate) fn new(capacity: u64, refill: u64, period_micros: u64) -> Result<Self, ConfigError> {
        if capacity == 0 {
            return Err(ConfigError::new("capacity", "must be at least 1"));
        }
        if refill == 0 {
            return Err(ConfigError::new("refill", "must be at least 1"));
        }
        if period_micros == 0 {
            return Err(ConfigError::new("period", "must be at least 1 µs"));
        }
        let g = gcd(period_micros, refill);
        let (num, den) = (period_micros / g, refill / g);
        let Ok(den) = u32::try_from(den) else {
            return Err(ConfigError::new(
                "refill",
                format!(
                    "{refill} per {period_micros} µs is one token every {num}/{den} µs; \
                     the denominator must be at most {} (use a refill and period with a larger common factor)",
                    u32::MAX
                ),
            ));
        };
        Self::from_parts(capacity, num, den).ok_or_else(|| {
            ConfigError::new(
                "capacity",
                "capacity times the refill interval must be at most 2^62 µs",
            )
        })
    }

    fn from_parts(capacity: u64, num: u64, den: u32) -> Option<Self> {
        let span = u128::from(capacity) * u128::from(num);
        let window = u64::try_from(span.div_ceil(u128::from(den)))
            .ok()
            .filter(|w| *w <= MAX_WINDOW)?;
        Some(TokenBucket {
            capacity,
            num,
            den,
            span,
            window,
        })
    }

    /// The refill interval as the reduced fraction `(p, q)`: one token every
    /// `p / q` µs.
    pub(crate) fn interval_micros(&self) -> (u64, u64) {
        (self.num, u64::from(self.den))
    }

    pub(crate) fn limit(&self) -> u64 {
        self.capacity
    }

    /// The time to refill from empty, rounded up to whole µs.
    pub(crate) fn window_micros(&self) -> u64 {
        self.window
    }

    /// `[capacity, p, q]`: the bucket size and the interval `p / q` µs.
    #[cfg(feature = "redis")]
    pub(crate) fn script_args(&self) -> [u64; 3] {
        [self.capacity, self.num, u64::from(self.den)]
    }

    /// Whether the Redis script decides this bucket exactly in doubles:
    /// with `q == 1`, a time to refill from empty of at most 2^50 µs (about
    /// 35 years); otherwise a capacity and `p` of at most 2^45 and a time to
    /// refill from empty below 2^45 µs (about 1.1 years). Both assume
    /// timestamps below 2^52 µs (the year 2112).
    #[cfg(feature = "redis")]
    pub(crate) fn lua_exact(&self) -> Result<(), ConfigError> {
        const TWO45: u64 = 1 << 45;
        if self.den == 1 {
            if self.window > 1 << 50 {
                return Err(ConfigError::new(
                    "capacity",
                    "the Redis store needs capacity times the refill interval at most 2^50 µs",
                ));
            }
        } else if self.capacity > TWO45 {
            return Err(ConfigError::new(
                "capacity",
                "the Redis store needs a capacity of at most 2^45 when the refill interval is not a whole number of µs",
            ));
        } else if self.num > TWO45 {
            return Err(ConfigError::new(
                "period",
                "the Redis store needs period / gcd(period, refill) at most 2^45 µs",
            ));
        } else if self.window >= TWO45 {
            return Err(ConfigError::new(
                "capacity",
                "the Redis store needs capacity times the refill interval below 2^45 µs when the interval is not a whole number of µs",
            ));
        }
        Ok(())
    }

    /// The same bucket with capacity and rate divided by `divisor` (capacity
    /// at least 1; the interval multiplied by `divisor`, exactly when it can
    /// be, else as slow as the window bound allows).
    pub(crate) fn share(&self, divisor: u64) -> TokenBucket {
        let divisor = divisor.max(1);
        let capacity = (self.capacity / divisor).max(1);
        let g = gcd(u64::from(self.den), divisor);
        let den = u32::try_from(u64::from(self.den) / g).unwrap_or(1);
        let most = u128::from(MAX_WINDOW) * u128::from(den) / u128::from(capacity);
        let num = (u128::from(self.num) * u128::from(divisor / g))
            .min(most)
            .max(1);
        Self::from_parts(capacity, sat_u64(num), den).unwrap_or_else(|| self.clone())
    }

    /// From this time the state is equivalent to fresh.
    pub(crate) fn fresh_at(&self, state: &TokenBucketState) -> u64 {
        state.fresh_at()
    }

    /// `x` in `1/den` µs as whole µs and fraction (saturating).
    #[inline]
    fn split(&self, x: u128) -> (u64, u32) {
        if self.den == 1 {
            return (sat_u64(x), 0);
        }
        let q = u128::from(self.den);
        match u64::try_from(x / q) {
            Ok(w) => (w, (x % q) as u32),
            Err(_) => (u64::MAX, 0),
        }
    }

    #[inline]
    fn ceil_micros(&self, x: u128) -> u64 {
        if self.den == 1 {
            sat_u64(x)
        } else {
            sat_u64(x.div_ceil(u128::from(self.den)))
        }
    }

    /// For a whole-µs interval: brings the state to these numbers when it
    /// is not a plain whole-µs state within the horizon (cold: only after a
    /// change of numbers or a clock set back), so that
    /// [`decide_whole`](Self::decide_whole) applies.
    #[inline(always)]
    fn prepare_whole(&self, state: &mut TokenBucketState, now: u64) {
        if (state.frac | state.den) != 0 || state.tat > now.saturating_add(self.window) {
            self.prepare_cold(state, now);
        }
    }

    #[cold]
    #[inline(never)]
    fn prepare_cold(&self, state: &mut TokenBucketState, now: u64) {
        self.prepare(state, now);
    }

    /// The decision in whole µs, and the TAT after it if admitted, for a
    /// whole-µs interval and a state that [`prepare_whole`](Self::prepare_whole)
    /// brought to it.
    #[inline(always)]
    fn decide_whole(&self, state: &TokenBucketState, now: u64, cost: u64) -> (Decision, u64) {
        let horizon = now.saturating_add(self.window);
        let start = state.tat.max(now);
        let interval = self.num;
        // A clock set back can leave the TAT beyond the horizon: saturate.
        let tokens = |at: u64| horizon.saturating_sub(at) / interval;
        if cost > self.capacity {
            return (never(self.capacity, tokens(start), start - now), start);
        }
        // cost <= capacity, so cost * interval <= window.
        let next = start.saturating_add(cost * interval);
        // One division per decision: `remaining` in each branch.
        let decision = if next <= horizon {
            Decision {
                admitted: true,
                limit: self.capacity,
                remaining: (horizon - next) / interval,
                retry_after: None,
                reset: micros(next - now),
            }
        } else {
            Decision {
                admitted: false,
                limit: self.capacity,
                remaining: tokens(start),
                retry_after: Some(micros(next - horizon)),
                reset: micros(start - now),
            }
        };
        (decision, next)
    }

    /// Writes a TAT of whole µs set at `now`, for a whole-µs state.
    #[inline]
    fn store_whole(&self, state: &mut TokenBucketState, now: u64, next: u64) {
        state.begin_life(now);
        if state.tat < now {
            // Idle: give the idle time back from the offset.
            state.off -= state.off.min(now - state.tat);
        }
        state.tat = next;
        state.last = state.last.max(now);
    }

    /// Brings the state to these numbers and returns its TAT in `1/den` µs:
    /// a fraction in another denominator is rounded up to the whole µs (and
    /// the offset raised by 1 µs, for holds read in the wrong unit), and a
    /// TAT beyond `max(now, last) + B * I` is clamped to it (the cut added to
    /// the offset). Both are written back; neither happens under unchanged
    /// numbers.
    fn prepare(&self, state: &mut TokenBucketState, now: u64) -> u128 {
        let q = u128::from(self.den);
        let tat = self.in_unit(state);
        let reference = now.max(state.last);
        let ceiling = u128::from(reference) * q + self.span;
        if tat <= ceiling {
            return tat;
        }
        let cut = tat - ceiling;
        state.off = state.off.saturating_add(sat_u64(cut.div_ceil(q)));
        // `tat` fits in u64 whole µs, and `ceiling` is below it.
        (state.tat, state.frac) = self.split(ceiling);
        state.den = self.unit();
        state.last = reference;
        ceiling
    }

    /// The state's TAT in `1/den` µs: a fraction in another denominator is
    /// rounded up to the whole µs (and the offset raised by 1 µs), written
    /// back. Only ever later, so it never makes the bucket fuller.
    fn in_unit(&self, state: &mut TokenBucketState) -> u128 {
        let whole = state.den == 0 && state.frac == 0;
        if (state.den != self.unit() && !whole) || state.frac >= self.den {
            if state.frac != 0 {
                state.tat = state.tat.saturating_add(1);
                state.frac = 0;
            }
            state.off = state.off.saturating_add(1);
            state.den = self.unit();
        }
        u128::from(state.tat) * u128::from(self.den) + u128::from(state.frac)
    }

    /// The decision for a TAT of `tat` (1/den µs), and the TAT after it if
    /// admitted.
    fn decide(&self, tat: u128, now: u64, cost: u64) -> (Decision, u128) {
        let q = u128::from(self.den);
        let interval = u128::from(self.num);
        let now_q = u128::from(now) * q;
        let horizon = now_q + self.span;
        let start = tat.max(now_q);
        let tokens = |at: u128| sat_u64(horizon.saturating_sub(at) / interval);
        if cost > self.capacity {
            let reset = self.ceil_micros(start - now_q);
            return (never(self.capacity, tokens(start), reset), start);
        }
        let next = start + u128::from(cost) * interval;
        let decision = if next <= horizon {
            Decision {
                admitted: true,
                limit: self.capacity,
                remaining: tokens(next),
                retry_after: None,
                reset: micros(self.ceil_micros(next - now_q)),
            }
        } else {
            Decision {
                admitted: false,
                limit: self.capacity,
                remaining: tokens(start),
                retry_after: Some(micros(self.ceil_micros(next - horizon))),
                reset: micros(self.ceil_micros(start - now_q)),
            }
        };
        (decision, next)
    }

    /// Writes the TAT `next` (1/den µs), set at `now` from the TAT `before`.
    fn store(&self, state: &mut TokenBucketState, now: u64, before: u128, next: u128) {
        state.begin_life(now);
        let now_q = u128::from(now) * u128::from(self.den);
        if before < now_q {
            // Idle: every hold's segment is behind `now`; give the idle time
            // back from the offset (whole µs, rounded down).
            let idle = sat_u64((now_q - before) / u128::from(self.den));
            state.off -= state.off.min(idle);
        }
        (state.tat, state.frac) = self.split(next);
        state.den = self.unit();
        state.last = state.last.max(now);
    }

    /// The hold of a charge whose segment ends at the TAT `tat` (1/den µs).
    fn hold_at(&self, state: &TokenBucketState, tat: u128, amount: u64) -> Hold {
        let mark = tat + u128::from(state.off) * u128::from(self.den);
        let (mark, frac) = self.split(mark);
        Hold {
            mark,
            frac: u64::from(frac),
            amount,
            life: state.born,
        }
    }

    /// Decides without recording. Only a state written under other numbers
    /// is changed (see [`TokenBucket`]).
    #[inline]
    pub(crate) fn check(&self, state: &mut TokenBucketState, now: u64, cost: u64) -> Decision {
        if self.den != 1 {
            return self.check_general(state, now, cost);
        }
        self.prepare_whole(state, now);
        self.decide_whole(state, now, cost).0
    }

    #[cold]
    #[inline(never)]
    fn check_general(&self, state: &mut TokenBucketState, now: u64, cost: u64) -> Decision {
        let tat = self.prepare(state, now);
        self.decide(tat, now, cost).0
    }

    /// Check and, if admitted, record, in one pass: the memory store's path
    /// for a quota of one bucket. Same result as `check` then `record`; the
    /// hold is the default one on a refusal.
    #[inline]
    pub(crate) fn step_in_place(
        &self,
        state: &mut TokenBucketState,
        now: u64,
        cost: u64,
    ) -> (Decision, Hold) {
        if (u64::from(state.frac | state.den) | state.off) == 0 {
            if let Some(step) =
                self.step_plain(&mut state.tat, &mut state.last, &mut state.born, now, cost)
            {
                return step;
            }
        }
        self.step_general(state, now, cost)
    }

    /// [`read_fresh`](TokenBucketState::read_fresh) then
    /// [`step_in_place`](Self::step_in_place) on the state
    /// [`from_whole(tat, last, born)`](TokenBucketState::from_whole), in
    /// place, in the plain case; `None`, with nothing changed, otherwise.
    #[inline]
    pub(crate) fn step_whole(
        &self,
        tat: &mut u64,
        last: &mut u64,
        born: &mut u64,
        now: u64,
        cost: u64,
    ) -> Option<(Decision, Hold)> {
        // Such a state is fresh from its TAT on (see `fresh_at`).
        let (mut next, mut life) = if *tat <= now { (0, 0) } else { (*tat, *born) };
        let mut written = *last;
        let step = self.step_plain(&mut next, &mut written, &mut life, now, cost)?;
        (*tat, *last, *born) = (next, written, life);
        Some(step)
    }

    /// The plain case of [`step_in_place`](Self::step_in_place) for a state
    /// of whole µs with no offset, given as its TAT and last write: a whole-µs
    /// interval, a TAT within the horizon and a cost that fits. `None`, with
    /// nothing changed, for anything else.
    #[inline(always)]
    fn step_plain(
        &self,
        tat: &mut u64,
        last: &mut u64,
        born: &mut u64,
        now: u64,
        cost: u64,
    ) -> Option<(Decision, Hold)> {
        let horizon = now.saturating_add(self.window);
        if self.den != 1 || *tat > horizon || cost > self.capacity {
            return None;
        }
        let start = (*tat).max(now);
        let interval = self.num;
        // cost <= capacity, so cost * interval <= window.
        let next = start.saturating_add(cost * interval);
        if next <= horizon {
            if *tat == 0 {
                *born = now;
            }
            *tat = next;
            *last = (*last).max(now);
            let decision = Decision {
                admitted: true,
                limit: self.capacity,
                remaining: (horizon - next) / interval,
                retry_after: None,
                reset: micros(next - now),
            };
            let hold = Hold {
                mark: next,
                frac: 0,
                amount: cost,
                life: *born,
            };
            return Some((decision, hold));
        }
        let decision = Decision {
            admitted: false,
            limit: self.capacity,
            remaining: (horizon - start) / interval,
            retry_after: Some(micros(next - horizon)),
            reset: micros(start - now),
        };
        Some((decision, Hold::default()))
    }

    #[cold]
    #[inline(never)]
    fn step_general(&self, state: &mut TokenBucketState, now: u64, cost: u64) -> (Decision, Hold) {
        let tat = self.prepare(state, now);
        let (decision, next) = self.decide(tat, now, cost);
        if !decision.admitted {
            return (decision, Hold::default());
        }
        self.store(state, now, tat, next);
        (decision, self.hold_at(state, next, cost))
    }

    /// Records an admission of `cost` that `check` admitted at `now`. Capped
    /// at what is left (so the amount of the hold is what was recorded).
    #[inline]
    pub(crate) fn record(&self, state: &mut TokenBucketState, now: u64, cost: u64) -> Hold {
        if self.den != 1 {
            return self.record_general(state, now, cost);
        }
        self.prepare_whole(state, now);
        let horizon = now.saturating_add(self.window);
        let start = state.tat.max(now);
        let mut amount = cost.min(self.capacity);
        let mut next = start.saturating_add(amount * self.num);
        if next > horizon {
            amount = horizon.saturating_sub(start) / self.num;
            next = start.saturating_add(amount * self.num);
        }
        self.store_whole(state, now, next);
        Hold {
            mark: next.saturating_add(state.off),
            frac: 0,
            amount,
            life: state.born,
        }
    }

    #[cold]
    #[inline(never)]
    fn record_general(&self, state: &mut TokenBucketState, now: u64, cost: u64) -> Hold {
        let tat = self.prepare(state, now);
        let interval = u128::from(self.num);
        let now_q = u128::from(now) * u128::from(self.den);
        let horizon = now_q + self.span;
        let start = tat.max(now_q);
        let mut amount = cost.min(self.capacity);
        let mut next = start + u128::from(amount) * interval;
        if next > horizon {
            amount = sat_u64(horizon.saturating_sub(start) / interval);
            next = start + u128::from(amount) * interval;
        }
        self.store(state, now, tat, next);
        self.hold_at(state, next, amount)
    }

    /// Settles a charge: `delta > 0` charges `delta` more at `now`, capped at
    /// what is left, and returns `hold` unchanged; `delta < 0` refunds at most
    /// `min(|delta|, hold.amount, tokens of the hold's segment still ahead of
    /// now, tokens held now)` and returns the hold with its amount lowered by
    /// what was refunded.
    pub(crate) fn settle(
        &self,
        state: &mut TokenBucketState,
        now: u64,
        hold: Hold,
        delta: i64,
    ) -> Hold {
        if delta == 0 {
            return hold;
        }
        // Not clamped to this bucket's horizon: the charge may have been made
        // under numbers that a redeploy has replaced, and the state decided
        // since under larger ones; clamping would refill the bucket. Beyond
        // the horizon there is no room to charge, and a refund stays bounded
        // by the charge's own tokens.
        let tat = self.in_unit(state);
        let q = u128::from(self.den);
        let interval = u128::from(self.num);
        let now_q = u128::from(now) * q;
        if delta > 0 {
            let start = tat.max(now_q);
            let room = sat_u64((now_q + self.span).saturating_sub(start) / interval);
            let extra = delta.unsigned_abs().min(room);
            if extra > 0 {
                self.store(state, now, tat, start + u128::from(extra) * interval);
            }
            return hold;
        }
        // A charge of another life of the state (one its store lost) holds
        // nothing in this one.
        if hold.life != state.born {
            return hold;
        }
        // The state's own time: a clock set back refunds nothing extra.
        let reference = now.max(state.last);
        let reference_q = u128::from(reference) * q;
        if tat <= reference_q {
            return hold;
        }
        let held = (tat - reference_q) / interval;
        let frac = if hold.frac < u64::from(self.den) {
            u128::from(hold.frac)
        } else {
            0
        };
        let end = u128::from(hold.mark) * q + frac;
        let seen = (u128::from(reference) + u128::from(state.off)) * q;
        let length = u128::from(hold.amount.min(self.capacity)) * interval;
        let from = seen.max(end.saturating_sub(length));
        let ahead = if end > from {
            (end - from) / interval
        } else {
            0
        };
        let refund = u128::from(delta.unsigned_abs().min(hold.amount))
            .min(ahead)
            .min(held);
        if refund == 0 {
            return hold;
        }
        let cut = refund * interval;
        let shift = cut.div_ceil(q);
        if shift > u128::from(MAX_OFFSET.saturating_sub(state.off)) {
            return hold;
        }
        (state.tat, state.frac) = self.split(tat - cut);
        state.den = self.unit();
        state.last = reference;
        state.off += shift as u64;
        // Same mark: against the raised offset, the segment `(mark - amount
        // * I, mark]` is now the charge's remaining tokens, before the
        // refunded ones.
        Hold {
            amount: hold.amount - refund as u64,
            ..hold
        }
    }
}

#[cfg(test)]
mod tests;
