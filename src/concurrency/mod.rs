//! concurrency (in progress)
