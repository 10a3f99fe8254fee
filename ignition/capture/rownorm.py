"""RMSNorm over rows as one Triton kernel (`flare::rms_norm`) for the few-row programs (decode
buckets, speculative lanes), so that a row's norm does not depend on the rows beside it.

Why a kernel of its own: Inductor picks a reduction's block shape and warps from the number of
rows (its persistent-reduction heuristics branch on them), and the block shape decides the order
in which a row's squares are summed. A decode step over B rows and a speculative program over
B x W lanes then normalize the same hidden vector to values an ulp apart, and the lanes stop
sampling what decoding samples (pytorch#180832 describes the same drift between batch sizes).
Here one program owns one row and its block is a function of the row width only.

The three forms, each in Transformers' order (float32 statistics):
- `rms`: `w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` (Llama, Qwen3's q/k norms);
- `zero_centred`: `(x * rsqrt(mean(x^2) + eps) * (1 + w)).to(x.dtype)` (Qwen3.5);
- `gated`: `rms`, then times SiLU(gate) in float32 and cast (the Gated DeltaNet output norm).
The eager functions below are the reference (CPU runs, prefill, and the kernel's tests).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ignition.capture.fallback import declare

if TYPE_CHECKING:
    from torch._library.custom_ops import CustomOpDef

MODES = {"rms": 0, "zero_centred": 1, "gated": 2}


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def zc_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: float32 statistics, scaled by (1 + w), cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


def gated_rms(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: RMSNorm with weight w, then times SiLU(gate), in Transformers' order."""
    return (rms(x, w, eps) * F.silu(gate.float())).to(x.dtype)


def reference(
    x: torch.Tensor, w: torch.Tensor, eps: float, mode: str, gate: torch.Tensor | None = None
) -> torch.Tensor:
    if mode == "rms":
        return rms(x, w, eps)
    if mode == "zero_centred":
        return zc_rms(x, w, eps)
    if mode == "gated" and gate is not None:
        return gated_rms(x, w, gate, eps)
    raise ValueError(f"rms_norm: unknown mode {mode!r} (or gated without a gate)")


@functools.cache
def _kernel() -> Any:  # a triton.JITFunction (Triton ships no type information)
    from ignition.capture.rownorm_triton import flare_rms_norm

    return flare_rms_norm


def _rows3(t: torch.Tensor, d: int) -> torch.Tensor:
    """t [..., D] as a view [A, B, D], never a copy: an ATen copy inside the op would be a library
    kernel in the graph, which no core can carry. Heads sliced out of a fused projection ([N, H, D]
    with row stride past H x D) stay two-level; reshaping them to [N x H, D] would copy."""
    if t.dim() < 2:
        return t.view(1, 1, d)
    if t.dim() == 2:
        return t.unsqueeze(1)
    try:
        return t.view(-1, t.shape[-2], d)
    except RuntimeError as e:
        raise ValueError(f"rms_norm: {tuple(t.shape)} with strides {t.stride()} has no [A, B, D] view") from e


def launch(x: torch.Tensor, w: torch.Tensor, eps: float, mode: str, gate: torch.Tensor | None = None) -> torch.Tensor:
    """What `flare::rms_norm` runs: x [..., D] normalized over its last dimension; rows are read
    through their strides (two levels of them) and written dense."""
    d = x.shape[-1]
    if w.shape != (d,) or mode not in MODES or (mode == "gated") != (gate is not None):
        raise ValueError(
            f"rms_norm: x {tuple(x.shape)}, weight {tuple(w.shape)}, mode {mode!r}, gate {gate is not None}"
        )
    xs = _rows3(x, d)
    gs = _rows3(gate, d) if gate is not None else xs
    n = xs.shape[0] * xs.shape[1]
    if gs.shape[0] * gs.shape[1] != n or gs.shape[2] != d:
        raise ValueError(f"rms_norm: gate {tuple(gs.shape)} does not match x {tuple(x.shape)}")
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n:
        block = max(16, 1 << (d - 1).bit_length())
        warps = min(8, max(1, block // 256))
        _kernel()[(n,)](
            xs, w.contiguous(), gs, y, d, xs.shape[1], *xs.stride(), gs.shape[1], *gs.stride(), y.stride(0), eps,
            MODE=MODES[mode], BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return y.view(x.shape)


@functools.cache
def rms_norm_op() -> CustomOpDef:
    """`flare::rms_norm`: one norm as one opaque op (Inductor would choose its reduction blocks
    by the number of rows)."""
    from torch.library import custom_op

    @custom_op("flare::rms_norm", mutates_args=())
    def rms_norm(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor | None, eps: float, mode: str) -> torch.Tensor:
        return launch(x, w, eps, mode, gate)

    @rms_norm.register_fake
    def _(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor | None, eps: float, mode: str) -> torch.Tensor:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    return declare(rms_norm)
