"""`flare::write_attend` inside a torch.compile'd layer loop, on CPU (Triton's interpreter runs
the kernels, float32), fed strided q/k/v views of a fused projection and rotating them itself:
the cache written in place matches the eager gather reference (bitwise where both paths
wrote from the same inputs), the outputs match (compiled: within float32 rounding of its matmuls),
and the compiled code allocates no KV-shaped buffer (the cache is never copied).
Prints one JSON line; exit 1 on a mismatch. Needs TRITON_INTERPRET=1 before Triton is imported."""

from __future__ import annotations

import json
import re
import sys

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from ignition.capture.attention import attend_gather, rotate, write_attend_op

op = write_attend_op()
layers, pages, t, h, kvh, d = 3, 10, 64, 4, 2, 64
kv_shape = (pages, layers, 2, t, kvh, d)
gen = torch.Generator().manual_seed(0)
# One fused QKV projection, as the recipe runs it: q/k/v reach the op as strided views.
wqkv = torch.randn(layers, (h + 2 * kvh) * d, h * d, generator=gen) * 0.05
tables = torch.tensor([[3, 7, -1, -1], [1, 8, 5, -1]]).int()
req = torch.tensor([0, 0, 1, 1]).int()
pos = torch.tensor([69, 70, 130, 131]).int()
slots = torch.tensor([7 * t + 5, 7 * t + 6, -1, 5 * t + 3]).long()  # one padded lane
scale = d**-0.5
ROWS = 16
inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)


def step(x: torch.Tensor, kv: torch.Tensor, fused: bool, p: torch.Tensor, sl: torch.Tensor) -> torch.Tensor:
    # As decode runs: rows padded to the GEMM minimum (inert: slot -1, position 0), and the
    # layer-invariant op inputs computed in the graph from graph inputs (nothing constant-folds).
    x, p, sl = F.pad(x, (0, 0, 0, ROWS - 4)), F.pad(p, (0, ROWS - 4)), F.pad(sl, (0, ROWS - 4), value=-1)
    rq = F.pad(req, (0, ROWS - 4))
    ang = p.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    for i in range(layers):
        qkv = (x @ wqkv[i].T).view(-1, h + 2 * kvh, d)
        q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        if fused:
            o = op(q, k, v, cos, sin, kv, sl, tables, rq, p, i, scale)
            o = o.reshape(x.shape[0], h * d)
        else:
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            ok = sl >= 0
            page, off = torch.where(ok, sl // t, 0), sl % t
            kv[page[ok], i, 0, off[ok]] = k[ok]
            kv[page[ok], i, 1, off[ok]] = v[ok]
            o = attend_gather(q, kv, i, tables.long().clamp(min=0), rq, p, scale)
        x = x + torch.tanh(o)
    return x[:4]


x = torch.randn(4, h * d, generator=gen)
kv0 = torch.randn(kv_shape, generator=gen)
ref_kv, eager_kv, kv = kv0.clone(), kv0.clone(), kv0.clone()
ref = step(x, ref_kv, False, pos, slots)
eager = step(x, eager_kv, True, pos, slots)
out, codes = run_and_get_code(
    torch.compile(lambda a, c, p, sl: step(a, c, True, p, sl), fullgraph=True), x, kv, pos, slots
)
code = "\n".join(codes)
calls = [ln.strip() for ln in code.splitlines() if "flare.write_attend.default(" in ln]
shapes = [
    tuple(int(v) for v in m.split(",") if v.strip()) for m in re.findall(r"empty_strided\w*\(\(([\d, ]+)\)", code)
]
written = torch.zeros(pages, t, dtype=torch.bool)
for sl in slots[slots >= 0].tolist():
    written[sl // t, sl % t] = True
untouched = ~written[:, None, None, :, None, None].expand(kv_shape)
# Layer 0's K/V are computed from the same x on both paths, so its written slots match bitwise;
# later layers see x after attention, which differs by rounding between the kernel and the gather.
report = {
    "eager_layer0_kv_bitwise_equal": bool(torch.equal(eager_kv[:, 0], ref_kv[:, 0])),
    "eager_out_max_abs_err": (eager - ref).abs().max().item(),
    "compiled_kv_max_abs_err": (kv - ref_kv).abs().max().item(),
    "compiled_untouched_kv_bitwise_equal": bool(torch.equal(kv[untouched], kv0[untouched])),
    "compiled_out_max_abs_err": (out - ref).abs().max().item(),
    "kv_shaped_buffers": sum(s == kv_shape for s in shapes),
    "op_calls": code.count("flare.write_attend"),
    # cos, sin, kv, slots, tables, req, pos: the same buffers in every layer's call (torch 2.11
    # under the default exact-stride constraint copied the computed ones once per call)
    "shared_op_inputs": len({tuple(c.rstrip(")").split(", ")[-9:-2]) for c in calls}) == 1,
}
print(json.dumps(report))
ok = (
    report["eager_layer0_kv_bitwise_equal"]
    and report["eager_out_max_abs_err"] < 1e-5
    and report["compiled_kv_max_abs_err"] < 1e-4
    and report["compiled_untouched_kv_bitwise_equal"]
    and report["compiled_out_max_abs_err"] < 1e-4
    and report["kv_shaped_buffers"] == 0
    and report["op_calls"] >= 1
    and report["shared_op_inputs"]
)
sys.exit(0 if ok else 1)
