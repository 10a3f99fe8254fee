//! Validated, typed view of a runtime core's manifest.
//!
//! Every value here has passed [`crate::validate`]: ids resolve, ranges fit, lists are
//! ascending, enums are known. Consumers never re-check what these types promise.

use std::collections::BTreeMap;

/// Execution ABI numbers this engine reads. The newest is what Ignition writes.
pub const ABI_VERSIONS: &[u32] = &[1, 2, 3, 4];
/// The ABI Ignition exports today.
pub const CURRENT_ABI: u32 = 4;
/// Completion token slots for a graph that declares none (ABI 1, or an explicit zero).
pub const DEFAULT_COMPLETION_TOKEN_CAPACITY: u32 = 8;

/// Identifies a buffer inside one core.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BufferId(pub u32);
/// Identifies a kernel image inside one core.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KernelId(pub u32);
/// Identifies a graph inside one core (ids start at 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GraphId(pub u32);

/// Who prepared the core and for what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub abi_version: u32,
    /// Lower-case hex sha256.
    pub model_fingerprint: String,
    pub device: PreparingDevice,
    pub cuda_driver_version: u32,
    pub cuda_toolkit_version: u32,
    pub producer: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparingDevice {
    pub name: String,
    pub compute_capability: (u32, u32),
    pub sm_count: u32,
    pub total_memory_bytes: u64,
}

/// Why a core's kernels cannot run on the device at hand.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceMismatch {
    /// The core's kernel images are machine code for one architecture (Triton builds
    /// `sm_90a` on Hopper), and loading them must not compile.
    #[error("the core was prepared for compute capability {}.{}, this device is {}.{}: prepare it again here",
        prepared.0, prepared.1, found.0, found.1)]
    ComputeCapability { prepared: (u32, u32), found: (u32, u32) },
}

impl PreparingDevice {
    /// Whether the core's kernels run on a device of compute capability `found`. Another name or
    /// SM count (an H100 core on an H200, a MIG slice) is allowed: no kernel needs all of its
    /// programs resident at once, so results stay correct; only the tuning was timed elsewhere.
    pub fn check_serving_device(&self, found: (u32, u32)) -> Result<(), DeviceMismatch> {
        if found != self.compute_capability {
            return Err(DeviceMismatch::ComputeCapability { prepared: self.compute_capability, found });
        }
        Ok(())
    }
}

/// The fixed virtual range all buffers live in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arena {
    pub base_address: u64,
    pub byte_size: u64,
    pub alignment: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BufferRole {
    Weights,
    Constants,
    GraphPool,
    Scratch,
    KvPages,
    ContinuationRows,
    StagingInputs,
    CompletionRecords,
    EmbeddingTable,
    RequestState,
}

impl BufferRole {
    pub const ALL: [BufferRole; 10] = [
        BufferRole::Weights,
        BufferRole::Constants,
        BufferRole::GraphPool,
        BufferRole::Scratch,
        BufferRole::KvPages,
        BufferRole::ContinuationRows,
        BufferRole::StagingInputs,
        BufferRole::CompletionRecords,
        BufferRole::EmbeddingTable,
        BufferRole::RequestState,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BufferRole::Weights => "weights",
            BufferRole::Constants => "constants",
            BufferRole::GraphPool => "graph pool",
            BufferRole::Scratch => "scratch",
            BufferRole::KvPages => "kv pages",
            BufferRole::ContinuationRows => "continuation rows",
            BufferRole::StagingInputs => "staging inputs",
            BufferRole::CompletionRecords => "completion records",
            BufferRole::EmbeddingTable => "embedding table",
            BufferRole::RequestState => "request state",
        }
    }
}

/// Element types of buffers and views. `Bytes` is untyped storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DType {
    BF16,
    F16,
    F32,
    F64,
    I8,
    U8,
    I16,
    I32,
    I64,
    U32,
    U64,
    Bool,
    F8E4M3,
    F8E5M2,
    Bytes,
}

impl DType {
    /// Bytes per element (`Bytes` counts one).
    pub fn size(self) -> u64 {
        match self {
            DType::I8 | DType::U8 | DType::Bool | DType::F8E4M3 | DType::F8E5M2 | DType::Bytes => 1,
            DType::BF16 | DType::F16 | DType::I16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::Bool => "bool",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::Bytes => "bytes",
        }
    }
}

