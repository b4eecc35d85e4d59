//! quota (in progress)
