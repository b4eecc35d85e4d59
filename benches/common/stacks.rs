//! The four HTTP stacks the request benches compare. Every quota and cap
//! admits every request: they measure the admitted path, which every served
//! request pays.

use std::num::NonZeroU32;
use std::sync::Arc;

use axum::body::Body;
use axum::Router;
use http::Request;
use tower_admission::quota::{MemoryStore, Quota, QuotaLayer};
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::GlobalKeyExtractor;
use tower_governor::GovernorLayer;

use super::inbound::{self, base, huge_bucket};

/// A stack: its name and the router.
pub(crate) struct Stack {
    pub(crate) name: &'static str,
    pub(crate) app: Router,
}

impl Stack {
    /// One request, the same to every stack so that the ratios between them
    /// count only the layers: `GET /?from=..&to=..&page_size=20` with
    /// `Authorization: Bearer bench`, which the whole stack needs and the
    /// others ignore.
    pub(crate) fn request(&self) -> Request<Body> {
        Request::get(inbound::PATH_AND_QUERY)
            .header("authorization", inbound::AUTHORIZATION)
            .body(Body::empty())
            .unwrap()
    }
}

/// The whole stack cut after its first `n` layers ([`inbound::first_layers`]),
/// named `stack_N`, for `n` in 1 to 5 (6 is the whole stack), finalised as
/// [`stacks`] are.
#[allow(dead_code)] // used by the instructions bench and `PAIRED=layers` only
pub(crate) fn first_layers(n: usize) -> Stack {
    Stack {
        name: "stack_n",
        app: inbound::first_layers(MemoryStore::new(), n)
            .unwrap()
            .with_state(()),
    }
}

/// Bare axum, axum + tower_governor, axum + one quota layer, and the whole
/// inbound stack ([`inbound::whole_stack`]) in memory.
///
/// Each router is finalised with `with_state(())`, as `axum::serve` does
/// (through `into_make_service`): without it, axum applies every layer to
/// the handler again on every request, and the benches would time the
/// building of the stack rather than the passing through it.
pub(crate) fn stacks() -> [Stack; 4] {
    let stacks = unfinalised();
    stacks.map(|stack| Stack {
        app: stack.app.with_state(()),
        ..stack
    })
}

fn unfinalised() -> [Stack; 4] {
    let governor_config = Arc::new(
        GovernorConfigBuilder::default()
            .per_nanosecond(1)
            .burst_size(NonZeroU32::MAX.get())
            .key_extractor(GlobalKeyExtractor)
            .finish()
            .unwrap(),
    );
    let quota = Quota::new("bench", [huge_bucket("bucket").unwrap()]).unwrap();
    [
        Stack {
            name: "bare_axum",
            app: base(),
        },
        Stack {
            name: "tower_governor",
            app: base().layer(GovernorLayer::new(governor_config)),
        },
        Stack {
            name: "quota_layer",
            app: base().layer(
                QuotaLayer::builder(MemoryStore::new())
                    .quota(quota)
                    .aggregate()
                    .build()
                    .unwrap(),
            ),
        },
        Stack {
            name: "whole_stack",
            app: inbound::whole_stack(MemoryStore::new()).unwrap(),
        },
    ]
}

/// Bare axum behind `n` layers (1, or else 6, in one `Router::layer`) that do
/// nothing but wrap the service and its future, as every layer does: what
/// `Router::layer` and each level of nesting cost before any layer's own
/// work (`PAIRED=layers`, variants `passthrough_N` of the instructions
/// bench).
#[allow(dead_code)] // used by the instructions bench and `PAIRED=layers` only
pub(crate) fn passthrough(n: usize) -> Stack {
    use pass::PassLayer as P;
    let b = tower::ServiceBuilder::new();
    let app = match n {
        1 => base().layer(b.layer(P)),
        _ => base().layer(b.layer(P).layer(P).layer(P).layer(P).layer(P).layer(P)),
    };
    Stack {
        name: "passthrough",
        app: app.with_state(()),
    }
}

#[allow(dead_code)]
mod pass {
    //! A layer that passes everything through: its service holds an `Arc`
    //! (cloned per request, as axum clones the stack) and its future holds
    //! the inner one beside a small field, like the crate's layers.
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    #[derive(Clone, Copy)]
    pub(crate) struct PassLayer;

    impl<S> tower::Layer<S> for PassLayer {
        type Service = Pass<S>;
        fn layer(&self, inner: S) -> Pass<S> {
            Pass(inner, std::sync::Arc::new(0))
        }
    }

    #[derive(Clone)]
    pub(crate) struct Pass<S>(S, std::sync::Arc<u64>);

    impl<S: tower::Service<R>, R> tower::Service<R> for Pass<S> {
        type Response = S::Response;
        type Error = S::Error;
        type Future = PassFuture<S::Future>;
        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
            self.0.poll_ready(cx)
        }
        fn call(&mut self, req: R) -> Self::Future {
            PassFuture {
                inner: self.0.call(req),
                extra: None,
            }
        }
    }

    pin_project_lite::pin_project! {
        pub(crate) struct PassFuture<F> {
            #[pin]
            inner: F,
            extra: Option<[u64; 4]>,
        }
    }

    impl<F: Future> Future for PassFuture<F> {
        type Output = F::Output;
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            let this = self.project();
            let out = std::task::ready!(this.inner.poll(cx));
            std::hint::black_box(this.extra.take());
            Poll::Ready(out)
        }
    }
}
