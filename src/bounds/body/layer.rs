//! [`BodyLimitsLayer`]: the caps and the decoder's settings.

use std::sync::Arc;

use tower::Layer;
use tower_http::decompression::RequestDecompressionLayer;

use super::service::BodyLimits;
use crate::bounds::decode::Codings;
use crate::reload::{Live, ReloadHandle, Target};
use crate::ConfigError;

#[doc = include_str!("../../../docs/body_limits.md")]
#[derive(Debug, Clone)]
pub struct BodyLimitsLayer {
    /// The caps in force, shared by clones and services.
    pub(super) caps: Arc<Live<BodyCaps>>,
    pub(super) codings: Codings,
}

/// The two caps of a [`BodyLimitsLayer`]: what its
/// [`reload_handle`](BodyLimitsLayer::reload_handle) applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyCaps {
    /// Bytes on the wire.
    pub wire_bytes: usize,
    /// Bytes after decompression.
    pub decoded_bytes: usize,
}

/// The layer's side of its [`ReloadHandle`].
struct CapsTarget(Arc<Live<BodyCaps>>);

impl Target<BodyCaps> for CapsTarget {
    fn check(&self, _: &BodyCaps) -> Result<(), ConfigError> {
        Ok(())
    }

    fn swap(&self, new: BodyCaps) {
        self.0.store(new);
    }
}

impl BodyLimitsLayer {
    /// Caps the body at `wire_bytes` as sent and `decoded_bytes` after
    /// decompression. A cap of 0 admits only empty bodies.
    ///
    /// For an uncompressed body both caps apply to the same bytes, so the
    /// smaller one wins.
    pub fn new(wire_bytes: usize, decoded_bytes: usize) -> Self {
        BodyLimitsLayer {
            caps: Arc::new(Live::new(BodyCaps {
                wire_bytes,
                decoded_bytes,
            })),
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

    /// The wire cap in force, in bytes.
    pub fn wire_bytes(&self) -> usize {
        self.caps.load().wire_bytes
    }

    /// The decoded cap in force, in bytes.
    pub fn decoded_bytes(&self) -> usize {
        self.caps.load().decoded_bytes
    }

    /// Changes the caps of this layer, its clones and every service built
    /// from them while they run. A request is capped wholly under the caps
    /// in force when it arrives, also while its body is still read.
    pub fn reload_handle(&self) -> ReloadHandle<BodyCaps> {
        ReloadHandle::new(Arc::new(CapsTarget(Arc::clone(&self.caps))))
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
