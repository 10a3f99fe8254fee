//! Typed loader errors. Every variant that concerns the manifest names the offending field with
//! a path such as `graphs[2].nodes[5].kernel.relocations[0].buffer_offset`.

use std::fmt;
use std::path::PathBuf;

use crate::model::DType;

/// Path to a manifest field, built as validation descends.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FieldPath(String);

impl FieldPath {
    pub fn root(name: &str) -> Self {
        FieldPath(name.to_owned())
    }

    /// `self.name`.
    pub fn field(&self, name: &str) -> Self {
        FieldPath(format!("{}.{name}", self.0))
    }

    /// `self[name=id]`: an entry of a list identified by its id rather than its position.
    pub fn keyed(&self, key: &str, id: u32) -> Self {
        FieldPath(format!("{}[{key}={id}]", self.0))
    }

    /// `self[index]`.
    pub fn index(&self, index: usize) -> Self {
        FieldPath(format!("{}[{index}]", self.0))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a runtime core cannot be loaded. Nothing here is raised after a CUDA call: `open`
/// validates everything first.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("manifest is not a valid RuntimeCore message: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("{field}: required field is missing")]
    MissingField { field: FieldPath },
    #[error("{field}: unknown or unspecified enum value {value}")]
    UnknownEnum { field: FieldPath, value: i32 },
    #[error("{field}: execution ABI {found} is not one this engine reads (reads {supported:?})")]
    UnsupportedAbi { field: FieldPath, found: u32, supported: &'static [u32] },
    #[error("{field}: {reason}")]
    InvalidValue { field: FieldPath, reason: InvalidReason },
    #[error("{field}: id {id} appears twice")]
    DuplicateId { field: FieldPath, id: u32 },
    #[error("{field}: references {kind} {id}, which does not exist")]
    DanglingReference { field: FieldPath, kind: ReferenceKind, id: u32 },
    #[error("{field}: buffers {first} and {second} overlap in the arena")]
    OverlappingBuffers { field: FieldPath, first: u32, second: u32 },
    #[error("{field}: [{start}, {end}) lies outside {what} of {limit} bytes")]
    OutOfRange { field: FieldPath, what: RangeOwner, start: u64, end: u64, limit: u64 },
    #[error("{field}: graph has a cycle through node {node}")]
    GraphCycle { field: FieldPath, node: u32 },
    #[error("{field}: view is {actual} bytes, expected {expected}")]
    ViewSize { field: FieldPath, expected: u64, actual: u64 },
    #[error("{field}: values must be strictly ascending (index {index}: {value} after {previous})")]
    NotAscending { field: FieldPath, index: usize, previous: u64, value: u64 },
    #[error("{field}: default {value} lies outside its range [{min}, {max}]")]
    DefaultOutOfRange { field: FieldPath, value: f64, min: f64, max: f64 },
    #[error("{field}: sha256 of {path} is {actual}, manifest says {expected}")]
    DigestMismatch { field: FieldPath, path: String, expected: String, actual: String },
    #[error("{field}: {path} is {actual} bytes, manifest says {expected}")]
    FileSize { field: FieldPath, path: String, expected: u64, actual: u64 },
    #[error("{field}: {path}: {source}")]
    Safetensors {
        field: FieldPath,
        path: String,
        #[source]
        source: safetensors::SafeTensorError,
    },
    #[error("{field}: tensor {tensor} is not in {path}")]
    MissingTensor { field: FieldPath, path: String, tensor: String },
    #[error("{field}: tensor {tensor} does not match the buffer: {reason}")]
    TensorMismatch { field: FieldPath, tensor: String, reason: String },
}

impl CoreError {
    /// The manifest field the error concerns, when it concerns one.
    pub fn field(&self) -> Option<&FieldPath> {
        match self {
            CoreError::Io { .. } | CoreError::Decode(_) => None,
            CoreError::MissingField { field }
            | CoreError::UnknownEnum { field, .. }
            | CoreError::UnsupportedAbi { field, .. }
            | CoreError::InvalidValue { field, .. }
            | CoreError::DuplicateId { field, .. }
            | CoreError::DanglingReference { field, .. }
            | CoreError::OverlappingBuffers { field, .. }
            | CoreError::OutOfRange { field, .. }
            | CoreError::GraphCycle { field, .. }
            | CoreError::ViewSize { field, .. }
            | CoreError::NotAscending { field, .. }
            | CoreError::DefaultOutOfRange { field, .. }
            | CoreError::DigestMismatch { field, .. }
            | CoreError::FileSize { field, .. }
            | CoreError::Safetensors { field, .. }
            | CoreError::MissingTensor { field, .. }
            | CoreError::TensorMismatch { field, .. } => Some(field),
        }
    }
}

/// What a dangling reference pointed at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReferenceKind {
    Buffer,
    Kernel,
    Graph,
    Node,
    Event,
    Param,
    PayloadFile,
}

impl fmt::Display for ReferenceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReferenceKind::Buffer => "buffer",
            ReferenceKind::Kernel => "kernel",
            ReferenceKind::Graph => "graph",
            ReferenceKind::Node => "node",
            ReferenceKind::Event => "event",
            ReferenceKind::Param => "parameter",
            ReferenceKind::PayloadFile => "payload file",
        })
    }
}

