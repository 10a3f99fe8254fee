"""GPU recorder: compile, capture on the fixed-address arena, walk the raw graphs, write a recording.

The recording is the format the CPU exporter consumes (`flare-recorded-graphs/1`, see
tests/fixtures/ignition/): allocations tile the arena (named tensors, then the remaining blocks
of every segment), every kernel's exact image comes from Triton's load hook keyed by the loaded
CUfunction (never by name), parameter bytes are copied through cuFuncGetParamInfo's layout,
memcpy/memset nodes and edges as captured. A kernel with no recorded image is written with
origin "library" so the exporter rejects it with `LibraryKernelError` naming it.

Beside the recording it writes, per graph, the raw bytes torch's replay consumed and produced
(`io/<graph>/in.<buffer>.bin`, `io/<graph>/out.<buffer>.bin`) for the bitwise comparison.
"""

from __future__ import annotations

import bisect
import ctypes as C
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ignition.capture import driver as D
from ignition.capture import fallback
from ignition.capture.arena import DEFAULT_BASE, FixedArena, Segment, build_allocator
from ignition.capture.gemv import time_graphs
from ignition.capture.paged import HEADER_WORDS
from ignition.capture.program import VALUE_DTYPES, GraphSpec, Program
from ignition.core import safetensors_io as st
from ignition.core.manifest import Dtype

RECORDING_FORMAT = "flare-recorded-graphs/1"
ARENA_ALIGNMENT = 1 << 16
TORCH_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "bool",
}
# State tensor -> (role, dtype in the manifest, init).
STATE_ROLES = {
    "kv_pages": ("kv_pages", "bf16", "zero"),
    "continuation_rows": ("continuation_rows", "bf16", "zero"),
    "penalty_histogram": ("request_state", "i32", "zero"),
    "pending_tokens": ("request_state", "i32", "zero"),
    "completion_records": ("completion_records", "u32", "zero"),
    "staging": ("staging_inputs", "u8", "zero"),
}
# How each sampling graph binds the pending tokens: all store what they sample, decode also reads.
PENDING_DIRECTION = {
    "decode": "state_read_write",
    "speculative": "state_read_write",
    "prefill": "state_write",
    "resume_sampling": "state_write",
}


# -- kernel images ---------------------------------------------------------------------------
class ImageHook:
    """Triton's kernel_load_end_hook: CUfunction handle -> exact cubin bytes, as loaded."""

    def __init__(self) -> None:
        self.by_function: dict[int, tuple[str, bytes]] = {}
        self.loads = 0
        import triton

        triton.knobs.runtime.kernel_load_end_hook.add(self._on_load)

    def _on_load(self, module: Any, function: Any, name: Any, metadata_group: Any, hash: Any) -> None:
        self.loads += 1
        group = dict(metadata_group or {})
        cubins = [p for k, p in group.items() if str(k).endswith(".cubin")]
        if cubins and os.path.exists(cubins[0]):
            self.by_function[int(function)] = (str(name), Path(cubins[0]).read_bytes())


def configure_inductor(template_fusion: str = "benchmark") -> dict[str, Any]:
    """Inductor's settings for every compile of a preparation. `template_fusion`: "benchmark"
    (Inductor's default) compiles and times each GEMM template with and without its epilogue
    before fusing; "heuristic" fuses without timing. On the H100 (2026-12-05, SmolLM2 shapes)
    that timing was ~52 of the ~67 s each prefill graph took to compile, and none of the decode
    graphs' (no templates with gemv)."""
    import torch._inductor.config as ic

    if template_fusion not in ("benchmark", "heuristic"):
        raise ValueError(f"template_fusion {template_fusion!r}: expected 'benchmark' or 'heuristic'")

    ic.max_autotune_gemm = True
    ic.max_autotune_gemm_backends = "TRITON"  # GEMMs as Triton templates: no cuBLAS in the graph
    ic.use_static_cuda_launcher = False  # with it, Triton's load hook never fires
    ic.fallback_random = False
    fallback.bound_operator_str()
    out: dict[str, Any] = {
        "max_autotune_gemm": True,
        "max_autotune_gemm_backends": "TRITON",
        "use_static_cuda_launcher": False,
    }
    # Shorter GEMM benchmarking (ms per choice; the defaults are 25 and 100): compile time on the
    # H200 was dominated by autotuning ~20 Triton configs per shape. Set where this torch has them.
    for key, value in (("inductor_default_autotune_warmup", 5), ("inductor_default_autotune_rep", 25)):
        if hasattr(ic, key):
            setattr(ic, key, value)
            out[key] = value
    # The setting's name changed (torch 2.15: benchmark_template_fusion; 2.11: benchmark_epilogue_fusion).
    names = ("benchmark_template_fusion", "benchmark_epilogue_fusion")
    fusion_key = next((k for k in names if hasattr(ic, k)), None)
    if fusion_key is not None:
        setattr(ic, fusion_key, template_fusion == "benchmark")
        out[fusion_key] = template_fusion == "benchmark"
    elif template_fusion != "benchmark":
        raise ValueError(f"template_fusion {template_fusion!r}: this torch has no setting for it")
    return out


