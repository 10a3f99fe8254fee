"""GPU machine, issue 19 item 3: is a graph with programmatic edges as fast once rebuilt node by
node (as a core's loader does) as when torch captured it?

Session 24 (H100): preparation's torch replay of a `--pdl auto` SmolLM2 core's `decode_b1` took
558 us, the exported core's replay 639 us (session 23's core: 550 against 607); without
programmatic edges the two agreed within about 5% at one row. This isolates the
rebuild: `pdl_probe.py`'s projection chain (every layer of a geometry, random weights, tuned
tiles without K splits) captured by torch with every kernel a programmatic dependent
(`--mode`, default 3 with whole rows prefetched), then, in the same process over the same
buffers:
- `captured`: torch's graph, replayed back to back;
- `clone`: `cuGraphClone` of it, instantiated by the driver (`clone_node_priority`: with node
  priorities honoured);
- `rebuilt`: every kernel node added again from what the recorder reads (function, grid,
  block, shared memory, the parameter bytes), full edges with their node and programmatic ones
  after every node (`ignition.replay.cuda`'s order);
- `rebuilt_inline`: each node's programmatic edges added right after the node, in creation
  order, as stream capture builds the graph;
- `rebuilt_attrs`: the `rebuilt` graph with each captured node's launch attributes copied over
  (`cuGraphKernelNodeCopyAttributes`);
- `rebuilt_pss`: the same with only the programmatic-stream-serialization attribute (id 6) set to
  1 on every kernel a programmatic edge ends at (the driver documents it for launches: a refusal
  is reported, not fatal);
- `rebuilt_full`: the programmatic edges rebuilt as full ones;
- `captured_plain` and `rebuilt_plain`: the chain captured without PDL, and that graph rebuilt
  (what rebuilding costs any graph).
Limits: the rebuild reuses Triton's function handles and torch's stream, without `cuGraphUpload`,
and the chain holds programmatic edges only (a decode step has full ones beside them), so a
rebuild as fast as the capture here would not clear the loader.
Also lists the launch attributes the captured kernel nodes carry (ids 1-20 that answer, with
their first word), and whether every variant's output equals the plain chain's bitwise.

    python3 qualification/pdl_rebuild_probe.py CONFIG.json OUT.json [--rows 1] [--reps 200]
"""

from __future__ import annotations

import argparse
import ctypes as C
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemv_check import problems  # siblings: the script directory is on the path
from pdl_probe import chain, uniform

from ignition.capture import driver as D
from ignition.capture.gemv import CANDIDATES, precompile, tune

sz, vp, u64 = C.c_size_t, C.c_void_p, C.c_uint64
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
USE_NODE_PRIORITY = 8  # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY


def back_to_back_ms(launch: Callable[[], None], reps: int) -> float:
    launch()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        launch()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / reps


def instantiate(graph: int, flags: int = 0) -> int:
    exe = vp()
    D.call("cuGraphInstantiateWithFlags", C.byref(exe), vp(graph), u64(flags))
    return exe.value or 0


def launcher(exe: int) -> Callable[[], None]:
    stream = torch.cuda.current_stream().cuda_stream

    def launch() -> None:
        D.call("cuGraphLaunch", vp(exe), vp(stream))

    return launch


def attributes(node: int) -> dict[int, int]:
    """Launch attribute id -> its first 32-bit word, for the ids 1-20 the driver answers."""
    out = {}
    for a in range(1, 21):
        value = (C.c_ubyte * 64)()
        rc = D.lib().cuGraphKernelNodeGetAttribute(vp(node), C.c_int(a), value)
        if rc == 0:
            out[a] = int.from_bytes(bytes(value[:4]), "little")
    return out


def rebuild(graph: int, programmatic: str, copy_attrs: bool, pss: bool = False) -> int:
    """A new graph with `graph`'s kernel nodes added one by one. `programmatic`: "after" (as the
    core loader: programmatic edges once every node exists), "inline" (each node's programmatic
    edges added right after it, nodes in the order of every edge: as stream capture builds it)
    or "full" (as full dependencies)."""
    nodes = D.graph_nodes(graph)
    edges = D.graph_edges(graph)
    new = vp()
    D.call("cuGraphCreate", C.byref(new), C.c_uint(0))
    preds: dict[int, list[int]] = {}
    order: dict[int, list[int]] = {}  # every predecessor, for the creation order
    late: list[tuple[int, int, str]] = []
    for a, b, kind in edges:
        if kind == "full" or programmatic == "full":
            preds.setdefault(b, []).append(a)
        else:
            late.append((a, b, kind))
        if kind == "full" or programmatic != "after":
            order.setdefault(b, []).append(a)
    made: dict[int, int] = {}
    keep: list[Any] = []
    pending = list(nodes)
    while pending:  # topological over the edges that order creation
        rest = []
        for n in pending:
            if any(p not in made for p in order.get(n, [])):
                rest.append(n)
                continue
            if D.node_kind(n) != "kernel":
                raise RuntimeError(f"node kind {D.node_kind(n)}: the chain should hold kernels only")
            k = D.kernel_launch(n)
            buf = D.ParamBuffer(k.param_bytes)
            keep.append(buf)
            p = D.KernelNodeParams()
            p.func = k.function
            p.gx, p.gy, p.gz = k.grid
            p.bx, p.by, p.bz = k.block
            p.smem = k.dynamic_shared_memory
            p.extra = C.addressof(buf.extra)
            deps = [made[x] for x in preds.get(n, [])]
            arr = (vp * max(1, len(deps)))(*deps)
            h = vp()
            D.call("cuGraphAddKernelNode_v2", C.byref(h), new, arr, sz(len(deps)), C.byref(p))
            made[n] = h.value or 0
            if copy_attrs:
                D.call("cuGraphKernelNodeCopyAttributes", vp(made[n]), vp(n))
            if programmatic == "inline":
                add_programmatic(new, made, [e for e in late if e[1] == n], pss)
        if len(rest) == len(pending):
            raise RuntimeError("cycle in the edges")
        pending = rest
    if programmatic == "after":
        add_programmatic(new, made, late, pss)
    return new.value or 0


