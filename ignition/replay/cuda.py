"""A runtime core on the device through the CUDA driver API (ctypes), with no torch: the same
steps as Helios' loader (crates/helios-replay/src/cuda.rs), so its replays are the Python floor
and the numerical reference for the Rust replay of the same core.

Load: reserve the arena at its recorded base (whole GiB, so the hint is honoured), map and
open it, upload payloads and zero fills, load every kernel image with its function attributes,
rebuild every graph node by node (relocations written for the actual base, launch attributes
re-applied), instantiate and upload. Teardown drains the stream before anything is destroyed.
"""

from __future__ import annotations

import ctypes as C
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ignition.capture.driver import (
    CU_MEMORYTYPE_DEVICE,
    FUNC_ATTR_MAX_DYNAMIC_SHARED,
    KernelNodeParams,
    Memcpy3D,
    MemsetNodeParams,
    ParamBuffer,
    programmatic_edge_data,
)
from ignition.replay.core import CoreFiles, CoreReadError, GraphInfo, topological

GIB = 1 << 30
u32, u64, sz, vp = C.c_uint, C.c_uint64, C.c_size_t, C.c_void_p

# Driver enums used here (cuda.h).
CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 1, 1, 3
CU_EVENT_DISABLE_TIMING = 2
CU_STREAM_NON_BLOCKING = 1
# How `DeviceCore` rebuilds programmatic edges.
EDGE_MODES = ("after", "inline", "full", "serialized")
# CUlaunchAttributeID: what a programmatic dependent launch sets on its stream launch.
PROGRAMMATIC_STREAM_SERIALIZATION = 6
LAUNCH_ATTRIBUTE_IDS = {
    "cooperative": 2,
    "cluster_dim": 4,
    "cluster_scheduling_policy": 5,
    "priority": 8,
    "mem_sync_domain": 10,
}


