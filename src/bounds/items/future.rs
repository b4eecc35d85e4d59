//! The response future of [`BatchItems`](super::BatchItems): the body read, then counted.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::combinators::Collect;
use http_body_util::Full;
use pin_project_lite::pin_project;
use tower::Service;

use super::parse::count_batch_items;
use super::ItemCount;
use crate::reject::{InvalidParameter, Protocol, RefusalBody, Rejection};

pin_project! {
    /// Response future of [`BatchItems`].
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<Full<Bytes>>>,
        B: Body,
    {
        #[pin]
        pub(super) state: State<S, B>,
    }
}

pin_project! {
    #[project = StateProj]
    pub(super) enum State<S, B>
    where
        S: Service<Request<Full<Bytes>>>,
        B: Body,
    {
        Reading {
            #[pin]
            collect: Collect<B>,
            parts: Option<Parts>,
            inner: Option<S>,
            max: usize,
        },
        Inner {
            #[pin]
            future: S::Future,
        },
        Done,
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<Full<Bytes>>>,
    B: Body,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Reading { .. } => "reading",
            State::Inner { .. } => "inner",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

impl<S, B, RB> Future for ResponseFuture<S, B>
where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>>,
    B: Body,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
    RB: RefusalBody,
{
    type Output = Result<Response<RB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Reading {
                    collect,
                    parts,
                    inner,
                    max,
                } => {
                    let read = ready!(collect.poll(cx));
                    let max = *max;
                    let (Some(mut parts), Some(mut inner)) = (parts.take(), inner.take()) else {
                        panic!("ResponseFuture polled after completion");
                    };
                    let protocol = Protocol::of(&parts.headers);
                    let counted = match read {
                        Err(err) => Err(Rejection::InvalidParameters(vec![InvalidParameter::new(
                            "body",
                            format!("could not be read: {}", err.into()),
                        )])),
                        Ok(collected) => {
                            let bytes = collected.to_bytes();
                            count_batch_items(&bytes, max).map(|n| (n, bytes))
                        }
                    };
                    match counted {
                        Ok((n, bytes)) => {
                            parts.extensions.insert(ItemCount(n));
                            let future = inner.call(Request::from_parts(parts, Full::new(bytes)));
                            this.state.set(State::Inner { future });
                        }
                        Err(err) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(err.respond(protocol)));
                        }
                    }
                }
                StateProj::Inner { future } => {
                    let response = ready!(future.poll(cx))?;
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}
