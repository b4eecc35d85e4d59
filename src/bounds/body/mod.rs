//! Wire-byte and decoded-byte caps, composed from tower-http's
//! [`RequestBodyLimit`](tower_http::limit::RequestBodyLimit) around this crate's streaming decoder, which follows
//! the coding settings of a tower-http [`RequestDecompressionLayer`](tower_http::decompression::RequestDecompressionLayer).

use std::error::Error as StdError;

use bytes::Bytes;
use http::Response;
use http_body_util::{Either, Full};

mod capped;
mod future;
mod layer;
mod probe;
mod service;
mod stack;
mod status;

pub use capped::CappedBody;
pub use layer::{BodyCaps, BodyLimitsLayer};
pub(in crate::bounds) use probe::Probe;

type BoxError = Box<dyn StdError + Send + Sync>;

/// A response of [`BodyLimits`]: the inner one as it was when the request
/// could not trip a cap, the one through the caps (`SB`), or a refusal.
type LimitedResponse<RB, SB> = Response<Either<Either<RB, status::StatusBody<SB>>, Full<Bytes>>>;

/// A cap in bytes as a refusal's `limit`.
fn limit(cap: usize) -> u64 {
    u64::try_from(cap).unwrap_or(u64::MAX)
}