class MemLocation(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class AllocFlags(C.Structure):
    _fields_ = [
        ("compressionType", C.c_ubyte),
        ("gpuDirectRDMACapable", C.c_ubyte),
        ("usage", C.c_ushort),
        ("reserved", C.c_ubyte * 4),
    ]


class AllocProp(C.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", C.c_int),
        ("requestedHandleTypes", C.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", vp),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(C.Structure):  # CUmemAccessDesc
    _fields_ = [("location", MemLocation), ("flags", C.c_int)]


class CudaError(Exception):
    """A driver call failed: the call and the driver's error name."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name


class NoDriverError(Exception):
    """libcuda.so.1 is not loadable on this machine."""


def _driver() -> C.CDLL:
    try:
        return C.CDLL("libcuda.so.1")
    except OSError as e:
        raise NoDriverError(f"the CUDA driver (libcuda.so.1) is not available: {e}") from e


@dataclass
class LoadReport:
    recorded_base: int = 0
    base: int = 0
    arena_bytes: int = 0
    uploaded_bytes: int = 0
    kernels: int = 0
    graphs: int = 0
    nodes: int = 0
    programmatic_edges: int = 0
    relocated_words: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def fixed_address_honoured(self) -> bool:
        return self.base == self.recorded_base


class DeviceCore:
    """One core mapped, uploaded and instantiated on device 0; `launch(graph)` enqueues a replay.
    `edges` (`EDGE_MODES`), how programmatic edges are rebuilt: "after" every node exists (as
    Helios does); "inline", each right after its dependent node, as stream capture builds a graph
    (the same graph: a comparison of whether the order of construction changes how it runs);
    "full", as full dependencies (the same results, since each dependent kernel waits for its
    predecessor: a comparison of the launch overlap they buy); "serialized", as "after" with
    programmatic stream serialization also set on each kernel a programmatic edge ends at (the
    attribute its captured launch carried; a comparison: the driver documents it for stream
    launches, and a refusal on a graph node fails the load with the driver's error)."""

    def __init__(
        self,
        core: CoreFiles,
        device: int = 0,
        relocate: bool = False,
        progress: Callable[[str], None] = lambda _m: None,
        edges: str = "after",
    ) -> None:
        if edges not in EDGE_MODES:
            raise ValueError(f"edges {edges!r}: expected one of {EDGE_MODES}")
        self.core = core
        self.edges = edges
        self.lib = _driver()
        self.report = LoadReport()
        self.modules: list[int] = []
        self.execs: dict[int, int] = {}
        self.graph_handles: list[int] = []
        self.events: list[int] = []
        self.base = 0
        self._handle: C.c_uint64 | None = None
        self.stream = vp()
        self._pinned, self._pinned_len = vp(), 0
        t = time.perf_counter()
        self.call("cuInit", 0)
        dev = C.c_int()
        self.call("cuDeviceGet", C.byref(dev), device)
        self.device = dev
        self.ctx = vp()
        self.call("cuDevicePrimaryCtxRetain", C.byref(self.ctx), dev)
        self.call("cuCtxSetCurrent", self.ctx)
        self.call("cuStreamCreate", C.byref(self.stream), u32(CU_STREAM_NON_BLOCKING))
        self._map_arena(device, relocate)
        self.report.seconds["map"] = time.perf_counter() - t
        t = time.perf_counter()
        self._upload(progress)
        self.report.seconds["upload"] = time.perf_counter() - t
        t = time.perf_counter()
        functions = self._load_kernels()
        self.functions = functions
        self.report.seconds["kernels"] = time.perf_counter() - t
        t = time.perf_counter()
        for i, g in enumerate(core.graphs):
            self._build(g, functions)
            if (i + 1) % 8 == 0 or i + 1 == len(core.graphs):
                progress(f"graphs {i + 1}/{len(core.graphs)}")
        self.call("cuStreamSynchronize", self.stream)
        self.report.seconds["graphs"] = time.perf_counter() - t

    # -- driver ---------------------------------------------------------------------------------
    def call(self, name: str, *args: Any) -> None:
        r = getattr(self.lib, name)(*args)
        if r != 0:
            s = C.c_char_p()
            self.lib.cuGetErrorName(r, C.byref(s))
            raise CudaError(name, r, (s.value or b"?").decode())

    def _map_arena(self, device: int, relocate: bool) -> None:
        arena = self.core.m.arena
        prop = AllocProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type, prop.location.id = CU_MEM_LOCATION_TYPE_DEVICE, device
        gran = sz()
        self.call("cuMemGetAllocationGranularity", C.byref(gran), C.byref(prop), 0)
        size = -(-arena.byte_size // gran.value) * gran.value
        reserve = -(-size // GIB) * GIB
        ptr = u64()
        hint = 0 if relocate else arena.base_address
        self.call("cuMemAddressReserve", C.byref(ptr), sz(reserve), sz(0), u64(hint), u64(0))
        if relocate and ptr.value == arena.base_address:
            other = u64()
            self.call("cuMemAddressReserve", C.byref(other), sz(reserve), sz(0), u64(0), u64(0))
            self.call("cuMemAddressFree", ptr, sz(reserve))
            ptr = other
        self.base, self._reserved, self._mapped = ptr.value, reserve, size
        h = u64()
        self.call("cuMemCreate", C.byref(h), sz(size), C.byref(prop), u64(0))
        self._handle = h
        self.call("cuMemMap", u64(self.base), sz(size), sz(0), h, u64(0))
        acc = AccessDesc()
        acc.location.type, acc.location.id, acc.flags = (
            CU_MEM_LOCATION_TYPE_DEVICE,
            device,
            CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        )
        self.call("cuMemSetAccess", u64(self.base), sz(size), C.byref(acc), sz(1))
        self.report.recorded_base, self.report.base, self.report.arena_bytes = arena.base_address, self.base, size

    def _upload(self, progress: Callable[[str], None]) -> None:
        total = sum(b.byte_size for b in self.core.m.buffers if b.WhichOneof("payload") == "safetensors")
        done = 0
        next_mark = 0.0
        for b in self.core.m.buffers:
            addr = self.base + b.offset
            kind = b.WhichOneof("payload")
            if kind == "safetensors":
                data = self.core.payload(b)
                self.call("cuMemcpyHtoD_v2", u64(addr), C.c_char_p(data), sz(len(data)))
                done += len(data)
                self.report.uploaded_bytes += len(data)
                if total and done / total >= next_mark:
                    progress(f"payloads {done / 2**20:.0f}/{total / 2**20:.0f} MiB")
                    next_mark += 0.25
            elif kind == "zero_fill":
                self.call("cuMemsetD8_v2", u64(addr), C.c_ubyte(0), sz(b.byte_size))
        self.call("cuCtxSynchronize")

    def _load_kernels(self) -> dict[int, int]:
        functions: dict[int, int] = {}
        for k in self.core.m.kernels:
            image = C.create_string_buffer(self.core.kernel_image(k))
            module = vp()
            self.call("cuModuleLoadData", C.byref(module), image)
            self.modules.append(module.value or 0)
            f = vp()
            self.call("cuModuleGetFunction", C.byref(f), module, k.function_name.encode())
            if k.max_dynamic_shared_memory:
                self.call(
                    "cuFuncSetAttribute", f, C.c_int(FUNC_ATTR_MAX_DYNAMIC_SHARED), C.c_int(k.max_dynamic_shared_memory)
                )
            functions[k.id] = f.value or 0
        self.report.kernels = len(functions)
        return functions

    def _build(self, g: GraphInfo, functions: dict[int, int]) -> None:
        msg = g.message
        graph = vp()
        self.call("cuGraphCreate", C.byref(graph), u32(0))
        self.graph_handles.append(graph.value or 0)
        events = []
        for _ in range(msg.event_count):
            e = vp()
            self.call("cuEventCreate", C.byref(e), u32(CU_EVENT_DISABLE_TIMING))
            events.append(e.value)
            self.events.append(e.value or 0)
        index = {n.id: i for i, n in enumerate(msg.nodes)}
        # Full dependencies go in with their node; programmatic ones (ABI 4) once both ends exist.
        preds: dict[int, list[int]] = {}
        programmatic: list[tuple[int, int, int]] = []
        for e in msg.edges:
            src, dst = index[getattr(e, "from")], index[e.to]
            if e.dependency not in (0, 1, 2):  # full, programmatic, launch order (the kernel node port)
                raise CoreReadError(f"graph {g.name}", f"edge {src}->{dst}: unknown dependency {e.dependency}")
            if e.dependency and self.edges != "full":
                programmatic.append((src, dst, e.dependency))
            else:
                preds.setdefault(dst, []).append(src)
        handles: dict[int, int] = {}
        for i in topological(msg):
            n = msg.nodes[i]
            deps = [handles[p] for p in preds.get(i, [])]
            deparr = (vp * max(1, len(deps)))(*deps)
            nd = sz(len(deps))
            h = vp()
            op = n.WhichOneof("op")
            if op == "kernel":
                k = n.kernel
                buf = ParamBuffer(self.core.kernel_params(n, self.base))
                p = KernelNodeParams()
                p.func = functions[k.kernel_id]
                p.gx, p.gy, p.gz = k.grid.x, k.grid.y, k.grid.z
                p.bx, p.by, p.bz = k.block.x, k.block.y, k.block.z
                p.smem = k.dynamic_shared_memory
                p.extra = C.addressof(buf.extra)
                self.call("cuGraphAddKernelNode_v2", C.byref(h), graph, deparr, nd, C.byref(p))
                for a in k.launch_attributes:
                    self._launch_attribute(h, a)
                self.report.relocated_words += len(k.relocations)
            elif op == "memcpy":
                c = n.memcpy
                m = Memcpy3D()
                m.srcMemoryType = m.dstMemoryType = CU_MEMORYTYPE_DEVICE
                m.srcDevice = self.core.address(self.base, c.src.buffer_id, c.src.offset)
                m.dstDevice = self.core.address(self.base, c.dst.buffer_id, c.dst.offset)
                m.WidthInBytes, m.Height, m.Depth = c.byte_count, 1, 1
                self.call("cuGraphAddMemcpyNode", C.byref(h), graph, deparr, nd, C.byref(m), self.ctx)
            elif op == "memset":
                s = n.memset
                p2 = MemsetNodeParams(
                    self.core.address(self.base, s.dst.buffer_id, s.dst.offset),
                    s.pitch,
                    s.value,
                    s.element_size,
                    s.width,
                    s.height,
                )
                self.call("cuGraphAddMemsetNode", C.byref(h), graph, deparr, nd, C.byref(p2), self.ctx)
            elif op == "empty":
                self.call("cuGraphAddEmptyNode", C.byref(h), graph, deparr, nd)
            elif op in ("event_record", "event_wait"):
                ev = getattr(n, op).event
                if ev >= len(events):
                    raise CudaError(f"graph {g.name} node {n.id}", -1, f"event {ev} of {len(events)}")
                fn = "cuGraphAddEventRecordNode" if op == "event_record" else "cuGraphAddEventWaitNode"
                self.call(fn, C.byref(h), graph, deparr, nd, vp(events[ev]))
            else:
                raise CudaError(f"graph {g.name} node {n.id}", -1, f"node kind {op}")
            handles[i] = h.value or 0
            if self.edges == "inline":  # its predecessors exist: the order follows every edge
                self._add_programmatic(g.name, graph, handles, [e for e in programmatic if e[1] == i])
        if self.edges in ("after", "serialized"):
            self._add_programmatic(g.name, graph, handles, programmatic)
        if self.edges == "serialized":
            one = (C.c_ubyte * 64)(1)
            for dst in sorted({e[1] for e in programmatic}):
                self.call(
                    "cuGraphKernelNodeSetAttribute", vp(handles[dst]), C.c_int(PROGRAMMATIC_STREAM_SERIALIZATION), one
                )
        exe = vp()
        self.call("cuGraphInstantiateWithFlags", C.byref(exe), graph, u64(0))
        self.call("cuGraphUpload", exe, self.stream)
        self.execs[g.id] = exe.value or 0
        self.report.graphs += 1
        self.report.nodes += len(msg.nodes)

    def _add_programmatic(
        self, name: str, graph: Any, handles: dict[int, int], edges: list[tuple[int, int, int]]
    ) -> None:
        if edges and not hasattr(self.lib, "cuGraphAddDependencies_v2"):
            raise CudaError(f"graph {name}", -1, "programmatic edges need cuGraphAddDependencies_v2 (CUDA 12.3+)")
        for src, dst, port in edges:
            a, b = (vp * 1)(handles[src]), (vp * 1)(handles[dst])
            self.call("cuGraphAddDependencies_v2", graph, a, b, programmatic_edge_data(port), sz(1))
            self.report.programmatic_edges += 1

    def _launch_attribute(self, node: Any, a: Any) -> None:
        which = a.WhichOneof("value")
        value = (C.c_ubyte * 64)()
        if which == "cluster_dim":
            C.memmove(value, (u32 * 3)(a.cluster_dim.x, a.cluster_dim.y, a.cluster_dim.z), 12)
        else:
            C.memmove(value, C.byref(C.c_int(int(getattr(a, which)))), 4)
        self.call("cuGraphKernelNodeSetAttribute", node, C.c_int(LAUNCH_ATTRIBUTE_IDS[which]), value)

    # -- execution ------------------------------------------------------------------------------
    def pinned(self, length: int) -> int:
        """A reusable pinned host region of at least `length` bytes (grown, never per step)."""
        if length > self._pinned_len:
            if self._pinned.value:
                self.call("cuMemFreeHost", self._pinned)
            self.call("cuMemAllocHost_v2", C.byref(self._pinned), sz(length))
            self._pinned_len = length
        return self._pinned.value or 0

    def write_async(self, address: int, host: int, length: int) -> None:
        self.call("cuMemcpyHtoDAsync_v2", u64(address), vp(host), sz(length), self.stream)

    def read_async(self, host: int, address: int, length: int) -> None:
        self.call("cuMemcpyDtoHAsync_v2", vp(host), u64(address), sz(length), self.stream)

    def zero_async(self, address: int, length: int) -> None:
        self.call("cuMemsetD8Async", u64(address), C.c_ubyte(0), sz(length), self.stream)

    def launch(self, graph_id: int) -> None:
        self.call("cuGraphLaunch", vp(self.execs[graph_id]), self.stream)

    def synchronize(self) -> None:
        self.call("cuStreamSynchronize", self.stream)

    def read(self, address: int, length: int) -> bytes:
        out = C.create_string_buffer(length)
        self.synchronize()
        self.call("cuMemcpyDtoH_v2", out, u64(address), sz(length))
        return out.raw

    def close(self) -> None:
        """Drains, then destroys graphs, events, modules and memory (in that order)."""
        lib = self.lib
        if self.stream.value:
            lib.cuStreamSynchronize(self.stream)
        for exe in self.execs.values():
            lib.cuGraphExecDestroy(vp(exe))
        for g in self.graph_handles:
            lib.cuGraphDestroy(vp(g))
        for e in self.events:
            lib.cuEventDestroy_v2(vp(e))
        for m in self.modules:
            lib.cuModuleUnload(vp(m))
        self.execs, self.graph_handles, self.events, self.modules = {}, [], [], []
        if self._handle is not None:
            lib.cuMemUnmap(u64(self.base), sz(self._mapped))
            lib.cuMemRelease(self._handle)
            lib.cuMemAddressFree(u64(self.base), sz(self._reserved))
            self._handle = None
        if self._pinned.value:
            lib.cuMemFreeHost(self._pinned)
            self._pinned = vp()
        if self.stream.value:
            lib.cuStreamDestroy_v2(self.stream)
            self.stream = vp()
        lib.cuDevicePrimaryCtxRelease_v2(self.device)
