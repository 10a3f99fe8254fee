"""`flare::decode_layers` inside `PagedLlama.hidden` under Triton's CPU interpreter (one program:
the interpreter runs programs one after another), float32 (it has no bfloat16): a decode step's
hidden vectors and K/V writes against the same model's six-kernel layers (`flare::write_attend`
and torch projections); each row alone against the rows batched; and the recipe's refusals.
Prints one JSON line; exit 1 on mismatch. Needs TRITON_INTERPRET=1 before Triton is imported."""

from __future__ import annotations

import json
import sys

import torch

from ignition.capture import persistent as persistent_mod
from ignition.capture.paged import Geometry, PagedLlama
from ignition.capture.persistent import PersistentError, layer_strides

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
invariant = bool(torch.equal(alone, got))
report |= {"max_abs_err": err, "kv_max_abs_err": kv_err, "rows_alone_equal_batched": invariant}
report["counter"] = persistent.counter.tolist()

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
layers_x_stages = 6 * geo.layers
ok = err < 1e-4 and kv_err < 1e-5 and invariant
ok = ok and persistent.counter.tolist() == [5 * layers_x_stages, 0] and len(refused) == 4
ok = ok and report["combine_in_rounds_max_abs_err"] < 1e-4  # type: ignore[operator]
sys.exit(0 if ok else 1)
