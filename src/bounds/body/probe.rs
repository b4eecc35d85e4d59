//! The per-request probe that records which cap a body tripped.

use std::error::Error as StdError;
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};

use http_body::{Body, Frame, SizeHint};
use http_body_util::LengthLimitError;
use pin_project_lite::pin_project;

use super::{limit, BoxError};
use crate::reject::{InvalidParameter, Rejection};

/// A request's probe and caps: which refusal a trip of its body stands for.
#[derive(Debug, Clone)]
pub(super) struct Trip {
    pub(super) probe: Probe,
    /// The `content-length` the wire stage reads the body to, if sent.
    pub(super) declared_length: Option<usize>,
    pub(super) wire_bytes: usize,
    pub(super) decoded_bytes: usize,
}

impl Trip {
    /// Whether a cap tripped or the coded body was found malformed.
    pub(super) fn tripped(&self) -> bool {
        self.probe.0.tripped.load(Ordering::Acquire) != 0
    }

    /// The refusal for what the request body tripped, if anything.
    pub(super) fn rejection(&self) -> Option<Rejection> {
        let state = &self.probe.0;
        match state.tripped.load(Ordering::Acquire) {
            TRIPPED_WIRE => Some(match self.declared_length {
                // The length the body broke is the one it declared.
                Some(declared) if declared <= self.wire_bytes => {
                    Rejection::InvalidParameters(vec![InvalidParameter::new(
                        "body",
                        format!("the body is longer than its content-length of {declared} bytes"),
                    )])
                }
                _ => Rejection::BodyTooLarge {
                    limit: limit(self.wire_bytes),
                },
            }),
            TRIPPED_DECODED => Some(Rejection::DecodedTooLarge {
                limit: limit(self.decoded_bytes),
            }),
            TRIPPED_MALFORMED => {
                let reason = state
                    .malformed
                    .get()
                    .cloned()
                    .unwrap_or_else(|| "the coded data is malformed".to_owned());
                Some(Rejection::InvalidParameters(vec![InvalidParameter::new(
                    "body", reason,
                )]))
            }
            _ => None,
        }
    }
}

pub(super) const PASSED_WIRE: u8 = 1;
pub(super) const PASSED_DECODED: u8 = 2;
const TRIPPED_WIRE: u8 = 1;
const TRIPPED_DECODED: u8 = 2;
const TRIPPED_MALFORMED: u8 = 3;

#[derive(Debug, Default)]
pub(super) struct ProbeState {
    /// Bit set of the probes the request reached.
    pub(super) passed: AtomicU8,
    /// The first cap whose length error was seen, or a malformed coded
    /// body, whichever came first; or 0.
    tripped: AtomicU8,
    /// Why the coded body is malformed, once `tripped` says it is.
    malformed: OnceLock<String>,
}

/// Per-request record shared by [`BodyLimits`](super::BodyLimits), its probes and their bodies,
/// carried in the request extensions.
#[derive(Debug, Clone, Default)]
pub(in crate::bounds) struct Probe(pub(super) Arc<ProbeState>);

impl Probe {
    /// Records that the decoder found the coded body malformed, unless a cap
    /// tripped first.
    pub(in crate::bounds) fn trip_malformed(&self, reason: &str) {
        let first = self
            .0
            .tripped
            .compare_exchange(0, TRIPPED_MALFORMED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if first {
            let _ = self.0.malformed.set(reason.to_owned());
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    Wire,
    Decoded,
}

impl Stage {
    pub(super) fn passed_bit(self) -> u8 {
        match self {
            Stage::Wire => PASSED_WIRE,
            Stage::Decoded => PASSED_DECODED,
        }
    }

    fn trip_code(self) -> u8 {
        match self {
            Stage::Wire => TRIPPED_WIRE,
            Stage::Decoded => TRIPPED_DECODED,
        }
    }
}

pin_project! {
    /// A request body inside [`BodyLimits`] that records when the cap
    /// directly around it is exceeded. Frames and errors pass through
    /// unchanged.
    pub(super) struct ProbedBody<B> {
        #[pin]
        pub(super) inner: B,
        pub(super) probe: Option<Probe>,
        pub(super) stage: Stage,
    }
}

impl<B: fmt::Debug> fmt::Debug for ProbedBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProbedBody")
            .field("inner", &self.inner)
            .field("stage", &self.stage)
            .finish()
    }
}

/// True when `err` or one of its sources is a [`LengthLimitError`].
fn is_length_limit(err: &(dyn StdError + 'static)) -> bool {
    let mut current = Some(err);
    while let Some(e) = current {
        if e.is::<LengthLimitError>() {
            return true;
        }
        current = e.source();
    }
    false
}

impl<B> Body for ProbedBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        match ready!(this.inner.poll_frame(cx)) {
            Some(Ok(frame)) => Poll::Ready(Some(Ok(frame))),
            Some(Err(err)) => {
                let err: BoxError = err.into();
                if let Some(probe) = this.probe {
                    if is_length_limit(&*err) {
                        // The first cap to trip wins: an error from the wire
                        // cap passes this probe before the decoded one.
                        let _ = probe.0.tripped.compare_exchange(
                            0,
                            this.stage.trip_code(),
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        );
                    }
                }
                Poll::Ready(Some(Err(err)))
            }
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
