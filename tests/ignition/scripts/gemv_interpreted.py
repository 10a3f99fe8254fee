"""Runs `flare::gemv`'s kernel under Triton's CPU interpreter (float32: numpy has no bfloat16)
against the eager reference, for every prologue/epilogue variant (both norm modes), row counts below, at and past
one row group, and shapes that are not multiples of the tile. Also checks that a row's result is
the same bitwise whatever rows share its launch, and in every PDL mode. Prints one JSON line; exit 1 on a mismatch.
Needs TRITON_INTERPRET=1 in the environment before Triton is imported."""

# mypy: disable-error-code="no-untyped-def"
# Triton reads a jit function's parameter annotations, so the stubs' pointers stay unannotated.
from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

from ignition.capture import gemv, gemv_triton
from ignition.capture.gemv import DOT_ROWS, GROUP_CANDIDATES, MAX_GROUP_ROWS, GemvConfig, launch, reference


@triton.jit
def _no_grid_dependency() -> None:
    pass


@triton.jit
def _no_prefetch(W, row0, N, K, stride_w, BLOCK_N: tl.constexpr, PF_K: tl.constexpr, ESIZE: tl.constexpr) -> None:
    pass


# The interpreter has no grid dependency control and no inline assembly: its waits and L2
# prefetches are no-ops here, so the PDL modes' arithmetic (the first weight tile prefetched and
# accumulated first, the reduce of a split launch waiting) is what is checked.
gemv_triton.gdc_wait = _no_grid_dependency
gemv_triton.gdc_launch_dependents = _no_grid_dependency
gemv_triton._prefetch_l2 = _no_prefetch
# (PDL mode, L2 prefetch columns) per configuration: a split one runs mode 1 at most.
MODES = ((1, 0), (2, 0), (3, 0), (3, 256), (4, 64))

gen = torch.Generator().manual_seed(0)
n, k = 37, 300  # neither a multiple of any tile
worst = 0.0
invariant = True
pdl_bitwise = True
cases = 0
# Row counts: one, a partial group, a group and a partial second (MAX_GROUP_ROWS + 3), and past
# one tensor-core group (DOT_ROWS + 2).
for cfg, variants, counts in (
    (GemvConfig(8, 128, 4), ("plain", "norm", "glu", "bias", "res"), (1, 3)),
    (GemvConfig(8, 128, 4), ("norm+bias+res", "glu+res", "zc", "zc+res"), (1, 3, MAX_GROUP_ROWS, MAX_GROUP_ROWS + 3)),
    (GemvConfig(16, 64, 2, wide=True), ("norm+bias+res", "glu+res"), (3, MAX_GROUP_ROWS + 3)),
    (GemvConfig(16, 64, 4, dot=True), ("norm+bias+res", "glu+res", "zc+res"), (1, DOT_ROWS + 2)),
    (GemvConfig(16, 64, 4, dot=True, stages=4), ("norm+res",), (1,)),  # a pipeline depth: the same sums
    # K = 300 in 3 slices of 128, 128 and 44 (the last partial); 2 slices, wide accumulators.
    (GemvConfig(8, 64, 4, split=3), ("plain", "norm+bias+res", "glu+res", "zc+res"), (1, MAX_GROUP_ROWS + 3)),
    (GemvConfig(16, 64, 2, wide=True, split=2), ("norm+bias+res",), (3,)),
    # The tensor-core kernel over 3 slices (the last partial), past one row tile.
    (GemvConfig(16, 64, 4, dot=True, split=3), ("plain", "norm+bias+res", "glu+res", "zc+res"), (1, DOT_ROWS + 2)),
):
    for variant in variants:
        w = torch.randn(n, k, generator=gen) * 0.05
        bias = torch.randn(n, generator=gen) if "bias" in variant else None
        # zc: Qwen3.5's zero-centred norm (weights near 0, applied as 1 + w)
        mode = "zero_centred" if "zc" in variant else "rms"
        norm = (
            torch.rand(k, generator=gen) + (0.5 if mode == "rms" else -0.5)
            if "norm" in variant or "zc" in variant
            else None
        )
        glu = "glu" in variant
        for m in counts:
            x = torch.randn(m, 2 * k if glu else k, generator=gen)
            r = torch.randn(m, n, generator=gen) if "res" in variant else None
            want = reference(x, w, bias, norm, r, 1e-6, glu, mode)
            got = launch(x, w, bias, norm, r, 1e-6, glu, config=cfg, norm_mode=mode)
            worst = max(worst, (got - want).abs().max().item() / max(1.0, want.abs().max().item()))
            alone = torch.cat(
                [
                    launch(
                        x[i : i + 1],
                        w,
                        bias,
                        norm,
                        None if r is None else r[i : i + 1],
                        1e-6,
                        glu,
                        config=cfg,
                        norm_mode=mode,
                    )
                    for i in range(m)
                ]
            )
            invariant = invariant and torch.equal(alone, got)
            # The tuner's rows per program of the per-row kernel (a size per bucket): the same bits.
            for g in (c for c in GROUP_CANDIDATES if c < min(m, MAX_GROUP_ROWS) and not cfg.dot):
                y = launch(x, w, bias, norm, r, 1e-6, glu, config=cfg, norm_mode=mode, group_rows=g)
                invariant = invariant and torch.equal(y, got)
            for pdl, pf in MODES if cfg.split == 1 else MODES[:1]:
                y = launch(x, w, bias, norm, r, 1e-6, glu, config=cfg, pdl=pdl, pf_k=pf, norm_mode=mode)
                pdl_bitwise = pdl_bitwise and torch.equal(y, got)
            cases += 1
