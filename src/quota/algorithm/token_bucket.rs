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

/// Token bucket with capacity `B` and continuous refill of `refill` tokens per
/// `period`, as GCRA: the state is one theoretical arrival time (TAT).
///
/// The refill interval is the exact fraction `I = p / q` µs, `period / refill`
/// reduced by their greatest common divisor, so every positive rate is exact
/// and a long-running key never drifts: 100 per minute is one token every
/// 600,000 µs, 3 per second one every 1,000,000/3 µs, 6 per 7 s one every
/// 7,000,000/6 µs. The TAT is kept as whole µs plus a fraction in `1/q` µs.
///
/// A request of cost `n` at `now` is admitted iff
/// `max(tat, now) + n * I <= now + B * I`, and then
/// `tat = max(tat, now) + n * I`. This is governor's rule (governor keeps
/// the interval in whole nanoseconds, so the two agree while its rounding
/// has not added up to a decision). Starting full, at most
/// `floor(B + T / I)` are admitted over any interval of length `T`, also
/// with settlements (see below).
///
/// # What is refused
///
/// [`Policy::token_bucket`](crate::quota::Policy::token_bucket) refuses a
/// zero `capacity`, `refill` or `period` (each named), a rate whose reduced
/// denominator `q` exceeds `u32::MAX` (`"refill"`), and a time to refill
/// from empty `B * I` over 2^62 µs (`"capacity"`).
///
/// # State
///
/// [`TokenBucketState`] is 40 bytes: the TAT (whole µs, and its fraction in
/// `1/den` µs with `den` the denominator it was written under, 0 for whole
/// µs), the settlement offset (whole µs, see below), `last`, the latest
/// time at which it was written, and its life (see below). The bucket is
/// full from `tat` on; the state is equivalent to fresh from
/// [`fresh_at`](TokenBucketState::fresh_at) = `ceil(tat) + offset` on.
///
/// # Changed numbers
///
/// A state written under other numbers (capacity, refill or period changed
/// by a redeploy) keeps only its TAT, the moment the bucket is full again:
///
/// - a TAT with a fraction in another denominator is rounded **up** to the
///   next whole µs;
/// - a TAT beyond `max(now, last) + B * I` under the new numbers (the bucket
///   would be more than empty) is clamped to it, and the clamp is written
///   back, so no wait is ever longer than the new time to refill from empty,
///   and a lower capacity takes effect at once;
/// - admissions then follow the new numbers from that TAT: never more than
///   the new numbers allow given the known TAT;
/// - a settle never clamps: a charge made under numbers that a redeploy
///   has replaced may settle after the state was decided under the new
///   ones, and clamping to the old, smaller capacity would refill the
///   bucket.
///
/// Under unchanged numbers the clamp never fires, whatever the clock does:
/// a clock set back is not mistaken for a change of numbers, and the state
/// never moves backwards (the decision is made at `now`, so the bucket looks
/// emptier, never fuller).
///
/// # Settlement
///
/// Recording an admission returns a hold whose mark is the end of the
/// charge's segment on the *hold timeline*, `tat + offset` right after the
/// charge, and whose amount is the cost. A refund of `k` tokens lowers the
/// TAT by `k * I` and raises the offset by `ceil(k * I)` µs: every hold's
/// segment, read as `mark - offset`, moves with the tokens after it, so no
/// two holds ever claim the same part of the timeline and no hold claims
/// beyond the TAT. A refund gives back at most `min(|delta|, amount, tokens
/// of the segment still ahead of now, tokens held now)`: nothing once the
/// charge's tokens have refilled, and never a token of another charge. The
/// refunded tokens are the last ones of the charge's segment; the returned
/// hold keeps its mark and its amount drops by `k`, so that against the
/// raised offset its segment is exactly the tokens it still holds. An extra
/// charge (`delta > 0`) is capped at what is left and is not refundable.
///
/// A hold also names the state's life: the time of its first write since it
/// was fresh. A refund whose hold names another life gives nothing back, so
/// a charge made before a store lost the state (a Redis restarted empty)
/// never frees the tokens of one made after it, although a new bucket's
/// timeline covers the old one's again. A change of numbers converts the
/// state and keeps its life; a state read as fresh (a full bucket, every
/// hold of it spent) and written begins a new one.
///
/// The offset gives idle time back (a bucket idle for `d` lowers it by `d`).
/// The state is kept until `ceil(tat) + offset`, after which every hold of it
/// is spent, so dropping it admits nothing extra. After a change of the
/// denominator the offset grows by 1 µs (a hold's fraction may be read in
/// the new unit). A refund after the interval changed reads the hold's
/// segment with the new interval; it stays bounded by the tokens held now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
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
pub struct TokenBucketState {
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
    pub fn fresh_at(&self) -> u64 {
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

    /// The bucket size: the most cost admitted at once.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The refill interval as the reduced fraction `(p, q)`: one token every
    /// `p / q` µs.
    pub fn interval_micros(&self) -> (u64, u64) {
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
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    const SECOND: u64 = 1_000_000;
    const MINUTE: u64 = 60 * SECOND;
    /// Some real-looking time, µs.
    const T0: u64 = 1_700_000_000 * SECOND;

    fn bucket(capacity: u64, refill: u64, period: u64) -> TokenBucket {
        TokenBucket::new(capacity, refill, period).unwrap()
    }

    fn wait_micros(d: &Decision) -> u64 {
        d.retry_after.map_or(0, |w| w.as_micros() as u64)
    }

    /// The general path (u128 units), bypassing the whole-µs one.
    fn step_general(
        b: &TokenBucket,
        s: &mut TokenBucketState,
        now: u64,
        cost: u64,
    ) -> (Decision, Hold) {
        let tat = b.prepare(s, now);
        let (decision, next) = b.decide(tat, now, cost);
        if !decision.admitted {
            return (decision, Hold::default());
        }
        b.store(s, now, tat, next);
        (decision, b.hold_at(s, next, cost))
    }

    /// `floor(B + refill * t / period)`.
    fn bound(capacity: u64, refill: u64, period: u64, t: u64) -> u128 {
        u128::from(capacity) + u128::from(t) * u128::from(refill) / u128::from(period)
    }

    /// Net events `(time, cost)` in time order: the most in any interval
    /// `[t1, t2]` must stay within `floor(B + r (t2 - t1))`.
    fn assert_interval_bound(events: &[(u64, i128)], capacity: u64, refill: u64, period: u64) {
        for i in 0..events.len() {
            let mut sum = 0i128;
            for e in &events[i..] {
                sum += e.1;
                let b = bound(capacity, refill, period, e.0 - events[i].0) as i128;
                assert!(
                    sum <= b,
                    "{sum} net in [{}, {}] ({} µs), bound {b}",
                    events[i].0,
                    e.0,
                    e.0 - events[i].0
                );
            }
        }
    }

    #[test]
    fn any_positive_rate_is_accepted() {
        for (capacity, refill, period) in [
            (10, 3, SECOND),
            (5, 7, MINUTE),
            (7, 6, 7 * SECOND),
            (20, 100, MINUTE),
            (1, u64::from(u32::MAX), 1),
            (1, 1, 1),
            (u64::MAX / 8, 1_000_000, SECOND),
        ] {
            let b = TokenBucket::new(capacity, refill, period).unwrap();
            assert_eq!(b.limit(), capacity);
        }
        let b = bucket(10, 3, SECOND);
        assert_eq!(b.interval_micros(), (1_000_000, 3));
        assert_eq!(b.window_micros(), 3_333_334);
        #[cfg(feature = "redis")]
        assert_eq!(b.script_args(), [10, 1_000_000, 3]);
        assert_eq!(bucket(20, 100, MINUTE).interval_micros(), (600_000, 1));
        assert_eq!(bucket(7, 6, 7 * SECOND).window_micros(), 8_166_667);
    }

    #[test]
    fn unrepresentable_numbers_are_refused_with_their_field() {
        let field = |c, r, p| TokenBucket::new(c, r, p).unwrap_err().field();
        assert_eq!(field(0, 1, 1), "capacity");
        assert_eq!(field(1, 0, 1), "refill");
        assert_eq!(field(1, 1, 0), "period");
        // 1 µs / (2^32 + 1): the denominator does not fit in u32.
        assert_eq!(field(1, (1 << 32) + 1, 1), "refill");
        assert_eq!(field(1, u64::MAX, SECOND), "refill");
        // A common factor keeps it: 2^33 per 2^10 µs is 2^23 per µs.
        assert!(TokenBucket::new(1, 1 << 33, 1 << 10).is_ok());
        assert_eq!(field(u64::MAX, 1, 8), "capacity");
        assert_eq!(field(1, 1, u64::MAX), "capacity");
        // Through the policy constructor.
        let err =
            crate::quota::Policy::token_bucket("b", 1, 0, Duration::from_secs(1)).unwrap_err();
        assert_eq!(err.field(), "refill");
        assert!(crate::quota::Policy::token_bucket("b", 10, 3, Duration::from_secs(1)).is_ok());
        assert!(crate::quota::Policy::token_bucket("b", 5, 7, Duration::from_secs(60)).is_ok());
        assert!(crate::quota::Policy::token_bucket("b", 5, 6, Duration::from_secs(7)).is_ok());
    }

    #[cfg(feature = "redis")]
    #[test]
    fn lua_exact_limits() {
        assert!(bucket(20, 100, MINUTE).lua_exact().is_ok());
        assert!(bucket(10, 3, SECOND).lua_exact().is_ok());
        assert!(bucket(1 << 40, 1_000_000, SECOND).lua_exact().is_ok());
        // Whole µs: up to 2^50 µs to refill from empty.
        assert!(bucket(1 << 50, 1, 1).lua_exact().is_ok());
        assert_eq!(
            bucket((1 << 50) + 1, 1, 1).lua_exact().unwrap_err().field(),
            "capacity"
        );
        // Fractions: capacity <= 2^45, window < 2^45 µs.
        assert!(bucket(1 << 45, 3, 1).lua_exact().is_ok());
        assert_eq!(
            bucket((1 << 45) + 1, 3, 1).lua_exact().unwrap_err().field(),
            "capacity"
        );
        assert_eq!(
            bucket(1 << 21, 3, 1 << 26).lua_exact().unwrap_err().field(),
            "capacity"
        );
        assert_eq!(
            bucket(1, 3, (1 << 46) + 1).lua_exact().unwrap_err().field(),
            "period"
        );
    }

    #[test]
    fn share_divides_capacity_and_rate_exactly() {
        let b = bucket(10, 3, SECOND).share(3);
        assert_eq!((b.limit(), b.interval_micros()), (3, (1_000_000, 1)));
        let b = bucket(20, 100, MINUTE).share(7);
        assert_eq!((b.limit(), b.interval_micros()), (2, (4_200_000, 1)));
        let b = bucket(1, 1, 1).share(u64::MAX);
        assert_eq!(b.limit(), 1);
        assert!(b.window_micros() <= MAX_WINDOW);
        let b = bucket(u64::MAX / 8, 1, 1).share(0);
        assert_eq!(b, bucket(u64::MAX / 8, 1, 1));
    }

    /// Saturating demand, one request of cost 1 every `every` µs from `start`
    /// for `span` µs, both ends included; returns how many were admitted.
    fn saturate(b: &TokenBucket, start: u64, span: u64, every: u64) -> u64 {
        let mut s = TokenBucketState::default();
        let mut admitted = 0;
        let mut t = start;
        while t <= start + span {
            admitted += u64::from(b.step_in_place(&mut s, t, 1).0.admitted);
            t += every;
        }
        admitted
    }

    #[test]
    fn admits_23_in_2s_and_120_in_60s() {
        let b = bucket(20, 100, MINUTE);
        assert_eq!(saturate(&b, T0, 2 * SECOND, 1_000), 23);
        assert_eq!(saturate(&b, T0, 60 * SECOND, 1_000), 120);
        // The same with the check-then-record path.
        let mut s = TokenBucketState::default();
        let mut admitted = 0;
        for ms in 0..=60_000 {
            let now = T0 + ms * 1_000;
            if b.check(&mut s, now, 1).admitted {
                b.record(&mut s, now, 1);
                admitted += 1;
            }
        }
        assert_eq!(admitted, 120);
    }

    #[test]
    fn fractional_rates_admit_exactly_floor_b_plus_rt() {
        // 10 per 3/s: 3 s later 10 + 9; 7 per minute: 60 s later 5 + 7.
        for (capacity, refill, period, span) in [
            (10, 3, SECOND, 3 * SECOND),
            (10, 3, SECOND, 3 * SECOND - 1),
            (5, 7, MINUTE, MINUTE),
            (5, 7, MINUTE, 17 * SECOND),
            (7, 6, 7 * SECOND, 7 * SECOND),
            (7, 6, 7 * SECOND, 7 * SECOND + 3_500_000),
        ] {
            let b = bucket(capacity, refill, period);
            assert_eq!(
                u128::from(saturate(&b, T0, span, 1)),
                bound(capacity, refill, period, span),
                "{capacity} per {refill}/{period} over {span}"
            );
        }
    }

    /// Greedy demand: a request of cost 1 at `t`, and after a refusal the
    /// next one exactly `retry_after` later (checking the wait is exact).
    /// Returns the count admitted in `[start, start + span]`.
    fn greedy(b: &TokenBucket, s: &mut TokenBucketState, start: u64, span: u64) -> u64 {
        let mut t = start;
        let mut admitted = 0;
        while t <= start + span {
            let (d, _) = b.step_in_place(s, t, 1);
            if d.admitted {
                admitted += 1;
            } else {
                let wait = wait_micros(&d);
                assert!(wait >= 1);
                assert!(!b.check(&mut s.clone(), t + wait - 1, 1).admitted);
                t += wait;
            }
        }
        admitted
    }

    #[test]
    fn no_drift_over_a_million_periods() {
        for (capacity, refill, period) in [(10, 3, SECOND), (5, 7, MINUTE), (7, 6, 7 * SECOND)] {
            let b = bucket(capacity, refill, period);
            let mut s = TokenBucketState::default();
            // Empty the bucket, then a long idle of 10^6 periods.
            for _ in 0..capacity {
                assert!(b.step_in_place(&mut s, T0, 1).0.admitted);
            }
            let start = T0 + 1_000_000 * period;
            // A steady stream of 10^6 periods, then a bit more.
            let span = 1_000_000 * period;
            let admitted = greedy(&b, &mut s, start, span);
            assert_eq!(u128::from(admitted), bound(capacity, refill, period, span));
            // The TAT is exactly where the count says: the next token comes
            // at start + (admitted - capacity + 1) intervals.
            let (p, q) = b.interval_micros();
            let next = u128::from(start) * u128::from(q)
                + u128::from(admitted - capacity + 1) * u128::from(p);
            let at = next.div_ceil(u128::from(q)) as u64;
            assert!(!b.check(&mut s.clone(), at - 1, 1).admitted);
            assert!(b.check(&mut s.clone(), at, 1).admitted);
            let more = greedy(&b, &mut s, start + span + 1, period * 3 + 17);
            assert_eq!(
                u128::from(admitted + more),
                bound(capacity, refill, period, span + 1 + period * 3 + 17)
            );
        }
    }

    #[test]
    fn refund_gives_nothing_back_once_the_tokens_refilled() {
        // B = 10, 1 token/s.
        let b = bucket(10, 1, SECOND);
        let mut s = TokenBucketState::default();
        let (d, a) = b.step_in_place(&mut s, T0, 10);
        assert!(d.admitted);
        assert_eq!(a.amount, 10);
        let t = T0 + 9_900_000;
        let (d, _) = b.step_in_place(&mut s, t, 9);
        assert!(d.admitted);
        let after = b.settle(&mut s, t, a, -10);
        assert_eq!(after, a, "A's tokens have refilled: nothing to give back");
        assert!(!b.check(&mut s, t, 10).admitted);
        // The same through check then record.
        let mut s = TokenBucketState::default();
        assert!(b.check(&mut s, T0, 10).admitted);
        let a = b.record(&mut s, T0, 10);
        assert!(b.check(&mut s, t, 9).admitted);
        b.record(&mut s, t, 9);
        assert_eq!(b.settle(&mut s, t, a, -10).amount, 10);
        assert!(!b.check(&mut s, t, 10).admitted);
    }

    #[test]
    fn refund_gives_back_what_the_charge_still_holds() {
        let b = bucket(10, 1, SECOND);
        let mut s = TokenBucketState::default();
        let (_, a) = b.step_in_place(&mut s, T0, 10);
        // 2.5 s later 7 of A's tokens are still ahead (7.5, rounded down).
        let t = T0 + 2_500_000;
        let a = b.settle(&mut s, t, a, -4);
        assert_eq!(a.amount, 6);
        let a2 = b.settle(&mut s, t, a, -100);
        assert_eq!(a2.amount, 3, "7 in all, never 4 + 6");
        assert_eq!(b.settle(&mut s, t, a2, -100), a2);
        assert_eq!(b.check(&mut s, t, 0).remaining, 9);
        // An extra charge is capped at what is left and not refundable.
        let h = b.settle(&mut s, t, a2, 50);
        assert_eq!(h, a2);
        assert_eq!(b.check(&mut s, t, 0).remaining, 0);
        let d = b.check(&mut s, t, 1);
        assert_eq!(d.retry_after, Some(Duration::from_millis(500)));
    }

    #[test]
    fn holds_behind_an_earlier_refund_claim_nothing_twice() {
        // B = 10, 1 token/s. A1 and A2 take 5 each, A1 is refunded in full,
        // A3 takes 5: A2's tokens moved to where A1's were, A3 sits where A2
        // was. Later A2 and A3 are refunded: only A3's tokens can come back.
        let b = bucket(10, 1, SECOND);
        let mut s = TokenBucketState::default();
        let (_, a1) = b.step_in_place(&mut s, T0, 5);
        let (_, a2) = b.step_in_place(&mut s, T0, 5);
        assert_eq!(b.settle(&mut s, T0, a1, -5).amount, 0);
        let (d, a3) = b.step_in_place(&mut s, T0, 5);
        assert!(d.admitted);
        let t = T0 + 6 * SECOND;
        let (d, _) = b.step_in_place(&mut s, t, 4);
        assert!(d.admitted);
        assert_eq!(
            b.settle(&mut s, t, a2, -5).amount,
            5,
            "A2's tokens have refilled"
        );
        assert_eq!(b.settle(&mut s, t, a3, -5).amount, 1, "4 of A3's are ahead");
        // Net admitted at t: 4, plus what is left now: never more than B.
        assert_eq!(b.check(&mut s, t, 0).remaining, 6);
    }

    #[test]
    fn a_refund_of_another_life_gives_nothing_back() {
        let b = bucket(10, 10, MINUTE);
        let mut lost = TokenBucketState::default();
        let (d, a) = b.step_in_place(&mut lost, T0, 10);
        assert!(d.admitted);
        // The store lost the state; B's charge 1 ms later begins a new life.
        let t = T0 + 1_000;
        let mut s = TokenBucketState::default();
        let (d, h) = b.step_in_place(&mut s, t, 10);
        assert!(d.admitted);
        assert_eq!((a.life, h.life), (T0, t));
        assert_eq!(b.settle(&mut s, t, a, -10), a);
        assert_eq!(b.check(&mut s, t, 0).remaining, 0);
        // B's own refund reaches its charge.
        assert_eq!(b.settle(&mut s, t, h, -10).amount, 0);
        assert_eq!(b.check(&mut s, t, 0).remaining, 10);
    }

    #[test]
    fn a_life_survives_changed_numbers_and_ends_when_fresh() {
        let small = bucket(10, 1, SECOND);
        let big = bucket(20, 1, SECOND);
        let mut s = TokenBucketState::default();
        let (_, h) = small.step_in_place(&mut s, T0, 5);
        // Redeployed with a larger capacity: the state is converted.
        let (d, later) = big.step_in_place(&mut s, T0, 1);
        assert!(d.admitted);
        assert_eq!((h.life, later.life), (T0, T0));
        assert_eq!(big.settle(&mut s, T0, h, -5).amount, 0);
        assert_eq!(big.check(&mut s, T0, 0).remaining, 19);
        // And with a smaller one: clamped, same life.
        big.step_in_place(&mut s, T0, 19);
        let tiny = bucket(5, 1, SECOND);
        assert_eq!(tiny.check(&mut s, T0, 0).remaining, 0);
        assert_eq!(s.born, T0);
        // Read as fresh and written again: a new life.
        let fresh = s.fresh_at();
        s.read_fresh(fresh);
        let (_, next) = tiny.step_in_place(&mut s, fresh, 1);
        assert_eq!(next.life, fresh);
    }

    #[test]
    fn changed_capacity_takes_effect_at_once_and_waits_stay_bounded() {
        let big = bucket(1_000, 1, SECOND);
        let small = bucket(10, 1, SECOND);
        let mut s = TokenBucketState::default();
        assert!(big.step_in_place(&mut s, T0, 1_000).0.admitted);
        // Under the small bucket the state is more than empty: clamped.
        let d = small.check(&mut s, T0, 1);
        assert_eq!(d.retry_after, Some(Duration::from_secs(1)));
        assert_eq!(d.reset, Duration::from_secs(10));
        assert!(small.check(&mut s, T0 + SECOND, 1).admitted);
        // Back to the big one: the TAT kept is the small one's.
        assert_eq!(big.check(&mut s, T0 + SECOND, 0).remaining, 991);
    }

    #[test]
    fn changed_denominator_rounds_the_tat_up() {
        let thirds = bucket(10, 3, SECOND);
        let whole = bucket(10, 1, SECOND);
        let mut s = TokenBucketState::default();
        thirds.step_in_place(&mut s, T0, 1); // TAT = T0 + 333,333 1/3 µs
        assert_eq!((s.tat, s.frac, s.den), (T0 + 333_333, 1, 3));
        let d = whole.check(&mut s, T0, 10);
        assert_eq!(d.retry_after, Some(Duration::from_micros(333_334)));
        assert_eq!((s.tat, s.frac, s.den), (T0 + 333_334, 0, 0));
        assert_eq!(s.off, 1);
    }

    #[test]
    fn clock_set_back_admits_and_refunds_nothing_extra() {
        let b = bucket(10, 1, 6 * SECOND);
        let mut s = TokenBucketState::default();
        let t = T0 + 59 * SECOND;
        let mut holds = Vec::new();
        for _ in 0..10 {
            let (d, h) = b.step_in_place(&mut s, t, 1);
            assert!(d.admitted);
            holds.push(h);
        }
        let back = t - 3_600 * SECOND;
        let d = b.check(&mut s, back, 1);
        assert!(!d.admitted);
        for now in [back, t - 1, t] {
            assert!(!b.step_in_place(&mut s, now, 1).0.admitted);
        }
        // A refund at the earlier time counts from the state's own time:
        // the same as at `t`.
        let mut at_t = s.clone();
        let h = b.settle(&mut s, back, holds[9], -5);
        assert_eq!(h, b.settle(&mut at_t, t, holds[9], -5));
        assert_eq!(s, at_t);
        assert_eq!(h.amount, 0);
        assert_eq!(b.check(&mut s, t, 0).remaining, 1);
    }

    #[test]
    fn extreme_numbers_never_overflow() {
        let buckets = [
            bucket(1, 1, 1),
            bucket(MAX_WINDOW, 1, 1),
            bucket(1, 1, MAX_WINDOW),
            bucket(u64::MAX, u64::from(u32::MAX), 1),
            bucket(u64::MAX / 8, 3, 1),
            bucket(3, u64::from(u32::MAX) - 4, u64::MAX / 4),
        ];
        let times = [0, 1, T0, u64::MAX / 2, u64::MAX - 1, u64::MAX];
        let costs = [0, 1, 3, u64::MAX / 3, u64::MAX - 1, u64::MAX];
        let deltas = [i64::MIN, -1, 0, 1, i64::MAX];
        for a in &buckets {
            for b in &buckets {
                for &t in &times {
                    for &c in &costs {
                        let mut s = TokenBucketState::default();
                        let (_, h) = a.step_in_place(&mut s, t, c);
                        a.record(&mut s, t, c);
                        for &t2 in &times {
                            let mut s2 = s.clone();
                            b.check(&mut s2, t2, c);
                            b.step_in_place(&mut s2, t2, c);
                            for &delta in &deltas {
                                let mut s3 = s2.clone();
                                b.settle(&mut s3, t2, h, delta);
                                b.settle(
                                    &mut s3,
                                    t2,
                                    Hold {
                                        mark: u64::MAX,
                                        frac: u64::MAX,
                                        amount: u64::MAX,
                                        life: u64::MAX,
                                    },
                                    delta,
                                );
                                let _ = b.fresh_at(&s3);
                            }
                        }
                    }
                }
            }
        }
    }

    fn rate() -> impl Strategy<Value = (u64, u64, u64)> {
        prop_oneof![
            Just((20, 100, MINUTE)),
            Just((10, 3, SECOND)),
            Just((5, 7, MINUTE)),
            Just((7, 6, 7 * SECOND)),
            Just((4, 3, 2)), // 2/3 µs per token
            (1u64..30, 1u64..20, 1u64..5_000_000),
        ]
    }

    #[derive(Debug, Clone)]
    enum Op {
        Take {
            gap: u64,
            cost: u64,
        },
        Refund {
            gap: u64,
            which: prop::sample::Index,
            amount: u64,
        },
        Extra {
            gap: u64,
            which: prop::sample::Index,
            amount: u64,
        },
    }

    /// A gap in units of a tenth of the interval, often zero.
    fn gap() -> impl Strategy<Value = u64> {
        prop_oneof![2 => Just(0u64), 6 => 0u64..30, 1 => 0u64..300]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (gap(), 0u64..8).prop_map(|(gap, cost)| Op::Take { gap, cost }),
            3 => (gap(), any::<prop::sample::Index>(), 1u64..12)
                .prop_map(|(gap, which, amount)| Op::Refund { gap, which, amount }),
            1 => (gap(), any::<prop::sample::Index>(), 1u64..6)
                .prop_map(|(gap, which, amount)| Op::Extra { gap, which, amount }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// Admissions, refunds of any earlier charge in any order, and extra
        /// charges: the net cost in every interval stays within
        /// floor(B + r * T), each charge counted at its own time.
        #[test]
        fn net_admitted_stays_within_the_bound_with_settlements(
            (capacity, refill, period) in rate(),
            ops in prop::collection::vec(op(), 1..120),
        ) {
            let b = bucket(capacity, refill, period);
            let tenth = (period / refill / 10).max(1);
            let mut s = TokenBucketState::default();
            let mut now = T0;
            // (time, net cost) per event; the hold and event index per charge.
            let mut events: Vec<(u64, i128)> = Vec::new();
            let mut charges: Vec<(usize, Hold)> = Vec::new();
            for op in ops {
                match op {
                    Op::Take { gap, cost } => {
                        now += gap * tenth;
                        let (d, h) = b.step_in_place(&mut s, now, cost);
                        if d.admitted {
                            prop_assert_eq!(h.amount, cost);
                            events.push((now, i128::from(cost)));
                            charges.push((events.len() - 1, h));
                        }
                    }
                    Op::Refund { gap, which, amount } => {
                        now += gap * tenth;
                        if charges.is_empty() { continue; }
                        let i = which.index(charges.len());
                        let (e, h) = charges[i];
                        let after = b.settle(&mut s, now, h, -(amount as i64));
                        prop_assert!(after.amount <= h.amount);
                        events[e].1 -= i128::from(h.amount - after.amount);
                        prop_assert!(events[e].1 >= 0);
                        charges[i].1 = after;
                    }
                    Op::Extra { gap, which, amount } => {
                        now += gap * tenth;
                        if charges.is_empty() { continue; }
                        let h = charges[which.index(charges.len())].1;
                        let before = b.check(&mut s.clone(), now, 0).remaining;
                        prop_assert_eq!(b.settle(&mut s, now, h, amount as i64), h);
                        let after = b.check(&mut s.clone(), now, 0).remaining;
                        prop_assert_eq!(before - after, amount.min(before));
                        events.push((now, i128::from(before - after)));
                    }
                }
            }
            assert_interval_bound(&events, capacity, refill, period);
        }

        /// Every rate, every demand: never more than floor(B + r * T) in any
        /// interval, and each refusal's wait is exact.
        #[test]
        fn admitted_stays_within_the_bound_and_waits_are_exact(
            (capacity, refill, period) in rate(),
            steps in prop::collection::vec((gap(), 0u64..6), 1..300),
        ) {
            let b = bucket(capacity, refill, period);
            let tenth = (period / refill / 10).max(1);
            let mut s = TokenBucketState::default();
            let mut now = T0;
            let mut events = Vec::new();
            for (gap, cost) in steps {
                now += gap * tenth;
                let before = s.clone();
                let (d, _) = b.step_in_place(&mut s, now, cost);
                if d.admitted {
                    events.push((now, i128::from(cost)));
                } else if let Some(wait) = d.retry_after {
                    prop_assert_eq!(&s, &before);
                    let wait = wait.as_micros() as u64;
                    prop_assert!(wait >= 1 && wait <= b.window_micros());
                    prop_assert!(!b.check(&mut s.clone(), now + wait - 1, cost).admitted);
                    prop_assert!(b.check(&mut s.clone(), now + wait, cost).admitted);
                } else {
                    prop_assert!(cost > capacity);
                }
            }
            assert_interval_bound(&events, capacity, refill, period);
        }

        /// The one-pass whole-µs path and the general path agree: decisions,
        /// holds and states.
        #[test]
        fn whole_micros_path_equals_the_general_path(
            capacity in prop_oneof![1u64..50, 1u64..(1 << 40)],
            interval in prop_oneof![1u64..10, 1u64..10_000_000],
            steps in prop::collection::vec((0u64..30_000_000, 0u64..60, -40i64..40, any::<bool>()), 1..200),
        ) {
            let interval = interval.min(MAX_WINDOW / capacity).max(1);
            let b = bucket(capacity, 1, interval);
            let mut fast = TokenBucketState::default();
            let mut general = TokenBucketState::default();
            let mut now = T0;
            let mut holds = Vec::new();
            for (gap, cost, delta, checked) in steps {
                now += gap % (interval * 3 + 1);
                let (df, hf) = if checked {
                    let d = b.check(&mut fast, now, cost);
                    let h = if d.admitted { b.record(&mut fast, now, cost) } else { Hold::default() };
                    (d, h)
                } else {
                    b.step_in_place(&mut fast, now, cost)
                };
                let (dg, hg) = step_general(&b, &mut general, now, cost);
                prop_assert_eq!(&df, &dg);
                prop_assert_eq!(hf, hg);
                prop_assert_eq!(&fast, &general);
                if df.admitted { holds.push(hf); }
                if delta != 0 && !holds.is_empty() {
                    let h = holds[(gap as usize) % holds.len()];
                    let a = b.settle(&mut fast, now, h, delta);
                    let c = b.settle(&mut general, now, h, delta);
                    prop_assert_eq!(a, c);
                }
            }
        }

        /// Random changes of numbers between decisions: never a panic, never
        /// a wait (or reset) longer than the new policy's time to refill from
        /// empty, and each wait exact under the new numbers.
        #[test]
        fn changed_numbers_never_wait_longer_than_a_refill(
            policies in prop::collection::vec(
                (prop_oneof![1u64..40, 1u64..1_000_000], 1u64..1_000, prop_oneof![1u64..100, 1u64..100_000_000]),
                1..5,
            ),
            steps in prop::collection::vec(
                (any::<prop::sample::Index>(), 0u64..20_000_000, 0u64..50, -30i64..30, any::<prop::sample::Index>()),
                1..150,
            ),
        ) {
            let buckets: Vec<TokenBucket> = policies
                .iter()
                .filter_map(|&(c, r, p)| TokenBucket::new(c, r, p).ok())
                .collect();
            prop_assume!(!buckets.is_empty());
            let mut s = TokenBucketState::default();
            let mut now = T0;
            let mut holds: Vec<Hold> = Vec::new();
            for (which, gap, cost, delta, hold) in steps {
                let b = &buckets[which.index(buckets.len())];
                now += gap % (b.window_micros().saturating_mul(2) + 1);
                let (d, h) = b.step_in_place(&mut s, now, cost);
                prop_assert!(d.reset.as_micros() <= u128::from(b.window_micros()));
                if d.admitted {
                    holds.push(h);
                } else if let Some(wait) = d.retry_after {
                    let wait = wait.as_micros() as u64;
                    prop_assert!(wait >= 1 && wait <= b.window_micros(), "wait {} window {}", wait, b.window_micros());
                    prop_assert!(!b.check(&mut s.clone(), now + wait - 1, cost).admitted);
                    prop_assert!(b.check(&mut s.clone(), now + wait, cost).admitted);
                }
                if !holds.is_empty() {
                    let i = hold.index(holds.len());
                    holds[i] = b.settle(&mut s, now, holds[i], delta);
                }
                let d = b.check(&mut s, now, 0);
                prop_assert!(d.reset.as_micros() <= u128::from(b.window_micros()));
            }
        }
    }
}
