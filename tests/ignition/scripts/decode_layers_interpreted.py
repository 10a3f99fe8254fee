"""`flare::decode_layers` inside `PagedLlama.hidden` under Triton's CPU interpreter (one program:
the interpreter runs programs one after another), float32 (it has no bfloat16): a decode step's
hidden vectors and K/V writes against the same model's six-kernel layers (`flare::write_attend`
and torch projections); each row alone against the rows batched; each stage alone over three
programs against torch; and the recipe's refusals.
Prints one JSON line; exit 1 on mismatch. Needs TRITON_INTERPRET=1 before Triton is imported."""

# mypy: disable-error-code="no-untyped-def"
# Triton reads a kernel's parameter annotations to specialize it: the test kernels' pointer and
# scalar parameters stay unannotated (as in ignition's kernel modules).
from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

from ignition.capture import persistent as persistent_mod
from ignition.capture.attention import attend_gather, rotate
from ignition.capture.paged import Geometry, PagedLlama
from ignition.capture.persistent import PersistentError, layer_strides
from ignition.capture.persistent_triton import attention_stage, combine_stage, projection_stage

torch.manual_seed(0)
geo = Geometry(
    layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=128, eps=1e-6, tie_embeddings=True,
    attention_bias=False, mlp_bias=False, qk_norm=False, eos_token_ids=(2,), page_tokens=16, context_limit=64,
    request_slots=4, snapshot_rows=4, max_kv_pages=16,
)  # fmt: skip
h, d, nqkv = geo.hidden, geo.head_dim, (geo.heads + 2 * geo.kv_heads) * geo.head_dim
shapes = {
    "qkv": (nqkv, h), "o_proj": (h, geo.heads * d), "gate_up": (2 * geo.ffn, h), "down": (h, geo.ffn),
    "input_norm": (h,), "post_attention_norm": (h,),
}  # fmt: skip
# Layer-major in one buffer, as the arena streams a recipe's layers: each role evenly spaced.
per_layer = sum(torch.Size(s).numel() for s in shapes.values())
flat = torch.empty(geo.layers * per_layer)
weights: dict[str, torch.Tensor] = {}
at = 0
for i in range(geo.layers):
    for role, shape in shapes.items():
        n = torch.Size(shape).numel()
        w = flat[at : at + n].view(shape)
        w.copy_(torch.rand(shape) + 0.5 if role.endswith("norm") else torch.randn(shape) / shape[-1] ** 0.5)
        weights[f"layers.{i}.{role}"] = w
        at += n
weights["embed_tokens"] = torch.randn(geo.vocab, h)
weights["final_norm"] = torch.rand(h) + 0.5
inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
report: dict[str, object] = {"layer_strides": list(layer_strides(weights, geo.layers))}

