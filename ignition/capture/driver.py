"""The CUDA driver calls capture needs, through ctypes (graph walking, function introspection).

Only what the recorder reads: nodes, edges, node kinds, kernel node parameters (exact parameter
bytes through cuFuncGetParamInfo's layout), function names and attributes, memcpy and memset
node parameters. Struct layouts follow cuda.h (CUDA 12/13).
"""

from __future__ import annotations

import ctypes as C
from dataclasses import dataclass

_lib: C.CDLL | None = None
u32, u64, sz, vp = C.c_uint, C.c_uint64, C.c_size_t, C.c_void_p


def lib() -> C.CDLL:
    global _lib
    if _lib is None:
        _lib = C.CDLL("libcuda.so.1")
    return _lib


class DriverError(RuntimeError):
    pass


def call(name: str, *args: object) -> None:
    r = getattr(lib(), name)(*args)
    if r != 0:
        s = C.c_char_p()
        lib().cuGetErrorName(r, C.byref(s))
        raise DriverError(f"{name} -> {r} {(s.value or b'?').decode()}")


# The node parameter structs are shared with the torch-free core replay (ignition.replay.cuda).
class KernelNodeParams(C.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [
        ("func", vp),
        ("gx", u32),
        ("gy", u32),
        ("gz", u32),
        ("bx", u32),
        ("by", u32),
        ("bz", u32),
        ("smem", u32),
        ("kernelParams", vp),
        ("extra", vp),
        ("kern", vp),
        ("ctx", vp),
    ]


# `extra` entries of cuLaunchKernel and kernel node parameters: the parameters as one buffer.
LAUNCH_PARAM_END, LAUNCH_PARAM_BUFFER_POINTER, LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2


class ParamBuffer:
    """A kernel's parameter bytes in the `extra` form cuLaunchKernel and kernel nodes take; it
    owns the memory `extra` points into, so it must outlive the launch or the node's creation."""

    def __init__(self, param_bytes: bytes) -> None:
        self.params = C.create_string_buffer(param_bytes, len(param_bytes))
        self.size = sz(len(param_bytes))
        self.extra = (vp * 5)(
            LAUNCH_PARAM_BUFFER_POINTER,
            C.addressof(self.params),
            LAUNCH_PARAM_BUFFER_SIZE,
            C.addressof(self.size),
            LAUNCH_PARAM_END,
        )


def programmatic_edge_data(port: int) -> C.Array[C.c_ubyte]:
    """CUgraphEdgeData of a programmatic edge from kernel node port `port` (1 programmatic, 2
    launch order: the manifest's `EdgeDependency` value), type CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC."""
    return (C.c_ubyte * 8)(port, 0, 1)


class Memcpy3D(C.Structure):  # CUDA_MEMCPY3D
    _fields_ = [
        ("srcXInBytes", sz),
        ("srcY", sz),
        ("srcZ", sz),
        ("srcLOD", sz),
        ("srcMemoryType", C.c_int),
        ("srcHost", vp),
        ("srcDevice", u64),
        ("srcArray", vp),
        ("reserved0", vp),
        ("srcPitch", sz),
        ("srcHeight", sz),
        ("dstXInBytes", sz),
        ("dstY", sz),
        ("dstZ", sz),
        ("dstLOD", sz),
        ("dstMemoryType", C.c_int),
        ("dstHost", vp),
        ("dstDevice", u64),
        ("dstArray", vp),
        ("reserved1", vp),
        ("dstPitch", sz),
        ("dstHeight", sz),
        ("WidthInBytes", sz),
        ("Height", sz),
        ("Depth", sz),
    ]


class MemsetNodeParams(C.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", u64), ("pitch", sz), ("value", u32), ("elementSize", u32), ("width", sz), ("height", sz)]


NODE_KINDS = {
    0: "kernel",
    1: "memcpy",
    2: "memset",
    3: "host",
    4: "graph",
    5: "empty",
    6: "event_wait",
    7: "event_record",
    8: "ext_sema_signal",
    9: "ext_sema_wait",
    10: "mem_alloc",
    11: "mem_free",
    12: "batch_mem_op",
    13: "conditional",
}
CU_MEMORYTYPE_DEVICE = 2
FUNC_ATTR_MAX_DYNAMIC_SHARED = 8
FUNC_ATTR_SHARED_SIZE = 1
FUNC_ATTR_NUM_REGS = 4


def graph_nodes(graph: int) -> list[int]:
    n = sz(0)
    call("cuGraphGetNodes", vp(graph), None, C.byref(n))
    arr = (vp * n.value)()
    call("cuGraphGetNodes", vp(graph), arr, C.byref(n))
    return [int(x or 0) for x in arr]


class _EdgeData(C.Structure):
    """CUgraphEdgeData (CUDA 12.3+)."""

    _fields_ = (("from_port", C.c_ubyte), ("to_port", C.c_ubyte), ("type", C.c_ubyte), ("reserved", C.c_ubyte * 5))


# (CUgraphDependencyType, from port) -> the manifest's `EdgeDependency` name: a full dependency,
# or a programmatic one on CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC / _LAUNCH_ORDER.
EDGE_KINDS = {(0, 0): "full", (1, 1): "programmatic", (1, 2): "launch_order"}
# A programmatic kind's kernel node port (`programmatic_edge_data`).
EDGE_PORTS = {kind: port for (kind_type, port), kind in EDGE_KINDS.items() if kind_type == 1}


def graph_edges(graph: int) -> list[tuple[int, int, str]]:
    """Every edge of `graph` as (from, to, dependency): what `EDGE_KINDS` names. A driver
    without edge data (before CUDA 12.3) reports full dependencies only."""
    n = sz(0)
    f = getattr(lib(), "cuGraphGetEdges_v2", None)
    if f is None:
        call("cuGraphGetEdges", vp(graph), None, None, C.byref(n))
        a, b = (vp * n.value)(), (vp * n.value)()
        call("cuGraphGetEdges", vp(graph), a, b, C.byref(n))
        return [(int(x), int(y), "full") for x, y in zip(a, b, strict=True)]
    call("cuGraphGetEdges_v2", vp(graph), None, None, None, C.byref(n))
    a, b, d = (vp * n.value)(), (vp * n.value)(), (_EdgeData * n.value)()
    call("cuGraphGetEdges_v2", vp(graph), a, b, d, C.byref(n))
    edges = []
    for x, y, e in zip(a, b, d, strict=True):
        kind = EDGE_KINDS.get((e.type, e.from_port)) if e.to_port == 0 else None
        if kind is None:
            raise DriverError(f"cuGraphGetEdges_v2: edge type {e.type} ports {e.from_port}->{e.to_port} not exportable")
        edges.append((int(x), int(y), kind))
    return edges


def node_kind(node: int) -> str:
    t = C.c_int()
    call("cuGraphNodeGetType", vp(node), C.byref(t))
    return NODE_KINDS.get(t.value, f"unknown_{t.value}")


@dataclass
class KernelLaunch:
    function: int  # CUfunction handle (0 when only a CUkernel was recorded)
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_shared_memory: int
    params: list[tuple[int, int]]  # cuFuncGetParamInfo (offset, size)
    param_bytes: bytes  # the exact parameter buffer, laid out by `params`


def function_name(func: int) -> str:
    s = C.c_char_p()
    call("cuFuncGetName", C.byref(s), vp(func))
    return (s.value or b"").decode()


def function_attribute(func: int, attr: int) -> int:
    v = C.c_int()
    call("cuFuncGetAttribute", C.byref(v), C.c_int(attr), vp(func))
    return v.value


def param_layout(func: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    while True:
        off, size = sz(), sz()
        if lib().cuFuncGetParamInfo(vp(func), sz(len(out)), C.byref(off), C.byref(size)) != 0:
            return out
        out.append((off.value, size.value))


def kernel_launch(node: int) -> KernelLaunch:
    p = KernelNodeParams()
    call("cuGraphKernelNodeGetParams_v2", vp(node), C.byref(p))
    func = int(p.func or 0)
    if not func and p.kern:
        # A CUkernel (runtime-API launch of a library kernel): name it through its function.
        f = vp()
        if lib().cuKernelGetFunction(C.byref(f), vp(p.kern)) == 0 and f.value:
            func = int(f.value)
    name = function_name(func) if func else "<unnamed kernel>"
    layout = param_layout(func) if func else []
    end = max((o + s for o, s in layout), default=0)
    buf = bytearray(end)
    if layout:
        if not p.kernelParams:
            raise DriverError(f"kernel {name}: parameters passed through 'extra', not supported")
        ptrs = (vp * len(layout)).from_address(p.kernelParams)
        for (off, size), ptr in zip(layout, ptrs, strict=True):
            buf[off : off + size] = C.string_at(ptr, size)
    return KernelLaunch(func, name, (p.gx, p.gy, p.gz), (p.bx, p.by, p.bz), p.smem, layout, bytes(buf))


@dataclass
class Copy:
    src: int
    dst: int
    byte_count: int


def memcpy(node: int) -> Copy:
    m = Memcpy3D()
    call("cuGraphMemcpyNodeGetParams", vp(node), C.byref(m))
    if m.srcMemoryType != CU_MEMORYTYPE_DEVICE or m.dstMemoryType != CU_MEMORYTYPE_DEVICE:
        raise DriverError(f"memcpy node with memory types {m.srcMemoryType}->{m.dstMemoryType}: only D2D is exported")
    if max(m.Height, 1) != 1 or max(m.Depth, 1) != 1:
        raise DriverError(f"memcpy node of {m.Height}x{m.Depth} rows: only 1-D copies are exported")
    src = int(m.srcDevice) + m.srcXInBytes + m.srcY * m.srcPitch
    dst = int(m.dstDevice) + m.dstXInBytes + m.dstY * m.dstPitch
    return Copy(src, dst, int(m.WidthInBytes))


@dataclass
class Fill:
    dst: int
    value: int
    element_size: int
    width: int
    height: int
    pitch: int


def memset(node: int) -> Fill:
    m = MemsetNodeParams()
    call("cuGraphMemsetNodeGetParams", vp(node), C.byref(m))
    return Fill(int(m.dst), int(m.value), int(m.elementSize), int(m.width), int(max(m.height, 1)), int(m.pitch))


def driver_version() -> int:
    v = C.c_int()
    call("cuDriverGetVersion", C.byref(v))
    return v.value


def copy_dtoh(address: int, size: int) -> bytes:
    buf = (C.c_ubyte * size)()
    call("cuMemcpyDtoH_v2", buf, u64(address), sz(size))
    return bytes(buf)
