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

import ctypes as C
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ignition.capture import driver as D
from ignition.capture.arena import DEFAULT_BASE, FixedArena, build_allocator
from ignition.capture.model import HEADER_WORDS, TinyConfig, TinyLlama
from ignition.core import safetensors_io as st
from ignition.core.manifest import Dtype

RECORDING_FORMAT = "flare-recorded-graphs/1"
ARENA_ALIGNMENT = 1 << 16
TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32", torch.int32: "i32",
                torch.int64: "i64", torch.uint8: "u8", torch.bool: "bool"}  # fmt: skip
COMPLETION_TOKENS = 1

TOKENIZER = '{"version":"1.0","model":{"type":"WordLevel","vocab":{"<unk>":0,"<eos>":1},"unk_token":"<unk>"}}'
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
SAMPLING = {
    "temperature": {"default": 1.0, "range": [0.05, 2.0]}, "top_k": {"default": 0, "range": [0, 64]},
    "top_p": {"default": 1.0, "range": [0.01, 1.0]}, "min_p": {"default": 0.0, "range": [0.0, 1.0]},
    "repetition_penalty": {"default": 1.0, "range": [0.5, 2.0]},
    "presence_penalty": {"default": 0.0, "range": [-2.0, 2.0]},
    "frequency_penalty": {"default": 0.0, "range": [-2.0, 2.0]}, "max_output_tokens": 64,
}  # fmt: skip


# -- kernel images ---------------------------------------------------------------------------
class ImageHook:
    """Triton's kernel_load_end_hook: CUfunction handle -> exact cubin bytes, as loaded."""

    def __init__(self) -> None:
        self.by_function: dict[int, tuple[str, bytes]] = {}
        self.loads = 0
        import triton

        triton.knobs.runtime.kernel_load_end_hook.add(self._on_load)

    def _on_load(self, module: Any, function: Any, name: Any, metadata_group: Any, hash: Any) -> None:  # noqa: A002
        self.loads += 1
        group = dict(metadata_group or {})
        cubins = [p for k, p in group.items() if str(k).endswith(".cubin")]
        if cubins and os.path.exists(cubins[0]):
            self.by_function[int(function)] = (str(name), Path(cubins[0]).read_bytes())


