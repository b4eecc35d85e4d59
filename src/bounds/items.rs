//! Item-count bound of a JSON batch `{"items": [...]}`.

use std::cell::Cell;
use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::combinators::Collect;
use http_body_util::{BodyExt, Full};
use pin_project_lite::pin_project;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use tower::{Layer, Service};

use crate::reject::{InvalidParameter, Protocol, RefusalBody, Rejection, SizeCap};

/// Why a batch was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BatchError {
    /// The `items` array holds more than `limit` items. 413.
    TooManyItems {
        /// The cap.
        limit: usize,
    },
    /// The body is not a JSON object with one `items` array of valid items.
    /// 400; `name` is `body`, or `items[i]` for a bad item.
    Malformed(InvalidParameter),
}

impl BatchError {
    /// The rejection to answer with: 413 with cap `items`, or 400.
    pub fn into_rejection(self) -> Rejection {
        match self {
            BatchError::TooManyItems { limit } => Rejection::PayloadTooLarge {
                cap: SizeCap::Items,
                limit: u64::try_from(limit).unwrap_or(u64::MAX),
            },
            BatchError::Malformed(param) => Rejection::InvalidParameters(vec![param]),
        }
    }
}

impl fmt::Display for BatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BatchError::TooManyItems { limit } => write!(f, "more than {limit} items"),
            BatchError::Malformed(p) => write!(f, "{}: {}", p.name, p.reason),
        }
    }
}

impl std::error::Error for BatchError {}

/// Where the parser was when it failed.
#[derive(Debug, Clone, Copy)]
enum At {
    Outside,
    Item(usize),
    OverCap,
}

/// Parses a batch `{"items": [...]}`, refusing it once the array has more
/// than `max` items.
///
/// The count is checked while the array is read: the parser stops at the
/// first item past the cap, so at most `max` values of `T` are ever built,
/// and a refused batch builds none that reach the caller. Other members of
/// the object are ignored; a second `items` member is refused.
///
/// Counting only, without building items: `parse_batch::<IgnoredAny>` (a
/// zero-sized type, so the returned `Vec` does not allocate), or
/// [`count_batch_items`].
///
/// ```
/// use tower_admission::bounds::{parse_batch, BatchError};
///
/// let ok: Vec<u32> = parse_batch(br#"{"items":[1,2,3]}"#, 3).unwrap();
/// assert_eq!(ok.len(), 3);
/// let over = parse_batch::<u32>(br#"{"items":[1,2,3,4]}"#, 3);
/// assert_eq!(over, Err(BatchError::TooManyItems { limit: 3 }));
/// ```
pub fn parse_batch<T>(json: &[u8], max: usize) -> Result<Vec<T>, BatchError>
where
    T: for<'de> Deserialize<'de>,
{
    let at = Cell::new(At::Outside);
    let mut de = serde_json::Deserializer::from_slice(json);
    let seed = Envelope {
        max,
        at: &at,
        item: PhantomData::<T>,
    };
    let result = seed.deserialize(&mut de).and_then(|items| {
        de.end()?;
        Ok(items)
    });
    result.map_err(|err| match at.get() {
        At::OverCap => BatchError::TooManyItems { limit: max },
        At::Item(i) => BatchError::Malformed(InvalidParameter::new(
            format!("items[{i}]"),
            err.to_string(),
        )),
        At::Outside => BatchError::Malformed(InvalidParameter::new("body", err.to_string())),
    })
}

/// The number of items of a batch, without building them; errors as
/// [`parse_batch`].
pub fn count_batch_items(json: &[u8], max: usize) -> Result<usize, BatchError> {
    parse_batch::<IgnoredAny>(json, max).map(|items| items.len())
}

struct Envelope<'a, T> {
    max: usize,
    at: &'a Cell<At>,
    item: PhantomData<T>,
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for Envelope<'_, T> {
    type Value = Vec<T>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<T>, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Envelope<'_, T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(r#"an object {"items": [...]}"#)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Vec<T>, A::Error> {
        let mut items = None;
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Items if items.is_some() => return Err(de::Error::duplicate_field("items")),
                Key::Items => {
                    items = Some(map.next_value_seed(ItemsSeed {
                        max: self.max,
                        at: self.at,
                        item: PhantomData::<T>,
                    })?);
                }
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        items.ok_or_else(|| de::Error::missing_field("items"))
    }
}

enum Key {
    Items,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a member name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(if v == "items" { Key::Items } else { Key::Other })
            }
        }
        deserializer.deserialize_identifier(KeyVisitor)
    }
}

struct ItemsSeed<'a, T> {
    max: usize,
    at: &'a Cell<At>,
    item: PhantomData<T>,
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for ItemsSeed<'_, T> {
    type Value = Vec<T>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<T>, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for ItemsSeed<'_, T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an array of at most {} items", self.max)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        // Never trust a size hint for a pre-allocation beyond the cap.
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(self.max).min(1024));
        loop {
            if out.len() == self.max {
                // One more element (skipped, never built) means over the cap.
                self.at.set(At::Item(out.len()));
                if seq.next_element::<IgnoredAny>()?.is_some() {
                    self.at.set(At::OverCap);
                    return Err(de::Error::custom(format_args!(
                        "more than {} items",
                        self.max
                    )));
                }
                break;
            }
            self.at.set(At::Item(out.len()));
            match seq.next_element::<T>()? {
                Some(item) => out.push(item),
                None => break,
            }
        }
        self.at.set(At::Outside);
        Ok(out)
    }
}

/// The item count of a batch request, inserted into the request extensions
/// by [`BatchItems`] so that later layers (a quota's cost function) and the
/// handler can read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ItemCount(pub usize);