kernels = PagedLlama(geo, weights, inv, 1.0, attention_kernel=True)
persistent = PagedLlama(geo, weights, inv, 1.0, attention_kernel=True, persistent=True)
t = geo.page_tokens
kv0 = torch.randn(geo.max_kv_pages + 1, geo.layers, 2, t, geo.kv_heads, d)
table = torch.full((3, geo.pages_per_request), -1, dtype=torch.int32)
table[0, :3] = torch.tensor([4, 9, 1])
table[1, :2] = torch.tensor([7, 2])
table[2, :1] = torch.tensor([12])
pos = torch.tensor([40, 20, 3])
slots = table.long()[torch.arange(3), pos // t] * t + pos % t
slots[2] = -1  # a lane that writes no K/V (padding)
tok = torch.tensor([5, 17, 99])


def step(model: PagedLlama, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    kv = kv0.clone()
    sel = torch.tensor(rows)
    out = model.hidden(tok[sel], pos[sel], slots[sel], table[sel], torch.arange(len(rows)), kv, few_rows=True)
    return out, kv


want, want_kv = step(kernels, [0, 1, 2])
got, got_kv = step(persistent, [0, 1, 2])
err = (got - want).abs().max().item()
kv_err = (got_kv - want_kv).abs().max().item()
alone = torch.cat([step(persistent, [r])[0] for r in range(3)])
# The combine two groups at a time (the first request's three groups take two rounds).
persistent_mod.COMBINE_GROUPS = 2
chunked, _ = step(persistent, [0, 1, 2])
report["combine_in_rounds_max_abs_err"] = (chunked - want).abs().max().item()
# The combine as its own stage behind a barrier (six barriers per layer), barriers polling with
# loads.
persistent_mod.FUSED_COMBINE, persistent_mod.POLL_LOAD = False, True
unfused, _ = step(persistent, [0, 1, 2])
persistent_mod.FUSED_COMBINE, persistent_mod.POLL_LOAD = True, False
report["combine_stage_max_abs_err"] = (unfused - want).abs().max().item()
invariant = bool(torch.equal(alone, got))
report |= {"max_abs_err": err, "kv_max_abs_err": kv_err, "rows_alone_equal_batched": invariant}
counter = persistent.counter
assert counter is not None  # the op's barrier counter, made with the model
report["counter"] = counter.tolist()

# Each stage alone over three programs (no barrier inside one stage), so the work split over
# programs (`range(pid, ..., P)`) is exercised: the projection stage with a norm over rows whose
# blocks do not divide evenly, then the attention stage's groups and the combine's (row, head)
# items as two launches, against torch and the gather reference.


@triton.jit
def _projection(X, W, NORM, Y, eps, B: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, P: tl.constexpr):  # fmt: skip
    projection_stage(X, K, W, NORM, X, Y, B, eps, N, K, BN, BK, P, True, False, False)


@triton.jit
def _attention(QKV, KV, PT, REQ, POS, SLOT, COS, SIN, PM, PL, PACC, ARR, OUT, s_page, s_layer, s_sel, s_tok, s_head,
               pt_stride, B: tl.constexpr, HEADS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
               S: tl.constexpr, GP: tl.constexpr, NQKV: tl.constexpr, SCALE: tl.constexpr, P: tl.constexpr,
               COMBINE: tl.constexpr, FUSED: tl.constexpr):  # fmt: skip
    if COMBINE:
        combine_stage(PM, PL, PACC, POS, OUT, B, HEADS, D, T, 1, S, 4, 2, P)
    else:
        attention_stage(QKV, KV, PT, REQ, POS, SLOT, COS, SIN, PM, PL, PACC, ARR, OUT, 0, s_page, s_layer, s_sel, s_tok,
                        s_head, pt_stride, B, HEADS, KVH, D, T, 1, S, GP, NQKV, SCALE, P, FUSED, 4, 2)  # fmt: skip


xs, ws, nw = torch.randn(2, h), torch.randn(72, h) / h**0.5, torch.rand(h) + 0.5
ys = torch.empty(2, 72)
_projection[(3,)](xs, ws, nw, ys, 1e-6, B=2, N=72, K=h, BN=16, BK=32, P=3)
want_ys = (xs * torch.rsqrt((xs * xs).mean(-1, keepdim=True) + 1e-6) * nw) @ ws.T
stage_errs = [(ys - want_ys).abs().max().item()]
qkv = torch.randn(3, nqkv)
kv_stage, kv_want = kv0.clone(), kv0.clone()
cs, sn = (f(pos.float()[:, None] * inv[None, :]).repeat(1, 2) for f in (torch.cos, torch.sin))
pm, pl, pacc = torch.empty(3, 4, geo.heads), torch.empty(3, 4, geo.heads), torch.empty(3, 4, geo.heads, d)
att_out, att_fused = torch.empty(3, geo.heads * d), torch.empty(3, geo.heads * d)
arrivals = torch.zeros(3 * geo.kv_heads, dtype=torch.int64)
st = kv_stage.stride()
# Separate stages, then the attention stage combining by its last arrivals (K/V written again,
# the same values).
for combine, fused, out in ((False, False, att_out), (True, False, att_out), (False, True, att_fused)):
    _attention[(3,)](qkv, kv_stage, table, torch.arange(3, dtype=torch.int32), pos.int(), slots, cs, sn, pm, pl, pacc,
                     arrivals, out, st[0], st[1], st[2], st[3], st[4], table.stride(0), B=3, HEADS=geo.heads,
                     KVH=geo.kv_heads, D=d, T=t, S=4, GP=16, NQKV=nqkv, SCALE=d**-0.5, P=3, COMBINE=combine,
                     FUSED=fused)  # fmt: skip
hq, hk = geo.heads * d, geo.kv_heads * d
q_ref = rotate(qkv[:, :hq].view(3, geo.heads, d), cs, sn)
live = slots >= 0
kv_want[slots[live] // t, 0, 0, slots[live] % t] = rotate(qkv[:, hq : hq + hk].view(3, geo.kv_heads, d), cs, sn)[live]
kv_want[slots[live] // t, 0, 1, slots[live] % t] = qkv[:, hq + hk :].view(3, geo.kv_heads, d)[live]
want_att = attend_gather(q_ref, kv_want, 0, table.long().clamp(min=0), torch.arange(3), pos, d**-0.5)
stage_errs += [(att_out - want_att).abs().max().item(), (kv_stage - kv_want).abs().max().item()]
stage_errs += [(att_fused - want_att).abs().max().item()]
report["arrivals_back_to_zero"] = arrivals.tolist() == [0] * len(arrivals)
report["stages_over_three_programs_max_abs_err"] = max(stage_errs)

refused = []
for field in ("attention_bias", "mlp_bias", "qk_norm"):
    try:
        PagedLlama(Geometry(**{**geo.as_dict(), field: True}), weights, inv, 1.0, True, persistent=True)
    except PersistentError:
        refused.append(field)
# A third layer's tensors somewhere else: no one stride reaches them from layer 0.
uneven = dict(weights) | {f"layers.2.{r}": weights[f"layers.1.{r}"].clone() for r in shapes}
try:
    layer_strides(uneven, 3)
except PersistentError:
    refused.append("uneven")
report["refused"] = refused
print(json.dumps(report))
barriers = (5 * 5 + 6) * geo.layers  # five fused launches, one with the combine stage
ok = err < 1e-4 and kv_err < 1e-5 and invariant and report["arrivals_back_to_zero"]
ok = ok and counter.tolist() == [barriers, 0] + [0] * (len(counter) - 2) and len(refused) == 4
ok = ok and report["combine_in_rounds_max_abs_err"] < 1e-4  # type: ignore[operator]
ok = ok and report["combine_stage_max_abs_err"] < 1e-4  # type: ignore[operator]
ok = ok and max(stage_errs) < 1e-4
sys.exit(0 if ok else 1)