def configure_inductor() -> dict[str, Any]:
    import torch._inductor.config as ic

    ic.max_autotune_gemm = True
    ic.max_autotune_gemm_backends = "TRITON"  # GEMMs as Triton templates: no cuBLAS in the graph
    ic.use_static_cuda_launcher = False  # with it, Triton's load hook never fires
    ic.fallback_random = False
    return {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON", "use_static_cuda_launcher": False}


# -- graph specs -----------------------------------------------------------------------------
@dataclass
class GraphSpec:
    name: str
    kind: str
    request_count: int
    token_capacity: int
    inputs: dict[str, torch.Tensor]  # value kind -> static tensor, in call order (kv/records apart)
    fn: Any = None
    graph: Any = None
    pool: Any = None
    output: torch.Tensor | None = None
    ids: list[int] = field(default_factory=list)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()


class Recorder:
    def __init__(self, out: Path, cfg: TinyConfig, base: int = DEFAULT_BASE) -> None:
        self.out = out
        self.cfg = cfg
        self.base_request = base
        self.report: dict[str, Any] = {"config": cfg.as_dict(), "torch": torch.__version__}
        self.timings: dict[str, float] = {}

    def _t(self, key: str, t0: float) -> None:
        self.timings[key] = round(time.time() - t0, 3)

    # -- setup ---------------------------------------------------------------------------
    def prepare(self) -> None:
        import triton

        t0 = time.time()
        self.report["triton"] = triton.__version__
        so = build_allocator(self.out / "build")
        self.arena = FixedArena(so, base=self.base_request)
        self._t("allocator_build_s", t0)
        self.report["arena"] = {"requested_base": hex(self.arena.requested_base), "base": hex(self.arena.base),
                                "reserved": self.arena.reserved, "mapped": self.arena.mapped,
                                "at_requested_base": self.arena.base == self.arena.requested_base}  # fmt: skip
        self.hook = ImageHook()
        self.report["inductor"] = configure_inductor()
        c = self.cfg
        dev = torch.device("cuda")
        self.state_pool = self.arena.pool()
        with torch.cuda.use_mem_pool(self.state_pool):
            self.model = TinyLlama(c, device=dev)
            self.kv = torch.zeros(c.kv_shape(), dtype=torch.bfloat16, device=dev)
            i32 = dict(dtype=torch.int32, device=dev)
            b, p = c.request_slots, c.pages_per_request
            t = b  # prefill chunk: the same token count as the decode bucket (the GEMM shapes are shared)
            self.decode = GraphSpec(f"decode_b{b}", "decode", b, b, {
                "token_ids": torch.zeros(b, **i32), "positions": torch.zeros(b, **i32),
                "request_slots": torch.zeros(b, **i32), "page_table": torch.zeros(b, p, **i32),
                "completion_records": torch.zeros(b, HEADER_WORDS + COMPLETION_TOKENS, **i32),
            })  # fmt: skip
            self.prefill = GraphSpec(f"prefill_t{t}", "prefill", 1, t, {
                "token_ids": torch.zeros(t, **i32), "positions": torch.zeros(t, **i32),
                "slot_mapping": torch.zeros(t, dtype=torch.int64, device=dev),
                "page_table": torch.zeros(1, p, **i32), "request_slots": torch.zeros(1, **i32),
                "query_lengths": torch.zeros(1, **i32),
                "completion_records": torch.zeros(1, HEADER_WORDS + COMPLETION_TOKENS, **i32),
            })  # fmt: skip
        self.graphs = [self.decode, self.prefill]
        self.set_inputs(0)
        torch.cuda.synchronize()

    def _call(self, g: GraphSpec, fn: Any) -> torch.Tensor:
        x = g.inputs
        if g.kind == "decode":
            return fn(x["token_ids"], x["positions"], x["request_slots"], x["page_table"], self.kv,
                      x["completion_records"])  # fmt: skip
        return fn(x["token_ids"], x["positions"], x["slot_mapping"], x["page_table"], x["request_slots"],
                  x["query_lengths"], self.kv, x["completion_records"])  # fmt: skip

    def set_inputs(self, seed: int) -> None:
        """Deterministic contents: shuffled page tables, positions across page boundaries, random KV."""
        c = self.cfg
        gen = torch.Generator(device="cpu").manual_seed(1000 + seed)
        self.kv.copy_((torch.randn(self.kv.shape, generator=gen) * 0.5).to(torch.bfloat16))
        pages = torch.randperm(c.max_kv_pages, generator=gen).view(c.request_slots, c.pages_per_request).int()
        d = self.decode.inputs
        d["token_ids"].copy_(torch.randint(0, c.vocab, (self.decode.token_capacity,), generator=gen).int())
        d["positions"].copy_(torch.tensor([5, 70, 130, c.context_limit - 1])[: self.decode.request_count].int())
        d["request_slots"].copy_(torch.arange(self.decode.request_count).int())
        d["page_table"].copy_(pages)
        d["completion_records"].zero_()
        p = self.prefill.inputs
        t = self.prefill.token_capacity
        pos = torch.arange(t) + (c.page_tokens - t // 2)  # straddles a page boundary
        p["token_ids"].copy_(torch.randint(0, c.vocab, (t,), generator=gen).int())
        p["positions"].copy_(pos.int())
        p["page_table"].copy_(pages[1:2])
        p["slot_mapping"].copy_(pages[1].long()[pos // c.page_tokens] * c.page_tokens + pos % c.page_tokens)
        p["request_slots"].copy_(torch.tensor([1]).int())
        p["query_lengths"].copy_(torch.tensor([t]).int())
        p["completion_records"].zero_()

    # -- compile and capture -------------------------------------------------------------
    def compile_and_capture(self) -> None:
        t0 = time.time()
        for g in self.graphs:
            method = self.model.decode if g.kind == "decode" else self.model.prefill
            g.fn = torch.compile(method, fullgraph=True, dynamic=False)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for g in self.graphs:
                for _ in range(3):
                    self._call(g, g.fn)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self._t("compile_s", t0)
        t0 = time.time()
        for g in self.graphs:
            g.pool = self.arena.pool()
            g.graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g.graph, pool=g.pool.id):
                g.output = self._call(g, g.fn)
            g.graph.instantiate()
        torch.cuda.synchronize()
        self._t("capture_s", t0)
        self.report["arena"]["used_bytes"] = self.arena.used
        self.report["arena"]["failed_allocs"] = self.arena.failed_allocs

    # -- memory map ----------------------------------------------------------------------
    def _named(self) -> dict[str, tuple[torch.Tensor, str, Any, str]]:
        """name -> (tensor, role, init, dtype name)."""
        out: dict[str, tuple[torch.Tensor, str, Any, str]] = {}
        for name, w in self.model.named_weights().items():
            out[name] = (w, "weights", {"tensor": name}, TORCH_DTYPES[w.dtype])
        out["kv_pages"] = (self.kv, "kv_pages", "zero", "bf16")
        for g in self.graphs:
            for value, t in g.inputs.items():
                if value == "completion_records":
                    out[f"{g.name}.{value}"] = (t, "completion_records", "zero", "u32")
                else:
                    out[f"{g.name}.{value}"] = (t, "staging_inputs", "zero", TORCH_DTYPES[t.dtype])
            assert g.output is not None
            out[f"{g.name}.logits"] = (g.output, "graph_pool", "uninitialized", TORCH_DTYPES[g.output.dtype])
        return out

    def _segments(self) -> tuple[list[dict[str, Any]], list[list[str]]]:
        """Allocator segments inside the arena (with blocks and pool) and foreign segments."""
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
        if not inside:
            # The snapshot does not list this allocator's segments: fall back to the arena's own
            # log (no block states, so nothing there is exported with contents).
            for sg in self.arena.segments():
                if not sg.freed:
                    a = self.arena.base + sg.offset
                    inside.append({"address": a, "size": sg.size, "pool": "unknown", "blocks": [(a, sg.size, "inactive")]})
        return inside, foreign

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
            allocs.append({"name": name, "role": role, "offset": a - base, "byte_size": nbytes,
                           "alignment": _align_of(a - base), "dtype": dt, "shape": list(t.shape), "init": init})  # fmt: skip
            covered.append((a, a + nbytes))
            if isinstance(init, dict):
                tensors[name] = st.TensorBytes(Dtype[dt.upper()], tuple(t.shape), _bytes(t))
        covered.sort()
        segments, foreign = self._segments()
        stats = {"segments": len(segments), "constants": 0, "constant_bytes": 0, "scratch": 0, "graph_pool": 0,
                 "pools": sorted({s["pool"] for s in segments})}  # fmt: skip
        for si, s in enumerate(segments):
            for bi, (addr, size, state) in enumerate(s["blocks"]):
                for gi, (lo, hi) in enumerate(_gaps(addr, addr + size, covered)):
                    name = f"arena.s{si}.b{bi}.{gi}"
                    entry = {"name": name, "offset": lo - base, "byte_size": hi - lo, "alignment": _align_of(lo - base),
                             "dtype": "u8", "shape": [hi - lo]}  # fmt: skip
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
            rec_nodes, kinds, library = [], {}, []
            for n in nodes:
                kind = D.node_kind(n)
                kinds[kind] = kinds.get(kind, 0) + 1
                nid = ids[n]
                if kind == "kernel":
                    k = D.kernel_launch(n)
                    key = self._kernel_entry(k, kernels, images_dir)
                    if kernels[k.function]["origin"] != "triton":
                        library.append(k.name)
                    rec_nodes.append({"id": nid, "kernel": {
                        "key": key, "grid": list(k.grid), "block": list(k.block),
                        "dynamic_shared_memory": k.dynamic_shared_memory, "param_bytes": k.param_bytes.hex()}})  # fmt: skip
                elif kind == "memcpy":
                    m = D.memcpy(n)
                    rec_nodes.append({"id": nid, "memcpy": {"src": hex(m.src), "dst": hex(m.dst), "byte_count": m.byte_count}})
                elif kind == "memset":
                    m = D.memset(n)
                    rec_nodes.append({"id": nid, "memset": {"dst": hex(m.dst), "value": m.value, "element_size": m.element_size,
                                                            "width": m.width, "height": m.height, "pitch": m.pitch}})  # fmt: skip
                elif kind == "empty":
                    rec_nodes.append({"id": nid, "empty": {}})
                else:
                    rec_nodes.append({"id": nid, "unsupported": kind})
            edges = [[ids[a], ids[b]] for a, b in D.graph_edges(raw)]
            bindings = []
            for value, t in g.inputs.items():
                dt = "u32" if value == "completion_records" else TORCH_DTYPES[t.dtype]
                bindings.append({"value": value, "address": hex(t.data_ptr()), "dtype": dt, "shape": list(t.shape)})
            graphs.append({
                "name": g.name, "kind": g.kind,
                "capacity": {"request_count": g.request_count, "token_capacity": g.token_capacity},
                "event_count": 0, "completion_token_capacity": COMPLETION_TOKENS, "continuation_rows_per_request": 1,
                "nodes": rec_nodes, "edges": edges, "bindings": bindings,
            })  # fmt: skip
            self.report["graphs"][g.name] = {"nodes": len(nodes), "kinds": kinds, "edges": len(edges),
                                             "library_kernels": sorted(set(library))}  # fmt: skip
        return graphs

    def _kernel_entry(self, k: D.KernelLaunch, kernels: dict[int, dict[str, Any]], images_dir: Path) -> str:
        e = kernels.get(k.function)
        if e is None:
            hooked = self.hook.by_function.get(k.function)
            key = f"f{k.function:x}"
            e = {"key": key, "function_name": k.name, "params": [list(p) for p in k.params], "format": "cubin",
                 "max_dynamic_shared_memory": 0, "required_threads_per_block": 0}  # fmt: skip
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
                    "registers": D.function_attribute(k.function, D.FUNC_ATTR_NUM_REGS)}  # fmt: skip
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
        (rec_dir / "tokenizer.json").write_text(TOKENIZER)
        (rec_dir / "chat_template.jinja").write_text(TEMPLATE)
        c = self.cfg
        props = torch.cuda.get_device_properties(0)
        cuda_ver = torch.version.cuda or "0.0"
        major, minor = (int(x) for x in cuda_ver.split(".")[:2])
        recording = {
            "format": RECORDING_FORMAT,
            "identity": {
                "device": {"name": props.name, "compute_capability": [props.major, props.minor],
                           "sm_count": props.multi_processor_count, "total_memory_bytes": props.total_memory},
                "cuda_driver_version": D.driver_version(), "cuda_toolkit_version": major * 1000 + minor * 10,
                "producer": f"ignition.capture (torch {torch.__version__})",
                "model_config": {"architectures": ["TinyLlamaPaged"], **c.as_dict()},
            },
            "arena": {"base_address": hex(self.arena.base), "byte_size": -(-self.arena.used // (2 << 20)) * (2 << 20),
                      "alignment": ARENA_ALIGNMENT},
            "foreign_ranges": foreign,
            "tensor_source": "weights.safetensors",
            "allocations": allocs,
            "kernels": list(kernels.values()),
            "cache_scheme": {
                "page_tokens": c.page_tokens,
                "page_regions": [{"name": f"layer{i}.{kv}", "bytes_per_page": c.region_bytes}
                                 for i in range(c.layers) for kv in ("k", "v")],
                "continuation_row_bytes": 0, "row_layout": [], "live_rows_per_slot": 1, "verification_width": 1,
                "padding_slot": -1,
            },
            "capacities": {
                "context_limit": c.context_limit, "decode_request_buckets": [self.decode.request_count],
                "prefill_chunk_capacities": [self.prefill.token_capacity], "request_slots": c.request_slots,
                "snapshot_rows": 0, "max_kv_pages": c.max_kv_pages, "vocab_size": c.vocab,
                "completion_record_header_words": HEADER_WORDS,
            },
            "frontend": {"tokenizer": "tokenizer.json", "chat_template": "chat_template.jinja", "eos_token_ids": [1],
                         "sampling": SAMPLING, "reasoning_parser": "none", "tool_parser": "none",
                         "served_model_name": "tiny-llama-paged"},  # fmt: skip
            "graphs": graphs,
        }  # fmt: skip
        path = rec_dir / "recorded_graph.json"
        path.write_text(json.dumps(recording, indent=1) + "\n")
        self._t("record_s", t0)
        self.report["kernels"] = {"distinct_functions": len(kernels),
                                  "with_image": sum(1 for e in kernels.values() if e["origin"] == "triton"),
                                  "hook_loads": self.hook.loads}  # fmt: skip
        self.report["memory_map"] = stats
        return path

    # -- reference -----------------------------------------------------------------------
    def reference(self, io_dir: Path, timed: int = 200, full_io_dir: Path | None = None) -> None:
        """Per graph: inputs set, their bytes saved, torch replays once, the outputs' bytes saved."""
        self.report["torch_replay"] = {}
        for gi, g in enumerate(self.graphs):
            d = io_dir / g.name
            d.mkdir(parents=True, exist_ok=True)
            self.set_inputs(gi)
            torch.cuda.synchronize()
            written = {"kv_pages": self.kv, **{f"{g.name}.{v}": t for v, t in g.inputs.items()}}
            for name, t in written.items():
                (d / f"in.{name}.bin").write_bytes(_bytes(t))
            eager_kv = self.kv.clone()
            eager_rec = g.inputs["completion_records"].clone()
            x = {**g.inputs, "completion_records": eager_rec}
            method = self.model.decode if g.kind == "decode" else self.model.prefill
            saved_kv, self.kv = self.kv, eager_kv
            try:
                eager = self._call(GraphSpec(g.name, g.kind, g.request_count, g.token_capacity, x), method)
            finally:
                self.kv = saved_kv
            if full_io_dir is not None:
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
            read = {"kv_pages": self.kv, f"{g.name}.completion_records": g.inputs["completion_records"],
                    f"{g.name}.logits": g.output}  # fmt: skip
            for name, t in read.items():
                (d / f"out.{name}.bin").write_bytes(_bytes(t))
                if full_io_dir is not None:
                    (full_io_dir / g.name / f"out.{name}.bin").write_bytes(_bytes(t))
            first = {name: _bytes(t) for name, t in read.items()}
            # Determinism of torch's own replay: same inputs again, replay, same bytes?
            self.set_inputs(gi)
            g.graph.replay()
            torch.cuda.synchronize()
            again = {name: _bytes(t) == first[name] for name, t in read.items()}
            # Does the result depend on what the graph pool held before the replay?
            for a in self.last_allocations:
                if a["role"] == "graph_pool":
                    D.call("cuMemsetD8_v2", D.u64(self.arena.base + a["offset"]), C.c_ubyte(0x55), D.sz(a["byte_size"]))
            self.set_inputs(gi)
            torch.cuda.synchronize()
            g.graph.replay()
            torch.cuda.synchronize()
            poisoned = {name: _bytes(t) == first[name] for name, t in read.items()}
            got = g.output.float()
            rel = ((got - eager.float()).norm() / eager.float().norm()).item()
            tokens_equal = bool(torch.equal(eager_rec, g.inputs["completion_records"]))
            t0 = time.time()
            for _ in range(timed):
                g.graph.replay()
            torch.cuda.synchronize()
            us = (time.time() - t0) / timed * 1e6
            self.report["torch_replay"][g.name] = {
                "replay_us": round(us, 2), "rel_l2_graph_vs_eager": rel, "records_equal_eager": tokens_equal,
                "second_replay_bitwise_equal": again, "poisoned_pool_replay_bitwise_equal": poisoned,
                "writes": sorted(written), "reads": sorted(read)}  # fmt: skip


def _align_of(offset: int) -> int:
    if offset == 0:
        return 4096
    return min(offset & -offset, 4096)


def _gaps(lo: int, hi: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of [lo, hi) outside every covered range; starts rounded up to 512 bytes (the caching
    allocator's block granularity) so fillers never share a word with a named tensor."""
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
        a2 = -(-a // 512) * 512
        if b > a2:
            res.append((a2, b))
    return res