# A strided activation (a view of a wider buffer) and an empty batch.
x = torch.randn(4, 2 * k, generator=gen)[:, :k]
w = torch.randn(n, k, generator=gen)
strided_ok = torch.allclose(launch(x, w), reference(x, w), rtol=1e-4, atol=1e-4)
empty_ok = launch(torch.zeros(0, k), w).shape == (0, n)
# Modes a launch refuses: a split configuration past mode 1, a prefetch outside modes 3 and 4 or
# of a width that is not a power of two.
refused = 0
for cfg, pdl, pf in (
    (GemvConfig(8, 64, 4, split=3), 3, 0),
    (GemvConfig(8, 64, 4), 1, 256),
    (GemvConfig(8, 64, 4), 3, 96),
):
    try:
        launch(x.contiguous(), w, config=cfg, pdl=pdl, pf_k=pf)
    except ValueError:
        refused += 1
# int64 weight row offsets (a weight of 2**31 elements or more; forced here by lowering the
# threshold): the same bits as int32 offsets, in the per-row, tensor-core and split kernels.
x = torch.randn(MAX_GROUP_ROWS + 3, k, generator=gen)
small = [
    launch(x, w, config=c)
    for c in (GemvConfig(8, 128, 4), GemvConfig(16, 64, 4, dot=True), GemvConfig(8, 64, 4, split=3))
]
gemv.ADDR64_ELEMENTS = 1
flags: list[bool] = []  # each main kernel launch's ADDR64 (the check must see the int64 path run)


class _Spy:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            flags.append(kwargs.get("ADDR64", False))
            return self.kernel[grid](*args, **kwargs)

        return run


per_row, dot = gemv._kernel(), gemv._dot_kernel()
gemv._kernel, gemv._dot_kernel = lambda: _Spy(per_row), lambda: _Spy(dot)  # type: ignore[assignment]
wide = [
    launch(x, w, config=c)
    for c in (GemvConfig(8, 128, 4), GemvConfig(16, 64, 4, dot=True), GemvConfig(8, 64, 4, split=3))
]
gemv.ADDR64_ELEMENTS = 1 << 31
addr64_bitwise = flags == [True] * 3 and all(torch.equal(a, b) for a, b in zip(small, wide, strict=True))
ok = worst < 1e-5 and invariant and strided_ok and empty_ok and pdl_bitwise and refused == 3 and addr64_bitwise
report = {"cases": cases, "max_rel_err": worst, "row_invariant": invariant, "strided": strided_ok, "empty": empty_ok}
report["pdl_modes_bitwise"] = pdl_bitwise
report["bad_modes_refused"] = refused
report["addr64_bitwise"] = addr64_bitwise
print(json.dumps(report))
sys.exit(0 if ok else 1)
