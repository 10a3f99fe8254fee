"""`flare::gemv` inside a torch.compile'd layer loop on CPU (Triton's interpreter runs the kernel,
float32): the compiled code calls the op (it is not traced through or replaced), its outputs
match the eager reference, and the decode-style loop with every prologue and epilogue variant
compiles without a graph break. Prints one JSON line; exit 1 on a mismatch.
Needs TRITON_INTERPRET=1 before Triton is imported."""

from __future__ import annotations

import json
import sys

import torch
from torch._inductor.utils import run_and_get_code

from ignition.capture.gemv import Projections

gen = torch.Generator().manual_seed(0)
layers, h, f, m = 2, 64, 96, 3
w = {
    "norm": [torch.rand(h, generator=gen) + 0.5 for _ in range(layers)],
    "qkv": [torch.randn(h, h, generator=gen) * 0.1 for _ in range(layers)],
    "gate_up": [torch.randn(2 * f, h, generator=gen) * 0.1 for _ in range(layers)],
    "down": [torch.randn(h, f, generator=gen) * 0.1 for _ in range(layers)],
    "bias": [torch.randn(h, generator=gen) for _ in range(layers)],
}


def step(x: torch.Tensor, proj: Projections) -> torch.Tensor:
    for i in range(layers):
        a = proj(x, w["qkv"][i], w["bias"][i], norm=w["norm"][i], eps=1e-6, few_rows=True)
        x = proj(a, w["qkv"][i], residual=x, few_rows=True)
        gu = proj(x, w["gate_up"][i], norm=w["norm"][i], eps=1e-6, few_rows=True)
        x = proj(gu, w["down"][i], glu=True, residual=x, few_rows=True)
    return x


x = torch.randn(m, h, generator=gen)
want = step(x, Projections(kernel=False))
compiled = torch.compile(step, fullgraph=True, dynamic=False)
got, code = run_and_get_code(compiled, x, Projections(kernel=True))
calls = sum(src.count("flare.gemv") for src in code)
err = (got - want).abs().max().item()
print(json.dumps({"gemv_calls_in_compiled_code": calls, "max_abs_err": err}))
sys.exit(0 if calls >= 4 * layers and err < 1e-4 else 1)