/// Where a buffer's initial contents come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Payload {
    /// A tensor in one of the core's safetensors files; its bytes equal the buffer's size.
    Safetensors {
        file_index: usize,
        tensor: String,
    },
    ZeroFill,
    Uninitialized,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    pub id: BufferId,
    pub name: String,
    pub role: BufferRole,
    /// Offset from the arena base; a multiple of `alignment`.
    pub offset: u64,
    pub byte_size: u64,
    pub alignment: u64,
    pub dtype: DType,
    /// Empty for untyped storage; otherwise `product(shape) * dtype.size() == byte_size`.
    pub shape: Vec<u64>,
    pub payload: Payload,
}

impl Buffer {
    /// One past the last arena offset the buffer covers.
    pub fn end(&self) -> u64 {
        self.offset + self.byte_size
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PayloadFile {
    pub path: String,
    pub sha256: String,
    pub byte_size: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageFormat {
    Cubin,
    Ptx,
    Fatbin,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamSlot {
    pub offset: u32,
    pub size: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelImage {
    pub id: KernelId,
    pub file: String,
    pub sha256: String,
    pub format: ImageFormat,
    pub function_name: String,
    /// In parameter order; slots do not overlap.
    pub params: Vec<ParamSlot>,
    pub max_dynamic_shared_memory: u32,
    pub required_threads_per_block: u32,
}

impl KernelImage {
    /// Size of the parameter buffer this layout describes.
    pub fn param_buffer_size(&self) -> u32 {
        self.params.iter().map(|p| p.offset + p.size).max().unwrap_or(0)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GraphKind {
    Prefill,
    Decode,
    ResumeSampling,
    StateMaintenance,
    Vision,
    TuningProducer,
    /// A speculative program (execution ABI 3): `capacity.request_count` B requests,
    /// `capacity.proposal_depth` D >= 1, `capacity.token_capacity` P = B × (D + 1) lanes and
    /// `completion_token_capacity` W = D + 1. See [`SpeculativeProgram`].
    Speculative,
}

impl GraphKind {
    pub const ALL: [GraphKind; 7] = [
        GraphKind::Prefill,
        GraphKind::Decode,
        GraphKind::ResumeSampling,
        GraphKind::StateMaintenance,
        GraphKind::Vision,
        GraphKind::TuningProducer,
        GraphKind::Speculative,
    ];

    pub fn name(self) -> &'static str {
        match self {
            GraphKind::Prefill => "prefill",
            GraphKind::Decode => "decode",
            GraphKind::ResumeSampling => "resume sampling",
            GraphKind::StateMaintenance => "state maintenance",
            GraphKind::Vision => "vision",
            GraphKind::TuningProducer => "tuning producer",
            GraphKind::Speculative => "speculative",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MaintenanceOp {
    Initialize,
    Restore,
    Snapshot,
    Reset,
    AdmitHistogram,
}

/// Capacities one graph was captured for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct GraphCapacity {
    /// Request rows B.
    pub request_count: u32,
    /// Token rows T (a speculative graph's lanes P = B × (D + 1)).
    pub token_capacity: u32,
    /// Proposal depth D (>= 1 for a speculative graph).
    pub proposal_depth: u32,
    /// Image patches (vision graphs only).
    pub patch_capacity: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

/// A pointer word inside a kernel's parameter buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Relocation {
    pub param_index: u32,
    /// Offset of the 8-byte word inside that parameter.
    pub byte_offset: u32,
    pub buffer: BufferId,
    /// Offset inside the buffer; strictly below its size.
    pub buffer_offset: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchAttribute {
    ClusterDim(Dim3),
    Priority(i32),
    Cooperative(bool),
    ClusterSchedulingPolicy(u32),
    MemSyncDomain(u32),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelNode {
    pub kernel: KernelId,
    pub grid: Dim3,
    pub block: Dim3,
    pub dynamic_shared_memory: u32,
    pub param_bytes: Vec<u8>,
    pub relocations: Vec<Relocation>,
    pub launch_attributes: Vec<LaunchAttribute>,
}

/// A byte position inside one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferRange {
    pub buffer: BufferId,
    pub offset: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeOp {
    Kernel(KernelNode),
    Memcpy { src: BufferRange, dst: BufferRange, byte_count: u64 },
    Memset { dst: BufferRange, value: u32, element_size: u32, width: u64, height: u64, pitch: u64 },
    Empty,
    EventRecord { event: u32 },
    EventWait { event: u32 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub id: u32,
    pub op: NodeOp,
}

/// Semantic values the shared packing code writes or reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ValueKind {
    TokenIds,
    Positions,
    SlotMapping,
    PageTable,
    RequestSlots,
    QueryLengths,
    ContextLengths,
    StateRowIndices,
    Temperature,
    TopK,
    TopP,
    MinP,
    RepetitionPenalty,
    PresencePenalty,
    FrequencyPenalty,
    RngSeed,
    RngCounter,
    SampleFlags,
    GrammarMask,
    SourceRows,
    DestinationRows,
    ExpectedConsumed,
    CompletionRecords,
    PatchPixels,
    ImageFeatureOffsets,
    /// Request state: the token each live row sampled and has not consumed yet.
    PendingTokens,
    /// Restore and snapshot graphs (ABI 3, optional): the moved checkpoint's epoch, checked
    /// against the source row's stamp with `ExpectedConsumed` ([`STAMP_BYTES`]).
    CheckpointEpoch,
}

impl ValueKind {
    pub fn name(self) -> &'static str {
        match self {
            ValueKind::TokenIds => "token_ids",
            ValueKind::Positions => "positions",
            ValueKind::SlotMapping => "slot_mapping",
            ValueKind::PageTable => "page_table",
            ValueKind::RequestSlots => "request_slots",
            ValueKind::QueryLengths => "query_lengths",
            ValueKind::ContextLengths => "context_lengths",
            ValueKind::StateRowIndices => "state_row_indices",
            ValueKind::Temperature => "temperature",
            ValueKind::TopK => "top_k",
            ValueKind::TopP => "top_p",
            ValueKind::MinP => "min_p",
            ValueKind::RepetitionPenalty => "repetition_penalty",
            ValueKind::PresencePenalty => "presence_penalty",
            ValueKind::FrequencyPenalty => "frequency_penalty",
            ValueKind::RngSeed => "rng_seed",
            ValueKind::RngCounter => "rng_counter",
            ValueKind::SampleFlags => "sample_flags",
            ValueKind::GrammarMask => "grammar_mask",
            ValueKind::SourceRows => "source_rows",
            ValueKind::DestinationRows => "destination_rows",
            ValueKind::ExpectedConsumed => "expected_consumed",
            ValueKind::CompletionRecords => "completion_records",
            ValueKind::PatchPixels => "patch_pixels",
            ValueKind::ImageFeatureOffsets => "image_feature_offsets",
            ValueKind::PendingTokens => "pending_tokens",
            ValueKind::CheckpointEpoch => "checkpoint_epoch",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Staged by the host before each submission.
    Input,
    /// Read back by the host after the submission completes.
    Output,
    /// Persistent request state the graph reads, writes, or both; never packed by the host.
    StateRead,
    StateWrite,
    StateReadWrite,
}

impl Direction {
    pub fn is_state(self) -> bool {
        matches!(self, Direction::StateRead | Direction::StateWrite | Direction::StateReadWrite)
    }

    pub fn reads_state(self) -> bool {
        matches!(self, Direction::StateRead | Direction::StateReadWrite)
    }

    pub fn writes_state(self) -> bool {
        matches!(self, Direction::StateWrite | Direction::StateReadWrite)
    }
}

/// One semantic value's byte view: `shape` elements of `dtype` at `view` (validated to fit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueBinding {
    pub value: ValueKind,
    pub direction: Direction,
    pub view: BufferRange,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

impl ValueBinding {
    pub fn byte_len(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Graph {
    pub id: GraphId,
    pub name: String,
    pub kind: GraphKind,
    pub capacity: GraphCapacity,
    /// Present exactly for state-maintenance graphs.
    pub maintenance_op: Option<MaintenanceOp>,
    pub nodes: Vec<Node>,
    /// Acyclic over all edges, whatever their dependency; no edge joins a node to itself; a
    /// programmatic or launch-order edge joins two kernel nodes (ABI 4 and later only).
    pub edges: Vec<Edge>,
    /// At most one binding per value kind.
    pub bindings: Vec<ValueBinding>,
    pub event_count: u32,
    pub completion_token_capacity: u32,
    pub continuation_rows_per_request: u32,
    pub embedding_table_buffers: Vec<BufferId>,
    pub requires_producer: Option<GraphId>,
}

impl Graph {
    pub fn binding(&self, value: ValueKind) -> Option<&ValueBinding> {
        self.bindings.iter().find(|b| b.value == value)
    }

    /// Edges whose dependency is programmatic or launch-order.
    pub fn programmatic_edges(&self) -> impl Iterator<Item = &Edge> {
        self.edges.iter().filter(|e| e.dependency.is_programmatic())
    }
}

/// A graph edge: `to` runs after `from`, as `dependency` says.
///
/// Invariants: `from` and `to` index the graph's `nodes` and differ; for a programmatic or
/// launch-order dependency both are kernel nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Edge {
    pub from: usize,
    pub to: usize,
    pub dependency: Dependency,
}

/// When an edge's `to` node may launch relative to its `from` node (the driver's
/// `CUgraphEdgeData`, as captured).
///
/// The programmatic kinds (Hopper programmatic dependent launch, execution ABI 4) join kernel
/// nodes only, and `to`'s kernel waits for `from`'s completion and memory with
/// `griddepcontrol.wait` before it reads anything `from` writes: replaying a programmatic edge
/// as a full one is therefore always correct, only slower (`to` no longer overlaps `from`'s
/// tail).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dependency {
    /// `to` launches after `from` has completed and its memory is visible.
    Full,
    /// `to` may launch once every block of `from` has triggered
    /// (`griddepcontrol.launch_dependents`) or exited (`CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC`).
    Programmatic,
    /// `to` may launch once every block of `from` has started
    /// (`CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER`).
    LaunchOrder,
}

impl Dependency {
    /// Whether `to` may launch before `from` completes (the kinds that join kernel nodes only).
    pub fn is_programmatic(self) -> bool {
        matches!(self, Dependency::Programmatic | Dependency::LaunchOrder)
    }
}

/// One region of a logical KV page (e.g. all layers' K, all layers' V).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageRegion {
    pub name: String,
    pub bytes_per_page: u64,
}

/// Bytes of a [`RowRegionKind::PositionMetadata`] region: the row's stamp.
pub const STAMP_BYTES: u64 = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowRegionKind {
    RecurrentState,
    ConvolutionHistory,
    PartialPage,
    HiddenVector,
    /// The row's stamp, exactly [`STAMP_BYTES`]: `[consumed: i32, epoch: i32]` little-endian.
    /// A live row's consumed count is written by every graph that consumes into it, its epoch
    /// by initialize (0) and restore (the checkpoint's); a snapshot row holds its checkpoint's
    /// stamp; the null row's is zero. Restore and snapshot graphs binding
    /// [`ValueKind::CheckpointEpoch`] check it before writing.
    PositionMetadata,
    TokenHistory,
}

/// One region of a continuation row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowRegion {
    pub name: String,
    pub kind: RowRegionKind,
    pub offset: u64,
    pub byte_size: u64,
}

/// Storage geometry the shared cache policy consumes. Nothing here names a model.
///
/// Row pool layout (fixed while loaded), for request slots `C` and `W = rows_per_slot()`:
/// row 0 is the null row; slot `s` owns rows `1 + s*W .. 1 + (s+1)*W`; snapshot `i` is row
/// `1 + C*W + i`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheScheme {
    /// Physical tokens per page; > 0.
    pub page_tokens: u32,
    /// Non-empty; names unique.
    pub page_regions: Vec<PageRegion>,
    /// Bytes of one continuation (live or snapshot) row; may be 0 for pure attention without
    /// saved state, in which case `row_layout` is empty.
    pub continuation_row_bytes: u64,
    /// Non-overlapping, inside `continuation_row_bytes`, sorted by offset.
    pub row_layout: Vec<RowRegion>,
    /// Always 0.
    pub null_row: u32,
    /// >= 1.
    pub live_rows_per_slot: u32,
    /// Rows per live row (at least 1): the live row, then its verification columns, scratch
    /// that a speculative round writes (lane `j` into column `j`) before anything reads them;
    /// never snapshotted, restored or initialized.
    pub verification_width: u32,
    /// Negative slot-mapping value that suppresses KV writes for padded rows.
    pub padding_slot: i64,
}

impl CacheScheme {
    /// Bytes one logical page costs across all regions.
    pub fn bytes_per_page(&self) -> u64 {
        self.page_regions.iter().map(|r| r.bytes_per_page).sum()
    }

    /// Rows each request slot owns: live rows × verification width.
    pub fn rows_per_slot(&self) -> u32 {
        self.live_rows_per_slot * self.verification_width
    }

    /// First row of request slot `slot`.
    pub fn first_live_row(&self, slot: u32) -> u32 {
        1 + slot * self.rows_per_slot()
    }

    /// Row of immutable snapshot `index` for `request_slots` live slots.
    pub fn snapshot_row(&self, request_slots: u32, index: u32) -> u32 {
        1 + request_slots * self.rows_per_slot() + index
    }

    /// Total rows: null + live + snapshots.
    pub fn total_rows(&self, request_slots: u32, snapshot_rows: u32) -> u32 {
        1 + request_slots * self.rows_per_slot() + snapshot_rows
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.page_tokens))
    }

    /// Whether a row region of this kind is part of the layout.
    pub fn has_row_region(&self, kind: RowRegionKind) -> bool {
        self.row_layout.iter().any(|r| r.kind == kind)
    }
}

/// Capacities the core was prepared for. All bucket lists are strictly ascending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capacities {
    pub context_limit: u32,
    pub decode_request_buckets: Vec<u32>,
    pub prefill_chunk_capacities: Vec<u32>,
    pub image_patch_buckets: Vec<u32>,
    pub request_slots: u32,
    pub snapshot_rows: u32,
    pub max_kv_pages: u32,
    pub vocab_size: u32,
    pub completion_record_header_words: u32,
    /// Captured speculative programs, ascending by (requests, depth), one per speculative graph
    /// (validation derives them; no two share (requests, depth)). Empty: none (every ABI 1 and
    /// 2 core, and ABI 3 cores prepared without speculation).
    pub speculative_programs: Vec<SpeculativeProgram>,
}

/// A captured speculative program: for up to `requests` requests it consumes each one's
/// pending token plus up to `depth` copy proposals, verifies the proposals with the ordinary
/// sampler (so outputs are distributed as ordinary decoding), commits the accepted prefix to
/// request state and reports, per request, the accepted proposals and one more sampled token.
///
/// Invariants: `depth >= 1`; `width == depth + 1` target rows (lanes) per request, the pending
/// token included; `rows == requests * width` (rectangular programs). A program derived from a
/// core is exactly its speculative graph's capacity: `requests` = B, `depth` = D, `rows` = P.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpeculativeProgram {
    pub requests: u32,
    pub depth: u32,
    pub width: u32,
    pub rows: u32,
}

impl SpeculativeProgram {
    /// The rectangular program for `requests` requests at `depth` proposals.
    pub fn rectangular(requests: u32, depth: u32) -> Self {
        SpeculativeProgram { requests, depth, width: depth + 1, rows: requests * (depth + 1) }
    }
}

impl Capacities {
    /// The smallest captured speculative program that holds `requests` requests with up to
    /// `depth` proposals each (fewest rows, then fewest requests), if any.
    pub fn speculative_program_for(&self, requests: u32, depth: u32) -> Option<SpeculativeProgram> {
        self.speculative_programs
            .iter()
            .copied()
            .filter(|p| p.requests >= requests && p.depth >= depth)
            .min_by_key(|p| (p.rows, p.requests))
    }

    /// The deepest proposal any captured program verifies for `requests` requests (0: none).
    pub fn max_speculative_depth(&self, requests: u32) -> u32 {
        self.speculative_programs.iter().filter(|p| p.requests >= requests).map(|p| p.depth).max().unwrap_or(0)
    }

    /// Smallest captured decode bucket that holds `requests`, if any.
    pub fn decode_bucket_for(&self, requests: u32) -> Option<u32> {
        self.decode_request_buckets.iter().copied().find(|&b| b >= requests)
    }

    /// Smallest captured prefill capacity that holds `tokens`, if any.
    pub fn prefill_capacity_for(&self, tokens: u32) -> Option<u32> {
        self.prefill_chunk_capacities.iter().copied().find(|&c| c >= tokens)
    }

    /// Largest prefill chunk.
    pub fn max_prefill_chunk(&self) -> u32 {
        self.prefill_chunk_capacities.last().copied().unwrap_or(0)
    }

    /// Page-table width of one request: pages covering the context limit.
    pub fn pages_per_request(&self, page_tokens: u32) -> u64 {
        u64::from(self.context_limit).div_ceil(u64::from(page_tokens))
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AssetFile {
    pub path: String,
    pub sha256: String,
}

/// A sampling parameter's default and the inclusive range requests may choose from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParameter {
    pub default: f64,
    /// `None`: fixed at `default`.
    pub range: Option<(f64, f64)>,
}

impl SamplingParameter {
    /// The value a request gets: its own clamped into the range, or the default.
    pub fn resolve(&self, requested: Option<f64>) -> f64 {
        match (requested, self.range) {
            (Some(v), Some((lo, hi))) => v.clamp(lo, hi),
            _ => self.default,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: SamplingParameter,
    pub top_k: SamplingParameter,
    pub top_p: SamplingParameter,
    pub min_p: SamplingParameter,
    pub repetition_penalty: SamplingParameter,
    pub presence_penalty: SamplingParameter,
    pub frequency_penalty: SamplingParameter,
    pub max_output_tokens: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningParser {
    None,
    ThinkTags,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolParser {
    None,
    HermesJson,
    Qwen3CoderXml,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Frontend {
    pub tokenizer: AssetFile,
    pub chat_template: AssetFile,
    pub eos_token_ids: Vec<u32>,
    pub sampling: SamplingDefaults,
    pub reasoning_parser: ReasoningParser,
    pub tool_parser: ToolParser,
    pub served_model_name: String,
}

/// The validated manifest.
#[derive(Clone, Debug, PartialEq)]
pub struct Manifest {
    pub identity: Identity,
    pub arena: Arena,
    /// Sorted by id; ids unique.
    pub buffers: Vec<Buffer>,
    pub payload_files: Vec<PayloadFile>,
    /// Sorted by id; ids unique.
    pub kernels: Vec<KernelImage>,
    /// Sorted by id; ids unique.
    pub graphs: Vec<Graph>,
    pub cache_scheme: CacheScheme,
    pub capacities: Capacities,
    pub frontend: Frontend,
}

impl Manifest {
    pub fn buffer(&self, id: BufferId) -> Option<&Buffer> {
        self.buffers.binary_search_by_key(&id, |b| b.id).ok().map(|i| &self.buffers[i])
    }

    pub fn kernel(&self, id: KernelId) -> Option<&KernelImage> {
        self.kernels.binary_search_by_key(&id, |k| k.id).ok().map(|i| &self.kernels[i])
    }

    pub fn graph(&self, id: GraphId) -> Option<&Graph> {
        self.graphs.binary_search_by_key(&id, |g| g.id).ok().map(|i| &self.graphs[i])
    }

    /// Graphs of one kind, in ascending capacity order.
    pub fn graphs_of(&self, kind: GraphKind) -> Vec<&Graph> {
        let mut graphs: Vec<&Graph> = self.graphs.iter().filter(|g| g.kind == kind).collect();
        graphs.sort_by_key(|g| (g.capacity.request_count, g.capacity.token_capacity, g.id));
        graphs
    }

    /// Total bytes per buffer role.
    pub fn bytes_by_role(&self) -> BTreeMap<BufferRole, (usize, u64)> {
        let mut by_role = BTreeMap::new();
        for b in &self.buffers {
            let entry = by_role.entry(b.role).or_insert((0usize, 0u64));
            entry.0 += 1;
            entry.1 += b.byte_size;
        }
        by_role
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hopper(sms: u32) -> PreparingDevice {
        PreparingDevice {
            name: String::from("NVIDIA H100 80GB HBM3"),
            compute_capability: (9, 0),
            sm_count: sms,
            total_memory_bytes: 80 << 30,
        }
    }

    #[test]
    fn a_core_serves_on_its_own_architecture_only() {
        assert_eq!(hopper(132).check_serving_device((9, 0)), Ok(()));
        assert_eq!(
            hopper(132).check_serving_device((10, 0)),
            Err(DeviceMismatch::ComputeCapability { prepared: (9, 0), found: (10, 0) })
        );
        assert_eq!(
            hopper(132).check_serving_device((8, 9)),
            Err(DeviceMismatch::ComputeCapability { prepared: (9, 0), found: (8, 9) })
        );
    }
}
