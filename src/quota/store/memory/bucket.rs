//! The state of a lone token bucket, in 24 bytes when it can be.

use crate::quota::algorithm::{Hold, TokenBucket, TokenBucketState};
use crate::quota::Decision;

/// A bucket's state in 24 bytes when its TAT is whole µs with no offset
/// (every state of a whole-µs rate without refunds), else boxed.
#[derive(Debug, Clone)]
pub(super) enum Bucket {
    /// The TAT `at` (whole µs, no offset), last written at `at - lag`, in
    /// the life that began at `born`; or, when `lag` is
    /// [`FRESH`](Bucket::FRESH), a TAT of 0 last written at `at`.
    Whole {
        lag: u32,
        at: u64,
        born: u64,
    },
    Full(Box<TokenBucketState>),
}

impl Default for Bucket {
    fn default() -> Self {
        Bucket::Whole {
            lag: 0,
            at: 0,
            born: 0,
        }
    }
}

impl Bucket {
    const FRESH: u32 = u32::MAX;

    #[inline]
    pub(super) fn get(&self) -> TokenBucketState {
        match *self {
            Bucket::Whole {
                lag: Self::FRESH,
                at,
                ..
            } => TokenBucketState::from_whole(0, at, 0),
            Bucket::Whole { lag, at, born } => {
                TokenBucketState::from_whole(at, at - u64::from(lag), born)
            }
            Bucket::Full(ref state) => (**state).clone(),
        }
    }

    /// The TAT and last write of a whole state.
    #[inline]
    fn whole(lag: u32, at: u64) -> (u64, u64) {
        if lag == Self::FRESH {
            (0, at)
        } else {
            (at, at - u64::from(lag))
        }
    }

    /// A decision of `bucket` at `now`, as `read_fresh` then `step_in_place`
    /// make it on the state this holds.
    #[inline]
    pub(super) fn step(&mut self, bucket: &TokenBucket, now: u64, cost: u64) -> (Decision, Hold) {
        if let Bucket::Whole { lag, at, born } = *self {
            let (mut tat, mut last) = Self::whole(lag, at);
            let mut born = born;
            if let Some(step) = bucket.step_whole(&mut tat, &mut last, &mut born, now, cost) {
                self.set_whole(tat, last, born);
                return step;
            }
        }
        let mut state = self.get();
        state.read_fresh(now);
        let step = bucket.step_in_place(&mut state, now, cost);
        self.set(state);
        step
    }

    #[inline]
    pub(super) fn set(&mut self, state: TokenBucketState) {
        match state.whole() {
            Some((tat, last, born)) => self.set_whole(tat, last, born),
            None => self.set_full(state),
        }
    }

    /// Holds the whole-µs state of TAT `tat` and last write `last` in the
    /// life that began at `born`.
    #[inline]
    fn set_whole(&mut self, tat: u64, last: u64, born: u64) {
        // A TAT before `last` wraps to a lag too large to keep.
        let lag = tat.wrapping_sub(last);
        if lag < u64::from(Self::FRESH) {
            *self = Bucket::Whole {
                lag: lag as u32,
                at: tat,
                born,
            };
        } else if tat == 0 {
            *self = Bucket::Whole {
                lag: Self::FRESH,
                at: last,
                born: 0,
            };
        } else {
            self.set_full(TokenBucketState::from_whole(tat, last, born));
        }
    }

    #[cold]
    #[inline(never)]
    fn set_full(&mut self, state: TokenBucketState) {
        match self {
            Bucket::Full(boxed) => **boxed = state,
            this => *this = Bucket::Full(Box::new(state)),
        }
    }

    #[inline]
    pub(super) fn fresh_at(&self) -> u64 {
        match *self {
            Bucket::Whole {
                lag: Self::FRESH, ..
            } => 0,
            Bucket::Whole { at, .. } => at,
            Bucket::Full(ref state) => state.fresh_at(),
        }
    }
}
