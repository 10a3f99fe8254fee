//! Shared helpers for the cross-crate scenarios.
