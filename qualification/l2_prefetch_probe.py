"""GPU machine, issue 19: can a graph branch that pulls the next layer's weights into L2 while
this layer computes shorten a decode step? A dependent kernel costs ~1 us on an H100 even when
empty (`graph_launch_probe.py`), and SmolLM2's small projections take 3-5 us each in its decode
graph because each starts its weight loads cold from HBM when its predecessor ends. The weights
are nobody's output, so they can be read ahead.

The chain of `pdl_probe.py` (every layer's four `flare::gemv` projections, tuned, random bf16
weights: SmolLM2's and the ~1B's geometries), captured as one CUDA graph:
- plain;
- with a side stream forked at each layer that prefetches the next layer's weights into L2
  (`prefetch.global.L2::evict_last`, one per 128-byte line, from a few programs), joined once
  at the end: the branch runs beside the chain, one layer ahead, never further;
- the same with plain loads summed into a sink instead of prefetch instructions.
Each as the median of single replays (events), against the HBM bound, outputs compared bitwise
with the plain chain's (the branch writes nothing the chain reads).

    python3 qualification/l2_prefetch_probe.py CONFIG.json OUT.json [--rows 1,4] [--programs 8,32]
"""

# mypy: disable-error-code="no-untyped-def"
# Triton reads a kernel's parameter annotations to specialize it, so the kernels' pointer and
# scalar parameters stay unannotated (as in ignition's kernel modules).
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemv_check import problems  # siblings: the script directory is on the path
from hbm import peak_gbps
from pdl_probe import captured, layer, replay_ms

from ignition.capture.gemv import CANDIDATES, precompile, tune

LINE = 128  # bytes per L2 line (a prefetch instruction fetches one)


@triton.jit
def _prefetch_lines(W, n_lines, LINES: tl.constexpr):
    """Each program prefetches every num_programs-th block of LINES 128-byte lines of W into L2."""
    pid = tl.program_id(0)
    lines = tl.arange(0, LINES)
    for start in range(pid * LINES, n_lines, tl.num_programs(0) * LINES):
        idx = start + lines
        ptr = W + tl.minimum(idx, n_lines - 1).to(tl.int64) * 128
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _load_lines(W, SINK, n_lines, LINES: tl.constexpr):
    """As `_prefetch_lines` with one 4-byte load per line, summed into SINK[pid] (kept live)."""
    pid = tl.program_id(0)
    lines = tl.arange(0, LINES)
    acc = tl.zeros([LINES], tl.int32)
    for start in range(pid * LINES, n_lines, tl.num_programs(0) * LINES):
        idx = start + lines
        acc += tl.load(W + idx.to(tl.int64) * 32, mask=idx < n_lines, other=0, eviction_policy="evict_last")
    tl.store(SINK + pid, tl.sum(acc, 0))


def prefetch(weights: list[torch.Tensor], programs: int, mode: str, sink: torch.Tensor) -> None:
    for w in weights:
        n_lines = w.numel() * w.element_size() // LINE
        if mode == "prefetch":
            _prefetch_lines[(programs,)](w, n_lines, LINES=256, num_warps=4)
        else:
            _load_lines[(programs,)](w.view(torch.int32), sink, n_lines, LINES=256, num_warps=4)


def chain(cfg: dict[str, Any], probs: dict[str, Any], x: torch.Tensor, ahead: tuple[str, int] | None) -> torch.Tensor:
    """`pdl_probe.chain` (plain launches), with the next layer's weights read ahead on a side
    stream when `ahead` = (mode, programs)."""
    main = torch.cuda.current_stream()
    # The side stream and the load variant's sink (nothing the plain chain's graph holds: its
    # graph is `pdl_probe`'s plain one).
    branch = None if ahead is None else (torch.cuda.Stream(), torch.empty(ahead[1], dtype=torch.int32, device="cuda"))
    layers = cfg["num_hidden_layers"]
    for i in range(layers):
        if branch is not None and ahead is not None and i + 1 < layers:
            side, sink = branch
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(
                    [probs[n].weights[i + 1] for n in ("qkv", "o_proj", "gate_up", "down")], ahead[1], ahead[0], sink
                )
        x = layer(cfg, probs, x, i)
    if branch is not None:
        main.wait_stream(branch[0])
    return x


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--programs", default="8,32")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    hbm_gbps, hbm_source = peak_gbps(None)
    cfg = json.loads(args.config.read_text())
    rows = [int(r) for r in args.rows.split(",")]
    layers = cfg["num_hidden_layers"]
    probs = {p.name: p for p in problems(cfg, layers) if p.name != "lm_head"}
    plain_tiles = [c for c in CANDIDATES if c.split == 1]
    precompile(list(probs.values()), rows, plain_tiles)
    tune(list(probs.values()), rows, plain_tiles)
    weight_bytes = sum(w.numel() * w.element_size() for p in probs.values() for w in p.weights)
    bound_us = weight_bytes / (hbm_gbps * 1e3)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "config": str(args.config),
        "weight_bytes": weight_bytes,
        "hbm_source": hbm_source,
        "hbm_bound_us": round(bound_us, 1),
        "rows": {},
    }
    variants: list[tuple[str, tuple[str, int] | None]] = [("plain", None)]
    for p in (int(v) for v in args.programs.split(",")):
        variants += [(f"prefetch_{p}", ("prefetch", p)), (f"load_{p}", ("load", p))]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    for m in rows:
        x0 = torch.randn(m, cfg["hidden_size"], generator=gen, device="cuda").bfloat16()
        entry: dict[str, Any] = {}
        plain_out = None
        for key, ahead in variants:
            try:
                graph, out = captured(functools.partial(chain, cfg, probs, x0.clone(), ahead))
                us = replay_ms(graph, args.reps) * 1e3
                entry[key] = {"graph_us": round(us, 1), "fraction_of_hbm_bound": round(bound_us / us, 3)}
                if plain_out is None:
                    plain_out = out.clone()
                else:
                    entry[key]["over_plain"] = round(us / entry["plain"]["graph_us"], 3)
                    entry[key]["bitwise_equal_to_plain"] = bool(torch.equal(out, plain_out))
                    ok &= entry[key]["bitwise_equal_to_plain"]
            except Exception as e:  # a variant that cannot compile or capture is a result
                entry[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        report["rows"][str(m)] = entry
        print(m, json.dumps(entry), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
