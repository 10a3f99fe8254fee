"""A runtime core read back from disk, without torch: the manifest decoded, each graph's value
bindings resolved to byte ranges, kernel parameters patched for a base address.

Everything here is pure Python (protobuf + struct), so it is checked on CPU against cores the
exporter wrote; `ignition.replay.cuda` puts it on a device.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignition.core.safetensors_io import TensorInfo, read_header, read_tensor
from ignition.core.schema import Schema, load_schema
from ignition.core.stepping import PAD

# Dtype enum name -> (struct code, bytes). Only what bindings use; weights travel as bytes.
_CODES = {
    "DTYPE_I32": ("i", 4),
    "DTYPE_I64": ("q", 8),
    "DTYPE_F32": ("f", 4),
    "DTYPE_U32": ("I", 4),
    "DTYPE_U64": ("Q", 8),
    "DTYPE_I16": ("h", 2),
    "DTYPE_U8": ("B", 1),
    "DTYPE_I8": ("b", 1),
    "DTYPE_F64": ("d", 8),
    "DTYPE_BOOL": ("?", 1),
}


class CoreReadError(Exception):
    """The core on disk is not one this harness can replay; `what` says which part."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"{what}: {detail}")
        self.what = what
        self.detail = detail


@dataclass(frozen=True)
class View:
    """One value binding: `count` elements of `code` at `buffer`+`offset`."""

    value: str
    buffer: int
    offset: int
    code: str
    size: int
    shape: tuple[int, ...]
    # "input", "output", "state_read", "state_write" or "state_read_write".
    direction: str = "input"

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def byte_len(self) -> int:
        return self.count * self.size

    def pack(self, values: list[Any], pad: Any) -> bytes:
        if len(values) > self.count:
            raise CoreReadError("pack", f"{len(values)} values for {self.value}, the view holds {self.count}")
        if self.code in "fd":
            lanes = [float(x) for x in values] + [float(pad)] * (self.count - len(values))
        else:
            # Unsigned views take two's-complement words (a seed >= 2^63 is packed as i64).
            mask = (1 << (8 * self.size)) - 1 if self.code in "BHIQ" else None
            lanes = [int(x) & mask if mask else int(x) for x in [*values, *[pad] * (self.count - len(values))]]
        return struct.pack(f"<{self.count}{self.code}", *lanes)

    def unpack(self, data: bytes) -> list[Any]:
        return list(struct.unpack(f"<{self.count}{self.code}", data))


@dataclass(frozen=True)
class GraphInfo:
    id: int
    name: str
    kind: str  # "prefill", "decode", "resume_sampling", "state_maintenance", ...
    op: str  # maintenance op ("initialize", "admit_histogram", ...) or ""
    request_count: int
    token_capacity: int
    inputs: dict[str, View]
    outputs: dict[str, View]
    # Persistent request state (in its own buffer, never packed by the host).
    state: dict[str, View]
    message: Any

    @property
    def reads_pending_tokens(self) -> bool:
        """A negative packed token id takes the lane's token from its row's pending token."""
        v = self.state.get("pending_tokens")
        return self.kind == "decode" and v is not None and v.direction in ("state_read", "state_read_write")


def _enum_suffix(schema: Schema, enum: str, number: int, prefix: str) -> str:
    for name, n in schema.enum_values(enum).items():
        if n == number:
            return name.removeprefix(prefix).lower()
    raise CoreReadError(enum, f"unknown value {number}")


