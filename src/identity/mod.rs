//! Authenticated identity and the client's address.
//!
//! An [`Identity`] is placed in the request extensions by
//! [`AuthenticateLayer`] and read by every later layer and by the handler.
//! Quotas are keyed on it, never on a header the caller can invent: a
//! request carrying `X-User-Id: someone-else` is still the identity its
//! credential proves.
//!
//! * [`Authenticator`] is the async trait that turns a request head into an
//!   [`Identity`] or the reason there is none; [`ApiKeys`] is the built-in one
//!   (`Authorization: Bearer <key>`, keys stored as SHA-256 digests and
//!   compared in constant time).
//! * [`AuthenticateLayer`] answers `401` (problem+json with
//!   `WWW-Authenticate: Bearer`, or gRPC `UNAUTHENTICATED`) when there is no
//!   identity; see [`Rejection::Unauthenticated`](crate::reject::Rejection::Unauthenticated).
//!   To leave some routes open (`/healthz`), put it on the protected routes
//!   with axum's `route_layer`.
//! * [`ClientIpLayer`] inserts the [`ClientIp`]: the TCP peer, or behind
//!   the proxies it trusts only, the rightmost untrusted hop of the forwarding
//!   header.
//! * With the `axum` feature, `Identity` and `ClientIp` are extractors.
//!
//! ```
//! use axum::{routing::get, Router};
//! use tower_admission::identity::{ApiKeys, AuthenticateLayer, Identity};
//!
//! let keys = ApiKeys::new()
//!     .with_key("demo-free", Identity::new("alice", "acme", "free"))
//!     .with_key("demo-pro", Identity::new("bob", "globex", "pro"));
//!
//! // Every route requires a key.
//! let app: Router = Router::new()
//!     .route("/reports", get(|who: Identity| async move { format!("hello {}", who.subject()) }))
//!     .layer(AuthenticateLayer::new(keys.clone()));
//!
//! // Only the routes added before `route_layer` require a key.
//! let app_with_health: Router = Router::new()
//!     .route("/reports", get(|who: Identity| async move { format!("hello {}", who.subject()) }))
//!     .route_layer(AuthenticateLayer::new(keys))
//!     .route("/healthz", get(|| async { "ok" }));
//! ```

mod api_keys;
mod authenticate;
mod client_ip;
#[cfg(feature = "axum")]
mod extract;
mod types;

pub use api_keys::ApiKeys;
pub use authenticate::{AuthenticateLayer, Authenticator};
pub use client_ip::{ClientIp, ClientIpLayer};
pub use types::Identity;
