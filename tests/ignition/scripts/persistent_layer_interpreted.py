"""`qualification/persistent_layer_probe.py`'s step kernel under Triton's CPU interpreter, as one
program (the interpreter runs programs one after another, so a grid barrier over several would
wait forever): every layer's four projections against the torch forward they stand for, float32
(the interpreter has no bfloat16), and the ticket counter at one arrival per barrier. Prints one
JSON line; exit 1 on mismatch. Needs TRITON_INTERPRET=1 before Triton is imported."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "qualification"))

import persistent_layer_probe as probe  # qualification/ is not a package: found through sys.path

from ignition.capture.attention import attend_gather, rotate

torch.manual_seed(0)
layers, h, heads, kvh, d, f = 2, 48, 3, 1, 16, 80
nqkv = (heads + 2 * kvh) * d


def weights(*shape: int) -> torch.Tensor:
    out: torch.Tensor = torch.randn(*shape) / shape[-1] ** 0.5
    return out


stacked = {
    "qkv": weights(layers, nqkv, h),
    "o_proj": weights(layers, h, heads * d),
    "gate_up": weights(layers, 2 * f, h),
    "down": weights(layers, h, f),
    "qkv_norm": torch.rand(layers, h) + 0.5,
    "gate_up_norm": torch.rand(layers, h) + 0.5,
}
cfg = {"num_attention_heads": heads, "head_dim": d, "intermediate_size": f, "rms_norm_eps": 1e-6}


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    return out


report = {}
ok = True
for rows, bn, bk in ((1, 8, 32), (3, 16, 64)):  # partial row and column blocks either way
    x0 = torch.randn(rows, h)
    want = x0.clone()
    for i in range(layers):
        qkv = rms(want, stacked["qkv_norm"][i]) @ stacked["qkv"][i].T
        x2 = want + qkv[:, : heads * d] @ stacked["o_proj"][i].T
        gu = rms(x2, stacked["gate_up_norm"][i]) @ stacked["gate_up"][i].T
        want = x2 + (F.silu(gu[:, :f]) * gu[:, f:]) @ stacked["down"][i].T
    scratch = {
        "x2": torch.empty(rows, h),
        "qkv": torch.empty(rows, nqkv),
        "gu": torch.empty(rows, 2 * f),
        "counter": torch.zeros(2, dtype=torch.int64),
    }
    got = probe.persistent_step(cfg, stacked, x0.clone(), scratch, 1, bn, bk, 4)
    err = (got - want).abs().max().item()
    arrivals, gave_up = (int(v) for v in scratch["counter"].tolist())
    report[f"rows{rows}"] = {"max_abs_err": err, "arrivals": arrivals, "gave_up": bool(gave_up)}
    ok &= err < 1e-4 and arrivals == 4 * layers and not gave_up

# The whole decode step with attention (`_decode_kernel`): two requests at positions 39 and 20
# of 16-token pages (4-page tables, one page per group), K/V written by the step, against the
# gather reference with the K/V written in torch.
t, width, pos = 16, 4, torch.tensor([39, 20], dtype=torch.int32)
rows = len(pos)
kv0 = torch.randn(2 * width + 1, layers, 2, t, kvh, d)
table = torch.randperm(2 * width + 1)[: 2 * width].int().view(rows, width)
table[1, 2:] = -1  # the second request holds two pages
inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
ang = pos.float()[:, None] * inv[None, :]
cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
x0 = torch.randn(rows, h)
want, kv_ref = x0.clone(), kv0.clone()
page, off = table.long()[torch.arange(rows), pos.long() // t], pos.long() % t
slots = page * t + off
for i in range(layers):
    qkv = rms(want, stacked["qkv_norm"][i]) @ stacked["qkv"][i].T
    q = rotate(qkv[:, : heads * d].view(rows, heads, d), cos, sin)
    kv_ref[page, i, 0, off] = rotate(qkv[:, heads * d : (heads + kvh) * d].view(rows, kvh, d), cos, sin)
    kv_ref[page, i, 1, off] = qkv[:, (heads + kvh) * d :].view(rows, kvh, d)
    o = attend_gather(q, kv_ref, i, table.long().clamp(min=0), torch.arange(rows), pos, d**-0.5)
    x2 = want + o @ stacked["o_proj"][i].T
    gu = rms(x2, stacked["gate_up_norm"][i]) @ stacked["gate_up"][i].T
    want = x2 + (F.silu(gu[:, :f]) * gu[:, f:]) @ stacked["down"][i].T
for fused, barriers in ((True, 5), (False, 6)):  # the combine by the last arrivals, or its own stage
    kv = kv0.clone()
    att: dict[str, object] = {"kv": kv, "table": table, "pos": pos, "pps": 1, "cos": cos, "sin": sin, "slots": slots}
    scratch = {"counter": torch.zeros(2 + rows * kvh, dtype=torch.int64)}
    got = probe.persistent_decode(
        cfg | {"num_key_value_heads": kvh}, stacked, x0.clone(), att, scratch, 1, 8, 32, 4, fused
    )
    err = (got - want).abs().max().item()
    kv_err = (kv - kv_ref).abs().max().item()
    tickets, gave_up, *left = (int(v) for v in scratch["counter"].tolist())
    report[f"decode_step_fused_{fused}"] = {"max_abs_err": err, "kv_max_abs_err": kv_err, "tickets": tickets}
    ok &= err < 1e-4 and kv_err < 1e-5 and tickets == barriers * layers and not gave_up and not any(left)
print(json.dumps(report))
sys.exit(0 if ok else 1)
