//! The one Redis call module (feature `redis`), crate-private: every Redis
//! call of the crate goes through it.
//!
//! Three callers share it: the quota store
//! ([`RedisStore`](crate::quota::RedisStore)), the rate leases'
//! [`LeaseStore`](crate::outbound::LeaseStore) and each region of a
//! [`RegionalBudget`](crate::outbound::RegionalBudget). Each keeps its own
//! public error type and maps it from the one [`CallError`].
//!
//! - `connection.rs`: the reconnecting slot ([`Connector`]) on one server or
//!   a cluster: one live connection, or one attempt every caller joins;
//!   exponential backoff between failed attempts; a stalled connection
//!   replaced; a closed one seen at once (RESP3 disconnect event).
//! - `call.rs`: one call ([`Connector::call`]) under its deadline, a script
//!   (EVALSHA, loaded again on NOSCRIPT) or a command, and its two failure
//!   phases. The redis crate's `ConnectionManager` reconnects inside the
//!   command future, so a caller that gives up at its deadline could not
//!   tell "still connecting, nothing sent" from "sent, no answer yet"; the
//!   two have opposite meanings (nothing happened; the outcome is unknown
//!   and must be counted as done), so this module keeps them apart:
//!   1. **Acquire**: take the live connection, or join (or start) an
//!      attempt. Any failure or deadline here is [`CallError::Unavailable`].
//!   2. **Send**: hand the request to the live connection. From here on a
//!      deadline is [`CallError::Timeout`] and a dropped connection
//!      [`CallError::Unknown`]: the bytes may have reached Redis. An error
//!      answered by Redis is [`CallError::Rejected`].
//! - `prelude.rs` and `scripts/`: the Lua prelude every script starts with,
//!   the clock (`clock_redis.lua`, Redis `TIME`; `clock_injected.lua`, the
//!   test-only time from an argument) and the integer helpers
//!   (`common.lua`). Scripts `include_str!` them from here only.
//! - `keys.rs`: what may go into a key (a prefix, a budget's name).
//!
//! The local token bucket the leases spend from is
//! `src/outbound/bucket.rs`, the one bucket of the crate's outbound side.

mod call;
mod connection;
mod keys;
mod prelude;

pub(crate) use call::{CallError, Request};
pub(crate) use connection::{Connector, Target, Timing};
pub(crate) use keys::{check_prefix, valid_key_part};
#[cfg(test)]
pub(crate) use prelude::clock;
pub(crate) use prelude::prelude;
