use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use super::adaptive::Outcome;
use super::body::PermitBody;
use super::state::{AcquireFuture, Guard, Refusal};
use crate::reject::{Protocol, RefusalBody};

/// Polls a clone of the inner service ready, then calls it with the request:
/// the inner future, or the error of `poll_ready` as the final output.
pub(crate) type CallInner<F> =
    Box<dyn FnMut(&mut Context<'_>) -> Poll<Result<F, <F as Future>::Output>> + Send>;

pin_project! {
    /// Response future of [`Concurrency`](super::Concurrency).
    ///
    /// Waits in the queue(s) when needed, then (holding the permits) waits
    /// for the inner service to be ready and runs its future, and finally
    /// wraps its body in a [`PermitBody`].
    pub struct ResponseFuture<F>
    where
        F: Future,
    {
        // The inner service's future once called: outside the state enum,
        // so that a request admitted at once writes it in place.
        #[pin]
        fut: Option<F>,
        // The permits, from admission until the inner future's answer.
        guard: Option<Guard>,
        state: State<F>,
    }
}

// A plain tag (no niche in the fields' values), so that telling the
// states apart, and dropping `Calling`, reads one byte.
#[repr(u8)]
enum State<F: Future> {
    Waiting {
        acquire: AcquireFuture,
        call: Option<CallInner<F>>,
        protocol: Protocol,
    },
    Readying {
        call: CallInner<F>,
    },
    /// `fut` runs.
    Calling,
    Refused {
        refusal: Option<Refusal>,
        protocol: Protocol,
    },
}

impl<F: Future> ResponseFuture<F> {
    pub(crate) fn waiting(acquire: AcquireFuture, call: CallInner<F>, protocol: Protocol) -> Self {
        ResponseFuture {
            fut: None,
            guard: None,
            state: State::Waiting {
                acquire,
                call: Some(call),
                protocol,
            },
        }
    }

    #[inline(always)]
    pub(crate) fn calling(fut: F, guard: Guard) -> Self {
        ResponseFuture {
            fut: Some(fut),
            guard: Some(guard),
            state: State::Calling,
        }
    }

    pub(crate) fn refused(refusal: Refusal, protocol: Protocol) -> Self {
        ResponseFuture {
            fut: None,
            guard: None,
            state: State::Refused {
                refusal: Some(refusal),
                protocol,
            },
        }
    }
}

fn refusal_response<B: RefusalBody>(
    refusal: Refusal,
    protocol: Protocol,
) -> Response<PermitBody<B>> {
    let mut response = refusal.rejection.respond(protocol);
    response.extensions_mut().insert(refusal.reason);
    response
}

/// How an answer of the inner service moves an adaptive limit: a 503 or
/// 504, or an error, is an overload; any other response a latency sample.
fn http_outcome<B, E>(result: &Result<Response<B>, E>) -> Outcome {
    match result {
        Ok(response) => match response.status().as_u16() {
            503 | 504 => Outcome::Overload,
            _ => Outcome::Success,
        },
        Err(_) => Outcome::Overload,
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: RefusalBody,
{
    type Output = Result<Response<PermitBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            if let Some(fut) = this.fut.as_mut().as_pin_mut() {
                let result = ready!(fut.poll(cx));
                let mut guard = this.guard.take().expect("polled after completion");
                guard.answered(|| http_outcome(&result));
                return Poll::Ready(match result {
                    Ok(response) => Ok(response.map(|body| PermitBody::new(body, guard))),
                    // The inner service failed: there is no body to hold
                    // the permits, so they are released now.
                    Err(e) => Err(e),
                });
            }
            match this.state {
                State::Waiting {
                    acquire,
                    call,
                    protocol,
                } => match ready!(acquire.as_mut().poll(cx)) {
                    Ok(guard) => {
                        let call = call.take().expect("polled after completion");
                        *this.guard = Some(guard);
                        *this.state = State::Readying { call };
                    }
                    Err(refusal) => {
                        let protocol = std::mem::replace(protocol, Protocol::HTTP);
                        *this.state = State::Refused {
                            refusal: None,
                            protocol: Protocol::HTTP,
                        };
                        return Poll::Ready(Ok(refusal_response(refusal, protocol)));
                    }
                },
                State::Readying { call } => match ready!(call(cx)) {
                    Ok(fut) => {
                        this.fut.set(Some(fut));
                        *this.state = State::Calling;
                    }
                    // `poll_ready` failed: the permits are released now, as
                    // for an error of the inner future.
                    Err(Err(e)) => {
                        this.guard.take();
                        return Poll::Ready(Err(e));
                    }
                    Err(Ok(response)) => {
                        let guard = this.guard.take().expect("polled after completion");
                        return Poll::Ready(Ok(response.map(|body| PermitBody::new(body, guard))));
                    }
                },
                State::Calling => unreachable!("a called request has its inner future"),
                State::Refused { refusal, protocol } => {
                    let refusal = refusal.take().expect("polled after completion");
                    let protocol = std::mem::replace(protocol, Protocol::HTTP);
                    return Poll::Ready(Ok(refusal_response(refusal, protocol)));
                }
            }
        }
    }
}

impl<F: Future> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Waiting { .. } => "waiting",
            State::Readying { .. } => "readying",
            State::Calling => "calling",
            State::Refused { .. } => "refused",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
