//! Bound the work one request can create: body bytes, decoded bytes, page
//! size, time range and batch items.
//!
//! # Order
//!
//! ```text
//! cap wire bytes -> decompress -> cap decoded bytes -> validate query -> count items -> quotas -> handler
//!  \________________ BodyLimitsLayer _______________/  ValidateQueryLayer  BatchItemsLayer
//! ```
//!
//! [`ValidateQueryLayer`] puts a [`ValidatedQuery`] (with the page size) and
//! [`BatchItemsLayer`] the item count into the request extensions, so a
//! quota layer after them can charge them as cost
//! ([`ValidatedQuery::page_cost`], [`BatchItemsLayer::item_cost`]). The
//! handler reads the items with [`BatchItemsLayer::parse`].
//!
//! * **Wire bytes first.** The wire cap bounds what the server reads from the
//!   network before any CPU is spent on it. A body with a too large
//!   `content-length` is refused before a byte is read; a chunked one is cut
//!   off at the cap. A body longer than the `content-length` it declares is
//!   a malformed body (400 naming `body`), not an exceeded cap.
//! * **Then decompress, streaming.** The decoder yields the decoded stream
//!   in chunks of at most 4 KiB, never the whole body, so a 1 MiB gzip bomb
//!   that inflates to 1 GiB costs no more memory than its decoded cap.
//!   Coding names match in any case. Unknown encodings get 415, and so do
//!   several codings at once (on several `content-encoding` lines or as a
//!   list), since only one would be decoded; empty list elements do not
//!   count, so a `content-encoding` of only those names no coding. Every
//!   member of a multi-member gzip body and every frame of a zstd body is
//!   decoded; bytes after the coded data that start no other member or
//!   frame, and truncated or corrupt coded data, are a malformed body,
//!   refused with 400 naming `body`, never dropped (see [`BodyLimitsLayer`]).
//! * **Then cap decoded bytes.** A small compressed body can decode to
//!   anything; this cap is what actually bounds the parser and the handler.
//!   It must sit *after* decompression, or it would count compressed bytes.
//! * **Then validate** page size, range and items: these bound the work a
//!   well-formed request asks for (a `page_size` of 100000 is a few bytes).
//!   Query validation needs no body, so it could run first, but running it
//!   after the byte caps keeps one refusal order for every request. The
//!   validated page size and the batch length are what quotas charge as
//!   cost, so validation comes before the quota layers.
//!
//! # Which cap answered
//!
//! tower-http reports an exceeded cap in two ways: an immediate 413 when
//! `content-length` is already over it, or a body error while the handler
//! reads. In the second case the handler (axum's `Json`, `Bytes`...)
//! answers with a response of its own. The body-limits service therefore puts a
//! per-request probe into the extensions; a probe under each tower-http
//! limit records that the request got past it, and wraps the body so as to
//! record which cap's [`LengthLimitError`](http_body_util::LengthLimitError)
//! went by first.
//! When the inner response arrives, the body-limits service replaces it with the
//! problem+json 413 naming `wire-bytes` or `decoded-bytes`, and maps
//! tower-http's own early 413 and the decoder's 415 the same way. The
//! decoder records a malformed coded body in the same probe, and that
//! becomes the 400 naming `body`. A handler that reads the body in a task
//! that outlives its response is not covered.
//!
//! A request that cannot trip anything skips the tower-http stack, and its
//! response passes unchanged: its body is already at its end
//! ([`is_end_stream`](http_body::Body::is_end_stream), or a size hint of at
//! most 0 bytes), it has no `content-encoding`, and its `content-length`, if
//! any, is within both caps. The inner service gets every body as a
//! [`CappedBody`]; one that yields data after reporting its end gets an
//! error in place of that data.
//!
//! # Example
//!
//! ```
//! use std::num::{NonZeroU32, NonZeroUsize};
//! use std::time::Duration;
//!
//! use axum::body::Bytes;
//! use axum::http::HeaderMap;
//! use axum::response::{IntoResponse, Response};
//! use axum::routing::{get, post};
//! use axum::Router;
//! use tower_admission::bounds::{
//!     BatchItemsLayer, BodyLimitsLayer, QueryRules, ValidateQueryLayer, ValidatedQuery,
//! };
//!
//! const MAX_ITEMS: usize = 1000;
//!
//! #[derive(serde::Deserialize)]
//! struct Event {
//!     name: String,
//! }
//!
//! async fn list(q: ValidatedQuery) -> String {
//!     format!("page of {}", q.page_size)
//! }
//!
//! async fn ingest(headers: HeaderMap, body: Bytes) -> Response {
//!     match BatchItemsLayer::parse::<Event>(&body, MAX_ITEMS) {
//!         Ok(events) => format!("{} events", events.len()).into_response(),
//!         Err(refused) => refused.into_response(&headers).into_response(),
//!     }
//! }
//!
//! # fn main() -> Result<(), tower_admission::ConfigError> {
//! let rules = QueryRules::new()
//!     .page_size(NonZeroU32::new(50).unwrap(), NonZeroU32::new(500).unwrap())?
//!     .max_span(Duration::from_secs(31 * 24 * 3600))?
//!     .ignore_unknown_params(false);
//!
//! let items = BatchItemsLayer::new(NonZeroUsize::new(MAX_ITEMS).unwrap());
//! let app: Router = Router::new()
//!     .route("/events", get(list))
//!     .route("/events/batch", post(ingest).layer(items))
//!     // Applied bottom-up: the last `.layer` is the first a request meets.
//!     .layer(ValidateQueryLayer::new(rules))
//!     .layer(BodyLimitsLayer::new(1 << 20, 8 << 20));
//! # Ok(())
//! # }
//! ```
//!
//! With these layers the ordering is the one above: a request is first cut to
//! 1 MiB on the wire and 8 MiB decoded, then its query is validated, then
//! a batch's items are counted (a quota charging per item would sit on the
//! batch route, inside the `BatchItemsLayer`).

mod body;
mod decode;
mod grpc_web;
mod items;
mod query;

pub use body::{BodyCaps, BodyLimitsLayer, CappedBody};
pub use items::BatchItemsLayer;
pub use query::{QueryRules, ValidateQueryLayer, ValidatedQuery};
