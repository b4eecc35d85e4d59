//! The local token bucket the leases spend from: the one bucket of the
//! outbound side, in integer nano-tokens.
//!
//! A rate in milli-units per second times a span in µs is a number of
//! nano-tokens, exactly, so the bucket fills with no rounding at all. The
//! [`RateLease`](crate::outbound::RateLease) spends from one, at its grant;
//! each share of a [`LeasedBudget`](crate::outbound::LeasedBudget) from
//! another, filled on the lease's schedule.

/// Nano-tokens per token.
pub(crate) const NANO: u128 = 1_000_000_000;

/// A token bucket of integer nano-tokens. Its rate and capacity are given at
/// each call, since both follow a lease that changes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Bucket {
    tokens: u128,
}

impl Bucket {
    /// An empty bucket.
    pub(crate) const EMPTY: Bucket = Bucket { tokens: 0 };

    /// Fills for `micros` at `per_us` nano-tokens per µs (a rate in
    /// milli-units per second), holding at most `capacity` nano-tokens
    /// before and after.
    pub(crate) fn fill(&mut self, per_us: u128, micros: u64, capacity: u128) {
        self.tokens = self
            .tokens
            .min(capacity)
            .saturating_add(per_us * u128::from(micros))
            .min(capacity);
    }

    /// Drops what is above `capacity` nano-tokens.
    pub(crate) fn cap(&mut self, capacity: u128) {
        self.tokens = self.tokens.min(capacity);
    }

    /// Empties the bucket.
    pub(crate) fn clear(&mut self) {
        self.tokens = 0;
    }

    /// The nano-tokens still missing for `cost` tokens; zero if it fits.
    pub(crate) fn missing(&self, cost: u64) -> u128 {
        nano(cost).saturating_sub(self.tokens)
    }

    /// Spends `cost` tokens, which must fit ([`missing`](Self::missing) is
    /// zero).
    pub(crate) fn spend(&mut self, cost: u64) {
        debug_assert_eq!(self.missing(cost), 0);
        self.tokens -= nano(cost);
    }

    /// The µs until `cost` tokens fit, filling at `per_us` (above zero)
    /// nano-tokens per µs; zero if they fit now.
    pub(crate) fn wait_us(&self, cost: u64, per_us: u128) -> u64 {
        u64::try_from(self.missing(cost).div_ceil(per_us)).unwrap_or(u64::MAX)
    }
}

/// `units` tokens in nano-tokens.
pub(crate) fn nano(units: u64) -> u128 {
    u128::from(units) * NANO
}

/// A capacity in nano-tokens as whole tokens.
pub(crate) fn whole(nano_tokens: u128) -> u64 {
    u64::try_from(nano_tokens / NANO).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_exactly_up_to_its_capacity_and_spends_whole_tokens() {
        let mut b = Bucket::EMPTY;
        // 2.5/s (2,500 milli-units per second) for 1 s: 2.5 tokens.
        b.fill(2_500, 1_000_000, nano(10));
        assert_eq!(b.missing(2), 0);
        assert_eq!(b.missing(3), NANO / 2);
        // Half a token at 2.5/s is 200 ms.
        assert_eq!(b.wait_us(3, 2_500), 200_000);
        b.spend(2);
        assert_eq!(b.missing(1), NANO / 2);
        b.fill(2_500, 10_000_000, nano(4));
        assert_eq!(b, Bucket { tokens: nano(4) });
        b.cap(nano(1));
        assert_eq!(b.wait_us(1, 1), 0);
        assert_eq!(whole(nano(4) + NANO - 1), 4);
        b.clear();
        assert_eq!(b, Bucket::EMPTY);
    }
}