/// The extent a range was checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RangeOwner {
    Arena,
    Buffer(u32),
    Param(u32),
    ParamBytes,
    RowLayout,
    /// A declared limit other than a byte extent (request slots, vocabulary, ...).
    Limit(&'static str),
}

impl fmt::Display for RangeOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RangeOwner::Arena => f.write_str("the arena"),
            RangeOwner::Buffer(id) => write!(f, "buffer {id}"),
            RangeOwner::Param(i) => write!(f, "parameter {i}"),
            RangeOwner::ParamBytes => f.write_str("the parameter bytes"),
            RangeOwner::RowLayout => f.write_str("the continuation row"),
            RangeOwner::Limit(what) => f.write_str(what),
        }
    }
}

/// Why a scalar field's value is invalid.
///
/// Speculative programs (ABI 3): `NeedsAbi` is a value an older ABI cannot carry; `ProgramShape`
/// a speculative graph's capacity that breaks `W = D + 1`, `P = B × W` or
/// `completion_token_capacity = W` (`expected` is what its requests B and depth D imply);
/// `DuplicateProgram` a second speculative graph for the same (requests, depth).
///
/// Checkpoint stamps (ABI 3): `StampSize` a position-metadata row region that is not
/// [`crate::model::STAMP_BYTES`]; `DuplicateRowRegion` a second region of a kind a row holds
/// once; `NotBindable` a value the graph's kind may not bind (the epoch outside restore and
/// snapshot); `MissingRowRegion` a binding that needs a row region the scheme lacks.
///
/// Programmatic edges (ABI 4): `NeedsAbi` an older core's edge that is not a full dependency;
/// `ProgrammaticEdgeNotBetweenKernels` a programmatic or launch-order edge with an end (`node`,
/// the end the field names) that is not a kernel node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InvalidReason {
    MustBePositive,
    NotPowerOfTwo(u64),
    Misaligned { offset: u64, alignment: u64 },
    NotHexSha256,
    UnsafePath,
    ShapeSize { shape_bytes: u64, byte_size: u64 },
    WrongDType { expected: &'static [DType], found: DType },
    WrongShape { expected: Vec<u64>, found: Vec<u64> },
    WrongDirection,
    WrongRole { role: &'static str },
    DuplicateBinding(&'static str),
    MissingBinding(&'static str),
    EmptyList,
    NotNegative(i64),
    MustBeZero(u64),
    Overlap { other: usize },
    MaintenanceOpMismatch,
    ParamBytesLength { expected: u32, actual: u64 },
    BadElementSize(u32),
    PitchTooSmall { pitch: u64, row_bytes: u64 },
    DuplicateName(String),
    SelfEdge,
    NonFinite,
    EmptyRange,
    BadRelocationWord { word: u64, expected: u64 },
    UnrelocatedPointer { param_index: u32, byte_offset: u32, word: u64 },
    NeedsAbi { abi: u32, found: u32 },
    ProgramShape { expected: u64, found: u64 },
    DuplicateProgram { requests: u32, depth: u32 },
    StampSize(u64),
    DuplicateRowRegion(&'static str),
    NotBindable(&'static str),
    MissingRowRegion(&'static str),
    ProgrammaticEdgeNotBetweenKernels { node: u32 },
}

impl fmt::Display for InvalidReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidReason::MustBePositive => f.write_str("must be positive"),
            InvalidReason::NotPowerOfTwo(v) => write!(f, "{v} is not a power of two"),
            InvalidReason::Misaligned { offset, alignment } => {
                write!(f, "offset {offset} is not a multiple of {alignment}")
            }
            InvalidReason::NotHexSha256 => f.write_str("not a lower-case hex sha256"),
            InvalidReason::UnsafePath => f.write_str("path must be relative, '/'-separated, without '..'"),
            InvalidReason::ShapeSize { shape_bytes, byte_size } => {
                write!(f, "shape covers {shape_bytes} bytes but the buffer is {byte_size}")
            }
            InvalidReason::WrongDType { expected, found } => {
                let names: Vec<&str> = expected.iter().map(|d| d.name()).collect();
                write!(f, "dtype {}, expected {}", found.name(), names.join(" or "))
            }
            InvalidReason::WrongShape { expected, found } => write!(f, "shape {found:?}, expected {expected:?}"),
            InvalidReason::WrongDirection => f.write_str("wrong direction for this value"),
            InvalidReason::WrongRole { role } => write!(f, "a binding cannot live in a {role} buffer"),
            InvalidReason::DuplicateBinding(v) => write!(f, "value {v} is bound twice"),
            InvalidReason::MissingBinding(v) => write!(f, "graphs of this kind must bind {v}"),
            InvalidReason::EmptyList => f.write_str("must not be empty"),
            InvalidReason::NotNegative(v) => write!(f, "{v} must be negative"),
            InvalidReason::MustBeZero(v) => write!(f, "{v} must be zero"),
            InvalidReason::Overlap { other } => write!(f, "overlaps entry {other}"),
            InvalidReason::MaintenanceOpMismatch => {
                f.write_str("maintenance_op is set exactly for state-maintenance graphs")
            }
            InvalidReason::ParamBytesLength { expected, actual } => {
                write!(f, "{actual} parameter bytes, the kernel's layout needs {expected}")
            }
            InvalidReason::BadElementSize(v) => write!(f, "element size {v} is not 1, 2 or 4"),
            InvalidReason::PitchTooSmall { pitch, row_bytes } => {
                write!(f, "pitch {pitch} is below the row's {row_bytes} bytes")
            }
            InvalidReason::DuplicateName(n) => write!(f, "name {n:?} appears twice"),
            InvalidReason::SelfEdge => f.write_str("edge from a node to itself"),
            InvalidReason::NonFinite => f.write_str("must be finite"),
            InvalidReason::EmptyRange => f.write_str("range min exceeds max"),
            InvalidReason::UnrelocatedPointer { param_index, byte_offset, word } => write!(
                f,
                "parameter {param_index} holds arena address {word:#x} at byte {byte_offset} with no relocation"
            ),
            InvalidReason::BadRelocationWord { word, expected } => {
                write!(f, "pointer word {word:#x} does not equal the recorded address {expected:#x}")
            }
            InvalidReason::NeedsAbi { abi, found } => {
                write!(f, "needs execution ABI {abi} or later; the core declares ABI {found}")
            }
            InvalidReason::ProgramShape { expected, found } => write!(
                f,
                "{found}, but the program's requests B and depth D need {expected} (W = D + 1 lanes per request, P = B x W)"
            ),
            InvalidReason::DuplicateProgram { requests, depth } => {
                write!(f, "a second speculative program for {requests} requests at depth {depth}")
            }
            InvalidReason::StampSize(v) => {
                write!(f, "{v} bytes, but a position metadata stamp is 8 ([consumed: i32, epoch: i32])")
            }
            InvalidReason::DuplicateRowRegion(kind) => write!(f, "a second {kind} region in one row"),
            InvalidReason::NotBindable(v) => write!(f, "graphs of this kind cannot bind {v}"),
            InvalidReason::MissingRowRegion(kind) => write!(f, "needs a {kind} row region, which the scheme lacks"),
            InvalidReason::ProgrammaticEdgeNotBetweenKernels { node } => {
                write!(f, "a programmatic edge joins two kernel nodes; node {node} is not a kernel")
            }
        }
    }
}
