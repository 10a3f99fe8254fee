"""GPU machine: where one replay of a graph spends its time, kernel by kernel, from an exported
core (replayed through the CUDA driver, as Helios does; torch only as CUPTI's recorder).

For each graph (default: every decode bucket and the largest prefill capacity):
- inputs from a real request (prompts admitted and prefilled first), so every kernel sees what
  serving gives it; a decode step's request holds `--decode-context` tokens (default 288, the
  floor harness's 32-token prompt plus 256 decoded tokens, so graph time compares with its
  back-to-back replay; 32 before 2026-12-06, when SmolLM2's graph time was 88 us shorter);
- graph time: back-to-back replays timed with events;
- in-graph kernel time: CUPTI's record of the same replays (torch.profiler), so durations and the
  gaps between kernels are what the graph really does, L2 state included;
- alone time: each kernel launched by itself between two events (what a kernel costs without
  its neighbours; the sum overstates launch gaps, not the graph);
- attribution: a kernel reading a weight buffer named `layers.I.ROLE` belongs to layer I and that
  role; kernels reading no layer weight belong to the layer of the last one that did ("prologue"
  before the first, "head" after the last layer's weights: final norm, vocabulary projection,
  sampler); achieved weight bytes/s for every kernel that reads weights.

    python3 qualification/kernel_breakdown.py CORE OUT.json [--graphs decode_b1,prefill_t512] [--hbm-gbps GBPS]
        [--decode-context TOKENS]
"""

from __future__ import annotations

import argparse
import ctypes as C
import json
import re
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from hbm import peak_gbps  # a sibling: the script directory is on the path

from ignition.capture.driver import ParamBuffer
from ignition.core.stepping import Row, Sampling, admit
from ignition.replay.core import CoreFiles, GraphInfo, topological
from ignition.replay.cuda import DeviceCore
from ignition.replay.harness import CoreReplay

LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def kernel_nodes(core: CoreFiles, g: GraphInfo) -> list[dict[str, Any]]:
    """Kernel nodes in dependency order with the weights they read and their attribution."""
    weights_role = core.schema.enum_values("BufferRole")["BUFFER_ROLE_WEIGHTS"]
    out: list[dict[str, Any]] = []
    layer: int | str = "prologue"
    seen_layers: set[int] = set()
    for i in topological(g.message):
        n = g.message.nodes[i]
        if n.WhichOneof("op") != "kernel":
            continue
        k = n.kernel
        reads: list[str] = []
        nbytes = 0
        for r in k.relocations:
            b = core.buffers[r.buffer_id]
            if b.role == weights_role and b.name not in reads:
                reads.append(b.name)
                nbytes += b.byte_size
        layers = sorted({int(m.group(1)) for w in reads if (m := LAYER.match(w))})
        if layers:
            layer = layers[0]
            seen_layers.update(layers)
        elif reads and seen_layers:
            layer = "head"
        roles = [m.group(2) if (m := LAYER.match(w)) else w for w in reads]
        if not seen_layers and not layers and reads:
            # Before the first layer a weight is the embedding table, read by rows (a gather).
            roles, nbytes = ["embedding"], 0
        out.append(
            {
                "node": int(n.id),
                "function": core.kernels[k.kernel_id].function_name,
                "grid": [k.grid.x, k.grid.y, k.grid.z],
                "block": [k.block.x, k.block.y, k.block.z],
                "layer": layer,
                "reads": roles,
                "weight_bytes": nbytes,
                "_buffers": [r.buffer_id for r in k.relocations if core.buffers[r.buffer_id].role == weights_role],
                "op": "+".join(roles) if roles else category(core.kernels[k.kernel_id].function_name),
                "_message": n,
            }
        )
    return out


