use std::fmt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::state::Guard;
use crate::reject::RefusalBody;

pin_project! {
    /// A response body that holds the request's concurrency permits until the
    /// body has been sent in full, has failed, or is dropped.
    ///
    /// This makes streaming responses count against the cap for as long as
    /// they stream, not just until the handler returned its headers.
    pub struct PermitBody<B> {
        #[pin]
        inner: B,
        guard: Option<Guard>,
    }
}

impl<B> PermitBody<B> {
    pub(crate) fn new(inner: B, guard: Guard) -> Self {
        PermitBody {
            inner,
            guard: Some(guard),
        }
    }

    /// True while the body still holds its permits.
    pub fn holds_permit(&self) -> bool {
        self.guard.is_some()
    }

    /// The wrapped body.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }
}

/// A refusal's body holds no permit.
impl<B: RefusalBody> RefusalBody for PermitBody<B> {
    fn from_refusal(body: Bytes) -> Self {
        PermitBody {
            inner: B::from_refusal(body),
            guard: None,
        }
    }
}

impl<B: Body> Body for PermitBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        let done = match &frame {
            None | Some(Err(_)) => true,
            Some(Ok(_)) => this.inner.is_end_stream(),
        };
        if done {
            this.guard.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> fmt::Debug for PermitBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PermitBody")
            .field("holds_permit", &self.guard.is_some())
            .finish_non_exhaustive()
    }
}
