"""`flare::decode_layers`: every layer of a dense decode step as one persistent kernel.

A decode step's graph runs six kernels per layer (qkv, attention, combine, o_proj, gate_up,
down), and on the H100 each costs at least ~1 us even when empty (`graph_launch_probe.py`). A
program that stays resident and meets the others at a grid barrier pays less per stage: in a
chain of projections, 1.79 against 2.40 us per link at SmolLM2's width and 4.02 against 5.41 at
the ~1B's (`persistent_probe.py`, 2026-12-06). This op runs the whole layer stack that way
(`persistent_triton.decode_layers_kernel`). `qualification/persistent_layer_probe.py` measures
the same kernel against the six-kernel layers before any core carries it.

Contract and invariants:
- one program per SM (`programs`), all resident at once: a grid barrier waits for every
  program, so a grid larger than the device holds would never finish (each barrier gives up
  after `SPIN_LIMIT` spins and sets the failure word instead of hanging);
- the barrier's counter (word 0 of `counter`, 64-bit, never reset), the failure word (word 1)
  and one arrival count per (row, KV head) (words 2.., zero between launches: the last arrival
  of a step puts it back) live in the state pool, created with the model and exported with the
  core as a constant. Launches that share it must not overlap (a core's steps run one after
  another on one stream);
- a row's arithmetic does not depend on the bucket it was packed into (the kernel loops over
  rows around one tile shape), so batched requests equal their solo runs bitwise;
- layer l's weights of each role sit at layer 0's plus l times one stride (the arena streams a
  recipe's layers in order): `layer_strides` finds that stride or says why there is none;
- `kv` is written in place but not declared mutated, as for `flare::write_attend` (only this op
  touches it inside a graph, and the op's output is consumed, so it is never reordered or
  dropped); the counter likewise.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ignition.capture.attention_tune import MAX_SPLITS
from ignition.capture.fallback import declare

if TYPE_CHECKING:
    from torch._library.custom_ops import CustomOpDef

# Rows per weight tile, columns per tile, warps. Not yet measured on a device: the probe's
# configurations (`persistent_layer_probe.CONFIGS`) decide it.
CONFIG = (16, 256, 8)
# Pages per attention group inside the kernel (more where a table would make over the tuner's
# `MAX_SPLITS` groups: each is a work item and a partial state per head), and groups the combine
# reads at once.
PAGES_PER_GROUP = 1
COMBINE_GROUPS = 16
# The last page group of a (row, KV head) to finish combines its heads (no combine stage and no
# barrier before it: five barriers per layer instead of six).
FUSED_COMBINE = True
# How a program waits at a barrier (`persistent_triton.grid_barrier`): volatile loads, else
# acquiring read-modify-writes (measured 1.79 us per projection link at SmolLM2's width, H100).
POLL_LOAD = False
# Spins at one barrier before a program gives up and sets the failure word (~1 s).
SPIN_LIMIT = 1 << 20
# The weight roles the kernel reads, in its argument order (the two norms share one stride).
ROLES = ("qkv", "o_proj", "gate_up", "down", "input_norm", "post_attention_norm")


class PersistentError(ValueError):
    """The geometry or weight layout is outside what `flare::decode_layers` computes."""


def refusal(geo: Any) -> str | None:
    """Why `flare::decode_layers` does not compute layers of geometry `geo` (a
    `ignition.capture.paged.Geometry`), or None. Known from the config alone, so preparation
    refuses before streaming any weight."""
    kinds = set(getattr(geo, "layer_kinds", ())) - {"full_attention"}
    if kinds:
        return f"it computes dense attention layers; this recipe also has {', '.join(sorted(kinds))} layers"
    if geo.attention_bias or geo.mlp_bias or geo.qk_norm:
        return "it computes layers without biases or q/k norms"
    return None


def layer_strides(weights: dict[str, torch.Tensor], layers: int) -> tuple[int, ...]:
    """Element strides from layer 0's to layer l's tensor for each of `ROLES` (the two norms
    must agree). Raises `PersistentError` when a role's layers are not evenly spaced."""
    out = []
    for role in ROLES:
        first = weights[f"layers.0.{role}"]
        size = first.element_size()
        if not first.is_contiguous():
            raise PersistentError(f"layers.0.{role} is not contiguous")
        step = None
        for i in range(1, layers):
            w = weights[f"layers.{i}.{role}"]
            if w.shape != first.shape or w.dtype != first.dtype or not w.is_contiguous():
                raise PersistentError(f"layers.{i}.{role}: {tuple(w.shape)} {w.dtype} unlike layer 0's")
            gap = w.data_ptr() - weights[f"layers.{i - 1}.{role}"].data_ptr()
            if gap % size or (step is not None and gap != step):
                raise PersistentError(f"{role}: layers are not evenly spaced ({gap} bytes after layer {i - 1})")
            step = gap
        out.append((step or 0) // size)
    if out[4] != out[5]:
        raise PersistentError(f"the norms' layer strides differ ({out[4]} and {out[5]})")
    return tuple(out[:5])


def new_counter(device: torch.device, rows: int, kv_heads: int) -> torch.Tensor:
    """The barrier's ticket counter, the failure word and the arrival counts for launches of up
    to `rows` rows (zeros); create it under the pool that holds persistent state, before capture."""
    return torch.zeros(2 + rows * kv_heads, dtype=torch.int64, device=device)


def _launch(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    pages: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    weights: Sequence[torch.Tensor],
    strides: Sequence[int],
    counter: torch.Tensor,
    dims: Sequence[int],
    eps: float,
    config: tuple[int, int, int] = CONFIG,
    programs: int | None = None,
    fused: bool | None = None,
    poll_load: bool | None = None,
) -> torch.Tensor:
    """x [B, H] through every layer (a new tensor). weights: layer 0's qkv, o_proj, gate_up,
    down, input_norm, post_attention_norm; dims: layers, heads, KV heads, head dim, ffn;
    `fused`: the combine inside the attention stage; `poll_load`: how barriers wait (defaults:
    `FUSED_COMBINE`, `POLL_LOAD`)."""
    import triton

    from ignition.capture.persistent_triton import decode_layers_kernel

    layers, heads, kvh, d, ffn = dims
    b, h = x.shape
    fused = FUSED_COMBINE if fused is None else fused
    poll_load = POLL_LOAD if poll_load is None else poll_load
    if counter.numel() < 2 + b * kvh:
        raise ValueError(f"the counter holds arrivals for {(counter.numel() - 2) // kvh} rows, not {b}")
    bn, bk, warps = config
    # One program per SM; one program where Triton's interpreter runs the kernel (CPU tensors:
    # it runs programs one after another, so only a single program passes a barrier there).
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    p = programs or sms
    pps = max(PAGES_PER_GROUP, -(-pages.shape[1] // MAX_SPLITS))
    splits = -(-pages.shape[1] // pps)
    nqkv = weights[0].shape[0]
    dev, dt = x.device, x.dtype
    out = x.clone()
    x2 = torch.empty(b, h, dtype=dt, device=dev)
    qkv = torch.empty(b, nqkv, dtype=dt, device=dev)
    gu = torch.empty(b, 2 * ffn, dtype=dt, device=dev)
    att = torch.empty(b, heads * d, dtype=dt, device=dev)
    pm = torch.empty(b, splits, heads, dtype=torch.float32, device=dev)
    pl = torch.empty(b, splits, heads, dtype=torch.float32, device=dev)
    pacc = torch.empty(b, splits, heads, d, dtype=torch.float32, device=dev)
    slots, pages, req, pos = (t.contiguous() for t in (slots, pages, req, pos))
    cos, sin = cos.contiguous(), sin.contiguous()
    st = kv.stride()
    wq, wo, wg, wd, nq, np_ = weights
    lq, lo, lg, ld, ln = strides
    decode_layers_kernel[(p,)](
        out, x2, qkv, gu, att, pm, pl, pacc, kv, pages, req, pos, slots, cos, sin, wq, wo, wg, wd, nq, np_,
        counter, counter[1:], counter[2:], eps, layers, lq, lo, lg, ld, ln, st[0], st[1], st[2], st[3], st[4],
        pages.stride(0),
        B=b, H=h, HEADS=heads, KVH=kvh, D=d, T=kv.shape[3], PPS=pps, S=splits,
        SP=max(2, triton.next_power_of_2(splits)), GP=max(16, triton.next_power_of_2(heads // kvh)), NQKV=nqkv,
        F=ffn, SCALE=d**-0.5, BN=bn, BK=bk, CB=COMBINE_GROUPS, P=p, LIMIT=SPIN_LIMIT, FUSED=fused,
        POLL_LOAD=poll_load, num_warps=warps,
    )  # fmt: skip
    return out


@functools.cache
def decode_layers_op() -> CustomOpDef:
    """`flare::decode_layers(x, cos, sin, kv, slots, pages, req, pos, weights, strides, counter,
    dims, eps)`: see the module doc for the contract. One launch per call."""
    from torch.library import custom_op

    @custom_op("flare::decode_layers", mutates_args=())
    def decode_layers(
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        slots: torch.Tensor,
        pages: torch.Tensor,
        req: torch.Tensor,
        pos: torch.Tensor,
        weights: list[torch.Tensor],
        strides: list[int],
        counter: torch.Tensor,
        dims: list[int],
        eps: float,
    ) -> torch.Tensor:
        return _launch(x, cos, sin, kv, slots, pages, req, pos, weights, strides, counter, dims, eps)

    @decode_layers.register_fake
    def _(
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        slots: torch.Tensor,
        pages: torch.Tensor,
        req: torch.Tensor,
        pos: torch.Tensor,
        weights: list[torch.Tensor],
        strides: list[int],
        counter: torch.Tensor,
        dims: list[int],
        eps: float,
    ) -> torch.Tensor:
        return torch.empty_like(x)

    return declare(decode_layers)