def category(function: str) -> str:
    """An operator name for a kernel that reads no weights, from its function name."""
    f = function.lower()
    for key, name in (
        # Ignition's own Triton kernels, by their function names.
        ("delta_rule_chunked", "gdn_delta_prefill_chunked"),
        ("delta_rule", "gdn_delta"),
        ("conv_prefill", "gdn_conv"),
        ("conv_step", "gdn_conv"),
        ("store_row", "store_row"),
        ("flare_sample", "sampler"),
        ("flare_rms_norm", "norm"),
        ("commit_columns", "commit_columns"),
        ("write_attend", "attention"),
        ("gemv", "gemv"),
        ("kv_write", "kv_write"),
        ("paged_attention_combine", "attention_combine"),
        ("paged_attention", "attention"),
        ("softmax", "sampler"),
        ("argmax", "sampler"),
        ("lshift", "sampler"),
        ("rshift", "sampler"),
        ("cos", "rope_tables"),
        ("index_put", "state_update"),
        ("rsqrt", "norm"),
    ):
        if key in f:
            return name
    return "pointwise" if "poi" in f else "reduction" if ("red" in f or "per" in f) else "other"


def setup(rep: CoreReplay, g: GraphInfo, context: int) -> list[Row]:
    """Admits requests and returns the rows of one realistic step of `g` (decode: each request
    holding `context` tokens)."""
    if g.kind == "decode":
        rows = []
        for j in range(g.request_count):
            prompt = [(7 + 13 * j + 5 * i) % 1000 + 10 for i in range(context)]
            pages = rep.pages_for(j, context + 8)
            live = rep.live_row(j)  # slots own verification-width rows: live rows are apart
            first = admit(rep, live, pages, prompt, 5 + j, Sampling())
            rows.append(Row(live, pages, context, [first], (5 + j, 1)))
        return rows
    cap = g.token_capacity
    pages = rep.pages_for(0, cap)
    rep.initialize(rep.live_row(0))
    return [Row(rep.live_row(0), pages, 0, [(11 + 3 * k) % 1000 + 10 for k in range(cap)], (5, 0))]


def graph_time_us(dev: DeviceCore, g: GraphInfo, reps: int) -> float:
    times = []
    for _ in range(5):
        a, b = C.c_void_p(), C.c_void_p()
        dev.call("cuEventCreate", C.byref(a), C.c_uint(0))
        dev.call("cuEventCreate", C.byref(b), C.c_uint(0))
        dev.call("cuEventRecord", a, dev.stream)
        for _ in range(reps):
            dev.launch(g.id)
        dev.call("cuEventRecord", b, dev.stream)
        dev.synchronize()
        ms = C.c_float()
        dev.call("cuEventElapsedTime", C.byref(ms), a, b)
        times.append(ms.value * 1e3 / reps)
    return statistics.median(times)


