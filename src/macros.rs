//! Macros shared by the crate's middleware.

/// The `get_ref`, `get_mut` and `into_inner` accessors of a middleware
/// service that wraps an inner service in its field `$field` of type `$inner`.
/// Invoked inside the service's inherent `impl` block:
///
/// ```text
/// impl<S> BodyLimits<S> {
///     crate::macros::inner_accessors!(inner: S);
/// }
/// ```
macro_rules! inner_accessors {
    ($field:ident: $inner:ty) => {
        /// A reference to the inner service.
        pub fn get_ref(&self) -> &$inner {
            &self.$field
        }

        /// A mutable reference to the inner service.
        pub fn get_mut(&mut self) -> &mut $inner {
            &mut self.$field
        }

        /// Consumes this service, returning the inner service.
        pub fn into_inner(self) -> $inner {
            self.$field
        }
    };
}

pub(crate) use inner_accessors;
