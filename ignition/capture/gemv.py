"""Projections over few rows (decode buckets, the sampled rows' vocabulary projection) as one
bandwidth-bound Triton kernel each, with the neighbouring elementwise work folded in.

`flare::gemv` computes `y = prologue(x) @ W^T (+ bias) (+ residual)` for x [M, K'] and a row-major
weight W [N, K], where the prologue is one of
- nothing (x is the input),
- RMSNorm (`norm` given): `norm * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` (Transformers' order:
  statistics in float32, cast, then the weight multiply in the activation dtype),
- SiLU-gated product (`glu`): x is [M, 2K] = [gate | up] and the input is `silu(gate) * up`, each
  rounded to the activation dtype as eager torch rounds it.
The result is rounded to the activation dtype before the residual add, as `x + F.linear(...)` is.

Why a kernel of its own: with one to eight rows a projection is a stream over its weight; the
GEMM templates Inductor emits for them ran at a fraction of the HBM bandwidth, and around them
sat separate kernels for the norm, the activation and the residual add (the ~1B Llama decoded one
token through 244 kernels). One program owns BLOCK_N weight rows and every activation row of its
group, so the weight is read once per step.

Two kernels, chosen per shape by the tuner: the per-row one (`flare_gemv`) and a tensor-core one
(`flare_gemv_dot`: rows in groups of `DOT_ROWS` through `tl.dot`, zeros past M).

Invariants:
- A row's result does not depend on how many rows were launched with it: the per-row kernel
  processes rows in groups of at most `MAX_GROUP_ROWS` by one code path per row (its own
  accumulator, the same tile layout, the same reduction order); the tensor-core one always
  launches `DOT_ROWS`-row tiles, and an MMA reduces each output element on its own. So decode
  buckets agree bitwise with each other (the lifecycle checks compare requests batched together
  with their solo runs). The configuration is chosen per weight shape, never per bucket, and the
  tuner keeps only tiles it has seen keep this property on the device. The per-row kernel's
  group size, which leaves every row's arithmetic alone, is chosen per bucket (checked the same way).
- Deterministic: no atomics. A split configuration (K in slices, for weights with few rows)
  writes each slice's float32 sums, and one program per output element adds them in slice
  order, so the first invariant holds for it too.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ignition.capture import rownorm
from ignition.capture.fallback import declare

if TYPE_CHECKING:
    from torch._library.custom_ops import CustomOpDef

# Rows one program of the per-row kernel multiplies against its weight tile, at most. Larger
# groups reuse the tile more but hold one accumulator per row and do that many rows' arithmetic
# per tile; a bucket's group size is tuned (`_GROUPS`), the default is the largest.
MAX_GROUP_ROWS = 8
# Group sizes the tuner times for a bucket of more than one row (below the default).
GROUP_CANDIDATES = (1, 2, 4)


@dataclass(frozen=True)
class GemvConfig:
    """Tile of one program: BLOCK_N weight rows by BLOCK_K columns per step, on `num_warps` warps;
    `wide`: one accumulator per tile element, reduced after the K loop (else reduced every step)."""

    block_n: int
    block_k: int
    num_warps: int
    wide: bool = False
    # The tensor-core variant (`flare_gemv_dot`): rows in groups of DOT_ROWS through `tl.dot`.
    dot: bool = False
    # K in this many slices, each its own programs, their float32 sums added in slice order by
    # `flare_gemv_reduce` (one more launch): for weights with few rows and long ones.
    split: int = 1
    # Triton's software-pipeline depth for the K loop (0: its default): more stages keep more
    # weight tiles in flight, what a stream over HBM needs; the tensor-core loop pipelines.
    stages: int = 0


# Used until a shape is tuned (CPU interpreter runs, tests).
DEFAULT_CONFIG = GemvConfig(block_n=8, block_k=256, num_warps=4)
# Candidates the tuner times on the device, for each projection shape, bounded by the elements of
# the weight tile per thread (wide accumulators hold that many floats per row of the group).
CANDIDATES: tuple[GemvConfig, ...] = tuple(
    GemvConfig(n, k, w, wide)
    for n in (4, 8, 16, 32)
    for k in (128, 256, 512)
    for w in (4, 8)
    for wide in (False, True)
    if 2 <= n * k // (32 * w) <= (16 if wide else 64)
) + tuple(GemvConfig(n, k, 4, dot=True) for n in (16, 32, 64) for k in (64, 128, 256))
CANDIDATES += tuple(
    GemvConfig(n, 256, 4, wide, split=s) for n, wide in ((4, True), (8, True), (16, False), (32, False)) for s in (2, 4)
)
# Tensor-core tiles over K slices: the one kernel whose K loop Triton software-pipelines, with a
# program per SM even for a weight of 2,048 rows, and the same weight read for every row count
# up to DOT_ROWS (the decode buckets of a batch cost what one row costs).
CANDIDATES += tuple(GemvConfig(n, k, 4, dot=True, split=s) for n in (16, 32, 64) for k in (128, 256) for s in (2, 4))
# Deeper pipelines for the tensor-core tiles the ~1B's widest projections chose (gate_up at 3.4 of
# the H200's 4.8 TB/s with the default depth, 2026-12-06): at most 5 stages of a 64 x 256 tile
# and its rows, 200 KiB of shared memory.
CANDIDATES += tuple(
    GemvConfig(n, k, 4, dot=True, stages=d) for n, k in ((32, 256), (64, 256), (64, 128)) for d in (4, 5)
)
# Activation rows per tensor-core group (the MMA's row tile; rows past M are zeros).
DOT_ROWS = 16
# The norm prologues (`rownorm` defines them): Llama's RMSNorm, and Qwen3.5's zero-centred one
# (x * rstd * (1 + w), float32, rounded once).
NORM_MODES = {"rms": 1, "zero_centred": 2}
# Weights with at least this many elements offset each tile by its first row in int64 (the
# kernels' `ADDR64`); below it every offset is int32, as it always was. The bound is 2**31 - 1
# for the last element's offset; at exactly 2**31 elements that still fits, so this is a margin.
ADDR64_ELEMENTS = 1 << 31


def needs_addr64(n: int, row_stride: int) -> bool:
    """Whether an [n, k] weight whose rows are `row_stride` elements apart takes the kernels'
    int64 tile offsets (`ADDR64_ELEMENTS`)."""
    return n * row_stride >= ADDR64_ELEMENTS


@dataclass(frozen=True)
class Variant:
    """Which prologue and epilogue a projection folds in (selects one kernel specialization)."""

    norm: bool = False
    glu: bool = False
    bias: bool = False
    residual: bool = False

    def key(self) -> str:
        parts = [
            n for n, on in (("norm", self.norm), ("glu", self.glu), ("bias", self.bias), ("res", self.residual)) if on
        ]
        return "+".join(parts) or "plain"


# (N, K, variant key) -> the configuration prepare's tuner chose for that projection shape.
_TUNED: dict[tuple[int, int, str], GemvConfig] = {}


def config_for(n: int, k: int, variant: Variant) -> GemvConfig:
    return _TUNED.get((n, k, variant.key()), DEFAULT_CONFIG)


def set_config(n: int, k: int, variant: Variant, config: GemvConfig) -> None:
    _TUNED[(n, k, variant.key())] = config


@dataclass(frozen=True)
class LaunchMode:
    """How a projection's kernel launches: `pdl` 0 plainly, else as a programmatic dependent
    (Hopper PDL) in the kernels' mode `pdl` (1: wait first, let the next kernel in after the
    loop; 3: prefetch, wait, let it in at once; 4: prefetch, wait, let it in after the loop),
    prefetching the first `pf_k` columns (a power of two, 0: none) of its weight rows into L2
    before waiting. A split configuration runs mode 0 or 1 only."""

    pdl: int = 0
    pf_k: int = 0


# (N, K, variant key, rows) -> rows per program of the per-row kernel that the tuner chose for
# that bucket; absent: min(rows, MAX_GROUP_ROWS). Any size gives every row the same arithmetic (one
# code path per row), so unlike the tile it may differ per bucket.
_GROUPS: dict[tuple[int, int, str, int], int] = {}


def group_rows_for(n: int, k: int, variant: Variant, m: int) -> int:
    return _GROUPS.get((n, k, variant.key(), m), min(m, MAX_GROUP_ROWS))


def set_group_rows(n: int, k: int, variant: Variant, m: int, rows: int) -> None:
    _GROUPS[(n, k, variant.key(), m)] = rows


def clear_group_rows() -> None:
    """Every bucket back to the default group size (a new tuning starts from it)."""
    _GROUPS.clear()


PLAIN = LaunchMode()
# (N, K, variant key) -> the launch mode prepare chose for that projection shape; absent: plain.
_MODES: dict[tuple[int, int, str], LaunchMode] = {}


def launch_mode_for(n: int, k: int, variant: Variant) -> LaunchMode:
    return _MODES.get((n, k, variant.key()), PLAIN)


def set_launch_mode(n: int, k: int, variant: Variant, mode: LaunchMode) -> None:
    _MODES[(n, k, variant.key())] = mode


def clear_launch_modes() -> None:
    """Every projection back to plain launches."""
    _MODES.clear()


# ---------------------------------------------------------------------------------------------
# The reference: eager torch, the arithmetic the kernel reproduces (and what CPU runs use).


def reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 0.0,
    glu: bool = False,
    norm_mode: str = "rms",
) -> torch.Tensor:
    if norm is not None:
        x = rownorm.reference(x, norm, eps, norm_mode)
    if glu:
        half = x.shape[-1] // 2
        x = F.silu(x[:, :half]) * x[:, half:]
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


# ---------------------------------------------------------------------------------------------
# The kernel


@functools.cache
def _kernel() -> Any:  # a triton.JITFunction (Triton ships no type information)
    from ignition.capture.gemv_triton import flare_gemv

    return flare_gemv


@functools.cache
def _reduce_kernel() -> Any:
    from ignition.capture.gemv_triton import flare_gemv_reduce

    return flare_gemv_reduce


@functools.cache
def _dot_kernel() -> Any:
    from ignition.capture.gemv_triton import flare_gemv_dot

    return flare_gemv_dot


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 0.0,
    glu: bool = False,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
    pdl: int | None = None,
    norm_mode: str = "rms",
    pf_k: int = 0,
    group_rows: int | None = None,
) -> torch.Tensor:
    """Runs the kernel (what `flare::gemv` calls); `config` overrides the tuned configuration,
    `pdl` (with `pf_k`) the launch mode prepare chose (`LaunchMode`; 2, for the probe only:
    the first weight tile loaded into registers before the wait), `group_rows` the per-row
    kernel's rows per program (`group_rows_for`)."""
    m = x.shape[0]
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != (2 * k if glu else k):
        raise ValueError(f"gemv: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} (glu={glu})")
    if norm is not None and glu:
        raise ValueError("gemv: the norm and SiLU-gated prologues do not combine")
    if norm_mode not in NORM_MODES:
        raise ValueError(f"gemv: norm mode {norm_mode!r} is none of {sorted(NORM_MODES)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    variant = Variant(norm is not None, glu, bias is not None, residual is not None)
    cfg = config or config_for(n, k, variant)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    r = residual.contiguous() if residual is not None else x
    if pdl is None:
        mode = launch_mode_for(n, k, variant)
        pdl, pf_k = mode.pdl, mode.pf_k
    if cfg.split > 1 and pdl > 1:
        raise ValueError(f"gemv: a split configuration runs PDL mode 0 or 1, not {pdl} ({cfg})")
    if pf_k and (pdl < 3 or pf_k & (pf_k - 1)):
        raise ValueError(f"gemv: pf_k={pf_k} needs PDL mode 3 or 4 and a power of two")
    esize = weight.element_size()
    if pf_k and (weight.data_ptr() % 16 or weight.stride(0) * esize % 16 or pf_k * esize < 16):
        pf_k = 0  # a bulk prefetch needs 16-byte aligned rows and sizes; the arithmetic is the same without
    partial = torch.empty(cfg.split, m, n, dtype=torch.float32, device=x.device) if cfg.split > 1 else y
    args = (
        x,
        weight,
        bias if bias is not None else x,
        norm if norm is not None else x,
        r,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        r.stride(0),
        y.stride(0),
        eps,
    )
    flags = {
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "NORM": NORM_MODES[norm_mode] if norm is not None else 0,
        "GLU": glu,
        "BIAS": bias is not None,
        "RESIDUAL": residual is not None,
        "num_warps": cfg.num_warps,
    }
    if cfg.stages:
        flags["num_stages"] = cfg.stages
    if pdl:
        flags.update(PDL=pdl, launch_pdl=True)
    if pf_k:
        flags.update(PF_K=pf_k, ESIZE=esize)
    if needs_addr64(n, weight.stride(0)):
        flags["ADDR64"] = True
    if cfg.dot:
        grid = (-(-n // cfg.block_n), -(-m // DOT_ROWS), cfg.split)
        _dot_kernel()[grid](*args, partial, BLOCK_M=DOT_ROWS, SPLIT=cfg.split, **flags)
    else:
        rows = group_rows or group_rows_for(n, k, variant, m)
        if not 1 <= rows <= MAX_GROUP_ROWS:
            raise ValueError(f"gemv: {rows} rows per program (1 to {MAX_GROUP_ROWS})")
        grid = (-(-n // cfg.block_n) * -(-m // rows), 1, cfg.split)
        _kernel()[grid](*args[:6], partial, *args[6:], ROWS=rows, WIDE=cfg.wide, SPLIT=cfg.split, **flags)
    if cfg.split > 1:
        block = min(1024, 1 << (n - 1).bit_length())
        _reduce_kernel()[(m, -(-n // block))](
            partial, args[2], r, y, m, n, r.stride(0), y.stride(0), SPLIT=cfg.split, BLOCK=block,
            BIAS=bias is not None, RESIDUAL=residual is not None, **({"PDL": pdl, "launch_pdl": True} if pdl else {}),
        )  # fmt: skip
    return y


@functools.cache
def gemv_op() -> CustomOpDef:
    """`flare::gemv`: one projection with its prologue and epilogue as one opaque op (Inductor
    would otherwise emit a GEMM template plus separate norm, activation and add kernels)."""
    from torch.library import custom_op

    @custom_op("flare::gemv", mutates_args=())
    def gemv(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        norm: torch.Tensor | None,
        residual: torch.Tensor | None,
        eps: float,
        glu: bool,
        norm_mode: str,
    ) -> torch.Tensor:
        return launch(x, weight, bias, norm, residual, eps, glu, norm_mode=norm_mode)

    @gemv.register_fake
    def _(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        norm: torch.Tensor | None,
        residual: torch.Tensor | None,
        eps: float,
        glu: bool,
        norm_mode: str,
    ) -> torch.Tensor:
        return torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)

    return declare(gemv)


class Projections:
    """The linear layers and row norms of a prepared forward. `few_rows` calls (decode buckets,
    speculative lanes, sampled rows) go through `flare::gemv` and `flare::rms_norm` when kernels
    are on, so a row's result does not depend on the rows beside it; everything else, and every
    CPU run, is the eager reference (Inductor compiles it, fused with its neighbours)."""

    def __init__(self, kernel: bool) -> None:
        self.kernel = kernel
        # Created before tracing (Dynamo does not trace their creation).
        self.op = gemv_op() if kernel else None
        self.norm_op = rownorm.rms_norm_op() if kernel else None

    def norm(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        eps: float,
        mode: str = "rms",
        gate: torch.Tensor | None = None,
        *,
        few_rows: bool = False,
    ) -> torch.Tensor:
        """RMSNorm of x over its last dimension (`rownorm` names the modes)."""
        if few_rows and self.norm_op is not None:
            y: torch.Tensor = self.norm_op(x, w, gate, eps, mode)
            return y
        return rownorm.reference(x, w, eps, mode, gate)

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        glu: bool = False,
        residual: torch.Tensor | None = None,
        few_rows: bool = False,
        norm_mode: str = "rms",
    ) -> torch.Tensor:
        """x @ weight.T (+ bias), after the norm prologue (`norm`: its weight, `norm_mode` one
        of `NORM_MODES`) or SiLU(gate) * up (`glu`), plus `residual`."""
        if few_rows and self.op is not None:
            y: torch.Tensor = self.op(x, weight, bias, norm, residual, eps, glu, norm_mode)
            return y
        return reference(x, weight, bias, norm, residual, eps, glu, norm_mode)


# ---------------------------------------------------------------------------------------------
# Tuning (on the device, before capture)


@dataclass(frozen=True)
class Problem:
    """One projection role of a model: its weights (one per layer, same shape), its variant."""

    name: str
    weights: Sequence[torch.Tensor]
    variant: Variant
    biases: Sequence[torch.Tensor] | None = None
    norms: Sequence[torch.Tensor] | None = None
    eps: float = 1e-6
    norm_mode: str = "rms"


def _time_ms(fn: Callable[[], object], reps: int) -> float:
    """Device time of `fn`'s launches, replayed as a CUDA graph (as the core runs them): timing
    Python launches would measure the host's launch cost, not the kernel (a few-row projection
    of the ~1B takes ~10 us, about what one Triton launch costs the host)."""
    return time_graphs([fn], reps)


def time_graphs(steps: Sequence[Callable[[], object]], reps: int) -> float:
    """Milliseconds per replay of one CUDA graph per step (each run once first, to compile and
    load outside the capture), the graphs replayed in turn `reps` times each: steps over copies
    of their operands keep a replay's reads out of L2 when its turn comes again."""
    graphs = []
    for fn in steps:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs.append(graph)
    for graph in graphs:
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        for graph in graphs:
            graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / (reps * len(graphs))


def _layer(
    p: Problem,
    i: int,
    x: torch.Tensor,
    r: torch.Tensor,
    cfg: GemvConfig | None = None,
    mode: LaunchMode = PLAIN,
    group_rows: int | None = None,
) -> torch.Tensor:
    """The problem's projection through layer i's weight (its bias and norm), launched as `mode`
    (`group_rows`: as `launch`)."""
    return launch(
        x,
        p.weights[i],
        None if p.biases is None else p.biases[i],
        None if p.norms is None else p.norms[i],
        r if p.variant.residual else None,
        p.eps,
        p.variant.glu,
        cfg,
        pdl=mode.pdl,
        pf_k=mode.pf_k,
        norm_mode=p.norm_mode,
        group_rows=group_rows,
    )


def _run(
    p: Problem,
    x: torch.Tensor,
    r: torch.Tensor,
    cfg: GemvConfig,
    layers: int | None = None,
    group_rows: int | None = None,
) -> torch.Tensor:
    """The problem's projection over its first `layers` weights (all by default), plainly; the
    last output."""
    y = x
    for i in range(len(p.weights[:layers])):
        y = _layer(p, i, x, r, cfg, group_rows=group_rows)
    return y


# Weight bytes one timed pass of the tuner streams: over twice what a Hopper L2 holds (50 MB), so
# every layer's weights come from HBM, as in a decode step (the whole model streams through L2
# there). Timed alone, SmolLM2's 30 o_proj weights (20 MB) stayed in L2 across replays and the
# tuner ranked tiles by warm reads (2026-12-06, H100: o_proj 2.3 us tuned, 3.6 us in the graph).
COLD_BYTES = 160 << 20
# Candidates timed cold: the fastest over the problem's own layers (which may sit in L2) are
# timed again over `COLD_BYTES`. Timing every candidate cold cost Qwen3.5's preparation 73 s and
# chose the tiles warm timing had ranked first (2026-12-06, H100).
COLD_FINALISTS = 6


def _cold(p: Problem) -> Problem:
    """`p` with its layers followed by copies of them (distinct memory) up to `COLD_BYTES`."""
    held = sum(w.numel() * w.element_size() for w in p.weights)
    copies = -(-COLD_BYTES // max(held, 1)) - 1
    if copies <= 0:
        return p

    def more(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [*ts, *(t.clone() for _ in range(copies) for t in ts)]

    return replace(
        p,
        weights=more(p.weights),
        biases=None if p.biases is None else more(p.biases),
        norms=None if p.norms is None else more(p.norms),
    )


def _inputs(
    p: Problem, counts: Iterable[int], gen: torch.Generator
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Random activations (twice as wide for the SiLU-gated prologue) and residuals of `p`, per
    row count."""
    w = p.weights[0]
    n, k = w.shape
    kin = 2 * k if p.variant.glu else k
    xs = {m: torch.randn(m, kin, generator=gen, device=w.device).to(w.dtype) for m in counts}
    res = {m: torch.randn(m, n, generator=gen, device=w.device).to(w.dtype) for m in counts}
    return xs, res


def _bucket_invariant(
    p: Problem, x: torch.Tensor, r: torch.Tensor, cfg: GemvConfig, group_rows: int | None = None
) -> bool:
    """Whether the rows of `x` projected together (`group_rows` per program) equal the same rows
    projected one by one."""
    grouped = _run(p, x, r, cfg, 1, group_rows)
    alone = torch.cat([_run(p, x[i : i + 1], r[i : i + 1], cfg, 1) for i in range(x.shape[0])])
    return bool(torch.equal(grouped, alone))


def _tune_groups(
    p: Problem, cold: Problem, xs: dict[int, torch.Tensor], res: dict[int, torch.Tensor], cfg: GemvConfig, reps: int
) -> dict[str, Any]:
    """Rows per program of the per-row kernel for each bucket of more than one row: the default
    (`min(rows, MAX_GROUP_ROWS)`) and the smaller `GROUP_CANDIDATES` timed over `cold`, the fastest
    that keeps the bucket's rows equal to the same rows alone kept (`set_group_rows`; none keeping
    them is an error). Returns per bucket the choice and every size's time per layer (us)."""
    n, k = p.weights[0].shape
    out: dict[str, Any] = {}
    if cfg.dot:  # the tensor-core kernel's row tile is fixed
        return out
    for m in sorted(x for x in xs if x > 1):
        default = min(m, MAX_GROUP_ROWS)
        times: dict[int, float] = {}
        for g in sorted({default, *(c for c in GROUP_CANDIDATES if c < default)}):
            ms = _time_ms(functools.partial(_run, cold, xs[m], res[m], cfg, None, g), reps)
            times[g] = ms * 1e3 / len(cold.weights)
        kept = next(
            (g for g in sorted(times, key=lambda g: times[g]) if _bucket_invariant(p, xs[m], res[m], cfg, g)), 0
        )
        if not kept:
            raise RuntimeError(f"gemv {p.name}: no group size keeps {m} rows equal to the same rows alone ({cfg})")
        set_group_rows(n, k, p.variant, m, kept)
        out[str(m)] = {"rows_per_program": kept, "us_per_layer": {str(g): round(t, 2) for g, t in times.items()}}
    return out


def _fits(cfg: GemvConfig, k: int) -> bool:
    """Whether the tuner times `cfg` on a row of `k`: a tile wider than twice the row runs as a
    narrower one with more masking, and a split needs a tile per slice."""
    return cfg.block_k <= 2 * max(16, 1 << (k - 1).bit_length()) and cfg.split * cfg.block_k <= k


@dataclass(frozen=True)
class CompileTask:
    """One kernel specialization the tuner launches: enough to launch it on scratch tensors of
    the same shapes, dtypes and alignment, which compiles exactly what the tuner's launch loads."""

    n: int
    k: int
    m: int
    dtype: torch.dtype
    variant: Variant
    norm_mode: str
    config: GemvConfig
    device: str
    # The norm weight's and bias's dtypes (a pointer's element type is part of the signature).
    norm_dtype: torch.dtype | None = None
    bias_dtype: torch.dtype | None = None
    # The per-row kernel's rows per program (None: the bucket's default).
    group_rows: int | None = None


def compile_tasks(
    problems: Sequence[Problem], rows: Sequence[int], candidates: Sequence[GemvConfig]
) -> list[CompileTask]:
    """The specializations `tune` will compile, each once. Triton keys a compiled kernel on its
    constexprs and on whether each integer argument is 1 or a multiple of 16, not on its value,
    so problems alike in those share a task (a coarser grouping would only cost a compile later)."""
    seen: set[tuple[Any, ...]] = set()
    out: list[CompileTask] = []
    for p in problems:
        k = p.weights[0].shape[1]
        for cfg in candidates:
            if not _fits(cfg, k):
                continue
            for m in rows:
                # The per-row kernel's group size is a constexpr; the tensor-core one's is fixed.
                key, task = _specialization(p, cfg, m, None if cfg.dot else min(m, MAX_GROUP_ROWS))
                if key not in seen:
                    seen.add(key)
                    out.append(task)
    return out


def _specialization(p: Problem, cfg: GemvConfig, m: int, group_rows: int | None) -> tuple[tuple[Any, ...], CompileTask]:
    """The Triton key (as `compile_tasks` describes it) of `p` launched with `cfg` over `m` rows,
    `group_rows` per program (None: the tensor-core kernel), and a task that compiles it."""
    w = p.weights[0]
    n, k = w.shape
    classes = tuple((v % 16 == 0, v == 1) for v in (n, k, 2 * k if p.variant.glu else k))
    nd = None if p.norms is None else p.norms[0].dtype
    bd = None if p.biases is None else p.biases[0].dtype
    # A split's reduction kernel takes its block from N.
    block = min(1024, 1 << (n - 1).bit_length()) if cfg.split > 1 else 0
    rows_key = (group_rows, m == 1, m % 16 == 0)
    key = (classes, block, rows_key, needs_addr64(n, k), w.dtype, p.variant, p.norm_mode, cfg, nd, bd)
    return key, CompileTask(n, k, m, w.dtype, p.variant, p.norm_mode, cfg, str(w.device), nd, bd, group_rows)


def _compile_one(t: CompileTask) -> bool:
    """Launches `t` on scratch tensors (in a pool worker): Triton compiles it into its cache
    directory, where the tuner's launch in the preparing process finds it. False if it failed
    (a tile the compiler cannot fit; the tuner meets and skips it again)."""
    dev = torch.device(t.device)
    v = t.variant
    x = torch.zeros(t.m, 2 * t.k if v.glu else t.k, dtype=t.dtype, device=dev)
    w = torch.zeros(t.n, t.k, dtype=t.dtype, device=dev)
    bias = torch.zeros(t.n, dtype=t.bias_dtype or t.dtype, device=dev) if v.bias else None
    norm = torch.zeros(t.k, dtype=t.norm_dtype or t.dtype, device=dev) if v.norm else None
    res = torch.zeros(t.m, t.n, dtype=t.dtype, device=dev) if v.residual else None
    try:
        launch(x, w, bias, norm, res, 1e-6, v.glu, t.config, pdl=0, norm_mode=t.norm_mode, group_rows=t.group_rows)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except Exception:  # reported by the tuner, which meets the same failure
        return False
    return True


def compile_workers() -> int:
    """Processes that compile the tuner's candidates: `IGNITION_COMPILE_WORKERS`, else one per
    core (0 or 1: compile in the preparing process, one kernel at a time)."""
    env = os.environ.get("IGNITION_COMPILE_WORKERS")
    return int(env) if env is not None else min(32, os.cpu_count() or 1)


def precompile(
    problems: Sequence[Problem],
    rows: Sequence[int],
    candidates: Sequence[GemvConfig] = CANDIDATES,
    workers: int | None = None,
) -> dict[str, Any]:
    """Compiles every specialization `tune` will launch in a pool of processes (spawned: each
    has its own CUDA context), so the tuner's launches load them from Triton's cache instead of
    compiling one after another in this process (~600 compiles, ~190 s on an idle H100 host
    for SmolLM2). Needs the cache directory (`TRITON_CACHE_DIR`) set before the pool starts."""
    return _compile_in_pool(compile_tasks(problems, rows, candidates), workers)


def group_compile_tasks(problems: Sequence[Problem], rows: Sequence[int]) -> list[CompileTask]:
    """The per-row kernel's specializations `tune_groups` launches beyond `compile_tasks`' (each
    bucket's default group): each problem's registered tile (`tune` chose it) at every smaller
    group size of `GROUP_CANDIDATES`, for each bucket of more than one row, each once."""
    seen: set[tuple[Any, ...]] = set()
    out: list[CompileTask] = []
    for p in problems:
        n, k = p.weights[0].shape
        cfg = config_for(n, k, p.variant)
        if cfg.dot:  # the tensor-core kernel's row tile is fixed
            continue
        # What the first pass compiled: each bucket's default group.
        seen |= {_specialization(p, cfg, m, min(m, MAX_GROUP_ROWS))[0] for m in rows}
        for m in rows:
            for g in (c for c in GROUP_CANDIDATES if m > 1 and c < min(m, MAX_GROUP_ROWS)):
                key, task = _specialization(p, cfg, m, g)
                if key not in seen:
                    seen.add(key)
                    out.append(task)
    return out


def precompile_groups(problems: Sequence[Problem], rows: Sequence[int], workers: int | None = None) -> dict[str, Any]:
    """Compiles `group_compile_tasks` in a process pool (after `tune`, before `tune_groups`):
    otherwise each compiles in the preparing process while the group sizes are timed."""
    return _compile_in_pool(group_compile_tasks(problems, rows), workers)


def _compile_in_pool(tasks: Sequence[CompileTask], workers: int | None) -> dict[str, Any]:
    """Launches each task once in a pool of spawned processes; reports tasks, workers, failures."""
    import multiprocessing

    n = min(compile_workers() if workers is None else workers, len(tasks))
    report: dict[str, Any] = {"tasks": len(tasks), "workers": n if n > 1 else 0, "failed": 0}
    if n <= 1:
        return report
    # A hung worker must not hang the preparation: past the deadline the pool is terminated
    # (leaving the with-block does) and the tuner compiles what is missing itself.
    deadline = 60.0 + 2.0 * len(tasks) / n
    try:
        with multiprocessing.get_context("spawn").Pool(n) as pool:
            done = pool.map_async(_compile_one, tasks, chunksize=4).get(timeout=deadline)
            report["failed"] = sum(not ok for ok in done)
    except Exception as e:  # the pool only saves time: the tuner compiles what it misses
        report["pool_error"] = f"{type(e).__name__}: {e}"
    return report


def tune(
    problems: Sequence[Problem],
    rows: Sequence[int],
    candidates: Sequence[GemvConfig] = CANDIDATES,
    reps: int = 5,
    invariant_rows: int = 0,
) -> dict[str, Any]:
    """Times every candidate on each problem's real weights (all layers in turn) for each row
    count in `rows`, then the `COLD_FINALISTS` fastest again with copies of the layers up to
    `COLD_BYTES` (so that the stream does not sit in L2, as in a decode step) when the layers
    alone are smaller; keeps the fastest total and registers it for the problem's shape.
    Before keeping a configuration it checks that the rows of the largest group (`rows`'
    largest, or `invariant_rows` if larger: a speculative program's lanes) equal the same rows
    computed alone, bitwise (the bucket invariance above).
    Returns a report: per problem the chosen tile, its time per layer and achieved bytes/s."""
    report: dict[str, Any] = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    clear_group_rows()
    for p in problems:
        cold = _cold(p)
        w0 = p.weights[0]
        n, k = w0.shape
        big = max(*rows, invariant_rows)
        xs, res = _inputs(p, {*rows, big}, gen)
        timings: list[tuple[float, GemvConfig]] = []
        skipped: list[str] = []
        for cfg in candidates:
            if not _fits(cfg, k):
                continue
            try:
                total = sum(_time_ms(functools.partial(_run, p, xs[m], res[m], cfg), reps) for m in rows)
            except Exception as e:  # a tile the compiler cannot fit (shared memory, registers)
                skipped.append(f"{asdict(cfg)}: {type(e).__name__}")
                continue
            timings.append((total, cfg))
        if not timings:
            raise RuntimeError(f"gemv tuning: no candidate ran for {p.name} ({n}x{k}): {skipped}")
        timed = len(timings)
        ranked = [cfg for _, cfg in sorted(timings, key=lambda t: t[0])]
        timed_cold = 0
        if cold is not p:  # the finalists again over weights that cannot stay in L2, the rest after
            finals = [
                (sum(_time_ms(functools.partial(_run, cold, xs[m], res[m], cfg), reps) for m in rows), cfg)
                for cfg in ranked[:COLD_FINALISTS]
            ]
            timed_cold = len(finals)
            ranked = [cfg for _, cfg in sorted(finals, key=lambda t: t[0])] + ranked[COLD_FINALISTS:]
        # The fastest tile whose grouped rows equal the same rows alone (the bucket invariance);
        # a tile that breaks it is reported and passed over, never used.
        broken = []
        best = None
        for cfg in ranked:
            if _bucket_invariant(p, xs[big], res[big], cfg):
                best = cfg
                break
            broken.append(asdict(cfg))
        if best is None:
            raise RuntimeError(f"gemv {p.name}: no tile keeps rows grouped by {big} equal to the same rows alone")
        set_config(n, k, p.variant, best)
        one = _time_ms(functools.partial(_run, cold, xs[min(rows)], res[min(rows)], best), reps) / len(cold.weights)
        report[p.name] = {
            "shape": [n, k],
            "variant": p.variant.key(),
            "layers": len(p.weights),
            "config": asdict(best),
            "candidates_timed": timed,
            "timed_cold": timed_cold,
            "skipped": skipped,
            "rows": min(rows),
            "ms_per_layer": round(one, 5),
            "weight_gb_per_s": round(n * k * w0.element_size() / one / 1e6, 1),
            "bucket_invariant": True,
            "invariance_checked_at_rows": big,
            "tiles_breaking_invariance": broken,
        }
    return report


def tune_groups(problems: Sequence[Problem], rows: Sequence[int], reps: int = 5) -> dict[str, dict[str, Any]]:
    """The per-row kernel's rows per program for each problem's registered tile (`tune` chose
    it) and each bucket of more than one row (`_tune_groups`; `precompile_groups` first saves
    the compiles). Returns per problem what `_tune_groups` reports."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    clear_group_rows()
    out: dict[str, dict[str, Any]] = {}
    for p in problems:
        n, k = p.weights[0].shape
        cfg = config_for(n, k, p.variant)
        if cfg.dot:  # the tensor-core kernel's row tile is fixed: nothing to time or copy
            out[p.name] = {}
            continue
        xs, res = _inputs(p, [m for m in rows if m > 1], gen)
        out[p.name] = _tune_groups(p, _cold(p), xs, res, cfg, reps)
    return out


# Launch modes `tune_launch` tries for each projection, all programmatic (Hopper PDL): waiting
# first (1), letting the next kernel in at once with or without the whole weight prefetched into
# L2 (3), and prefetching the first columns with the next kernel let in after the loop (4).
# Measured on the decode projections' chain (`qualification/pdl_probe.py`, H100, 2026-12-06):
# SmolLM2's chain at one row took 0.77 of its plain time with mode 3 and whole rows prefetched;
# the ~1B's took 1.33 with the same mode (its layers overflow L2) and 0.96 with mode 1.
LAUNCH_CANDIDATES = (
    LaunchMode(1),
    LaunchMode(3),
    LaunchMode(3, 8192),
    LaunchMode(4, 256),
    LaunchMode(4, 1024),
    LaunchMode(4, 4096),
)
# A chain of modes must beat plain launches by this fraction to be kept: below it, timing noise.
LAUNCH_MIN_GAIN = 0.02
# Greedy passes over the projections at most (`tune_launch`): a projection's trigger serves its
# successor, whose own mode a first pass has not chosen yet when it reaches the predecessor (in
# session 23's SmolLM2 core o_proj kept mode 4, which lets gate_up in only after its loop, before
# gate_up took its prefetching mode 3).
LAUNCH_PASSES = 3


def _chain(
    problems: Sequence[Problem], xs: dict[str, torch.Tensor], rs: dict[str, torch.Tensor], modes: dict[str, LaunchMode]
) -> None:
    """Every layer's projections in `problems`' order, each on its own operands (no data flows
    between them: a programmatic dependent waits for its predecessor all the same)."""
    for i in range(max(len(p.weights) for p in problems)):
        for p in problems:
            if i < len(p.weights):
                _layer(p, i, xs[p.name], rs[p.name], mode=modes.get(p.name, PLAIN))


def tune_launch(
    problems: Sequence[Problem],
    rows: int,
    candidates: Sequence[LaunchMode] | None = None,
    reps: int = 30,
    step_ms: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Picks each projection's launch mode on this device, after `tune` chose its tile. A trial
    registers its modes and times `step_ms` (a decode step captured anew: the modes are read at
    launch), or without it the projections that have a weight per layer, layer by layer in
    `problems`' order (a decode step's order), as one CUDA graph at `rows` rows: a poor proxy,
    since in session 23 the modes that took that chain to 0.69 of its plain time saved 1% of
    the step (against the same kernels without programmatic edges).
    Projections sharing a shape and variant share a registered mode, so they are tuned as one
    unit named after its members (Qwen3.5's out_proj and o_proj). From plain launches: every
    unit at mode 1, then each unit's `candidates` (default `LAUNCH_CANDIDATES`) in turn, each
    kept when the time drops (greedy, passes until one changes nothing, at most
    `LAUNCH_PASSES`); the result is kept only if it beats plain launches by
    `LAUNCH_MIN_GAIN`. Registers the modes (`set_launch_mode`); projections outside the chain
    (one weight: the vocabulary) stay plain. Costs a compile per (projection, mode) and, per
    trial, a capture and its replays.
    Returns a report: the time plain and with the chosen modes, each trial's time."""
    chain = [p for p in problems if len(p.weights) > 1]
    if not chain:
        return {"chosen": {}, "kept": False, "reason": "no projection has a weight per layer"}
    candidates = LAUNCH_CANDIDATES if candidates is None else candidates
    units: dict[tuple[int, int, str], list[Problem]] = {}
    for p in chain:
        n, k = p.weights[0].shape
        units.setdefault((n, k, p.variant.key()), []).append(p)
    members = {"+".join(p.name for p in ps): ps for ps in units.values()}
    xs, rs = {}, {}  # the chain's operands (none when the step itself is timed)
    gen = torch.Generator(device=chain[0].weights[0].device).manual_seed(0)
    for p in chain if step_ms is None else ():
        n, k = p.weights[0].shape
        w = p.weights[0]
        xs[p.name] = torch.randn(rows, 2 * k if p.variant.glu else k, generator=gen, device=w.device).to(w.dtype)
        rs[p.name] = torch.randn(rows, n, generator=gen, device=w.device).to(w.dtype)

    def register(modes: dict[str, LaunchMode]) -> None:
        for unit, ps in members.items():
            n, k = ps[0].weights[0].shape
            set_launch_mode(n, k, ps[0].variant, modes.get(unit, PLAIN))

    def timed(modes: dict[str, LaunchMode]) -> float:
        if step_ms is not None:
            register(modes)
            return step_ms()
        each = {p.name: modes.get(unit, PLAIN) for unit, ps in members.items() for p in ps}
        return time_graphs([functools.partial(_chain, chain, xs, rs, each)], reps)

    def split(ps: list[Problem]) -> bool:
        n, k = ps[0].weights[0].shape
        return config_for(n, k, ps[0].variant).split > 1

    plain_ms = timed({})
    trials: list[dict[str, Any]] = []
    best = dict.fromkeys(members, LaunchMode(1))
    best_ms = timed(best)
    trials.append({"modes": "all mode 1", "ms": round(best_ms, 4)})
    if best_ms >= plain_ms:
        best, best_ms = {}, plain_ms
    passes = 0
    for passes in range(1, LAUNCH_PASSES + 1):
        changed = False
        for unit, ps in members.items():
            for mode in candidates:
                if split(ps) and mode.pdl > 1:  # a split configuration's two launches run mode 1 at most
                    continue
                if best.get(unit) == mode:
                    continue
                trial = {**best, unit: mode}
                ms = timed(trial)
                trials.append({"pass": passes, "projection": unit, "mode": asdict(mode), "ms": round(ms, 4)})
                if ms < best_ms:
                    best, best_ms, changed = trial, ms, True
        if not changed:
            break
    kept = best_ms < plain_ms * (1 - LAUNCH_MIN_GAIN)
    register(best if kept else {})
    return {
        "timed": "decode step" if step_ms is not None else "projections' chain",
        "rows": rows,
        "plain_ms": round(plain_ms, 4),
        "chosen_ms": round(best_ms, 4),
        "kept": kept,
        "passes": passes,
        "chosen": {unit: asdict(m) for unit, m in best.items()} if kept else {},
        "trials": trials,
    }