def in_graph(dev: DeviceCore, g: GraphInfo, count: int, reps: int) -> list[list[tuple[str, float, float]]] | str:
    """Per replay, its kernels as (name, start us, duration us) from CUPTI, or why not."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError as e:
        return f"torch.profiler unavailable: {e}"
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            dev.launch(g.id)
        dev.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    ev = sorted(
        (
            (e["name"], float(e["ts"]), float(e["dur"]))
            for e in trace.get("traceEvents", [])
            if e.get("cat") == "kernel"
        ),
        key=lambda e: e[1],
    )
    if len(ev) != count * reps:
        return f"CUPTI recorded {len(ev)} kernels for {reps} replays of {count}"
    return [ev[i * count : (i + 1) * count] for i in range(reps)]


def exposed(trace: list[tuple[str, float, float]]) -> list[float]:
    """Each kernel's time past every kernel that started before it (start order): its duration
    when the graph runs its kernels one after another; with programmatic edges a dependent
    starts early and waits, and only its time past its predecessors' ends extends the step.
    The sum is the time some kernel was running."""
    out, reached = [], float("-inf")
    for _, start, dur in trace:
        end = start + dur
        out.append(max(0.0, end - max(start, reached)))
        reached = max(reached, end)
    return out


def alone_us(core: CoreFiles, dev: DeviceCore, nodes: list[dict[str, Any]]) -> list[float]:
    """Each kernel launched by itself, in dependency order, between two events."""
    lib_events = []
    keep = []
    for n in nodes:
        k = n["_message"].kernel
        buf = ParamBuffer(core.kernel_params(n["_message"], dev.base))
        a, b = C.c_void_p(), C.c_void_p()
        dev.call("cuEventCreate", C.byref(a), C.c_uint(0))
        dev.call("cuEventCreate", C.byref(b), C.c_uint(0))
        dev.call("cuEventRecord", a, dev.stream)
        dev.call(
            "cuLaunchKernel",
            C.c_void_p(dev.functions[k.kernel_id]),
            C.c_uint(k.grid.x),
            C.c_uint(k.grid.y),
            C.c_uint(k.grid.z),
            C.c_uint(k.block.x),
            C.c_uint(k.block.y),
            C.c_uint(k.block.z),
            C.c_uint(k.dynamic_shared_memory),
            dev.stream,
            None,
            buf.extra,
        )
        dev.call("cuEventRecord", b, dev.stream)
        lib_events.append((a, b))
        keep.append(buf)
    dev.synchronize()
    out = []
    for a, b in lib_events:
        ms = C.c_float()
        dev.call("cuEventElapsedTime", C.byref(ms), a, b)
        out.append(ms.value * 1e3)
    return out


def summarize(
    core: CoreFiles, g: GraphInfo, nodes: list[dict[str, Any]], graph_us: float, hbm_gbps: float
) -> dict[str, Any]:
    have = all("us" in n for n in nodes)
    key = "us" if have else "alone_us"
    total = sum(n[key] for n in nodes)
    by_op: dict[str, dict[str, float]] = defaultdict(
        lambda: {"count": 0, "us": 0.0, "exposed_us": 0.0, "weight_bytes": 0}
    )
    by_layer: dict[str, dict[str, float]] = defaultdict(lambda: {"kernels": 0, "us": 0.0})
    by_function: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "us": 0.0})
    for n in nodes:
        o = by_op[n["op"]]
        o["count"] += 1
        o["us"] += n[key]
        o["exposed_us"] += n.get("exposed_us", 0.0)
        o["weight_bytes"] += n["weight_bytes"]
        lay = by_layer[str(n["layer"])]
        lay["kernels"] += 1
        lay["us"] += n[key]
        f = by_function[n["function"]]
        f["count"] += 1
        f["us"] += n[key]
    # Each weight buffer once (a tied table is read by the gather and the vocabulary projection).
    unique: dict[int, int] = {}
    for n in nodes:
        if n["weight_bytes"]:
            unique.update((b, int(core.buffers[b].byte_size)) for b in n["_buffers"])
    weight_bytes = sum(unique.values())
    layer_ids = sorted(int(k) for k in by_layer if k.isdigit())
    mid = str(layer_ids[len(layer_ids) // 2]) if layer_ids else None
    ops = []
    for name, o in sorted(by_op.items(), key=lambda kv: -kv[1]["us"]):
        entry = {"op": name, "count": int(o["count"]), "us": round(o["us"], 1), "share": round(o["us"] / total, 3)}
        if have:  # in-graph timings: the time the op extends the step (`exposed`)
            entry["exposed_us"] = round(o["exposed_us"], 1)
        if o["weight_bytes"]:
            entry["weight_gb_per_s"] = round(o["weight_bytes"] / o["us"] / 1e3, 1)
        ops.append(entry)
    return {
        "graph": g.name,
        "kind": g.kind,
        "rows": g.request_count,
        "tokens": g.token_capacity,
        "timing_source": "cupti_in_graph" if have else "launched_alone",
        "kernels": len(nodes),
        "kernels_per_layer": int(by_layer[mid]["kernels"]) if mid else None,
        "graph_us": round(graph_us, 1),
        "sum_of_kernels_us": round(total, 1),
        # Time some kernel ran (`exposed`); below the sum when kernels overlap (programmatic edges).
        "sum_of_exposed_us": round(sum(n.get("exposed_us", 0.0) for n in nodes), 1) if have else None,
        "gaps_us": round(graph_us - total, 1),
        "weight_bytes": weight_bytes,
        "hbm_bound_us": round(weight_bytes / (hbm_gbps * 1e3), 1),
        "fraction_of_hbm_bound": round(weight_bytes / (hbm_gbps * 1e3) / graph_us, 3),
        "by_op": ops,
        "by_layer": {k: {"kernels": int(v["kernels"]), "us": round(v["us"], 1)} for k, v in by_layer.items()},
        "by_function": [
            {"function": k, "count": int(v["count"]), "us": round(v["us"], 1)}
            for k, v in sorted(by_function.items(), key=lambda kv: -kv[1]["us"])
        ][:30],
        "nodes": [{k: v for k, v in n.items() if not k.startswith("_")} for n in nodes],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("core", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--graphs", help="comma-separated graph names (default: decode buckets + largest prefill)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--decode-context", type=int, default=288, help="tokens each decode request holds")
    ap.add_argument("--hbm-gbps", type=float, help="GB/s for the HBM bound (default: the device's datasheet figure)")
    args = ap.parse_args()
    args.hbm_gbps, hbm_source = peak_gbps(args.hbm_gbps)
    core = CoreFiles(args.core)
    dev = DeviceCore(core)
    rep = CoreReplay(core, dev)
    names = (
        args.graphs.split(",")
        if args.graphs
        else [g.name for g in core.by_kind("decode")] + [core.by_kind("prefill")[-1].name]
    )
    report: dict[str, Any] = {
        "core": str(args.core),
        "hbm_gbps": args.hbm_gbps,
        "hbm_source": hbm_source,
        "decode_context": args.decode_context,
        "graphs": [],
    }
    for name in names:
        g = next(x for x in core.graphs if x.name == name)
        rows = setup(rep, g, args.decode_context)
        rep.rows_step(g, rows)
        nodes = kernel_nodes(core, g)
        graph_us = graph_time_us(dev, g, args.reps)
        traced = in_graph(dev, g, len(nodes), 5)
        if isinstance(traced, str):
            report.setdefault("notes", []).append(f"{name}: {traced}")
        else:
            shown = [exposed(t) for t in traced]
            for i, n in enumerate(nodes):
                names_seen = {t[i][0] for t in traced}
                n["us"] = round(statistics.median(t[i][2] for t in traced), 2)
                n["exposed_us"] = round(statistics.median(e[i] for e in shown), 2)
                nxt = [t[i + 1][1] - (t[i][1] + t[i][2]) for t in traced if i + 1 < len(t)]
                n["gap_after_us"] = round(statistics.median(nxt), 2) if nxt else None
                if n["function"] not in names_seen:
                    n["cupti_name"] = sorted(names_seen)[0]
        for n, us in zip(nodes, alone_us(core, dev, nodes), strict=True):
            n["alone_us"] = round(us, 2)
            if n["weight_bytes"] and "us" in n:
                n["weight_gb_per_s"] = round(n["weight_bytes"] / n["us"] / 1e3, 1)
        s = summarize(core, g, nodes, graph_us, args.hbm_gbps)
        report["graphs"].append(s)
        brief = {k: s[k] for k in ("graph", "timing_source", "kernels", "kernels_per_layer", "graph_us")}
        brief.update({k: s[k] for k in ("sum_of_kernels_us", "sum_of_exposed_us", "gaps_us", "hbm_bound_us")})
        brief["fraction_of_hbm_bound"] = s["fraction_of_hbm_bound"]
        print(json.dumps(brief))
        for o in s["by_op"][:10]:
            print("   ", json.dumps(o))
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    dev.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