def add_programmatic(graph: Any, made: dict[int, int], edges: list[tuple[int, int, str]], pss: bool) -> None:
    for a, b, kind in edges:
        data = D.programmatic_edge_data(D.EDGE_PORTS[kind])
        D.call("cuGraphAddDependencies_v2", graph, (vp * 1)(made[a]), (vp * 1)(made[b]), data, sz(1))
        if pss:
            value = (C.c_ubyte * 64)(1)
            D.call("cuGraphKernelNodeSetAttribute", vp(made[b]), C.c_int(PROGRAMMATIC_STREAM_SERIALIZATION), value)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--mode", default="3,8192", help="PDL mode and L2 prefetch columns of every projection")
    args = ap.parse_args()
    cfg = json.loads(args.config.read_text())
    layers = cfg["num_hidden_layers"]
    probs = {p.name: p for p in problems(cfg, layers) if p.name != "lm_head"}
    plain_tiles = [c for c in CANDIDATES if c.split == 1]
    precompile(list(probs.values()), [args.rows], plain_tiles)
    tune(list(probs.values()), [args.rows], plain_tiles)
    pdl, pf = (int(v) for v in args.mode.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(args.rows, cfg["hidden_size"], generator=gen, device="cuda").bfloat16()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "config": str(args.config), "rows": args.rows,
                              "mode": [pdl, pf], "kernels": 4 * layers, "us": {}}  # fmt: skip
    # Each graph with its input and output: the input must outlive the capture (a freed input's
    # memory would be reused by the next capture's activations).
    graphs: dict[str, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
    for key, spec in (("plain", {}), ("pdl", uniform(pdl, pf))):
        x = x0.clone()
        for _ in range(2):
            chain(cfg, probs, x, spec)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g):
            out = chain(cfg, probs, x, spec)
        g.instantiate()
        graphs[key] = (g, x, out)
    raw = int(graphs["pdl"][0].raw_cuda_graph())
    raw_plain = int(graphs["plain"][0].raw_cuda_graph())
    nodes = D.graph_nodes(raw)
    kinds: dict[str, int] = {}
    for _, _, kind in D.graph_edges(raw):
        kinds[kind] = kinds.get(kind, 0) + 1
    report["edges"] = kinds
    seen: dict[str, int] = {}
    for n in nodes:
        for a, v in attributes(n).items():
            seen[f"{a}={v}"] = seen.get(f"{a}={v}", 0) + 1
    report["captured_node_attributes"] = seen

    def clone() -> int:
        cloned = vp()
        D.call("cuGraphClone", C.byref(cloned), vp(raw))
        return cloned.value or 0

    # name -> (graph builder, instantiate flags, the captured graph whose buffers it uses)
    variants: dict[str, tuple[Callable[[], int], int, str]] = {
        "clone": (clone, 0, "pdl"),
        "clone_node_priority": (clone, USE_NODE_PRIORITY, "pdl"),
        "rebuilt": (lambda: rebuild(raw, "after", False), 0, "pdl"),
        "rebuilt_inline": (lambda: rebuild(raw, "inline", False), 0, "pdl"),
        "rebuilt_attrs": (lambda: rebuild(raw, "after", True), 0, "pdl"),
        "rebuilt_pss": (lambda: rebuild(raw, "after", False, pss=True), 0, "pdl"),
        "rebuilt_full": (lambda: rebuild(raw, "full", False), 0, "pdl"),
        "rebuilt_plain": (lambda: rebuild(raw_plain, "after", False), 0, "plain"),
    }
    execs: dict[str, tuple[int, str]] = {}
    report["failed"] = {}
    for key, (build, flags, source) in variants.items():
        try:
            execs[key] = (instantiate(build(), flags), source)
        except D.DriverError as e:  # reported; the other variants still run (attribute 6 may be launch-only)
            report["failed"][key] = str(e)
    outputs = {}
    for rnd in range(3):  # alternating rounds: a drifting clock shows as spread, not as a ratio
        for key in ("plain", "pdl"):
            g, _, out = graphs[key]
            name = "captured_plain" if key == "plain" else "captured"
            report["us"].setdefault(name, []).append(round(back_to_back_ms(g.replay, args.reps) * 1e3, 1))
            if rnd == 0:
                outputs[name] = out.clone()
        for key, (exe, source) in execs.items():
            out = graphs[source][2]
            out.zero_()
            report["us"].setdefault(key, []).append(round(back_to_back_ms(launcher(exe), args.reps) * 1e3, 1))
            if rnd == 0:
                outputs[key] = out.clone()
        print(json.dumps({k: v[-1] for k, v in report["us"].items()}), flush=True)
    want = outputs["captured_plain"]
    report["bitwise_equal_to_plain"] = {k: bool(torch.equal(want, o)) for k, o in outputs.items()}
    report["median_us"] = {k: sorted(v)[1] for k, v in report["us"].items()}
    report["over_captured"] = {k: round(v / report["median_us"]["captured"], 3) for k, v in report["median_us"].items()}
    shown = ("edges", "captured_node_attributes", "failed", "median_us", "over_captured", "bitwise_equal_to_plain")
    print(json.dumps({k: report[k] for k in shown}), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(report["bitwise_equal_to_plain"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
