use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::request::Parts;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use super::Identity;
use crate::reject::{Protocol, RefusalBody, Rejection};

/// Establishes who is calling from the request head.
///
/// The method returns `impl Future + Send` (a return-position `impl Trait` in
/// a trait), so implementations may be written as `async fn` when their body
/// is `Send`, and a synchronous implementation such as [`ApiKeys`] returns
/// [`std::future::Ready`]. The layer's service boxes the future once per
/// request so that its own future type stays nameable, unless
/// [`authenticate_now`](Self::authenticate_now) answers first: then it
/// decides in `call` and allocates nothing.
///
/// Implementations read only what the transport or an earlier trusted layer
/// established (an `Authorization` header checked against a secret, a TLS
/// client certificate in the extensions, ...). They must never trust
/// caller-invented headers such as `X-User-Id`.
///
/// ```
/// use http::request::Parts;
/// use tower_admission::identity::{Authenticator, Identity};
///
/// /// Everyone is the same anonymous caller (for demos only).
/// struct Anonymous;
///
/// impl Authenticator for Anonymous {
///     async fn authenticate(&self, _parts: &Parts) -> Result<Identity, &'static str> {
///         Ok(Identity::new("anonymous", "public", "free"))
///     }
/// }
/// ```
///
/// [`ApiKeys`]: super::ApiKeys
pub trait Authenticator {
    /// The answer of [`authenticate`](Self::authenticate) when it needs no
    /// waiting, as [`ApiKeys`] never does; `None` (the default) when it may
    /// wait. The layer's service calls this first, in `call`, and calls
    /// `authenticate` only on `None`: each request is authenticated once.
    ///
    /// [`ApiKeys`]: super::ApiKeys
    fn authenticate_now(&self, parts: &Parts) -> Option<Result<Identity, &'static str>> {
        let _ = parts;
        None
    }

    /// Returns the caller's identity, or why there is none: the reason the
    /// 401's problem `detail` (or gRPC message) gives, so it never carries
    /// the credential or another secret.
    fn authenticate(
        &self,
        parts: &Parts,
    ) -> impl Future<Output = Result<Identity, &'static str>> + Send;
}

impl<A: Authenticator + ?Sized> Authenticator for Arc<A> {
    fn authenticate_now(&self, parts: &Parts) -> Option<Result<Identity, &'static str>> {
        (**self).authenticate_now(parts)
    }

    fn authenticate(
        &self,
        parts: &Parts,
    ) -> impl Future<Output = Result<Identity, &'static str>> + Send {
        (**self).authenticate(parts)
    }
}

/// Layer that authenticates every request with an [`Authenticator`].
///
/// On success the [`Identity`] is inserted into the request extensions, where
/// later layers and the handler read it. On failure the request never reaches
/// the inner service: the answer is `401` with `WWW-Authenticate: Bearer` and
/// an `application/problem+json` body, or `grpc-status: 16`
/// (`UNAUTHENTICATED`) for gRPC requests. See [`Rejection::Unauthenticated`].
///
/// Clones share the authenticator through an `Arc`.
#[derive(Debug)]
pub struct AuthenticateLayer<A> {
    authenticator: Arc<A>,
}

impl<A> AuthenticateLayer<A> {
    /// A layer authenticating with `authenticator`.
    pub fn new(authenticator: A) -> Self {
        AuthenticateLayer {
            authenticator: Arc::new(authenticator),
        }
    }

    /// A layer sharing an authenticator that is already behind an `Arc`.
    pub fn from_arc(authenticator: Arc<A>) -> Self {
        AuthenticateLayer { authenticator }
    }
}

impl<A> Clone for AuthenticateLayer<A> {
    fn clone(&self) -> Self {
        AuthenticateLayer {
            authenticator: Arc::clone(&self.authenticator),
        }
    }
}

impl<S, A> Layer<S> for AuthenticateLayer<A> {
    type Service = AuthenticateService<S, A>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthenticateService {
            inner,
            authenticator: Arc::clone(&self.authenticator),
        }
    }
}

