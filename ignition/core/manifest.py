"""Typed runtime-core manifest: dataclasses mirroring runtime_core.proto, and their encoding.

Each class maps one-to-one onto a proto message; enums carry the proto's numbers (a test checks
them against the parsed schema). `RuntimeCore.encode()` returns the bytes of `manifest.pb`.
Field meanings and constraints are those of the proto comments and of
crates/helios-contract/src/validate.rs, which is the authority; `ignition.core.checks` repeats
the checks an exporter can get wrong so they fail in Python, with the Python names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from ignition.core.schema import load_schema

# 4: programmatic graph edges (Edge.dependency); 3 added speculative programs. Helios reads
# every earlier ABI.
ABI_VERSION = 4
MANIFEST_FILE = "manifest.pb"


class BufferRole(IntEnum):
    WEIGHTS = 1
    CONSTANTS = 2
    GRAPH_POOL = 3
    SCRATCH = 4
    KV_PAGES = 5
    CONTINUATION_ROWS = 6
    STAGING_INPUTS = 7
    COMPLETION_RECORDS = 8
    EMBEDDING_TABLE = 9
    REQUEST_STATE = 10


class Dtype(IntEnum):
    BF16 = 1
    F16 = 2
    F32 = 3
    F64 = 4
    I8 = 5
    U8 = 6
    I16 = 7
    I32 = 8
    I64 = 9
    U32 = 10
    U64 = 11
    BOOL = 12
    F8_E4M3 = 13
    F8_E5M2 = 14
    BYTES = 15

    @property
    def size(self) -> int:
        return _DTYPE_SIZE[self]

    @property
    def safetensors_name(self) -> str:
        """Safetensors dtype string (untyped bytes are stored as U8)."""
        return "U8" if self is Dtype.BYTES else self.name

    @classmethod
    def from_safetensors(cls, name: str) -> Dtype:
        return cls[name]


_DTYPE_SIZE = {
    Dtype.BF16: 2,
    Dtype.F16: 2,
    Dtype.F32: 4,
    Dtype.F64: 8,
    Dtype.I8: 1,
    Dtype.U8: 1,
    Dtype.I16: 2,
    Dtype.I32: 4,
    Dtype.I64: 8,
    Dtype.U32: 4,
    Dtype.U64: 8,
    Dtype.BOOL: 1,
    Dtype.F8_E4M3: 1,
    Dtype.F8_E5M2: 1,
    Dtype.BYTES: 1,
}


class ImageFormat(IntEnum):
    CUBIN = 1
    PTX = 2
    FATBIN = 3


class GraphKind(IntEnum):
    PREFILL = 1
    DECODE = 2
    RESUME_SAMPLING = 3
    STATE_MAINTENANCE = 4
    VISION = 5
    TUNING_PRODUCER = 6
    SPECULATIVE = 7


class EdgeDependency(IntEnum):
    """How an edge's `dst` waits for its `src` (ABI 4; the proto's `EdgeDependency`)."""

    FULL = 0  # `dst` starts after `src` completes (UNSPECIFIED in the proto)
    PROGRAMMATIC = 1  # kernels only: `dst` may launch once every block of `src` has triggered
    LAUNCH_ORDER = 2  # kernels only: `dst` may launch once every block of `src` has started


class MaintenanceOp(IntEnum):
    INITIALIZE = 1
    RESTORE = 2
    SNAPSHOT = 3
    RESET = 4
    ADMIT_HISTOGRAM = 5


class ValueKind(IntEnum):
    TOKEN_IDS = 1
    POSITIONS = 2
    SLOT_MAPPING = 3
    PAGE_TABLE = 4
    REQUEST_SLOTS = 5
    QUERY_LENGTHS = 6
    CONTEXT_LENGTHS = 7
    STATE_ROW_INDICES = 8
    TEMPERATURE = 9
    TOP_K = 10
    TOP_P = 11
    MIN_P = 12
    REPETITION_PENALTY = 13
    PRESENCE_PENALTY = 14
    FREQUENCY_PENALTY = 15
    RNG_SEED = 16
    RNG_COUNTER = 17
    SAMPLE_FLAGS = 18
    GRAMMAR_MASK = 19
    SOURCE_ROWS = 20
    DESTINATION_ROWS = 21
    EXPECTED_CONSUMED = 22
    COMPLETION_RECORDS = 23
    PATCH_PIXELS = 24
    IMAGE_FEATURE_OFFSETS = 25
    PENDING_TOKENS = 26
    CHECKPOINT_EPOCH = 27


class Direction(IntEnum):
    INPUT = 1
    OUTPUT = 2
    STATE_READ = 3
    STATE_WRITE = 4
    STATE_READ_WRITE = 5

    @property
    def is_state(self) -> bool:
        """Persistent request state: bound in a REQUEST_STATE buffer, never packed by the host."""
        return self in (Direction.STATE_READ, Direction.STATE_WRITE, Direction.STATE_READ_WRITE)


class RowRegionKind(IntEnum):
    RECURRENT_STATE = 1
    CONVOLUTION_HISTORY = 2
    PARTIAL_PAGE = 3
    HIDDEN_VECTOR = 4
    POSITION_METADATA = 5
    TOKEN_HISTORY = 6


class ReasoningParser(IntEnum):
    NONE = 1
    THINK_TAGS = 2


class ToolParser(IntEnum):
    NONE = 1
    HERMES_JSON = 2
    QWEN3_CODER_XML = 3


# Python enum → proto enum name, for the schema-consistency test.
PROTO_ENUMS: dict[type[IntEnum], str] = {
    BufferRole: "BufferRole",
    Dtype: "Dtype",
    ImageFormat: "ImageFormat",
    GraphKind: "GraphKind",
    EdgeDependency: "EdgeDependency",
    MaintenanceOp: "MaintenanceOp",
    ValueKind: "ValueKind",
    Direction: "Direction",
    RowRegionKind: "RowRegionKind",
    ReasoningParser: "ReasoningParser",
    ToolParser: "ToolParser",
}

# ---------------------------------------------------------------------------------------------
# Identity and storage


@dataclass(frozen=True)
class PreparingDevice:
    name: str
    compute_capability_major: int
    compute_capability_minor: int
    sm_count: int
    total_memory_bytes: int


@dataclass(frozen=True)
class Identity:
    model_fingerprint: str
    device: PreparingDevice
    cuda_driver_version: int
    cuda_toolkit_version: int
    producer: str
    abi_version: int = ABI_VERSION


@dataclass(frozen=True)
class Arena:
    base_address: int
    byte_size: int
    alignment: int

    @property
    def end(self) -> int:
        return self.base_address + self.byte_size

    def contains(self, address: int) -> bool:
        return self.base_address <= address < self.end


@dataclass(frozen=True)
class SafetensorsPayload:
    file_index: int
    tensor: str


@dataclass(frozen=True)
class ZeroFill:
    pass


@dataclass(frozen=True)
class Uninitialized:
    pass


Payload = SafetensorsPayload | ZeroFill | Uninitialized


@dataclass(frozen=True)
class Buffer:
    id: int
    name: str
    role: BufferRole
    offset: int
    byte_size: int
    alignment: int
    dtype: Dtype
    payload: Payload
    shape: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.offset + self.byte_size


@dataclass(frozen=True)
class PayloadFile:
    path: str
    sha256: str
    byte_size: int


# ---------------------------------------------------------------------------------------------
# Kernels and graphs


@dataclass(frozen=True)
class ParamSlot:
    offset: int
    size: int


@dataclass(frozen=True)
class KernelImage:
    id: int
    file: str
    sha256: str
    format: ImageFormat
    function_name: str
    params: tuple[ParamSlot, ...]
    max_dynamic_shared_memory: int = 0
    required_threads_per_block: int = 0

    @property
    def param_buffer_size(self) -> int:
        return max((p.offset + p.size for p in self.params), default=0)


@dataclass(frozen=True)
class Dim3:
    x: int
    y: int = 1
    z: int = 1


@dataclass(frozen=True)
class GraphCapacity:
    request_count: int
    token_capacity: int = 0
    proposal_depth: int = 0
    patch_capacity: int = 0


@dataclass(frozen=True)
class Relocation:
    """param_bytes[params[param_index].offset + byte_offset ..][..8] holds
    arena_base + buffers[buffer_id].offset + buffer_offset."""

    param_index: int
    byte_offset: int
    buffer_id: int
    buffer_offset: int


@dataclass(frozen=True)
class ClusterDim:
    dim: Dim3


@dataclass(frozen=True)
class Priority:
    value: int


@dataclass(frozen=True)
class Cooperative:
    value: bool


@dataclass(frozen=True)
class ClusterSchedulingPolicy:
    value: int


@dataclass(frozen=True)
class MemSyncDomain:
    value: int


LaunchAttribute = ClusterDim | Priority | Cooperative | ClusterSchedulingPolicy | MemSyncDomain


@dataclass(frozen=True)
class BufferRange:
    buffer_id: int
    offset: int = 0


@dataclass(frozen=True)
class KernelNode:
    kernel_id: int
    grid: Dim3
    block: Dim3
    param_bytes: bytes
    relocations: tuple[Relocation, ...]
    dynamic_shared_memory: int = 0
    launch_attributes: tuple[LaunchAttribute, ...] = ()


@dataclass(frozen=True)
class MemcpyNode:
    src: BufferRange
    dst: BufferRange
    byte_count: int


@dataclass(frozen=True)
class MemsetNode:
    dst: BufferRange
    value: int
    element_size: int
    width: int
    height: int = 1
    pitch: int = 0


@dataclass(frozen=True)
class EmptyNode:
    pass


@dataclass(frozen=True)
class EventRecordNode:
    event: int


@dataclass(frozen=True)
class EventWaitNode:
    event: int


NodeOp = KernelNode | MemcpyNode | MemsetNode | EmptyNode | EventRecordNode | EventWaitNode


@dataclass(frozen=True)
class Node:
    id: int
    op: NodeOp


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    dependency: EdgeDependency = EdgeDependency.FULL


@dataclass(frozen=True)
class ValueBinding:
    value: ValueKind
    direction: Direction
    view: BufferRange
    dtype: Dtype
    shape: tuple[int, ...]

    @property
    def byte_size(self) -> int:
        n = self.dtype.size
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Graph:
    id: int
    name: str
    kind: GraphKind
    capacity: GraphCapacity
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    bindings: tuple[ValueBinding, ...]
    maintenance_op: MaintenanceOp | None = None
    event_count: int = 0
    completion_token_capacity: int = 8
    continuation_rows_per_request: int = 1
    embedding_table_buffers: tuple[int, ...] = ()
    requires_producer: int = 0


# ---------------------------------------------------------------------------------------------
# Cache scheme, capacities, frontend


@dataclass(frozen=True)
class PageRegion:
    name: str
    bytes_per_page: int


@dataclass(frozen=True)
class RowRegion:
    name: str
    kind: RowRegionKind
    offset: int
    byte_size: int


@dataclass(frozen=True)
class CacheScheme:
    page_tokens: int
    page_regions: tuple[PageRegion, ...]
    continuation_row_bytes: int
    row_layout: tuple[RowRegion, ...]
    live_rows_per_slot: int = 1
    verification_width: int = 1
    padding_slot: int = -1
    null_row: int = 0

    @property
    def bytes_per_page(self) -> int:
        return sum(r.bytes_per_page for r in self.page_regions)

    @property
    def rows_per_slot(self) -> int:
        return self.live_rows_per_slot * self.verification_width

    def total_rows(self, request_slots: int, snapshot_rows: int) -> int:
        return 1 + request_slots * self.rows_per_slot + snapshot_rows


@dataclass(frozen=True)
class Capacities:
    context_limit: int
    decode_request_buckets: tuple[int, ...]
    prefill_chunk_capacities: tuple[int, ...]
    request_slots: int
    snapshot_rows: int
    max_kv_pages: int
    vocab_size: int
    completion_record_header_words: int
    image_patch_buckets: tuple[int, ...] = ()

    def pages_per_request(self, page_tokens: int) -> int:
        return -(-self.context_limit // page_tokens)


@dataclass(frozen=True)
class AssetFile:
    path: str
    sha256: str


@dataclass(frozen=True)
class Range:
    min: float
    max: float


@dataclass(frozen=True)
class SamplingParameter:
    """A default and, when present, the inclusive range a request may choose from."""

    default: float
    range: Range | None = None


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: SamplingParameter
    top_k: SamplingParameter
    top_p: SamplingParameter
    min_p: SamplingParameter
    repetition_penalty: SamplingParameter
    presence_penalty: SamplingParameter
    frequency_penalty: SamplingParameter
    max_output_tokens: int

    def parameters(self) -> dict[str, SamplingParameter]:
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }


@dataclass(frozen=True)
class Frontend:
    tokenizer: AssetFile
    chat_template: AssetFile
    eos_token_ids: tuple[int, ...]
    sampling: SamplingDefaults
    reasoning_parser: ReasoningParser
    tool_parser: ToolParser
    served_model_name: str


@dataclass(frozen=True)
class RuntimeCore:
    identity: Identity
    arena: Arena
    buffers: tuple[Buffer, ...]
    payload_files: tuple[PayloadFile, ...]
    kernels: tuple[KernelImage, ...]
    graphs: tuple[Graph, ...]
    cache_scheme: CacheScheme
    capacities: Capacities
    frontend: Frontend
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_proto(self) -> Any:
        return _encode_core(self)

    def encode(self) -> bytes:
        """The binary `manifest.pb`. Deterministic for equal manifests."""
        data: bytes = self.to_proto().SerializeToString(deterministic=True)
        return data


# ---------------------------------------------------------------------------------------------
# Encoding


def _dim3(msg: Any, d: Dim3) -> None:
    msg.x, msg.y, msg.z = d.x, d.y, d.z


def _range(msg: Any, r: BufferRange) -> None:
    msg.buffer_id, msg.offset = r.buffer_id, r.offset


def _encode_buffer(msg: Any, b: Buffer) -> None:
    msg.id, msg.name, msg.role = b.id, b.name, int(b.role)
    msg.offset, msg.byte_size, msg.alignment = b.offset, b.byte_size, b.alignment
    msg.dtype = int(b.dtype)
    msg.shape.extend(b.shape)
    match b.payload:
        case SafetensorsPayload(file_index=i, tensor=t):
            msg.safetensors.file_index, msg.safetensors.tensor = i, t
        case ZeroFill():
            msg.zero_fill.SetInParent()
        case Uninitialized():
            msg.uninitialized.SetInParent()


def _encode_launch_attribute(msg: Any, a: LaunchAttribute) -> None:
    match a:
        case ClusterDim(dim=d):
            _dim3(msg.cluster_dim, d)
        case Priority(value=v):
            msg.priority = v
        case Cooperative(value=v):
            msg.cooperative = v
        case ClusterSchedulingPolicy(value=v):
            msg.cluster_scheduling_policy = v
        case MemSyncDomain(value=v):
            msg.mem_sync_domain = v


def _encode_node(msg: Any, n: Node) -> None:
    msg.id = n.id
    match n.op:
        case KernelNode() as k:
            m = msg.kernel
            m.kernel_id = k.kernel_id
            _dim3(m.grid, k.grid)
            _dim3(m.block, k.block)
            m.dynamic_shared_memory = k.dynamic_shared_memory
            m.param_bytes = k.param_bytes
            for r in k.relocations:
                m.relocations.add(
                    param_index=r.param_index,
                    byte_offset=r.byte_offset,
                    buffer_id=r.buffer_id,
                    buffer_offset=r.buffer_offset,
                )
            for a in k.launch_attributes:
                _encode_launch_attribute(m.launch_attributes.add(), a)
        case MemcpyNode() as c:
            _range(msg.memcpy.src, c.src)
            _range(msg.memcpy.dst, c.dst)
            msg.memcpy.byte_count = c.byte_count
        case MemsetNode() as s:
            _range(msg.memset.dst, s.dst)
            msg.memset.value, msg.memset.element_size = s.value, s.element_size
            msg.memset.width, msg.memset.height, msg.memset.pitch = s.width, s.height, s.pitch
        case EmptyNode():
            msg.empty.SetInParent()
        case EventRecordNode(event=e):
            msg.event_record.event = e
        case EventWaitNode(event=e):
            msg.event_wait.event = e


def _encode_graph(msg: Any, g: Graph) -> None:
    msg.id, msg.name, msg.kind = g.id, g.name, int(g.kind)
    c = g.capacity
    cap = msg.capacity
    cap.request_count, cap.token_capacity = c.request_count, c.token_capacity
    cap.proposal_depth, cap.patch_capacity = c.proposal_depth, c.patch_capacity
    cap.SetInParent()
    msg.maintenance_op = int(g.maintenance_op) if g.maintenance_op is not None else 0
    for n in g.nodes:
        _encode_node(msg.nodes.add(), n)
    for e in g.edges:
        edge = msg.edges.add()
        setattr(edge, "from", e.src)
        edge.to = e.dst
        edge.dependency = int(e.dependency)
    for b in g.bindings:
        m = msg.bindings.add()
        m.value, m.direction, m.dtype = int(b.value), int(b.direction), int(b.dtype)
        _range(m.view, b.view)
        m.shape.extend(b.shape)
    msg.event_count = g.event_count
    msg.completion_token_capacity = g.completion_token_capacity
    msg.continuation_rows_per_request = g.continuation_rows_per_request
    msg.embedding_table_buffers.extend(g.embedding_table_buffers)
    msg.requires_producer = g.requires_producer


def _encode_sampling_parameter(msg: Any, p: SamplingParameter) -> None:
    msg.default = p.default
    if p.range is not None:
        msg.range.min, msg.range.max = p.range.min, p.range.max
        msg.range.SetInParent()
    msg.SetInParent()


def _encode_core(core: RuntimeCore) -> Any:
    msg = load_schema().message("RuntimeCore")()
    i, d = core.identity, core.identity.device
    msg.identity.abi_version = i.abi_version
    msg.identity.model_fingerprint = i.model_fingerprint
    dev = msg.identity.device
    dev.name, dev.sm_count, dev.total_memory_bytes = d.name, d.sm_count, d.total_memory_bytes
    dev.compute_capability_major, dev.compute_capability_minor = d.compute_capability_major, d.compute_capability_minor
    msg.identity.cuda_driver_version = i.cuda_driver_version
    msg.identity.cuda_toolkit_version = i.cuda_toolkit_version
    msg.identity.producer = i.producer
    a = core.arena
    msg.arena.base_address, msg.arena.byte_size, msg.arena.alignment = a.base_address, a.byte_size, a.alignment
    for b in core.buffers:
        _encode_buffer(msg.buffers.add(), b)
    for pf in core.payload_files:
        msg.payload_files.add(path=pf.path, sha256=pf.sha256, byte_size=pf.byte_size)
    for k in core.kernels:
        m = msg.kernels.add(
            id=k.id,
            file=k.file,
            sha256=k.sha256,
            format=int(k.format),
            function_name=k.function_name,
            max_dynamic_shared_memory=k.max_dynamic_shared_memory,
            required_threads_per_block=k.required_threads_per_block,
        )
        for p in k.params:
            m.params.add(offset=p.offset, size=p.size)
    for g in core.graphs:
        _encode_graph(msg.graphs.add(), g)
    s = core.cache_scheme
    cs = msg.cache_scheme
    cs.page_tokens = s.page_tokens
    for r in s.page_regions:
        cs.page_regions.add(name=r.name, bytes_per_page=r.bytes_per_page)
    cs.continuation_row_bytes = s.continuation_row_bytes
    for rr in s.row_layout:
        cs.row_layout.add(name=rr.name, kind=int(rr.kind), offset=rr.offset, byte_size=rr.byte_size)
    cs.null_row, cs.live_rows_per_slot = s.null_row, s.live_rows_per_slot
    cs.verification_width, cs.padding_slot = s.verification_width, s.padding_slot
    c = core.capacities
    caps = msg.capacities
    caps.context_limit = c.context_limit
    caps.decode_request_buckets.extend(c.decode_request_buckets)
    caps.prefill_chunk_capacities.extend(c.prefill_chunk_capacities)
    caps.image_patch_buckets.extend(c.image_patch_buckets)
    caps.request_slots, caps.snapshot_rows, caps.max_kv_pages = c.request_slots, c.snapshot_rows, c.max_kv_pages
    caps.vocab_size, caps.completion_record_header_words = c.vocab_size, c.completion_record_header_words
    f = core.frontend
    fe = msg.frontend
    fe.tokenizer.path, fe.tokenizer.sha256 = f.tokenizer.path, f.tokenizer.sha256
    fe.chat_template.path, fe.chat_template.sha256 = f.chat_template.path, f.chat_template.sha256
    fe.eos_token_ids.extend(f.eos_token_ids)
    for name, param in f.sampling.parameters().items():
        _encode_sampling_parameter(getattr(fe.sampling, name), param)
    fe.sampling.max_output_tokens = f.sampling.max_output_tokens
    fe.reasoning_parser, fe.tool_parser = int(f.reasoning_parser), int(f.tool_parser)
    fe.served_model_name = f.served_model_name
    return msg