class CoreFiles:
    """The decoded manifest of a core directory plus the buffers' arena placement."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        schema = load_schema()
        self.schema = schema
        path = self.root / "manifest.pb"
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise CoreReadError("manifest", f"cannot read {path}: {e}") from e
        try:
            self.m = schema.message("RuntimeCore").FromString(raw)
        except Exception as e:  # protobuf's DecodeError has no stable import path across versions
            raise CoreReadError("manifest", f"{path} does not decode: {e}") from e
        self.buffers = {b.id: b for b in self.m.buffers}
        self.kernels = {k.id: k for k in self.m.kernels}
        dtype_names = {n: name for name, n in schema.enum_values("Dtype").items()}
        self.graphs: list[GraphInfo] = []
        for g in self.m.graphs:
            inputs: dict[str, View] = {}
            outputs: dict[str, View] = {}
            state: dict[str, View] = {}
            for b in g.bindings:
                value = _enum_suffix(schema, "ValueKind", b.value, "VALUE_KIND_")
                dname = dtype_names.get(b.dtype, str(b.dtype))
                if dname not in _CODES:
                    raise CoreReadError(f"graph {g.name}", f"binding {value} has dtype {dname}")
                if b.view.buffer_id not in self.buffers:
                    raise CoreReadError(f"graph {g.name}", f"binding {value} names buffer {b.view.buffer_id}")
                code, size = _CODES[dname]
                direction = _enum_suffix(schema, "Direction", b.direction, "DIRECTION_")
                view = View(value, b.view.buffer_id, b.view.offset, code, size, tuple(b.shape), direction)
                if view.offset + view.byte_len > self.buffers[b.view.buffer_id].byte_size:
                    raise CoreReadError(f"graph {g.name}", f"binding {value} runs past its buffer")
                if direction == "input":
                    inputs[value] = view
                elif direction == "output":
                    outputs[value] = view
                elif direction.startswith("state_"):
                    state[value] = view
                else:
                    raise CoreReadError(f"graph {g.name}", f"binding {value} has direction {direction}")
            op = _enum_suffix(schema, "MaintenanceOp", g.maintenance_op, "MAINTENANCE_OP_")
            self.graphs.append(
                GraphInfo(
                    g.id,
                    g.name,
                    _enum_suffix(schema, "GraphKind", g.kind, "GRAPH_KIND_"),
                    "" if op == "unspecified" else op,
                    g.capacity.request_count,
                    g.capacity.token_capacity,
                    inputs,
                    outputs,
                    state,
                    g,
                )
            )
        staging = {v.buffer for g in self.graphs for v in g.inputs.values()}
        if len(staging) != 1:
            raise CoreReadError("staging", f"inputs live in {len(staging)} buffers; one staging buffer is supported")
        self.staging = staging.pop()

    # -- geometry ------------------------------------------------------------------------------
    @property
    def page_tokens(self) -> int:
        return int(self.m.cache_scheme.page_tokens)

    @property
    def pages_per_request(self) -> int:
        return int(self.m.capacities.context_limit) // self.page_tokens

    @property
    def context_limit(self) -> int:
        return int(self.m.capacities.context_limit)

    @property
    def header_words(self) -> int:
        return int(self.m.capacities.completion_record_header_words)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.m.frontend.eos_token_ids)

    def by_kind(self, kind: str) -> list[GraphInfo]:
        key = (lambda g: g.request_count) if kind == "decode" else (lambda g: g.token_capacity)
        return sorted((g for g in self.graphs if g.kind == kind), key=key)

    @property
    def device_fed(self) -> bool:
        """Whether every decode graph can take its input tokens from the rows' pending tokens."""
        decode = self.by_kind("decode")
        return bool(decode) and all(g.reads_pending_tokens for g in decode)

    def maintenance(self, op: str) -> GraphInfo | None:
        return next((g for g in self.graphs if g.kind == "state_maintenance" and g.op == op), None)

    # -- payloads and kernels ------------------------------------------------------------------
    def payload(self, buffer: Any) -> bytes:
        """The safetensors bytes of a buffer with a safetensors payload."""
        p = buffer.safetensors
        if p.file_index >= len(self.m.payload_files):
            raise CoreReadError(f"buffer {buffer.name}", f"payload file {p.file_index} does not exist")
        path = self.root / self.m.payload_files[p.file_index].path
        header = self._headers(path)
        if p.tensor not in header:
            raise CoreReadError(f"buffer {buffer.name}", f"{path.name} has no tensor {p.tensor!r}")
        data = read_tensor(path, header[p.tensor])
        if len(data) > buffer.byte_size:
            raise CoreReadError(
                f"buffer {buffer.name}", f"payload {len(data)} B exceeds the buffer's {buffer.byte_size} B"
            )
        return data

    def _headers(self, path: Path) -> dict[str, TensorInfo]:
        cache: dict[Path, dict[str, TensorInfo]] = self.__dict__.setdefault("_header_cache", {})
        if path not in cache:
            cache[path] = read_header(path)
        return cache[path]

    def kernel_image(self, kernel: Any) -> bytes:
        data = (self.root / str(kernel.file)).read_bytes()
        if kernel.format == self.schema.enum_values("ImageFormat")["IMAGE_FORMAT_PTX"] and not data.endswith(b"\0"):
            data += b"\0"
        return data

    def address(self, base: int, buffer_id: int, offset: int = 0) -> int:
        b = self.buffers.get(buffer_id)
        if b is None:
            raise CoreReadError("address", f"buffer {buffer_id} does not exist")
        return base + int(b.offset) + offset

    def kernel_params(self, node: Any, base: int) -> bytes:
        """The node's parameter bytes with every relocation written for arena `base`.

        Every relocation is written (not only when relocated), as the Rust loader does, so a
        word the exporter recorded is never trusted over the buffer it names."""
        k = node.kernel
        image = self.kernels.get(k.kernel_id)
        if image is None:
            raise CoreReadError(f"node {node.id}", f"unknown kernel {k.kernel_id}")
        params = bytearray(k.param_bytes)
        for r in k.relocations:
            if r.param_index >= len(image.params):
                raise CoreReadError(f"node {node.id}", f"relocation names parameter {r.param_index}")
            at = image.params[r.param_index].offset + r.byte_offset
            if at + 8 > len(params):
                raise CoreReadError(f"node {node.id}", "relocation outside the parameter bytes")
            params[at : at + 8] = struct.pack("<Q", self.address(base, r.buffer_id, r.buffer_offset))
        return bytes(params)


def topological(g: Any) -> list[int]:
    """Node indices of graph message `g` in dependency order (edges name node ids)."""
    index = {n.id: i for i, n in enumerate(g.nodes)}
    indegree = [0] * len(g.nodes)
    succ: list[list[int]] = [[] for _ in g.nodes]
    for e in g.edges:
        if getattr(e, "from") not in index or e.to not in index:
            raise CoreReadError(f"graph {g.name}", f"edge {getattr(e, 'from')}->{e.to} names a missing node")
        succ[index[getattr(e, "from")]].append(index[e.to])
        indegree[index[e.to]] += 1
    ready = [i for i, d in enumerate(indegree) if d == 0]
    out = []
    while ready:
        i = ready.pop()
        out.append(i)
        for j in succ[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    if len(out) != len(g.nodes):
        raise CoreReadError(f"graph {g.name}", "edges form a cycle")
    return out


def pack_graph(
    core: CoreFiles, g: GraphInfo, values: dict[str, list[Any]], mirror: bytearray, pad: dict[str, Any] | None = None
) -> None:
    """Writes this graph's input views into the staging mirror, padding every lane after the values."""
    base = core.buffers[core.staging]
    pad = pad or PAD
    for value, view in g.inputs.items():
        if value not in pad:
            raise CoreReadError(f"graph {g.name}", f"no padding rule for input {value}")
        data = view.pack(values.get(value, []), pad[value])
        mirror[view.offset : view.offset + len(data)] = data
    assert len(mirror) == base.byte_size, "the mirror is the whole staging buffer"