/// Counts the items of a JSON batch `{"items": [...]}` before the inner
/// service runs, refusing more than `max` with 413 (cap `items`) and bad
/// JSON with 400. Builds [`BatchItems`].
///
/// Use it where the count must be known *before* the handler, for example
/// to charge it as quota cost: place it inside [`BodyLimitsLayer`](super::BodyLimitsLayer)
/// (which bounds the bytes it buffers) and outside the quota layers. It
/// reads the whole (capped) body, counts items without building them
/// ([`count_batch_items`]), inserts [`ItemCount`] and hands the same bytes
/// on as a `Full<Bytes>` body; the handler then parses them again, for
/// example with the `Batch` extractor. Apply it only to batch routes (axum's
/// `route_layer` or a method router's `layer`): a request without a JSON
/// object body is refused.
///
/// A body read error is answered with 400 naming `body`; when that error is
/// a byte cap of [`BodyLimits`](super::BodyLimits), that layer replaces the
/// answer with its 413.
#[derive(Debug, Clone, Copy)]
pub struct BatchItemsLayer {
    max: usize,
}

impl BatchItemsLayer {
    /// Refuses batches of more than `max` items.
    pub fn new(max: std::num::NonZeroUsize) -> Self {
        BatchItemsLayer { max: max.get() }
    }
}

impl<S> Layer<S> for BatchItemsLayer {
    type Service = BatchItems<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BatchItems {
            inner,
            max: self.max,
        }
    }
}

/// Service built by [`BatchItemsLayer`]. Clones share nothing but the cap.
#[derive(Debug, Clone)]
pub struct BatchItems<S> {
    inner: S,
    max: usize,
}

impl<S> BatchItems<S> {
    crate::macros::inner_accessors!(inner: S);
}

impl<S, B, RB> Service<Request<B>> for BatchItems<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>> + Clone,
    B: Body,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
    RB: RefusalBody,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The body is read before the inner service is called: take the
        // service that was polled ready, leave a clone.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (parts, body) = req.into_parts();
        ResponseFuture {
            state: State::Reading {
                collect: body.collect(),
                parts: Some(parts),
                inner: Some(inner),
                max: self.max,
            },
        }
    }
}

pin_project! {
    /// Response future of [`BatchItems`].
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<Full<Bytes>>>,
        B: Body,
    {
        #[pin]
        state: State<S, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
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
                        Err(err) => Err(BatchError::Malformed(InvalidParameter::new(
                            "body",
                            format!("could not be read: {}", err.into()),
                        ))),
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
                            return Poll::Ready(Ok(err
                                .into_rejection()
                                .into_layer_response(protocol)));
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

#[cfg(feature = "axum")]
mod extract {
    use std::ops::Deref;

    use axum::body::Bytes;
    use axum::extract::rejection::BytesRejection;
    use axum::extract::{FromRequest, Request};
    use axum::response::{IntoResponse, Response};
    use serde::Deserialize;

    use super::{parse_batch, BatchError};

    /// Axum extractor of a JSON batch `{"items": [...]}` of at most `MAX`
    /// items, read with [`parse_batch`].
    ///
    /// The cap is a const generic so that it sits in the handler signature,
    /// checked at compile time to be at least 1:
    ///
    /// ```
    /// use tower_admission::bounds::Batch;
    ///
    /// #[derive(serde::Deserialize)]
    /// struct Report { id: u64 }
    ///
    /// async fn ingest(batch: Batch<Report, 1000>) -> String {
    ///     // `batch.len()` is what a quota can charge.
    ///     format!("{}", batch.len())
    /// }
    /// let _app: axum::Router = axum::Router::new().route("/reports", axum::routing::post(ingest));
    /// ```
    ///
    /// Over the cap: 413 with cap `items`, before the handler runs. Bad JSON:
    /// 400 naming `body` or `items[i]`. The body itself is read with axum's
    /// `Bytes` extractor, so the byte caps of [`BodyLimits`](super::super::BodyLimits)
    /// apply first. The content type is not checked.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Batch<T, const MAX: usize>(pub Vec<T>);

    impl<T, const MAX: usize> Batch<T, MAX> {
        /// The cap.
        pub const MAX: usize = MAX;

        /// The items.
        pub fn into_inner(self) -> Vec<T> {
            self.0
        }
    }

    impl<T, const MAX: usize> Deref for Batch<T, MAX> {
        type Target = [T];

        fn deref(&self) -> &[T] {
            &self.0
        }
    }

    /// Rejection of [`Batch`].
    #[derive(Debug)]
    #[non_exhaustive]
    pub enum BatchRejection {
        /// Too many items or malformed JSON.
        Batch(BatchError),
        /// The body could not be read (for example a byte cap tripped).
        Body(BytesRejection),
    }

    impl IntoResponse for BatchRejection {
        fn into_response(self) -> Response {
            match self {
                BatchRejection::Batch(err) => err
                    .into_rejection()
                    .into_response(false)
                    .map(axum::body::Body::new),
                BatchRejection::Body(err) => err.into_response(),
            }
        }
    }

    impl<S, T, const MAX: usize> FromRequest<S> for Batch<T, MAX>
    where
        S: Send + Sync,
        T: for<'de> Deserialize<'de>,
    {
        type Rejection = BatchRejection;

        async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
            const { assert!(MAX > 0, "Batch<T, MAX> needs MAX >= 1") };
            let bytes = Bytes::from_request(req, state)
                .await
                .map_err(BatchRejection::Body)?;
            parse_batch(&bytes, MAX)
                .map(Batch)
                .map_err(BatchRejection::Batch)
        }
    }
}

#[cfg(feature = "axum")]
pub use extract::{Batch, BatchRejection};
