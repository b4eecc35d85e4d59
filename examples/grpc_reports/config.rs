//! Limits of the gRPC service: the HTTP reporting API's keys, plans and
//! caps (its built-in `reporting.toml`), plus what only gRPC has.

#[path = "../reporting_api/config.rs"]
#[allow(dead_code, reason = "the HTTP example's knobs, only some apply here")]
mod shared;
// The HTTP example's dependency limit, which its configuration names.
#[path = "../reporting_api/overload.rs"]
#[allow(dead_code, reason = "the HTTP example's knobs, only some apply here")]
mod overload;
use shared as config;

use std::sync::OnceLock;

pub(crate) use shared::Config;

/// Where the service listens unless `--listen` says otherwise.
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
/// Largest request message, in bytes (the gRPC counterpart of the body cap).
pub(crate) const MAX_MESSAGE_BYTES: usize = 64 << 10;

/// The HTTP example's built-in configuration.
pub(crate) fn shared() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(Config::builtin)
}
