"""Runs the prepared Triton kernels (paged attention, KV write) under Triton's CPU interpreter
and checks them against the torch reference. float32: the interpreter's numpy backend has no
bfloat16 (the bf16 kernels are qualified on the GPU). Prints one JSON line; exit 1 on mismatch.
Needs TRITON_INTERPRET=1 in the environment before Triton is imported."""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl  # noqa: F401 (a jit function needs it visible)

from ignition.capture import attention, attention_triton
from ignition.capture.attention import (
    PAGES_PER_SPLIT,
    SPLIT_MAX_TOKENS,
    _launch_attention,
    _launch_write,
    attend_gather,
    pages_per_split,
    rotate,
)

g = torch.Generator().manual_seed(0)
n, h, kvh, d, t, p, pages, layers = 6, 6, 2, 64, 64, 4, 12, 3
kv = torch.randn(pages, layers, 2, t, kvh, d, generator=g)
q = torch.randn(n, h, d, generator=g)
tables = torch.randperm(pages, generator=g)[: 2 * p].view(2, p).int()
tables[0, 2:] = -1  # request 0 holds two pages; unused entries are -1
req = torch.tensor([0, 0, 1, 1, 1, 1]).int()
pos = torch.tensor([0, 70, 5, 130, 255, 64]).int()
scale = d**-0.5
ref = attend_gather(q, kv, 1, tables.long().clamp(min=0), req, pos, scale).view(n, h, d)
# One page group per program (4 groups for these 4-page tables), two, three (a partial last
# group), and all four in one group (the direct store without a combine, as prefill runs).
attn_err = max(
    (_launch_attention(q, kv, tables, req, pos, 1, scale, pps) - ref).abs().max().item() for pps in (1, 2, 3, 4)
)
# The default policy: few query tokens split, many (a prefill chunk) walk all pages at once.
assert pages_per_split(16, 72) == PAGES_PER_SPLIT and pages_per_split(256, 72) == 72
n2 = SPLIT_MAX_TOKENS + 1
q2 = torch.randn(n2, h, d, generator=g)
req2 = torch.ones(n2, dtype=torch.int32)
pos2 = torch.arange(n2, dtype=torch.int32) * 3
ref2 = attend_gather(q2, kv, 0, tables.long().clamp(min=0), req2, pos2, scale).view(n2, h, d)
attn_err = max(attn_err, (_launch_attention(q2, kv, tables, req2, pos2, 0, scale) - ref2).abs().max().item())
k = torch.randn(3, kvh, d, generator=g)
v = torch.randn(3, kvh, d, generator=g)
slots = torch.tensor([5, -1, 3 * t + 9]).long()
written = kv.clone()
_launch_write(k, v, written, slots, 2)
want = kv.clone()
want[0, 2, 0, 5], want[0, 2, 1, 5] = k[0], v[0]
want[3, 2, 0, 9], want[3, 2, 1, 9] = k[2], v[2]
kv_write_exact = torch.equal(written, want)
# RoPE inside the kernels, on strided views of a fused [N, H + 2 KVH, D] projection: the write
# stores rotate(k), the attention attends with rotate(q).
qkv = torch.randn(n, h + 2 * kvh, d, generator=g)
rq, rk, rv = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
ang = pos.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
rslots = torch.arange(n).long() * 7
rwritten, rwant = kv.clone(), kv.clone()
_launch_write(rk, rv, rwritten, rslots, 1, cos, sin)
rot_k = rotate(rk, cos, sin)
for i, sl in enumerate(rslots.tolist()):
    rwant[sl // t, 1, 0, sl % t], rwant[sl // t, 1, 1, sl % t] = rot_k[i], rv[i]
rope_write_err = (rwritten - rwant).abs().max().item()
rref = attend_gather(rotate(rq, cos, sin), kv, 1, tables.long().clamp(min=0), req, pos, scale).view(n, h, d)
rope_attn_err = max(
    (_launch_attention(rq, kv, tables, req, pos, 1, scale, pps, cos=cos, sin=sin) - rref).abs().max().item()
    for pps in (1, 4)
)
# A prefill chunk (one request, increasing positions, padding past the real tokens at position
# 0): the block kernel against the gather reference and the per-token kernel; a row's result is
# the same whichever block holds it (the chunk shifted by one token: every block changes).
n3 = SPLIT_MAX_TOKENS + 23
q3 = torch.randn(n3 + 1, h, d, generator=g)
req3 = torch.ones(n3 + 1, dtype=torch.int32)
pos3 = torch.arange(n3 + 1, dtype=torch.int32) + 150
pos3[-5:] = 0
ang3 = pos3.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
cos3, sin3 = torch.cat([ang3, ang3], -1).cos(), torch.cat([ang3, ang3], -1).sin()
ref3 = attend_gather(rotate(q3, cos3, sin3), kv, 2, tables.long().clamp(min=0), req3, pos3, scale).view(n3 + 1, h, d)
block = _launch_attention(q3, kv, tables, req3, pos3, 2, scale, cos=cos3, sin=sin3, tokens="prefill")
per_token = _launch_attention(q3, kv, tables, req3, pos3, 2, scale, cos=cos3, sin=sin3)
shifted = _launch_attention(
    q3[1:], kv, tables, req3[1:], pos3[1:], 2, scale, cos=cos3[1:], sin=sin3[1:], tokens="prefill"
)
prefill_err = (block - ref3).abs().max().item()
prefill_vs_per_token = (block - per_token).abs().max().item()
prefill_block_invariant = torch.equal(shifted, block[1:])
# Decode with the write inside the attention programs (each token its request's only one): the
# same output and cache, bitwise, as the write kernel followed by the attention, whether the
# token's page group is the first, the last or alone, with RoPE and without; a padding token
# (slot -1) writes nothing.
kv4 = torch.randn(26, layers, 2, t, kvh, d, generator=g)
tables4 = torch.randperm(26, generator=g)[:24].view(6, 4).int()
req4 = torch.arange(6).int()
pos4 = torch.tensor([0, 70, 5, 130, 255, 64]).int()
slots4 = torch.tensor([int(tables4[r, int(p_) // t]) * t + int(p_) % t for r, p_ in enumerate(pos4.tolist())]).long()
slots4[2] = -1
fused_bitwise = True
for pps, rope in ((1, True), (2, False), (4, True)):
    c4, s4 = (cos, sin) if rope else (None, None)
    a_kv, b_kv = kv4.clone(), kv4.clone()
    _launch_write(rk, rv, a_kv, slots4, 1, c4, s4)
    want4 = _launch_attention(rq, a_kv, tables4, req4, pos4, 1, scale, pps, cos=c4, sin=s4)
    got4 = _launch_attention(rq, b_kv, tables4, req4, pos4, 1, scale, pps, cos=c4, sin=s4, tokens="decode",
                             write=(rk, rv, slots4))  # fmt: skip
    fused_bitwise &= torch.equal(got4, want4) and torch.equal(a_kv, b_kv)
# A recycled page still holding another request's non-finite values past the positions read:
# decode (split and not) and the prefill block kernel give the same bits as over clean pages.


def poisoned_past(r_: int, last_: int) -> torch.Tensor:
    """`kv` with request r_'s positions past `last_` (in its pages) set to NaN."""
    out_ = kv.clone()
    for j_, page_ in enumerate(tables[r_].tolist()):
        if page_ >= 0:
            out_[page_, :, :, max(0, last_ + 1 - j_ * t) :] = float("nan")
    return out_


no_nan_leak = all(
    torch.equal(
        _launch_attention(q, poisoned_past(0, 70), tables, req, pos, 1, scale, pps),
        _launch_attention(q, kv, tables, req, pos, 1, scale, pps),
    )
    for pps in (1, 4)
)
got_block = _launch_attention(q3, poisoned_past(1, int(pos3.max())), tables, req3, pos3, 2, scale, cos=cos3, sin=sin3,
                              tokens="prefill")  # fmt: skip
no_nan_leak &= torch.equal(got_block, block)
# The combine reads only the page groups up to each token's last page: with NaN in every group
# past it, its outputs are the same bits as with the empty state there (m -inf, l and acc 0), and
# match the softmax states combined in torch.
splits, cpos = 5, torch.tensor([0, 70, 130, 300]).int()
cm = torch.randn(len(cpos), splits, h, generator=g)
cl = torch.rand(len(cpos), splits, h, generator=g) + 0.5
cacc = torch.randn(len(cpos), splits, h, d, generator=g)
held = torch.arange(splits)[None, :] <= (cpos.long() // t)[:, None]  # one page per group
cm[~held], cl[~held], cacc[~held] = float("-inf"), 0.0, 0.0
want_c = (cacc * torch.exp(cm - cm.amax(1, keepdim=True))[..., None]).sum(1)
want_c = want_c / (cl * torch.exp(cm - cm.amax(1, keepdim=True))).sum(1)[..., None]
combined = []
for fill in (False, True):
    pm, pl, pacc = cm.clone(), cl.clone(), cacc.clone()
    if fill:
        pm[~held], pl[~held], pacc[~held] = float("nan"), float("nan"), float("nan")
    got_c = torch.empty(len(cpos), h, d)
    attention._combine_kernel()[(len(cpos), h)](pacc, pm, pl, got_c, cpos, H=h, D=d, T=t, PPS=1, SPLITS=splits, SP=8)
    combined.append(got_c)
idle_groups_unread = torch.equal(combined[0], combined[1]) and (combined[0] - want_c).abs().max().item() < 1e-5


@triton.jit
def _no_grid_dependency() -> None:
    pass


# Launched as programmatic dependents (`attention.PDL`): the interpreter has no grid dependency
# control, so its waits are no-ops and what is checked is that the flags leave the arithmetic
# alone (the fused write, groups combined), bitwise.
attention_triton.gdc_wait = _no_grid_dependency
attention_triton.gdc_launch_dependents = _no_grid_dependency
pdl_bitwise = True
for pps in (1, 4):
    plain_kv, pdl_kv = kv4.clone(), kv4.clone()
    plain = _launch_attention(rq, plain_kv, tables4, req4, pos4, 1, scale, pps, tokens="decode", write=(rk, rv, slots4))
    attention.PDL = True
    try:
        pdl = _launch_attention(rq, pdl_kv, tables4, req4, pos4, 1, scale, pps, tokens="decode", write=(rk, rv, slots4))
    finally:
        attention.PDL = False
    pdl_bitwise &= torch.equal(plain, pdl) and torch.equal(plain_kv, pdl_kv)
report = {
    "pdl_bitwise": pdl_bitwise,
    "idle_groups_unread": idle_groups_unread,
    "decode_fused_write_bitwise": fused_bitwise,
    "poisoned_pages_bitwise": no_nan_leak,
    "prefill_block_max_abs_err": prefill_err,
    "prefill_block_vs_per_token": prefill_vs_per_token,
    "prefill_block_invariant": prefill_block_invariant,
    "attention_max_abs_err": attn_err,
    "kv_write_exact": kv_write_exact,
    "rope_write_max_abs_err": rope_write_err,
    "rope_attention_max_abs_err": rope_attn_err,
}
print(json.dumps(report))
ok = attn_err < 1e-5 and kv_write_exact and rope_write_err < 1e-5 and rope_attn_err < 1e-5
ok = ok and prefill_err < 1e-5 and prefill_vs_per_token < 1e-5 and prefill_block_invariant and fused_bitwise
ok = ok and no_nan_leak and idle_groups_unread and pdl_bitwise
sys.exit(0 if ok else 1)
