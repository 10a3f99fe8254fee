"""GPU machine, issue 19: what launching a CUDA graph costs beyond its kernels. On the H100
(2026-12-06) SmolLM2's decode_b1 replays back to back in 670 us between CUDA events (the kernel
breakdown's graph time, equal to CUPTI's kernel sum) but in 758 us on the host clock in the
floor harness, and `flare run` decodes in 758 us. This separates a per-replay cost from a
per-kernel one on synthetic graphs of N one-element kernels (N = 50 to 400):
- back-to-back replays of one graph exec (CUDA events around R replays), and of two execs of
  the same capture alternated (as an executor with two steps in flight could launch them);
- each replay's kernel span and the idle time between replays, from torch's profiler (CUPTI),
  which shows what profiling adds;
- the replay time fitted against N: a per-replay intercept and a per-kernel slope.

    python3 qualification/graph_launch_probe.py OUT.json
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

KERNELS = (50, 100, 200, 400)
REPS = 200
PROFILED = 8


def capture(x: torch.Tensor, n: int) -> torch.cuda.CUDAGraph:
    """A graph of n dependent one-element kernels."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            x.add_(1)
    return graph


def replay_us(graphs: list[torch.cuda.CUDAGraph]) -> float:
    """Per replay, REPS replays cycling through `graphs` back to back (events around them)."""
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(REPS):
        graphs[i % len(graphs)].replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1000 / REPS


def spans(graph: torch.cuda.CUDAGraph, n: int) -> dict[str, float | str]:
    """PROFILED back-to-back replays under the profiler: the median kernel span of a replay, the
    median idle time between one replay's last kernel and the next one's first, and the median
    kernel duration."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "add" in e.name.lower()
    )
    if len(kernels) != n * PROFILED:
        return {"error": f"{len(kernels)} kernels profiled, expected {n * PROFILED}"}
    groups = [kernels[i * n : (i + 1) * n] for i in range(PROFILED)]
    return {
        "span_us": statistics.median(g[-1][1] - g[0][0] for g in groups),
        "between_replays_us": statistics.median(b[0][0] - a[-1][1] for a, b in itertools.pairwise(groups)),
        "kernel_us": statistics.median(e - s for s, e in kernels),
    }


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> int:
    x = torch.zeros(1, device="cuda")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "reps": REPS, "cases": []}
    for n in KERNELS:
        one, other = capture(x, n), capture(x, n)
        case: dict[str, Any] = {"kernels": n, "replay_us": round(replay_us([one]), 2)}
        case["replay_us_two_execs_alternated"] = round(replay_us([one, other]), 2)
        case |= {k: round(v, 2) if isinstance(v, float) else v for k, v in spans(one, n).items()}
        report["cases"].append(case)
        print(json.dumps(case), flush=True)
    a, b = fit([float(c["kernels"]) for c in report["cases"]], [c["replay_us"] for c in report["cases"]])
    report["replay_us_fit"] = {"per_replay_us": round(a, 2), "per_kernel_us": round(b, 3)}
    print(json.dumps(report["replay_us_fit"]), flush=True)
    Path(sys.argv[1]).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
