//! The Lua prelude every script starts with: a clock, then the integer
//! helpers.
//!
//! `scripts/clock_redis.lua` reads Redis `TIME` (production);
//! `scripts/clock_injected.lua` reads the time from an argument (test-only
//! scripts, a different SHA). Both define `clock_now()` and `EXPIRY_PAD_MS`.
//! `scripts/common.lua` holds the integer helpers (`idiv`, `muldiv` and the
//! rest) that keep every number exact in Lua's doubles.

const CLOCK_REDIS: &str = include_str!("scripts/clock_redis.lua");
const CLOCK_INJECTED: &str = include_str!("scripts/clock_injected.lua");
const COMMON: &str = include_str!("scripts/common.lua");

/// The clock: Redis `TIME`, or with `injected_at = Some(n)` the test-only
/// clock that reads the time from `ARGV[n]`.
pub(crate) fn clock(injected_at: Option<u8>) -> String {
    match injected_at {
        None => CLOCK_REDIS.to_owned(),
        Some(n) => format!("local CLOCK_ARG = {n}\n{CLOCK_INJECTED}"),
    }
}

/// The whole prelude, the clock then the helpers, for a script's body to
/// follow.
pub(crate) fn prelude(injected_at: Option<u8>) -> String {
    format!("{}\n{COMMON}\n", clock(injected_at))
}
