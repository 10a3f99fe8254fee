"""GPU machine, issue 19: can one persistent kernel run a decode step's chain of dependent
projections faster than a kernel per projection? On the H100 a dependent kernel costs ~1 us even
when empty (`graph_launch_probe.py`), and a small projection 3-5 us in SmolLM2's decode graph:
its weight loads start cold when its predecessor ends. Inside one kernel whose programs stay
resident, a program can load its slice of the next projection's weights before it waits for the
activations (weights are nobody's output), and programs meet at a grid barrier (an atomic
counter) instead of a kernel boundary. Before any recipe work this measures the two costs that
decide it: a barrier, and a projection whose weights were loaded ahead.

A chain of L square projections y <- W_l y (one row, distinct bf16 weights per link, more than L2
holds; SmolLM2's 576 wide x 120 links, the ~1B's 2,048 x 64), as one CUDA graph each way:
- `flare::gemv`, tuned, one kernel per link;
- one persistent kernel, each program owning ROWS output rows of every link: waits until every
  program finished the previous link, reads y, computes its rows, stores them, arrives;
  `ahead` loads the next link's weight slice before waiting, `after` once the wait is over.
Reports the time per link and the relative error against the gemv chain.

    python3 qualification/persistent_probe.py OUT.json
"""

# mypy: disable-error-code="no-untyped-def"
# Triton reads a kernel's parameter annotations to specialize it, so the kernel's pointer and
# scalar parameters stay unannotated (as in ignition's kernel modules).
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdl_probe import captured, replay_ms

from ignition.capture.gemv import CANDIDATES, Problem, Variant, launch, tune

# (name, width, links, output rows per program, warps): at most one program per SM (72 and 128),
# each holding its rows of a link's weights (and of the next link's) in registers.
CHAINS = (("smollm2", 576, 120, 8, 4), ("llama_1b", 2048, 64, 16, 16))
# Spins a program makes at a barrier before it gives up and flags the run: programs that are not
# all resident at once would wait for each other forever (~50 ms per barrier at most).
SPIN_LIMIT = 1 << 16


@triton.jit
def _chain_kernel(X, W, Y, BAR, FAIL, L, N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr,
                  AHEAD: tl.constexpr, LIMIT: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    ks = tl.arange(0, KP)
    at = rows[:, None].to(tl.int64) * K + ks[None, :]
    kmask = (ks < K)[None, :]
    w = tl.load(W + at, mask=kmask, other=0.0)
    for link in range(L):
        if not AHEAD:
            w = tl.load(W + link * N * K + at, mask=kmask, other=0.0)
        if link > 0:
            target = link * programs
            spins = 0
            while (tl.atomic_add(BAR, 0, sem="acquire") < target) & (spins < LIMIT):
                spins += 1
            if spins >= LIMIT:
                tl.store(FAIL, 1)
        src = X if link == 0 else Y + ((link - 1) % 2) * N
        x = tl.load(src + ks, mask=ks < K, other=0.0, cache_modifier=".cg")
        nxt = w
        if AHEAD:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if link + 1 < L:
                nxt = tl.load(W + (link + 1) * N * K + at, mask=kmask, other=0.0)
        acc = tl.sum(w.to(tl.float32) * x[None, :].to(tl.float32), 1)
        tl.store(Y + (link % 2) * N + rows, acc.to(Y.dtype.element_ty))
        tl.debug_barrier()  # every thread's rows stored before the arrival's release
        tl.atomic_add(BAR, 1, sem="release")
        w = nxt


def persistent(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, bar: torch.Tensor, fail: torch.Tensor,
               rows: int, warps: int, ahead: bool) -> torch.Tensor:  # fmt: skip
    links, n, k = w.shape
    bar.zero_()
    _chain_kernel[(n // rows,)](
        x, w, y, bar, fail, links, N=n, K=k, KP=triton.next_power_of_2(k), ROWS=rows, AHEAD=ahead,
        LIMIT=SPIN_LIMIT, num_warps=warps,
    )  # fmt: skip
    return y[(links - 1) % 2]


def per_kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x
    for link in range(w.shape[0]):
        y = launch(y, w[link])
    return y


def main() -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "sms": sms, "chains": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    for name, n, links, rows, warps in CHAINS:
        w = (torch.randn(links, n, n, generator=gen, device="cuda") * n**-0.5).bfloat16()
        x = torch.randn(1, n, generator=gen, device="cuda").bfloat16()
        tune([Problem(name, list(w), Variant())], [1], [c for c in CANDIDATES if c.split == 1])
        graph, want = captured(lambda: per_kernel(x, w))  # noqa: B023 (captured at once)
        case: dict[str, Any] = {"chain": name, "width": n, "links": links, "programs": n // rows}
        if n // rows > sms:
            case["skipped"] = f"{n // rows} programs cannot all be resident on {sms} SMs"
            report["chains"].append(case)
            continue
        case["per_kernel_us_per_link"] = round(replay_ms(graph, 100) * 1e3 / links, 2)
        for ahead in (False, True):
            key = "ahead" if ahead else "after"
            y = torch.empty(2, n, dtype=torch.bfloat16, device="cuda")
            bar = torch.zeros(1, dtype=torch.int32, device="cuda")
            fail = torch.zeros(1, dtype=torch.int32, device="cuda")
            try:
                graph, got = captured(lambda: persistent(x[0], w, y, bar, fail, rows, warps, ahead))  # noqa: B023
                us = replay_ms(graph, 100) * 1e3 / links
                err = float((got.float() - want[0].float()).norm() / want[0].float().norm())
                case[key] = {
                    "us_per_link": round(us, 2),
                    "rel_l2_vs_per_kernel": err,
                    "barrier_gave_up": bool(fail.item()),
                }
                ok &= err < 0.1 and not fail.item()  # 120 bf16 roundings each way: a sanity bound
            except Exception as e:  # a variant that cannot compile or launch is a result
                case[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                ok = False
        report["chains"].append(case)
        print(json.dumps(case), flush=True)
    Path(sys.argv[1]).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
