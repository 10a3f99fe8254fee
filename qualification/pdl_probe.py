"""GPU machine, issue 19 item 3: does programmatic dependent launch (PDL) measurably help the
decode graphs? Before any ABI or Helios work, this measures it where it can matter most: a
decode step's chain of `flare::gemv` projections, every layer of a model's geometry (random
bf16 weights), captured as one CUDA graph three times, the kernels launched plainly, as
programmatic dependents (`launch_pdl`: each waits for its predecessor before reading anything,
and lets its successor launch once its loads are done), as programmatic dependents that load
their first weight tile before waiting (weights are nobody's output), and as programmatic
dependents that let their successor launch right after their own wait ("early"), optionally
bulk-prefetching the first `pf` columns of their weight rows into L2 before waiting: each
kernel's prefetch then runs during its predecessor's whole loop, one kernel ahead.

Per layer: qkv (RMSNorm folded in), o_proj over the query part (residual), gate_up (RMSNorm),
down (SiLU-gate, residual): four kernels, no attention. Reports per row count each graph's replay
time, per kernel, against the HBM bound of the weights it streams, and whether the outputs are
bitwise equal to the plain launches' (a missing wait would show as a difference).

    python3 qualification/pdl_probe.py CONFIG.json OUT.json [--rows 1,4] [--reps 200]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemv_check import problems  # siblings: the script directory is on the path
from hbm import peak_gbps

from ignition.capture.gemv import CANDIDATES, launch, precompile, tune

# The chain's projections, in launch order.
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
# How each projection launches: name -> (PDL mode, L2 prefetch columns); absent: plainly.
Spec = dict[str, tuple[int, int]]


def uniform(pdl: int, pf: int = 0) -> Spec:
    return dict.fromkeys(PROJECTIONS, (pdl, pf))


def chain(cfg: dict[str, Any], probs: dict[str, Any], x: torch.Tensor, spec: Spec) -> torch.Tensor:
    """One decode step's projections through every layer (no attention): the activations after
    the last layer."""
    for i in range(cfg["num_hidden_layers"]):
        x = layer(cfg, probs, x, i, spec)
    return x


def layer(
    cfg: dict[str, Any], probs: dict[str, Any], x: torch.Tensor, i: int, spec: Spec | None = None
) -> torch.Tensor:
    """Layer i's four projections (qkv with its norm, o_proj with the residual, gate_up with its
    norm, down with the SiLU gate and the residual), each launched as `spec` says."""
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    eps = float(cfg.get("rms_norm_eps", 1e-6))

    m = {name: (spec or {}).get(name, (0, 0)) for name in PROJECTIONS}
    qkv = launch(x, probs["qkv"].weights[i], norm=probs["qkv"].norms[i], eps=eps, pdl=m["qkv"][0], pf_k=m["qkv"][1])
    x = launch(qkv[:, : heads * d], probs["o_proj"].weights[i], residual=x, pdl=m["o_proj"][0], pf_k=m["o_proj"][1])
    gu = launch(
        x,
        probs["gate_up"].weights[i],
        norm=probs["gate_up"].norms[i],
        eps=eps,
        pdl=m["gate_up"][0],
        pf_k=m["gate_up"][1],
    )
    return launch(gu, probs["down"].weights[i], residual=x, glu=True, pdl=m["down"][0], pf_k=m["down"][1])


def captured(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`step` run twice (compiles and warms outside the capture), then captured as one graph and
    replayed once: the graph and the output tensor it writes."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median of `reps` replays, each timed alone with events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)))
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--pf", default="8192", help="L2 prefetch columns per weight row, PDL mode 3 (early)")
    ap.add_argument("--late-pf", default="256,1024,4096", help="the same for PDL mode 4 (late)")
    ap.add_argument("--hbm-gbps", type=float, help="GB/s for the HBM bound (default: the device's datasheet figure)")
    args = ap.parse_args()
    args.hbm_gbps, hbm_source = peak_gbps(args.hbm_gbps)
    cfg = json.loads(args.config.read_text())
    rows = [int(r) for r in args.rows.split(",")]
    layers = cfg["num_hidden_layers"]
    probs = {p.name: p for p in problems(cfg, layers) if p.name != "lm_head"}
    # PDL launches are single-kernel: split configurations (a second, reducing launch) stay out.
    plain = [c for c in CANDIDATES if c.split == 1]
    precompile(list(probs.values()), rows, plain)  # in a process pool first, as prepare does
    tuned = tune(list(probs.values()), rows, plain)
    weight_bytes = sum(w.numel() * w.element_size() for p in probs.values() for w in p.weights)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "config": str(args.config),
        "kernels_per_step": 4 * layers,
        "weight_bytes": weight_bytes,
        "hbm_gbps": args.hbm_gbps,
        "hbm_source": hbm_source,
        "hbm_bound_us": round(weight_bytes / (args.hbm_gbps * 1e3), 1),
        "tiles": {name: t["config"] for name, t in tuned.items()},
        "rows": {},
    }
    pfs = [int(v) for v in args.pf.split(",") if v]
    late = [int(v) for v in args.late_pf.split(",") if v]
    modes: list[tuple[str, Spec]] = [("plain", {}), ("pdl", uniform(1)), ("pdl_prefetch", uniform(2))]
    modes += [("early", uniform(3))] + [(f"early_pf{c}", uniform(3, c)) for c in pfs]
    modes += [(f"late_pf{c}", uniform(4, c)) for c in late]
    # Per projection, in launch order: from every projection at PDL mode 1, each one's choice
    # among these kept where it shortens the whole chain (greedy, one pass).
    choices = [(3, 0)] + [(3, c) for c in pfs] + [(4, c) for c in late]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in rows:
        x0 = torch.randn(m, cfg["hidden_size"], generator=gen, device="cuda").bfloat16()
        entry: dict[str, Any] = {}
        outs: dict[str, torch.Tensor] = {}

        def timed(
            key: str,
            spec: Spec,
            x0: torch.Tensor = x0,
            outs: dict[str, torch.Tensor] = outs,
            entry: dict[str, Any] = entry,
        ) -> float:
            graph, out = captured(functools.partial(chain, cfg, probs, x0.clone(), spec))
            outs[key] = out.clone()
            us = replay_ms(graph, args.reps) * 1e3
            del graph
            entry[key] = {
                "spec": {k: list(v) for k, v in spec.items()},
                "graph_us": round(us, 1),
                "us_per_kernel": round(us / (4 * layers), 2),
                "fraction_of_hbm_bound": round(report["hbm_bound_us"] / us, 3),
            }
            return us

        for key, spec in modes:
            timed(key, spec)
        best, best_us = uniform(1), entry["pdl"]["graph_us"]
        for name in PROJECTIONS:
            for pdl, pf in choices:
                trial = {**best, name: (pdl, pf)}
                us = timed(f"greedy_{name}_{pdl}_{pf}", trial)
                if us < best_us:
                    best, best_us = trial, us
        timed("greedy_best", best)
        for key in list(entry):
            if key != "plain":
                entry[key]["over_plain"] = round(entry[key]["graph_us"] / entry["plain"]["graph_us"], 3)
        entry["outputs_bitwise_equal"] = all(bool(torch.equal(outs["plain"], o)) for o in outs.values())
        report["rows"][str(m)] = entry
        summary = {k: v["graph_us"] for k, v in entry.items() if isinstance(v, dict) and not k.startswith("greedy_")}
        print(m, json.dumps({**summary, "greedy_best": entry["greedy_best"]}), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(e["outputs_bitwise_equal"] for e in report["rows"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
