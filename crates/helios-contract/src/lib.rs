//! The runtime-core contract between Ignition (which exports a core) and Helios (which serves it).
//!
//! - [`pb`]: the protobuf wire format (`proto/flare/core/v1/runtime_core.proto`).
//! - [`validate()`]: wire message → validated [`Manifest`], every violation a typed
//!   [`CoreError`] naming its field.
//! - [`RuntimeCore::open`]: a core directory → manifest + exact kernel images + memory-mapped
//!   payloads + checked frontend assets, all before any CUDA call.
//! - [`BoundContract`]: every graph's value sources resolved to byte views, with the shared
//!   packing code that writes request metadata into staging mirrors.
//! - [`compat`]: one reader per execution ABI ever shipped.

pub mod bound;
pub mod compat;
pub mod core;
pub mod error;
pub mod model;
pub mod prepared;
pub mod record;
pub mod summary;
pub mod validate;

#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;

/// Generated protobuf types of `flare.core.v1`.
#[allow(missing_docs, clippy::all, unreachable_pub, missing_debug_implementations)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/flare.core.v1.rs"));
}

pub use crate::bound::{BoundContract, BoundGraph, ByteView, CapacityError, Element, PackError};
pub use crate::core::{MANIFEST_FILE, OpenOptions, RuntimeCore};
pub use crate::error::{CoreError, FieldPath, InvalidReason, RangeOwner, ReferenceKind};
pub use crate::model::*;
pub use crate::summary::Summary;
pub use crate::validate::validate;