# -- the recorder ----------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _compile_metrics() -> dict[str, float]:
    """Seconds torch's compile timers (`dynamo_timed`) have accumulated, per timer; empty where
    this torch keeps them elsewhere (diagnostics only)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {str(k): float(sum(v)) for k, v in compilation_time_metrics.items()}


# torch's timers nest; these name disjoint parts of one compile (autotuning: every timer whose
# name says so).
_BRIEF_TIMERS = {
    "trace": "bytecode_tracing",
    "lower": "GraphLowering.run",
    "fuse": "Scheduler.__init__",
    "codegen": "Scheduler.codegen",
    "triton": "async_compile.wait",
}


def _compile_brief(spent: dict[str, float]) -> dict[str, float]:
    out = {name: spent[key] for name, key in _BRIEF_TIMERS.items() if key in spent}
    tuned = sum(v for k, v in spent.items() if "autotune" in k.lower() or "select_algorithm" in k)
    if tuned:
        out["autotune"] = round(tuned, 2)
    return out


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bytes equal (NaN payloads included, which `torch.equal` on floats would not call equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return torch.equal(flat[0], flat[1])


def copy_block_sizes(nbytes: int) -> tuple[int, int]:
    """The block sizes torch's caching allocator can hand a tensor of `nbytes`: rounded up to 512;
    a small-pool request (at most 1 MiB) gets exactly that, a large one may keep up to 2 MiB more
    (a remainder too small to split, or a segment rounded to 2 MiB)."""
    rounded = -(-max(nbytes, 1) // 512) * 512
    return (rounded, rounded) if rounded <= 1 << 20 else (rounded, rounded + (2 << 20))


def unlisted_segments(listed: list[dict[str, Any]], log: list[Segment], base: int) -> list[dict[str, Any]]:
    """The arena's own segments (`log`) that torch's snapshot does not list, as whole inactive
    blocks: pool "released" where the caching allocator freed the segment, "unlisted" otherwise.
    The arena never reuses or unmaps an address, so such a range stays this process's alone, and a
    captured graph that still points into it exports it as scratch instead of failing on an
    unresolved pointer. A guard: the caching allocator releases a live pool's segment only by
    `release_available_cached_blocks` during a capture whose allocation failed, with
    `max_split_size_mb` set (pytorch/pytorch#159594). Ranges overlapping a listed segment are left out."""
    spans = sorted((s["address"], s["address"] + s["size"]) for s in listed)
    out = []
    for sg in log:
        a, b = base + sg.offset, base + sg.offset + sg.size
        i = bisect.bisect_right(spans, (a, float("inf"))) - 1
        overlaps = (i >= 0 and spans[i][1] > a) or (i + 1 < len(spans) and spans[i + 1][0] < b)
        if not overlaps:
            pool = "released" if sg.freed else "unlisted"
            out.append({"address": a, "size": sg.size, "pool": pool, "blocks": [(a, sg.size, "inactive")]})
    return out


@dataclass
class CoreDescription:
    """What the manifest says beyond the graphs: identity, scheme, capacities, frontend."""

    model_config: dict[str, Any]
    served_model_name: str
    tokenizer_json: bytes
    chat_template: str
    eos_token_ids: list[int]
    sampling: dict[str, Any]
    decode_buckets: list[int]
    prefill_chunks: list[int]


class Recorder:
    """Compiles and captures a `Program`'s graphs on the fixed-address arena and writes the recording.

    `build(device)` is called inside the arena's state pool and returns the Program, so every
    state tensor the graphs touch lies in the arena."""

    def __init__(
        self,
        out: Path,
        build: Callable[[torch.device], Program],
        describe: CoreDescription,
        arena_bytes: int,
        base: int = DEFAULT_BASE,
        template_fusion: str = "benchmark",
    ) -> None:
        self.out = out
        self.template_fusion = template_fusion
        self.build = build
        self.describe = describe
        self.arena_bytes = arena_bytes
        self.base_request = base
        self.report: dict[str, Any] = {"torch": torch.__version__}
        self.timings: dict[str, float] = {}

    def _t(self, key: str, t0: float) -> None:
        self.timings[key] = round(time.time() - t0, 3)

    # -- setup ---------------------------------------------------------------------------
    def prepare(self) -> None:
        import triton

        t0 = time.time()
        self.report["triton"] = triton.__version__
        so = build_allocator(self.out / "build")
        gib = 1 << 30
        mapped = -(-self.arena_bytes // (2 << 20)) * (2 << 20)
        self.arena = FixedArena(so, base=self.base_request, reserve=-(-mapped // gib) * gib, mapped=mapped)
        self._t("allocator_build_s", t0)
        self.report["arena"] = {
            "requested_base": hex(self.arena.requested_base),
            "base": hex(self.arena.base),
            "reserved": self.arena.reserved,
            "mapped": self.arena.mapped,
            "at_requested_base": self.arena.base == self.arena.requested_base,
        }
        self.hook = ImageHook()
        self.report["inductor"] = configure_inductor(self.template_fusion)
        t0 = time.time()
        self.state_pool = self.arena.pool()
        with torch.cuda.use_mem_pool(self.state_pool):
            self.program = self.build(torch.device("cuda"))
        self.graphs = self.program.graphs
        torch.cuda.synchronize()
        self._t("weights_to_device_s", t0)
        self.report["geometry"] = self.program.geo.as_dict()

    def _call(self, g: GraphSpec, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        return self.program.call(g, fn)

    # -- compile and capture -------------------------------------------------------------
    def time_graph(self, name: str, reps: int = 50) -> float:
        """Milliseconds per replay of graph `name` (compiled) captured now as a throwaway graph
        outside the arena: settings its ops read at launch (gemv's launch modes, attention's
        PDL flag) take effect. A first call outside the capture compiles the kernel variants
        they need. Replays run on the inputs `set_inputs` gives and mutate the state as a
        step does (the checks set their own inputs later)."""
        g = next(x for x in self.graphs if x.name == name)
        self.program.set_inputs(g, 0)
        return time_graphs([lambda: self._call(g, g.fn)], reps)

    def _warm(self, graphs: list[GraphSpec], runs: int) -> None:
        """Each of `graphs` run `runs` times on a side stream (compiles, loads kernels)."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for g in graphs:
                for _ in range(runs):
                    self.program.set_inputs(g, 0)
                    self._call(g, g.fn)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()

    def compile_and_capture(self, progress: Any = print, before_capture: Callable[[], None] | None = None) -> None:
        """Compiles every graph, runs `before_capture` (tuning that times compiled graphs with
        `time_graph`) and every graph once more after it, then captures every graph in its
        arena pool."""
        t0 = time.time()
        self.report["compile_breakdown"] = {}
        with fallback.watch_lowerings() as implicit:
            for i, g in enumerate(self.graphs):
                t1 = time.time()
                before = _compile_metrics()
                g.fn = torch.compile(self.program.method(g), fullgraph=True, dynamic=False)
                self._warm([g], 3)
                wall = time.time() - t1
                # Where this graph's compile went (torch's own timers; the rest of the wall time is
                # the warm-up runs, Ignition's Triton kernels compiling on first launch included).
                after = _compile_metrics()
                spent = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items() if v - before.get(k, 0.0) >= 0.1}
                self.report["compile_breakdown"][g.name] = {"wall_s": round(wall, 2), "timers_s": spent}
                brief = ", ".join(f"{name} {v:.1f}" for name, v in _compile_brief(spent).items())
                progress(f"compiled {g.name} ({i + 1}/{len(self.graphs)}) in {wall:.1f} s ({brief})")
        self._t("compile_s", t0)
        self.report["implicit_fallbacks"] = implicit
        if implicit:
            progress(f"ops Inductor lowered implicitly (no declared lowering): {implicit}")
        if before_capture is not None:
            before_capture()
            # Tuning may have changed what the ops launch (kernel variants of other row counts
            # never warmed): every graph runs once more so nothing compiles inside a capture.
            self._warm(self.graphs, 1)
        t0 = time.time()
        for g in self.graphs:
            g.pool = self.arena.pool()
            g.graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g.graph, pool=g.pool.id):
                g.output = self._call(g, g.fn)
            g.graph.instantiate()
        torch.cuda.synchronize()
        progress(f"captured {len(self.graphs)} graphs in {time.time() - t0:.1f} s")
        self._t("capture_s", t0)
        self.report["arena"]["used_bytes"] = self.arena.used
        self.report["arena"]["failed_allocs"] = self.arena.failed_allocs
        # A compiled graph that functionalized a KV or continuation-row write holds a copy of the
        # whole buffer in its pool and copies it every replay (see attention.write_attend_op and
        # gdn.gdn_ops). Find blocks of that size: any block at least as large as the KV cache,
        # and for the rows (small for dense recipes, where activations outgrow them) a block of
        # the size the caching allocator would give their copy (`copy_block_sizes`).
        blocks = [size for seg in self._segments()[0] if seg["pool"] == "graph" for _, size, _ in seg["blocks"]]
        kv_bytes = self.program.kv_all.numel() * self.program.kv_all.element_size()
        row_bytes = self.program.rows.numel() * self.program.rows.element_size()
        lo, hi = copy_block_sizes(row_bytes)
        for name, nbytes, hits in (
            ("kv", kv_bytes, [b for b in blocks if b >= kv_bytes]),
            ("rows", row_bytes, [b for b in blocks if lo <= b <= hi]),
        ):
            self.report[f"{name}_sized_graph_pool_blocks"] = hits
            if hits:
                progress(
                    f"WARNING: graph pools hold {len(hits)} {name}-sized blocks ({nbytes} B): "
                    f"a graph may copy the {name} buffer"
                )

    # -- memory map ----------------------------------------------------------------------
    def _named(self) -> dict[str, tuple[torch.Tensor, str, Any, str]]:
        """name -> (tensor, role, init, dtype name)."""
        out: dict[str, tuple[torch.Tensor, str, Any, str]] = {}
        for name, w in self.program.model.w.items():
            out[name] = (w, "weights", {"tensor": name}, TORCH_DTYPES[w.dtype])
        inv = self.program.model.inv_freq
        out["rope.inv_freq"] = (inv, "constants", {"tensor": "rope.inv_freq"}, "f32")
        for name, t in self.program.state().items():
            role, dt, init = STATE_ROLES[name]
            out[name] = (t, role, init, TORCH_DTYPES[t.dtype] if name == "continuation_rows" else dt)
        for g in self.graphs:
            assert g.output is not None
            out[f"{g.name}.output"] = (g.output, "graph_pool", "uninitialized", TORCH_DTYPES[g.output.dtype])
        return out

    def _segments(self) -> tuple[list[dict[str, Any]], list[list[str]]]:
        """Allocator segments inside the arena (with blocks and pool) and foreign segments."""
        # A block freed during capture with a use on another stream waits for its end-of-life
        # event until no capture is underway, listed as "active_awaiting_free" meanwhile (a state
        # pool block in that state would be exported as a constant). An allocation outside
        # capture makes the caching allocator process those events.
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")
        snap = torch.cuda.memory._snapshot()
        pools = {tuple(self.state_pool.id): "state"}
        for g in self.graphs:
            pools[tuple(g.pool.id)] = "graph"
        inside, foreign = [], []
        lo, hi = self.arena.base, self.arena.base + self.arena.used
        for s in snap["segments"]:
            a, size = int(s["address"]), int(s["total_size"])
            if lo <= a < hi:
                blocks, at = [], a
                for b in s.get("blocks", []):
                    addr = int(b.get("address", at))
                    blocks.append((addr, int(b["size"]), str(b.get("state", "inactive"))))
                    at = addr + int(b["size"])
                pid = s.get("segment_pool_id")
                kind = pools.get(tuple(pid) if pid is not None else (), "unknown")
                inside.append({"address": a, "size": size, "pool": kind, "blocks": blocks})
            else:
                foreign.append([hex(a), hex(a + size)])
        return inside + unlisted_segments(inside, self.arena.segments(), self.arena.base), foreign

    def allocations(self) -> tuple[list[dict[str, Any]], list[list[str]], dict[str, st.TensorBytes], dict[str, Any]]:
        named = self._named()
        base = self.arena.base
        allocs: list[dict[str, Any]] = []
        tensors: dict[str, st.TensorBytes] = {}
        covered: list[tuple[int, int]] = []
        for name, (t, role, init, dt) in named.items():
            a = t.data_ptr()
            if not self.arena.contains(a):
                raise RuntimeError(f"tensor {name} at {a:#x} is outside the arena")
            nbytes = t.numel() * t.element_size()
            allocs.append(
                {
                    "name": name,
                    "role": role,
                    "offset": a - base,
                    "byte_size": nbytes,
                    "alignment": _align_of(a - base),
                    "dtype": dt,
                    "shape": list(t.shape),
                    "init": init,
                }
            )
            covered.append((a, a + nbytes))
            if isinstance(init, dict):
                tensors[name] = st.TensorBytes(Dtype[dt.upper()], tuple(t.shape), _bytes(t))
        covered.sort()
        segments, foreign = self._segments()
        stats: dict[str, Any] = {
            "segments": len(segments),
            "constants": 0,
            "constant_bytes": 0,
            "scratch": 0,
            "graph_pool": 0,
            "pools": sorted({s["pool"] for s in segments}),
            # Arena segments torch's snapshot did not list (see `unlisted_segments`).
            "unlisted": [
                [s["pool"], s["address"] - base, s["size"]] for s in segments if s["pool"] in ("released", "unlisted")
            ],
        }
        for si, s in enumerate(segments):
            for bi, (addr, size, state) in enumerate(s["blocks"]):
                for gi, (lo, hi) in enumerate(_gaps(addr, addr + size, covered)):
                    name = f"arena.s{si}.b{bi}.{gi}"
                    entry = {
                        "name": name,
                        "offset": lo - base,
                        "byte_size": hi - lo,
                        "alignment": _align_of(lo - base),
                        "dtype": "u8",
                        "shape": [hi - lo],
                    }
                    if s["pool"] == "graph":
                        entry.update(role="graph_pool", init="uninitialized")
                        stats["graph_pool"] += 1
                    elif state.startswith("active"):
                        # Live state that no named tensor accounts for (e.g. an Inductor constant):
                        # exported with its contents.
                        entry.update(role="constants", init={"tensor": name})
                        tensors[name] = st.TensorBytes(Dtype.U8, (hi - lo,), D.copy_dtoh(lo, hi - lo))
                        stats["constants"] += 1
                        stats["constant_bytes"] += hi - lo
                    else:
                        entry.update(role="scratch", init="uninitialized")
                        stats["scratch"] += 1
                    allocs.append(entry)
        allocs.sort(key=lambda e: e["offset"])
        self.last_allocations = allocs
        return allocs, foreign, tensors, stats

    # -- graph walk ----------------------------------------------------------------------
    def walk(self, kernels: dict[int, dict[str, Any]], images_dir: Path) -> list[dict[str, Any]]:
        graphs = []
        self.report["graphs"] = {}
        for g in self.graphs:
            raw = int(g.graph.raw_cuda_graph())
            nodes = D.graph_nodes(raw)
            ids = {n: i + 1 for i, n in enumerate(nodes)}
            rec_nodes: list[dict[str, Any]] = []
            kinds: dict[str, int] = {}
            library: list[str] = []
            kernel_nodes: set[int] = set()
            for n in nodes:
                kind = D.node_kind(n)
                kinds[kind] = kinds.get(kind, 0) + 1
                nid = ids[n]
                if kind == "kernel":
                    kernel_nodes.add(nid)
                if kind == "kernel":
                    k = D.kernel_launch(n)
                    key = self._kernel_entry(k, kernels, images_dir)
                    if kernels[k.function]["origin"] != "triton":
                        library.append(k.name)
                    rec_nodes.append(
                        {
                            "id": nid,
                            "kernel": {
                                "key": key,
                                "grid": list(k.grid),
                                "block": list(k.block),
                                "dynamic_shared_memory": k.dynamic_shared_memory,
                                "param_bytes": k.param_bytes.hex(),
                            },
                        }
                    )
                elif kind == "memcpy":
                    m = D.memcpy(n)
                    rec_nodes.append(
                        {"id": nid, "memcpy": {"src": hex(m.src), "dst": hex(m.dst), "byte_count": m.byte_count}}
                    )
                elif kind == "memset":
                    fill = D.memset(n)
                    rec_nodes.append(
                        {
                            "id": nid,
                            "memset": {
                                "dst": hex(fill.dst),
                                "value": fill.value,
                                "element_size": fill.element_size,
                                "width": fill.width,
                                "height": fill.height,
                                "pitch": fill.pitch,
                            },
                        }
                    )
                elif kind == "empty":
                    rec_nodes.append({"id": nid, "empty": {}})
                else:
                    rec_nodes.append({"id": nid, "unsupported": kind})
            # Full dependencies as [from, to]; programmatic ones (PDL launches) name their kind.
            # The manifest allows them between kernel nodes only. Capture has made none other;
            # one would be recorded as a full dependency, which orders the same nodes at least
            # as strictly (a dependent kernel waits for its predecessor's completion anyway).
            edges = []
            for a, b, kind in D.graph_edges(raw):
                pdl = kind != "full" and ids[a] in kernel_nodes and ids[b] in kernel_nodes
                edges.append([ids[a], ids[b], kind] if pdl else [ids[a], ids[b]])
            bindings = []
            for value, t in g.inputs.items():
                bindings.append(
                    {
                        "value": value,
                        "address": hex(t.data_ptr()),
                        "dtype": VALUE_DTYPES[value][1],
                        "shape": list(t.shape),
                    }
                )
            # Sampling graphs and the maintenance ops that check a stamp write records.
            if g.kind != "state_maintenance" or g.maintenance_op in ("initialize", "restore", "snapshot"):
                assert g.records is not None
                bindings.append(
                    {
                        "value": "completion_records",
                        "address": hex(g.records.data_ptr()),
                        "dtype": "u32",
                        "shape": list(g.records.shape),
                    }
                )
            if g.kind != "state_maintenance":
                pending = self.program.pending
                bindings.append(
                    {
                        "value": "pending_tokens",
                        "address": hex(pending.data_ptr()),
                        "dtype": "i32",
                        "shape": list(pending.shape),
                        "direction": PENDING_DIRECTION[g.kind],
                    }
                )
            graphs.append(
                {
                    "name": g.name,
                    "kind": g.kind,
                    "capacity": {
                        "request_count": g.request_count,
                        "token_capacity": g.token_capacity,
                        "proposal_depth": g.proposal_depth,
                    },
                    "event_count": 0,
                    "completion_token_capacity": g.completion_tokens,
                    # A speculative program of a recipe with state columns writes one row per
                    # lane (the geometry's verification width covers the widest program).
                    "continuation_rows_per_request": (
                        min(self.program.geo.verification_width, g.proposal_depth + 1) if g.kind == "speculative" else 1
                    ),
                    "nodes": rec_nodes,
                    "edges": edges,
                    "bindings": bindings,
                    **({"maintenance_op": g.maintenance_op} if g.maintenance_op else {}),
                }
            )
            self.report["graphs"][g.name] = {
                "nodes": len(nodes),
                "kinds": kinds,
                "edges": len(edges),
                "programmatic_edges": sum(len(e) == 3 for e in edges),
                "library_kernels": sorted(set(library)),
            }
        return graphs

    def _kernel_entry(self, k: D.KernelLaunch, kernels: dict[int, dict[str, Any]], images_dir: Path) -> str:
        e = kernels.get(k.function)
        if e is None:
            hooked = self.hook.by_function.get(k.function)
            key = f"f{k.function:x}"
            e = {
                "key": key,
                "function_name": k.name,
                "params": [list(p) for p in k.params],
                "format": "cubin",
                "max_dynamic_shared_memory": 0,
                "required_threads_per_block": 0,
            }
            if hooked is not None:
                digest = hashlib.sha256(hooked[1]).hexdigest()[:16]
                rel = f"kernels/{k.name[:80]}-{digest}.cubin"
                (images_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                (images_dir / rel).write_bytes(hooked[1])
                e.update(origin="triton", image=rel)
            else:
                e.update(origin="library", image=None)
            if k.function:
                e["function_attributes"] = {
                    "max_dynamic_shared_size": D.function_attribute(k.function, D.FUNC_ATTR_MAX_DYNAMIC_SHARED),
                    "static_shared_size": D.function_attribute(k.function, D.FUNC_ATTR_SHARED_SIZE),
                    "registers": D.function_attribute(k.function, D.FUNC_ATTR_NUM_REGS),
                }
            kernels[k.function] = e
        # The loader sets the function's dynamic shared memory limit to what its launches need.
        e["max_dynamic_shared_memory"] = max(e["max_dynamic_shared_memory"], k.dynamic_shared_memory)
        return str(e["key"])

    # -- recording -----------------------------------------------------------------------
    def record(self) -> Path:
        t0 = time.time()
        rec_dir = self.out / "recording"
        rec_dir.mkdir(parents=True, exist_ok=True)
        kernels: dict[int, dict[str, Any]] = {}
        graphs = self.walk(kernels, rec_dir)
        allocs, foreign, tensors, stats = self.allocations()
        st.write(rec_dir / "weights.safetensors", tensors, {"producer": "ignition.capture"})
        d = self.describe
        (rec_dir / "tokenizer.json").write_bytes(d.tokenizer_json)
        (rec_dir / "chat_template.jinja").write_text(d.chat_template)
        c = self.program.geo
        props = torch.cuda.get_device_properties(0)
        cuda_ver = torch.version.cuda or "0.0"
        major, minor = (int(x) for x in cuda_ver.split(".")[:2])
        recording = {
            "format": RECORDING_FORMAT,
            "identity": {
                "device": {
                    "name": props.name,
                    "compute_capability": [props.major, props.minor],
                    "sm_count": props.multi_processor_count,
                    "total_memory_bytes": props.total_memory,
                },
                "cuda_driver_version": D.driver_version(),
                "cuda_toolkit_version": major * 1000 + minor * 10,
                "producer": f"ignition prepare (torch {torch.__version__})",
                "model_config": d.model_config,
            },
            "arena": {
                "base_address": hex(self.arena.base),
                "byte_size": -(-self.arena.used // (2 << 20)) * (2 << 20),
                "alignment": ARENA_ALIGNMENT,
            },
            "foreign_ranges": foreign,
            "tensor_source": "weights.safetensors",
            "allocations": allocs,
            "kernels": list(kernels.values()),
            "cache_scheme": self.program.model.cache_scheme(),
            "capacities": {
                "context_limit": c.context_limit,
                "decode_request_buckets": d.decode_buckets,
                "prefill_chunk_capacities": d.prefill_chunks,
                "request_slots": c.request_slots,
                "snapshot_rows": c.snapshot_rows,
                "max_kv_pages": c.max_kv_pages,
                "vocab_size": c.vocab,
                "completion_record_header_words": HEADER_WORDS,
            },
            "frontend": {
                "tokenizer": "tokenizer.json",
                "chat_template": "chat_template.jinja",
                "eos_token_ids": d.eos_token_ids,
                "sampling": d.sampling,
                "reasoning_parser": "none",
                "tool_parser": "none",
                "served_model_name": d.served_model_name,
            },
            "graphs": graphs,
        }
        path = rec_dir / "recorded_graph.json"
        path.write_text(json.dumps(recording, indent=1) + "\n")
        self._t("record_s", t0)
        self.report["kernels"] = {
            "distinct_functions": len(kernels),
            "with_image": sum(1 for e in kernels.values() if e["origin"] == "triton"),
            "hook_loads": self.hook.loads,
        }
        self.report["memory_map"] = stats
        return path

    # -- reference -----------------------------------------------------------------------
    def reference(
        self, io_dir: Path, timed: int = 200, full_io_dir: Path | None = None, graphs: list[str] | None = None
    ) -> None:
        """Per graph: inputs set, their bytes saved, torch replays once, the outputs' bytes saved;
        also torch's own determinism (replay again, replay over a poisoned pool) and graph vs eager."""
        self.report["torch_replay"] = {}
        prog = self.program
        for gi, g in enumerate(self.graphs):
            prog.set_inputs(g, gi)
            torch.cuda.synchronize()
            written = dict(prog.state())
            assert g.records is not None  # set_inputs placed the graph's records view
            eager_state = {
                "kv": prog.kv_all.clone(),
                "rows": prog.rows.clone(),
                "hist": prog.hist.clone(),
                "records": g.records.clone(),
                "pending": prog.pending.clone(),
            }
            eager = prog.call(g, prog.method(g), eager_state)
            for big in ("kv", "rows", "hist"):  # the eager run's scratch state: only its outputs are compared
                del eager_state[big]
            dump = graphs is None or g.name in graphs
            d = io_dir / g.name
            if dump:
                d.mkdir(parents=True, exist_ok=True)
                for name, t in written.items():
                    (d / f"in.{name}.bin").write_bytes(_bytes(t))
            if full_io_dir is not None and dump:
                # Diagnostics: every graph-pool and scratch buffer's bytes as torch's replay found them.
                fd = full_io_dir / g.name
                fd.mkdir(parents=True, exist_ok=True)
                for name, t in written.items():
                    (fd / f"in.{name}.bin").write_bytes(_bytes(t))
                for a in self.last_allocations:
                    if a["role"] in ("graph_pool", "scratch"):
                        addr = self.arena.base + a["offset"]
                        (fd / f"in.{a['name']}.bin").write_bytes(D.copy_dtoh(addr, a["byte_size"]))
            g.graph.replay()
            torch.cuda.synchronize()
            assert g.output is not None
            read = {
                "kv_pages": prog.kv,
                "continuation_rows": prog.rows,
                "penalty_histogram": prog.hist,
                "pending_tokens": prog.pending,
                "completion_records": prog.records,
                f"{g.name}.output": g.output,
            }
            if dump:
                for name, t in read.items():
                    (d / f"out.{name}.bin").write_bytes(_bytes(t))
                    if full_io_dir is not None:
                        (full_io_dir / g.name / f"out.{name}.bin").write_bytes(_bytes(t))
            # Compared on the device: on the host, the KV pages would be copied three times per graph
            # (this phase took 62-142 s on the device, 2026-12-05; the copies' share is unmeasured).
            first = {name: t.clone() for name, t in read.items()}
            prog.set_inputs(g, gi)
            g.graph.replay()
            torch.cuda.synchronize()
            again = all(_bitwise_equal(t, first[name]) for name, t in read.items())
            for a in self.last_allocations:
                if a["role"] == "graph_pool":
                    D.call("cuMemsetD8_v2", D.u64(self.arena.base + a["offset"]), C.c_ubyte(0x55), D.sz(a["byte_size"]))
            prog.set_inputs(g, gi)
            torch.cuda.synchronize()
            g.graph.replay()
            torch.cuda.synchronize()
            poisoned = all(_bitwise_equal(t, first[name]) for name, t in read.items())
            del first
            got = g.output.float()
            denom = eager.float().norm().item()
            rel = ((got - eager.float()).norm().item() / denom) if denom else 0.0
            records_equal = bool(torch.equal(eager_state["records"], g.records))
            pending_equal = bool(torch.equal(eager_state["pending"], prog.pending))
            t0 = time.time()
            for _ in range(timed):
                g.graph.replay()
            torch.cuda.synchronize()
            us = (time.time() - t0) / max(timed, 1) * 1e6
            self.report["torch_replay"][g.name] = {
                "replay_us": round(us, 2),
                "rel_l2_graph_vs_eager": rel,
                "records_equal_eager": records_equal,
                "pending_tokens_equal_eager": pending_equal,
                "second_replay_bitwise_equal": again,
                "poisoned_pool_replay_bitwise_equal": poisoned,
                "io_dumped": dump,
            }


def _align_of(offset: int) -> int:
    if offset == 0:
        return 4096
    return min(offset & -offset, 4096)


def _gaps(lo: int, hi: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of [lo, hi) outside every covered range, starts rounded up to a word (8 bytes) so
    fillers never share one with a named tensor. Rounding to the allocator's 512-byte blocks left
    a hole after a tensor of another size: a graph output reusing a freed block at its start
    (1,152 bytes at SmolLM2's width) left the rest of what the block held earlier in the same
    graph (decode_b1's K, a view 1,152 bytes into its QKV projection) in no buffer, and export
    failed on the pointer (device, 2026-12-05)."""
    out, at = [], lo
    for a, b in covered:
        if b <= at or a >= hi:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    res = []
    for a, b in out:
        a2 = -(-a // 8) * 8
        if b > a2:
            res.append((a2, b))
    return res
