//! Shared helpers for the cross-crate scenarios in `tests/`.

use std::path::PathBuf;

/// `tests/fixtures/<relative>`.
pub fn fixture_path(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(relative)
}
