"""Python-side checks of a manifest before it is written.

The Rust validator (crates/helios-contract/src/validate.rs) is the authority; these repeat the
rules an exporter can break, so a bad core fails in the preparing process with Python names
instead of later in `flare check`. Each failure is a `ManifestError` naming the field.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ignition.core.contract import expected_view, required_values
from ignition.core.manifest import (
    Buffer,
    BufferRole,
    Direction,
    EdgeDependency,
    Graph,
    GraphKind,
    KernelImage,
    KernelNode,
    MaintenanceOp,
    RowRegionKind,
    RuntimeCore,
    SamplingParameter,
    ValueKind,
    ZeroFill,
)


@dataclass(eq=False)
class ManifestError(Exception):
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _ascending(values: tuple[int, ...], field: str, allow_empty: bool) -> None:
    if not values and not allow_empty:
        raise ManifestError(field, "must not be empty")
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            raise ManifestError(f"{field}[{i}]", f"{values[i]} does not follow {values[i - 1]} strictly ascending")
    if values and values[0] == 0:
        raise ManifestError(f"{field}[0]", "must be positive")


def check_sampling_parameter(p: SamplingParameter, field: str) -> None:
    if not math.isfinite(p.default):
        raise ManifestError(f"{field}.default", "must be finite")
    if p.range is not None:
        lo, hi = p.range.min, p.range.max
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ManifestError(f"{field}.range", "must be finite")
        if lo > hi:
            raise ManifestError(f"{field}.range", f"empty range [{lo}, {hi}]")
        if not lo <= p.default <= hi:
            raise ManifestError(f"{field}.default", f"{p.default} outside [{lo}, {hi}]")


def check_core(core: RuntimeCore) -> None:
    a = core.arena
    if not _pow2(a.alignment) or a.base_address == 0 or a.base_address % a.alignment:
        raise ManifestError("arena", f"base {a.base_address:#x} / alignment {a.alignment} invalid")
    ids: set[int] = set()
    for b in sorted(core.buffers, key=lambda b: b.offset):
        f = f"buffers[{b.name}]"
        if b.id in ids:
            raise ManifestError(f"{f}.id", f"duplicate id {b.id}")
        ids.add(b.id)
        if not _pow2(b.alignment) or b.alignment > a.alignment or b.offset % b.alignment:
            raise ManifestError(f"{f}.offset", f"offset {b.offset} alignment {b.alignment} invalid")
        if b.byte_size <= 0 or b.end > a.byte_size:
            raise ManifestError(f"{f}.byte_size", f"[{b.offset}, {b.end}) outside the arena ({a.byte_size} bytes)")
        if b.shape and math.prod(b.shape) * b.dtype.size != b.byte_size:
            raise ManifestError(f"{f}.shape", f"{list(b.shape)} x {b.dtype.name} != {b.byte_size} bytes")
    ordered = sorted(core.buffers, key=lambda b: b.offset)
    for x, y in itertools.pairwise(ordered):
        if x.end > y.offset:
            raise ManifestError(f"buffers[{y.name}].offset", f"overlaps buffer {x.name}")
    by_id = {b.id: b for b in core.buffers}
    c, s = core.capacities, core.cache_scheme
    _ascending(c.decode_request_buckets, "capacities.decode_request_buckets", False)
    _ascending(c.prefill_chunk_capacities, "capacities.prefill_chunk_capacities", False)
    if c.decode_request_buckets[-1] > c.request_slots:
        raise ManifestError("capacities.decode_request_buckets", "largest bucket exceeds request_slots")
    for role, expected in (
        (BufferRole.KV_PAGES, c.max_kv_pages * s.bytes_per_page),
        (BufferRole.CONTINUATION_ROWS, s.total_rows(c.request_slots, c.snapshot_rows) * s.continuation_row_bytes),
    ):
        found = [b for b in core.buffers if b.role is role]
        if len(found) > 1 or (expected and not found) or (found and found[0].byte_size != expected):
            raise ManifestError(f"buffers[{role.name}]", f"need exactly one buffer of {expected} bytes")
    kernels = {k.id: k for k in core.kernels}
    for g in core.graphs:
        _check_graph_kernels(core, g.name, [n.op for n in g.nodes if isinstance(n.op, KernelNode)], kernels, by_id)
        _check_edges(core, g)
        bound = set()
        for bnd in g.bindings:
            f = f"graphs[{g.name}].bindings[{bnd.value.name}]"
            want = expected_view(bnd.value, g.kind, g.capacity, g.completion_token_capacity, s, c)
            if want is None:
                raise ManifestError(f, f"a {g.kind.name} graph may not bind it")
            if bnd.direction is not want.direction or bnd.dtype not in want.dtypes or not want.matches(bnd.shape):
                raise ManifestError(f, f"expected {want}, got {bnd.direction.name} {bnd.dtype.name} {bnd.shape}")
            buf = by_id.get(bnd.view.buffer_id)
            if buf is None or bnd.view.offset + bnd.byte_size > buf.byte_size:
                raise ManifestError(f"{f}.view", "does not fit its buffer")
            if bnd.direction.is_state:
                allowed: tuple[BufferRole, ...] = (BufferRole.REQUEST_STATE,)
            elif bnd.direction is Direction.INPUT:
                allowed = (BufferRole.STAGING_INPUTS, BufferRole.REQUEST_STATE)
            else:
                allowed = (BufferRole.COMPLETION_RECORDS,)
            if buf.role not in allowed:
                raise ManifestError(f"{f}.view", f"buffer role {buf.role.name} not allowed")
            if bnd.direction.is_state:
                # Request state persists across submissions in a buffer of its own (zeroed at load,
                # indexed by live row): the view is that whole buffer.
                whole = bnd.view.offset == 0 and buf.dtype is bnd.dtype and buf.shape == bnd.shape
                if not whole or not isinstance(buf.payload, ZeroFill):
                    got = f"{buf.dtype.name} {list(buf.shape)} {type(buf.payload).__name__}"
                    raise ManifestError(f"{f}.view", f"must be all of a zero-filled buffer; {buf.name} is {got}")
            bound.add(bnd.value)
        for v in required_values(g.kind, g.maintenance_op):
            if v not in bound:
                raise ManifestError(f"graphs[{g.name}].bindings", f"missing required binding {v.name}")
    _check_pending_tokens(core)
    for bucket in c.decode_request_buckets:
        if not any(g.kind is GraphKind.DECODE and g.capacity.request_count == bucket for g in core.graphs):
            raise ManifestError("capacities.decode_request_buckets", f"no decode graph for bucket {bucket}")
    _check_speculative(core)
    _check_stamps(core)
    for cap in c.prefill_chunk_capacities:
        if not any(g.kind is GraphKind.PREFILL and g.capacity.token_capacity == cap for g in core.graphs):
            raise ManifestError("capacities.prefill_chunk_capacities", f"no prefill graph for capacity {cap}")
    fe = core.frontend
    if not fe.eos_token_ids or any(not 0 <= t < c.vocab_size for t in fe.eos_token_ids):
        raise ManifestError("frontend.eos_token_ids", f"must be non-empty ids below vocab_size {c.vocab_size}")
    for name, p in fe.sampling.parameters().items():
        check_sampling_parameter(p, f"frontend.sampling.{name}")
    t = fe.sampling.temperature
    if t.default <= 0 or (t.range is not None and t.range.min <= 0):
        raise ManifestError("frontend.sampling.temperature", "must stay positive over its whole range")
    if fe.sampling.max_output_tokens <= 0:
        raise ManifestError("frontend.sampling.max_output_tokens", "must be positive")


def _check_edges(core: RuntimeCore, g: Graph) -> None:
    """Programmatic edges (ABI 4) join two kernel nodes; a core of an earlier ABI has none."""
    kinds = {n.id: isinstance(n.op, KernelNode) for n in g.nodes}
    for i, e in enumerate(g.edges):
        if e.dependency is EdgeDependency.FULL:
            continue
        f = f"graphs[{g.name}].edges[{i}]"
        if core.identity.abi_version < 4:
            raise ManifestError(f, f"programmatic edges need ABI 4 (core: {core.identity.abi_version})")
        if not (kinds.get(e.src) and kinds.get(e.dst)):
            raise ManifestError(f, f"a {e.dependency.name} edge joins kernel nodes only ({e.src} -> {e.dst})")


def _check_speculative(core: RuntimeCore) -> None:
    """A speculative program of B requests and D proposals has W = D + 1 lanes per request,
    P = B * W lanes and W record tokens; no two share (B, D); only cores of ABI 3 or later carry them."""
    seen: set[tuple[int, int]] = set()
    for g in core.graphs:
        if g.kind is not GraphKind.SPECULATIVE:
            continue
        f = f"graphs[{g.name}]"
        if core.identity.abi_version < 3:
            raise ManifestError(f"{f}.kind", f"speculative programs need ABI 3 (core: {core.identity.abi_version})")
        b, d, p = g.capacity.request_count, g.capacity.proposal_depth, g.capacity.token_capacity
        if b < 1 or d < 1 or p != b * (d + 1) or g.completion_token_capacity != d + 1:
            got = f"B={b} D={d} P={p} tokens={g.completion_token_capacity}"
            raise ManifestError(f"{f}.capacity", f"need B >= 1, D >= 1, P = B*(D+1), D+1 record tokens; {got}")
        if (b, d) in seen:
            raise ManifestError(f"{f}.capacity", f"a second program for B={b} D={d}")
        seen.add((b, d))


def _check_stamps(core: RuntimeCore) -> None:
    """Checkpoint stamps (helios-contract validate.rs): a row's POSITION_METADATA region is one
    8-byte stamp; only restore and snapshot bind CHECKPOINT_EPOCH, and one that does also binds
    its status record, in a core whose rows carry the stamp."""
    stamps = [r for r in core.cache_scheme.row_layout if r.kind is RowRegionKind.POSITION_METADATA]
    if len(stamps) > 1 or any(r.byte_size != 8 for r in stamps):
        raise ManifestError("cache_scheme.row_layout", "at most one POSITION_METADATA region, of 8 bytes")
    for g in core.graphs:
        bound = {b.value for b in g.bindings}
        if ValueKind.CHECKPOINT_EPOCH not in bound:
            continue
        f = f"graphs[{g.name}].bindings[CHECKPOINT_EPOCH]"
        if g.maintenance_op not in (MaintenanceOp.RESTORE, MaintenanceOp.SNAPSHOT):
            raise ManifestError(f, "only restore and snapshot graphs check a stamp")
        if ValueKind.COMPLETION_RECORDS not in bound or not stamps:
            raise ManifestError(f, "needs the graph's status record and a stamp region in the rows")


def _check_pending_tokens(core: RuntimeCore) -> None:
    """A decode reading a pending token that some sampling graph did not store would consume a
    stale one: when any graph binds PENDING_TOKENS, every sampling graph binds the same buffer."""
    views = {g.name: b.view.buffer_id for g in core.graphs for b in g.bindings if b.value is ValueKind.PENDING_TOKENS}
    if not views:
        return
    for g in core.graphs:
        sampling = (GraphKind.DECODE, GraphKind.SPECULATIVE, GraphKind.PREFILL, GraphKind.RESUME_SAMPLING)
        if g.kind in sampling and g.name not in views:
            raise ManifestError(f"graphs[{g.name}].bindings", "missing PENDING_TOKENS (other graphs bind it)")
    if len(set(views.values())) != 1:
        raise ManifestError("graphs.bindings[PENDING_TOKENS]", f"views in several buffers: {views}")


def _check_graph_kernels(
    core: RuntimeCore,
    graph: str,
    nodes: list[KernelNode],
    kernels: dict[int, KernelImage],
    by_id: dict[int, Buffer],
) -> None:
    base = core.arena.base_address
    for k in nodes:
        image = kernels.get(k.kernel_id)
        f = f"graphs[{graph}].kernel[{k.kernel_id}]"
        if image is None:
            raise ManifestError(f, "unknown kernel id")
        if len(k.param_bytes) != image.param_buffer_size:
            raise ManifestError(
                f"{f}.param_bytes", f"{len(k.param_bytes)} bytes, layout needs {image.param_buffer_size}"
            )
        covered = set()
        for r in k.relocations:
            at = image.params[r.param_index].offset + r.byte_offset
            word = int.from_bytes(k.param_bytes[at : at + 8], "little")
            want = base + by_id[r.buffer_id].offset + r.buffer_offset
            if word != want:
                raise ManifestError(f"{f}.relocations", f"word {word:#x} at {at} != {want:#x}")
            covered.add(at)
        for i, slot in enumerate(image.params):
            for at in range(slot.offset, slot.offset + slot.size - 7, 8):
                word = int.from_bytes(k.param_bytes[at : at + 8], "little")
                if at not in covered and core.arena.contains(word):
                    raise ManifestError(f"{f}.param_bytes", f"unrelocated pointer {word:#x} in param {i}")