/// Service built by [`AuthenticateLayer`].
///
/// Clones share the authenticator through an `Arc`.
#[derive(Debug)]
pub struct AuthenticateService<S, A> {
    inner: S,
    authenticator: Arc<A>,
}

impl<S, A> AuthenticateService<S, A> {
    /// Wraps `inner`, authenticating with `authenticator`.
    pub fn new(inner: S, authenticator: A) -> Self {
        AuthenticateService {
            inner,
            authenticator: Arc::new(authenticator),
        }
    }

    /// The authenticator.
    pub fn authenticator(&self) -> &A {
        &self.authenticator
    }

    crate::macros::inner_accessors!(inner: S);
}

impl<S: Clone, A> Clone for AuthenticateService<S, A> {
    fn clone(&self) -> Self {
        AuthenticateService {
            inner: self.inner.clone(),
            authenticator: Arc::clone(&self.authenticator),
        }
    }
}

impl<S, A, ReqB, ResB> Service<Request<ReqB>> for AuthenticateService<S, A>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    A: Authenticator + Send + Sync + 'static,
    ResB: RefusalBody,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        // Decided here, in place: no future to box, and the inner service
        // that `poll_ready` prepared is called at once. Each arm builds the
        // future where it is returned: the inner future, large, is not
        // copied once more.
        match self.authenticator.authenticate_now(&parts) {
            Some(Ok(identity)) => {
                parts.extensions.insert(identity);
                return ResponseFuture {
                    state: State::Calling {
                        future: self.inner.call(Request::from_parts(parts, body)),
                    },
                };
            }
            Some(Err(reason)) => {
                return ResponseFuture {
                    state: State::Refused {
                        reason,
                        protocol: Protocol::of(&parts.headers),
                    },
                }
            }
            None => {}
        }
        // `call` awaits authentication before it calls the inner service, so
        // it takes the service that `poll_ready` prepared and leaves a clone.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let authenticator = Arc::clone(&self.authenticator);
        let auth: AuthFuture = Box::pin(async move {
            let result = authenticator.authenticate(&parts).await;
            (parts, result)
        });
        ResponseFuture {
            state: State::Authenticating {
                auth,
                body: Some(body),
                inner: Some(inner),
            },
        }
    }
}

type AuthFuture = Pin<Box<dyn Future<Output = (Parts, Result<Identity, &'static str>)> + Send>>;

pin_project! {
    /// Future of [`AuthenticateService`]: authentication, then the inner
    /// service's response or a 401.
    pub struct ResponseFuture<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        Authenticating {
            auth: AuthFuture,
            body: Option<ReqB>,
            inner: Option<S>,
        },
        Calling {
            #[pin]
            future: S::Future,
        },
        Refused {
            reason: &'static str,
            protocol: Protocol,
        },
        Done,
    }
}

impl<S, ReqB> fmt::Debug for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Authenticating { .. } => "authenticating",
            State::Calling { .. } => "calling",
            State::Refused { .. } => "refused",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

impl<S, ReqB, ResB> Future for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    ResB: RefusalBody,
{
    type Output = Result<Response<ResB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Authenticating { auth, body, inner } => {
                    let (mut parts, result) = ready!(auth.as_mut().poll(cx));
                    let (Some(body), Some(mut inner)) = (body.take(), inner.take()) else {
                        unreachable!("the authenticating state is left once");
                    };
                    match result {
                        Ok(identity) => {
                            parts.extensions.insert(identity);
                            let future = inner.call(Request::from_parts(parts, body));
                            this.state.set(State::Calling { future });
                        }
                        Err(reason) => {
                            this.state.set(State::Refused {
                                reason,
                                protocol: Protocol::of(&parts.headers),
                            });
                        }
                    }
                }
                StateProj::Calling { future } => {
                    let response = ready!(future.poll(cx))?;
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Refused { reason, protocol } => {
                    let (reason, protocol) = (*reason, std::mem::replace(protocol, Protocol::HTTP));
                    tracing::debug!(reason, "request not authenticated");
                    this.state.set(State::Done);
                    let rejection = Rejection::Unauthenticated { reason };
                    return Poll::Ready(Ok(rejection.respond(protocol)));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}
