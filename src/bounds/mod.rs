//! bounds (in progress)
