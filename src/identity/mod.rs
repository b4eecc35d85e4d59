//! Authenticated identity.
//!
//! An [`Identity`] is placed in the request extensions by an authentication
//! layer and read by every later layer. Quotas are keyed on it, never on a
//! header the caller can invent.

mod identity;

pub use identity::Identity;
