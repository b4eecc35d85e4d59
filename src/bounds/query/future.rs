//! The response future of [`ValidateQuery`](super::ValidateQuery).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

pin_project! {
    /// Response future of [`ValidateQuery`].
    pub struct ResponseFuture<F, RB> {
        #[pin]
        pub(super) kind: Kind<F, RB>,
    }
}

pin_project! {
    #[project = KindProj]
    pub(super) enum Kind<F, RB> {
        Inner { #[pin] future: F },
        Rejected { response: Option<Response<RB>> },
    }
}

impl<F, RB> fmt::Debug for ResponseFuture<F, RB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Inner { .. } => "inner",
            Kind::Rejected { .. } => "rejected",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}

impl<F, RB, E> Future for ResponseFuture<F, RB>
where
    F: Future<Output = Result<Response<RB>, E>>,
{
    type Output = Result<Response<RB>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Inner { future } => {
                let response = ready!(future.poll(cx))?;
                Poll::Ready(Ok(response))
            }
            KindProj::Rejected { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("ResponseFuture polled after completion"),
            },
        }
    }
}
