//! outbound (in progress)
