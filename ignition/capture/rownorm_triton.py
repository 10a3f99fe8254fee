"""The Triton kernel behind `flare::rms_norm` (see `ignition.capture.rownorm` for its contract).

Kept in its own module, imported only when a norm launches: Triton resolves the helper functions
a kernel calls through the module's globals, and CPU runs never need Triton.
"""

# mypy: disable-error-code="no-untyped-def"
# Triton reads a kernel's parameter annotations to specialize it (tl.constexpr, dtype names), so
# the pointer and scalar parameters stay unannotated: the one exemption from typing.
import triton
import triton.language as tl


@triton.jit
def flare_rms_norm(
    X, W, GATE, Y, D, XB, sxa, sxb, sxd, GB, sga, sgb, sgd, sy, eps, MODE: tl.constexpr, BLOCK: tl.constexpr
):
    """One program per row: float32 statistics over the row, then the weight (MODE 0: w times the
    normalized row cast to the activation dtype; 1: zero-centred, times 1 + w in float32 before
    the cast; 2: MODE 0 then times SiLU(gate) in float32). The block covers the whole row and is
    a function of D only, so a row's result does not depend on how many rows were launched.
    Row r of X is X[r // XB, r % XB] of its [A, XB, D] view (GATE likewise with GB): heads sliced
    out of a fused projection are read in place. Triton specializes XB, GB and the D strides when
    they are 1, so dense rows pay nothing for it."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    m = d < D
    x = tl.load(X + (r // XB) * sxa + (r % XB) * sxb + d * sxd, mask=m, other=0.0)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.load(W + d, mask=m, other=0.0)
    if MODE == 1:
        y = (xf * inv * (1.0 + w.to(tl.float32))).to(Y.dtype.element_ty)
    else:
        y = (w.to(tl.float32) * (xf * inv).to(x.dtype).to(tl.float32)).to(Y.dtype.element_ty)
        if MODE == 2:
            g = tl.load(GATE + (r // GB) * sga + (r % GB) * sgb + d * sgd, mask=m, other=0.0).to(tl.float32)
            y = (y.to(tl.float32) * (g * tl.sigmoid(g))).to(Y.dtype.element_ty)
    tl.store(Y + r * sy + d, y, mask=m)
