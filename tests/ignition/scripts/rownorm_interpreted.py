"""Runs `flare::rms_norm`'s kernel under Triton's CPU interpreter against the eager reference
for each mode (rms, zero-centred, gated), in float32 and float16, over widths that are and are
not powers of two and strided rows (q/k heads viewed out of a fused projection). Checks that a
row's result is bitwise the same whatever rows share its launch, and that the op is called from
compiled code. Prints one JSON line; exit 1 on a mismatch. Needs TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import sys

import torch
from torch._inductor.utils import run_and_get_code

from ignition.capture.gemv import Projections
from ignition.capture.rownorm import MODES, launch, reference

gen = torch.Generator().manual_seed(0)
worst = {"float32": 0.0, "float16": 0.0}
invariant = True
cases = 0
for dtype in (torch.float32, torch.float16):
    for d in (64, 100, 576):
        for mode in MODES:
            x = (torch.randn(37, d, generator=gen) * 3).to(dtype)
            w = (torch.randn(d, generator=gen) * 0.5 + 1).to(dtype)
            gate = torch.randn(37, d, generator=gen).to(dtype) if mode == "gated" else None
            want = reference(x, w, 1e-6, mode, gate)
            got = launch(x, w, 1e-6, mode, gate)
            ulp = torch.finfo(dtype).eps
            err = ((got.float() - want.float()).abs() / (want.float().abs() + 1)).max().item() / ulp
            worst[str(dtype).split(".")[1]] = max(worst[str(dtype).split(".")[1]], err)
            for lo, hi in ((0, 1), (5, 6), (3, 11), (36, 37)):
                alone = launch(x[lo:hi], w, 1e-6, mode, gate[lo:hi] if gate is not None else None)
                invariant &= torch.equal(alone, got[lo:hi])
            cases += 1
# Strided rows: the q heads of a fused projection (Qwen3.5's q is each head's first half of
# [query | gate]), and a gate of another shape.
qkv = torch.randn(5, 3 * 4 * 64, generator=gen)
q = qkv[:, : 4 * 64].reshape(5, 4, 64)[..., :32]
z = qkv[:, 4 * 64 : 4 * 64 + 4 * 32]
w = torch.rand(32, generator=gen) + 0.5
got_q = launch(q, w, 1e-6, "zero_centred")
got_g = launch(q, w, 1e-6, "gated", z.reshape(5 * 4, 32)[:, None, :])
strided = max(
    (got_q - reference(q, w, 1e-6, "zero_centred")).abs().max().item(),
    (got_g - reference(q, w, 1e-6, "gated", z.reshape(5, 4, 32))).abs().max().item(),
)


def step(x: torch.Tensor, proj: Projections) -> torch.Tensor:
    h = proj.norm(x, w4, 1e-6, "zero_centred", few_rows=True)
    return proj.norm(h * 2, w4, 1e-6, "gated", x, few_rows=True)


w4 = torch.rand(48, generator=gen)
x4 = torch.randn(3, 48, generator=gen)
got4, code = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False), x4, Projections(kernel=True))
calls = sum(src.count("flare.rms_norm") for src in code)
err4 = (got4 - step(x4, Projections(kernel=False))).abs().max().item()
report = {"cases": cases, "worst_ulps": worst, "row_invariant": invariant, "strided_err": strided}
report.update({"op_calls_in_compiled_code": calls, "compiled_err": err4})
print(json.dumps(report))
ok = invariant and worst["float32"] < 8 and worst["float16"] <= 1 and strided < 1e-5 and calls >= 2 and err4 < 1e-5
sys.exit(0 if ok else 1)
