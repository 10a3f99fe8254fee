"""CPU-only exporter over a recorded graph description (JSON, see tests/fixtures/ignition/).

A recording holds what capture observed, in the preparing process's terms: the arena and the
allocations in it, every kernel's exact image and parameter layout, and per graph its nodes
with parameter bytes *as captured* (absolute addresses), memcpy/memset addresses, edges and the
addresses of the PreparedContract's value views. The exporter resolves every address to a
buffer, emits relocations, rejects library kernels and unresolved pointers, copies payloads,
images and frontend assets into a core directory and writes manifest.pb.

The GPU path (issue 6) produces the same recording from a live capture; this module is the
part of export that needs no device.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignition.core import safetensors_io as st
from ignition.core.manifest import (
    Arena,
    AssetFile,
    Buffer,
    BufferRole,
    CacheScheme,
    Capacities,
    ClusterDim,
    Cooperative,
    Dim3,
    Direction,
    Dtype,
    Edge,
    EdgeDependency,
    EmptyNode,
    EventRecordNode,
    EventWaitNode,
    Frontend,
    Graph,
    GraphCapacity,
    GraphKind,
    Identity,
    ImageFormat,
    KernelImage,
    KernelNode,
    LaunchAttribute,
    MaintenanceOp,
    MemcpyNode,
    MemsetNode,
    Node,
    PageRegion,
    ParamSlot,
    PayloadFile,
    PreparingDevice,
    Priority,
    Range,
    ReasoningParser,
    RowRegion,
    RowRegionKind,
    RuntimeCore,
    SafetensorsPayload,
    SamplingDefaults,
    SamplingParameter,
    ToolParser,
    Uninitialized,
    ValueBinding,
    ValueKind,
    ZeroFill,
)
from ignition.core.writer import CoreDirectory, sha256_hex
from ignition.export.errors import (
    ForeignPointerError,
    LibraryKernelError,
    MissingKernelImageError,
    RecordingError,
    UnresolvedAddressError,
    UnresolvedPointerError,
)
from ignition.export.resolve import AddressMap, BufferRange, classify, library_kernel_reason, pointer_words

RECORDING_FORMAT = "flare-recorded-graphs/1"
PAYLOAD_FILE = "payloads/weights.safetensors"
Progress = Callable[[str], None]


def _int(v: Any, field: str) -> int:
    if isinstance(v, bool):
        raise RecordingError(field, f"expected an integer, got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v, 0)
        except ValueError:
            pass
    raise RecordingError(field, f"expected an integer or hex string, got {v!r}")


def _enum(enum: Any, v: Any, field: str) -> Any:
    try:
        return enum[str(v).upper()]
    except KeyError:
        raise RecordingError(field, f"unknown {enum.__name__} {v!r}") from None


def _edge(e: Any, field: str) -> Edge:
    """A recorded edge: [from, to] (a full dependency) or [from, to, dependency name]."""
    if not isinstance(e, (list, tuple)) or len(e) not in (2, 3):
        raise RecordingError(field, f"an edge is [from, to] or [from, to, dependency], not {e!r}")
    dep = _enum(EdgeDependency, e[2], f"{field}[2]") if len(e) == 3 else EdgeDependency.FULL
    return Edge(_int(e[0], field), _int(e[1], field), dep)


def _get(d: dict[str, Any], key: str, field: str) -> Any:
    if key not in d:
        raise RecordingError(f"{field}.{key}", "missing")
    return d[key]


def _dim3(v: Any, field: str) -> Dim3:
    xs = [_int(x, field) for x in v]
    if len(xs) != 3:
        raise RecordingError(field, "expected [x, y, z]")
    return Dim3(*xs)


def _sampling(d: dict[str, Any], field: str) -> SamplingDefaults:
    def param(name: str) -> SamplingParameter:
        p = _get(d, name, field)
        r = p.get("range")
        return SamplingParameter(float(p["default"]), Range(float(r[0]), float(r[1])) if r is not None else None)

    return SamplingDefaults(
        temperature=param("temperature"),
        top_k=param("top_k"),
        top_p=param("top_p"),
        min_p=param("min_p"),
        repetition_penalty=param("repetition_penalty"),
        presence_penalty=param("presence_penalty"),
        frequency_penalty=param("frequency_penalty"),
        max_output_tokens=_int(_get(d, "max_output_tokens", field), f"{field}.max_output_tokens"),
    )


def _launch_attribute(d: dict[str, Any], field: str) -> LaunchAttribute:
    if len(d) != 1:
        raise RecordingError(field, "a launch attribute has exactly one key")
    ((key, v),) = d.items()
    if key == "cluster_dim":
        return ClusterDim(_dim3(v, field))
    if key == "priority":
        return Priority(_int(v, field))
    if key == "cooperative":
        return Cooperative(bool(v))
    raise RecordingError(field, f"unsupported launch attribute {key!r}")


@dataclass
class _Kernels:
    images: dict[str, KernelImage]
    origins: dict[str, str]


class RecordingExporter:
    def __init__(self, recording: dict[str, Any], base_dir: Path, progress: Progress | None = None) -> None:
        if recording.get("format") != RECORDING_FORMAT:
            raise RecordingError("format", f"expected {RECORDING_FORMAT!r}, got {recording.get('format')!r}")
        self.r = recording
        self.base = base_dir
        self.progress = progress or (lambda _msg: None)

    # -- storage ---------------------------------------------------------------------------
    def _arena(self) -> Arena:
        a = _get(self.r, "arena", "recording")
        return Arena(
            _int(a["base_address"], "arena.base_address"),
            _int(a["byte_size"], "arena.byte_size"),
            _int(a["alignment"], "arena.alignment"),
        )

    def _buffers(self, tensors: dict[str, st.TensorBytes]) -> list[Buffer]:
        out = []
        source = self._tensor_source()
        for i, a in enumerate(_get(self.r, "allocations", "recording")):
            f = f"allocations[{i}]"
            init = _get(a, "init", f)
            dtype = _enum(Dtype, _get(a, "dtype", f), f"{f}.dtype")
            shape = tuple(_int(x, f"{f}.shape") for x in a.get("shape", []))
            payload: SafetensorsPayload | ZeroFill | Uninitialized
            if init == "zero":
                payload = ZeroFill()
            elif init == "uninitialized":
                payload = Uninitialized()
            elif isinstance(init, dict) and "tensor" in init:
                name = init["tensor"]
                info = source.get(name)
                if info is None:
                    raise RecordingError(f"{f}.init.tensor", f"{name!r} is not in the tensor source")
                data = st.read_tensor(self.base / self.r["tensor_source"], info)
                tensors[name] = st.TensorBytes(Dtype.from_safetensors(info.dtype), info.shape, data)
                payload = SafetensorsPayload(0, name)
            else:
                raise RecordingError(
                    f"{f}.init", f"expected 'zero', 'uninitialized' or {{'tensor': ...}}, got {init!r}"
                )
            out.append(
                Buffer(
                    id=i + 1,
                    name=_get(a, "name", f),
                    role=_enum(BufferRole, _get(a, "role", f), f"{f}.role"),
                    offset=_int(_get(a, "offset", f), f"{f}.offset"),
                    byte_size=_int(_get(a, "byte_size", f), f"{f}.byte_size"),
                    alignment=_int(a.get("alignment", 256), f"{f}.alignment"),
                    dtype=dtype,
                    payload=payload,
                    shape=shape,
                )
            )
        return out

    def _tensor_source(self) -> dict[str, st.TensorInfo]:
        name = self.r.get("tensor_source")
        return st.read_header(self.base / name) if name else {}

    # -- kernels ---------------------------------------------------------------------------
    def _kernels(self, core: CoreDirectory) -> _Kernels:
        images: dict[str, KernelImage] = {}
        origins: dict[str, str] = {}
        by_digest: dict[tuple[str, str], KernelImage] = {}
        for i, k in enumerate(_get(self.r, "kernels", "recording")):
            f = f"kernels[{i}]"
            key, name = _get(k, "key", f), _get(k, "function_name", f)
            origins[key] = str(k.get("origin", "unknown"))
            params = tuple(ParamSlot(_int(o, f"{f}.params"), _int(s, f"{f}.params")) for o, s in _get(k, "params", f))
            image_path = k.get("image")
            if library_kernel_reason(name, origins[key]) is not None:
                # Rejected when a graph uses it (the error then names the graph and node).
                images[key] = KernelImage(0, "", "", ImageFormat.CUBIN, name, params)
                continue
            if not image_path or not (self.base / image_path).is_file():
                raise MissingKernelImageError(name, str(image_path))
            data = (self.base / image_path).read_bytes()
            digest = sha256_hex(data)
            fmt = _enum(ImageFormat, k.get("format", "cubin"), f"{f}.format")
            # One KernelImage per exact (image, function): never identified by name alone.
            existing = by_digest.get((digest, name))
            if existing is not None:
                images[key] = existing
                continue
            kid = len(by_digest) + 1
            rel = f"kernels/k{kid}-{digest[:16]}.{fmt.name.lower()}"
            core.add_file(rel, data)
            image = KernelImage(
                id=kid,
                file=rel,
                sha256=digest,
                format=fmt,
                function_name=name,
                params=params,
                max_dynamic_shared_memory=_int(k.get("max_dynamic_shared_memory", 0), f"{f}.max_dynamic_shared_memory"),
                required_threads_per_block=_int(
                    k.get("required_threads_per_block", 0), f"{f}.required_threads_per_block"
                ),
            )
            by_digest[(digest, name)] = image
            images[key] = image
        return _Kernels(images, origins)

    # -- graphs ----------------------------------------------------------------------------
    def _kernel_node(
        self,
        graph: str,
        nid: int,
        k: dict[str, Any],
        kernels: _Kernels,
        amap: AddressMap,
        foreign: list[tuple[int, int]],
    ) -> KernelNode:
        f = f"graphs[{graph}].nodes[{nid}].kernel"
        key = _get(k, "key", f)
        image = kernels.images.get(key)
        if image is None:
            raise RecordingError(f"{f}.key", f"unknown kernel {key!r}")
        reason = library_kernel_reason(image.function_name, kernels.origins[key])
        if reason is not None:
            raise LibraryKernelError(graph, nid, image.function_name, reason)
        param_bytes = bytes.fromhex(_get(k, "param_bytes", f))
        if len(param_bytes) != image.param_buffer_size:
            raise RecordingError(
                f"{f}.param_bytes", f"{len(param_bytes)} bytes, layout needs {image.param_buffer_size}"
            )
        relocations = []
        for w in pointer_words(param_bytes, image.params):
            c = classify(w, amap, foreign)
            if c.problem == "arena-gap":
                raise UnresolvedPointerError(
                    graph, nid, image.function_name, w.param_index, w.byte_offset, w.word, amap.around(w.word)
                )
            if c.problem == "foreign":
                raise ForeignPointerError(graph, nid, image.function_name, w.param_index, w.byte_offset, w.word)
            if c.relocation is not None:
                relocations.append(c.relocation)
        return KernelNode(
            kernel_id=image.id,
            grid=_dim3(_get(k, "grid", f), f"{f}.grid"),
            block=_dim3(_get(k, "block", f), f"{f}.block"),
            param_bytes=param_bytes,
            relocations=tuple(relocations),
            dynamic_shared_memory=_int(k.get("dynamic_shared_memory", 0), f"{f}.dynamic_shared_memory"),
            launch_attributes=tuple(
                _launch_attribute(a, f"{f}.launch_attributes") for a in k.get("launch_attributes", [])
            ),
        )

    def _range(self, graph: str, where: str, address: Any, count: int, amap: AddressMap) -> BufferRange:
        a = _int(address, where)
        r = amap.find(a, count)
        if r is None:
            raise UnresolvedAddressError(graph, where, a, count)
        return r

    def _graph(
        self, gid: int, g: dict[str, Any], kernels: _Kernels, amap: AddressMap, foreign: list[tuple[int, int]]
    ) -> Graph:
        name = _get(g, "name", f"graphs[{gid}]")
        f = f"graphs[{name}]"
        nodes = []
        for n in _get(g, "nodes", f):
            nid = _int(_get(n, "id", f), f"{f}.nodes.id")
            nf = f"{f}.nodes[{nid}]"
            if "kernel" in n:
                op: Any = self._kernel_node(name, nid, n["kernel"], kernels, amap, foreign)
            elif "memcpy" in n:
                m = n["memcpy"]
                count = _int(m["byte_count"], f"{nf}.byte_count")
                op = MemcpyNode(
                    self._range(name, f"node {nid} memcpy src", m["src"], count, amap),
                    self._range(name, f"node {nid} memcpy dst", m["dst"], count, amap),
                    count,
                )
            elif "memset" in n:
                m = n["memset"]
                es, w = _int(m["element_size"], nf), _int(m["width"], nf)
                h, pitch = _int(m.get("height", 1), nf), _int(m.get("pitch", 0), nf)
                extent = pitch * (h - 1) + w * es
                op = MemsetNode(
                    self._range(name, f"node {nid} memset dst", m["dst"], extent, amap),
                    _int(m["value"], nf),
                    es,
                    w,
                    h,
                    pitch,
                )
            elif "event_record" in n:
                op = EventRecordNode(_int(n["event_record"], nf))
            elif "event_wait" in n:
                op = EventWaitNode(_int(n["event_wait"], nf))
            elif "empty" in n:
                op = EmptyNode()
            else:
                raise RecordingError(nf, f"unknown node kind among {sorted(n)}")
            nodes.append(Node(nid, op))
        bindings = []
        for b in _get(g, "bindings", f):
            value = _enum(ValueKind, _get(b, "value", f), f"{f}.bindings.value")
            dtype = _enum(Dtype, _get(b, "dtype", f), f"{f}.bindings.dtype")
            shape = tuple(_int(x, f"{f}.bindings.shape") for x in _get(b, "shape", f))
            # Explicit for request state (which a value kind alone does not decide); else inferred.
            if "direction" in b:
                direction = _enum(Direction, b["direction"], f"{f}.bindings.direction")
            else:
                direction = Direction.OUTPUT if value is ValueKind.COMPLETION_RECORDS else Direction.INPUT
            size = dtype.size * math.prod(shape)
            view = self._range(name, f"binding {value.name}", _get(b, "address", f), size, amap)
            bindings.append(ValueBinding(value, direction, view, dtype, shape))
        c = _get(g, "capacity", f)
        op_name = g.get("maintenance_op")
        return Graph(
            id=gid,
            name=name,
            kind=_enum(GraphKind, _get(g, "kind", f), f"{f}.kind"),
            capacity=GraphCapacity(
                *(
                    _int(c.get(k, 0), f"{f}.capacity.{k}")
                    for k in ("request_count", "token_capacity", "proposal_depth", "patch_capacity")
                )
            ),
            nodes=tuple(nodes),
            edges=tuple(_edge(e, f"{f}.edges[{i}]") for i, e in enumerate(g.get("edges", []))),
            bindings=tuple(bindings),
            maintenance_op=_enum(MaintenanceOp, op_name, f"{f}.maintenance_op") if op_name else None,
            event_count=_int(g.get("event_count", 0), f"{f}.event_count"),
            completion_token_capacity=_int(g.get("completion_token_capacity", 8), f),
            continuation_rows_per_request=_int(g.get("continuation_rows_per_request", 1), f),
        )

    # -- the rest --------------------------------------------------------------------------
    def _scheme(self) -> CacheScheme:
        s = _get(self.r, "cache_scheme", "recording")
        return CacheScheme(
            page_tokens=_int(s["page_tokens"], "cache_scheme.page_tokens"),
            page_regions=tuple(
                PageRegion(r["name"], _int(r["bytes_per_page"], "page_regions")) for r in s["page_regions"]
            ),
            continuation_row_bytes=_int(s.get("continuation_row_bytes", 0), "cache_scheme.continuation_row_bytes"),
            row_layout=tuple(
                RowRegion(
                    r["name"],
                    _enum(RowRegionKind, r["kind"], "row_layout.kind"),
                    _int(r["offset"], "row_layout"),
                    _int(r["byte_size"], "row_layout"),
                )
                for r in s.get("row_layout", [])
            ),
            live_rows_per_slot=_int(s.get("live_rows_per_slot", 1), "cache_scheme.live_rows_per_slot"),
            verification_width=_int(s.get("verification_width", 1), "cache_scheme.verification_width"),
            padding_slot=_int(s.get("padding_slot", -1), "cache_scheme.padding_slot"),
        )

    def _capacities(self) -> Capacities:
        c = _get(self.r, "capacities", "recording")

        def ints(k: str) -> tuple[int, ...]:
            return tuple(_int(x, f"capacities.{k}") for x in c.get(k, []))

        return Capacities(
            context_limit=_int(c["context_limit"], "capacities.context_limit"),
            decode_request_buckets=ints("decode_request_buckets"),
            prefill_chunk_capacities=ints("prefill_chunk_capacities"),
            request_slots=_int(c["request_slots"], "capacities.request_slots"),
            snapshot_rows=_int(c.get("snapshot_rows", 0), "capacities.snapshot_rows"),
            max_kv_pages=_int(c["max_kv_pages"], "capacities.max_kv_pages"),
            vocab_size=_int(c["vocab_size"], "capacities.vocab_size"),
            completion_record_header_words=_int(c["completion_record_header_words"], "capacities"),
            image_patch_buckets=ints("image_patch_buckets"),
        )

    def _frontend(self, core: CoreDirectory) -> Frontend:
        fe = _get(self.r, "frontend", "recording")
        assets = {}
        for key, dest in (("tokenizer", "frontend/tokenizer.json"), ("chat_template", "frontend/chat_template.jinja")):
            src = self.base / _get(fe, key, "frontend")
            if not src.is_file():
                raise RecordingError(f"frontend.{key}", f"{src} is missing")
            assets[key] = AssetFile(dest, core.add_file(dest, src.read_bytes()))
        return Frontend(
            tokenizer=assets["tokenizer"],
            chat_template=assets["chat_template"],
            eos_token_ids=tuple(_int(t, "frontend.eos_token_ids") for t in fe["eos_token_ids"]),
            sampling=_sampling(_get(fe, "sampling", "frontend"), "frontend.sampling"),
            reasoning_parser=_enum(ReasoningParser, fe.get("reasoning_parser", "none"), "frontend.reasoning_parser"),
            tool_parser=_enum(ToolParser, fe.get("tool_parser", "none"), "frontend.tool_parser"),
            served_model_name=_get(fe, "served_model_name", "frontend"),
        )

    def _identity(self, tensors: dict[str, st.TensorBytes]) -> Identity:
        i = _get(self.r, "identity", "recording")
        d = _get(i, "device", "identity")
        headers = json.dumps({n: [t.dtype.name, list(t.shape)] for n, t in sorted(tensors.items())})
        fingerprint = sha256_hex((headers + json.dumps(i.get("model_config", {}), sort_keys=True)).encode())
        return Identity(
            model_fingerprint=fingerprint,
            device=PreparingDevice(
                d["name"],
                _int(d["compute_capability"][0], "cc"),
                _int(d["compute_capability"][1], "cc"),
                _int(d["sm_count"], "sm_count"),
                _int(d["total_memory_bytes"], "total_memory"),
            ),
            cuda_driver_version=_int(i["cuda_driver_version"], "identity.cuda_driver_version"),
            cuda_toolkit_version=_int(i["cuda_toolkit_version"], "identity.cuda_toolkit_version"),
            producer=str(i.get("producer", "ignition dry-run exporter")),
        )

    def export(self, out: Path) -> RuntimeCore:
        """Resolves everything first; only then writes files. Raises ExportError on any defect."""
        arena = self._arena()
        tensors: dict[str, st.TensorBytes] = {}
        self.progress("buffers: resolving allocations")
        buffers = self._buffers(tensors)
        amap = AddressMap(arena, buffers)
        foreign = [
            (_int(lo, "foreign_ranges"), _int(hi, "foreign_ranges")) for lo, hi in self.r.get("foreign_ranges", [])
        ]
        staging = CoreDirectory(out)
        kernels = self._kernels(staging)
        graphs = []
        for gi, g in enumerate(_get(self.r, "graphs", "recording")):
            graph = self._graph(gi + 1, g, kernels, amap, foreign)
            relocs = sum(len(n.op.relocations) for n in graph.nodes if isinstance(n.op, KernelNode))
            self.progress(f"graph {graph.name}: {len(graph.nodes)} nodes, {relocs} pointer words relocated")
            graphs.append(graph)
        used = {n.op.kernel_id for g in graphs for n in g.nodes if isinstance(n.op, KernelNode)}
        images = sorted({k.id: k for k in kernels.images.values() if k.id in used}.values(), key=lambda k: k.id)
        payload = st.serialize(tensors, {"producer": "ignition"})
        digest = staging.add_file(PAYLOAD_FILE, payload)
        self.progress(f"payload: {len(tensors)} tensors, {len(payload)} bytes")
        core = RuntimeCore(
            identity=self._identity(tensors),
            arena=arena,
            buffers=tuple(buffers),
            payload_files=(PayloadFile(PAYLOAD_FILE, digest, len(payload)),),
            kernels=tuple(images),
            graphs=tuple(graphs),
            cache_scheme=self._scheme(),
            capacities=self._capacities(),
            frontend=self._frontend(staging),
        )
        staging.write_manifest(core)
        self.progress(f"core written to {out}")
        return core


def export_recording(recording_path: Path, out: Path, progress: Progress | None = None) -> RuntimeCore:
    try:
        recording = json.loads(recording_path.read_text())
    except (OSError, ValueError) as e:
        raise RecordingError(str(recording_path), f"cannot read: {e}") from e
    return RecordingExporter(recording, recording_path.parent, progress).export(out)
