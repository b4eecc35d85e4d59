//! [`BodyLimitsLayer`]: the caps and the decoder's settings.

use tower::Layer;
use tower_http::decompression::RequestDecompressionLayer;

use super::service::BodyLimits;
use crate::bounds::decode::Codings;

#[doc = include_str!("../../../docs/body_limits.md")]
#[derive(Debug, Clone)]
pub struct BodyLimitsLayer {
    pub(super) wire_bytes: usize,
    pub(super) decoded_bytes: usize,
    pub(super) codings: Codings,
}

impl BodyLimitsLayer {
    /// Caps the body at `wire_bytes` as sent and `decoded_bytes` after
    /// decompression. A cap of 0 admits only empty bodies.
    ///
    /// For an uncompressed body both caps apply to the same bytes, so the
    /// smaller one wins.
    pub fn new(wire_bytes: usize, decoded_bytes: usize) -> Self {
        BodyLimitsLayer {
            wire_bytes,
            decoded_bytes,
            codings: Codings::default(),
        }
    }

    /// Takes the coding settings of this tower-http decompression layer, for
    /// example one with some encodings turned off
    /// (`RequestDecompressionLayer::new().no_br()`). An encoding that is
    /// turned off is answered with 415. A layer set to
    /// `pass_through_unaccepted(true)` passes such requests on undecoded
    /// instead, several codings with their `content-encoding` in one line.
    ///
    /// Only the settings are taken: the decoding itself is this crate's,
    /// with the behaviour [above](Self#where-the-coded-data-ends).
    pub fn decompression(mut self, layer: RequestDecompressionLayer) -> Self {
        self.codings = Codings::learn(&layer);
        self
    }

    /// The wire cap in bytes.
    pub fn wire_bytes(&self) -> usize {
        self.wire_bytes
    }

    /// The decoded cap in bytes.
    pub fn decoded_bytes(&self) -> usize {
        self.decoded_bytes
    }
}

impl<S> Layer<S> for BodyLimitsLayer {
    type Service = BodyLimits<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BodyLimits {
            inner,
            caps: self.clone(),
        }
    }
}
