"""Attention over 64-token KV pages: a hand-written Triton kernel (the prepared operation) and the
gather reference it is checked against (and that CPU runs use).

KV storage is page-major: `kv[page, layer, k|v, token, kv_head, head_dim]`, so a page is one
contiguous byte range (the executor's page-copy convention). Each query token attends to the
positions `0..=position` of its request, read through that request's page table; work and reads
follow the actual length, not the context limit. Padding rows read page 0 and their output is
never used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ignition.capture.fallback import declare

if TYPE_CHECKING:
    from torch._library.custom_ops import CustomOpDef


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [N, heads, D] with cos/sin [N, D] (Transformers' convention)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def attend_gather(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    pages: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [N, H, D] bf16; pages [R, P] (>= 0); req [N] row of each token; pos [N]. -> [N, H*D]."""
    n, h, d = q.shape
    kvh, t = kv.shape[4], kv.shape[3]
    g = h // kvh
    tbl = pages.long()[req.long()]  # [N, P]
    ctx = tbl.shape[1] * t
    keys = kv[tbl, layer, 0].reshape(n, ctx, kvh, 1, d).float()
    vals = kv[tbl, layer, 1].reshape(n, ctx, kvh, 1, d).float()
    scores = (q.float().reshape(n, 1, kvh, g, d) * keys).sum(-1) * scale  # [N, C, KVH, G]
    mask = torch.arange(ctx, device=q.device)[None, :] <= pos.long()[:, None]
    scores = scores.masked_fill(~mask[:, :, None, None], float("-inf"))
    p = scores.softmax(1)
    return (p[..., None] * vals).sum(1).to(q.dtype).reshape(n, h * d)


# Pages one attention program walks: a request's pages are split into groups of this many, each
# group reduced by its own program and the partial softmax states combined afterwards, so a long
# context is read by many SMs at once instead of one program per (token, KV head). Preparation
# sets it for the device and geometry (`ignition.capture.attention_tune`) before capture; 4 is the
# value for runs that do not tune (CPU, the qualification scripts).
PAGES_PER_SPLIT = 4
# Whether the page-group kernels launch as programmatic dependents (Hopper PDL): each waits for
# its predecessor, then lets its successor launch, so a projection after them can prefetch its
# weights while they run. Preparation sets it with the projections' launch modes
# (`ignition.capture.gemv.set_launch_mode`) before capture; off for runs that do not tune.
PDL = False
# From this many query tokens on (prefill chunks), (token, KV head) programs already fill the GPU:
# one program walks all pages and stores the normalized output, with no partials and no combine.
# Measured on the H200 with splits for prefill too: a 256-token chunk took 2.82 ms instead of
# 1.86 ms (SmolLM2), cold TTFT at 4,096 tokens 69 ms instead of 59 ms.
SPLIT_MAX_TOKENS = 64
# Query rows (tokens x the heads of one KV head) per program of the prefill kernel: a page read
# serves this many rows (see `prefill_block_config`).
PREFILL_BLOCK_ROWS = 32


def prefill_block_config(gp: int, d: int) -> tuple[int, int, int]:
    """(tokens per block, warps, pipeline stages) of the prefill kernel for GP padded heads per KV
    head and head dim d: 32 query rows per program, 4 warps, 2 stages. Measured on an H100
    (`attention_check.py`, 2026-12-05, a 256-token chunk at 4,096 tokens of context, every layer)
    against eight other settings: the fastest or within 6% of it at the ~1B's, SmolLM2's and
    Qwen3.5's geometries (1.55, 2.81, 0.85 ms; the per-token kernel 5.43, 3.68, 1.84 ms)."""
    bt = max(1, PREFILL_BLOCK_ROWS // gp, 16 // gp)  # 16: tl.dot's smallest row tile
    return bt, 4, 2


# The prefill kernel's configuration rule; `qualification/attention_check.py` swaps in others.
PREFILL_BLOCK_CONFIG: Callable[[int, int], tuple[int, int, int]] = prefill_block_config
# How the tokens of one attention call relate, which decides what may share work:
# - "decode": each token is its own request's only token (so no token reads another's K/V, and
#   the attention programs write the tokens' K/V themselves);
# - "prefill": one request's chunk at increasing positions (blocks of tokens share page reads);
# - "lanes": anything else (speculative lanes read the K/V other lanes write in the same call,
#   so the write is a kernel of its own, finished before any attention program starts).
TOKENS = ("decode", "prefill", "lanes")
# The two uses of `TOKENS`, each checked bitwise (decode) or per row (prefill) under Triton's
# interpreter but not yet qualified on the device (session 12 had none); False restores the
# separate write kernel / the per-token prefill kernel for every core prepared afterwards.
FUSED_DECODE_WRITE = True
PREFILL_BLOCKS = True


def pages_per_split(tokens: int, pages: int) -> int:
    """Pages per attention program for `tokens` query tokens over `pages`-page tables."""
    return PAGES_PER_SPLIT if tokens <= SPLIT_MAX_TOKENS else max(1, pages)


@functools.cache
def _kernel() -> Any:  # a triton.JITFunction (Triton ships no type information)
    from ignition.capture.attention_triton import paged_attention_kernel

    return paged_attention_kernel


@functools.cache
def _prefill_kernel() -> Any:  # a triton.JITFunction (Triton ships no type information)
    from ignition.capture.attention_triton import paged_prefill_attention_kernel

    return paged_prefill_attention_kernel


@functools.cache
def _combine_kernel() -> Any:  # a triton.JITFunction (Triton ships no type information)
    from ignition.capture.attention_triton import paged_attention_combine

    return paged_attention_combine


@functools.cache
def _write_kernel() -> Any:  # a triton.JITFunction (Triton ships no type information)
    from ignition.capture.attention_triton import kv_write_kernel

    return kv_write_kernel


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] with unit stride along D (views of the fused QKV projection qualify)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _rope_inputs(
    cos: torch.Tensor | None, sin: torch.Tensor | None, absent: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(cos, sin, True) made dense when both are given, else `absent` twice (never read) and False."""
    if cos is not None and sin is not None:
        return cos.contiguous(), sin.contiguous(), True
    return absent, absent, False


def _launch_write(
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    layer: int,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> None:
    """K/V [N, KVH, D] into their slots; with cos/sin [N, D], K rotated on the way."""
    k, v = _rows(k), _rows(v)
    n, kvh, d = k.shape
    st = kv.stride()
    c, s, rope = _rope_inputs(cos, sin, k)
    _write_kernel()[(n, kvh)](
        k,
        v,
        c,
        s,
        kv,
        slots,
        layer,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        st[0],
        st[1],
        st[2],
        st[3],
        st[4],
        D=d,
        T=kv.shape[3],
        ROPE=rope,
    )


def _pdl() -> dict[str, bool]:
    """The launch flags of a page-group kernel under `PDL` (none when off)."""
    return {"PDL": True, "launch_pdl": True} if PDL else {}


def _launch_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    pages: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    layer: int,
    scale: float,
    pps: int | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    tokens: str = "lanes",
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Paged attention of q [N, H, D] (rotated first when cos/sin [N, D] are given) over `pages`
    [R, P]: page groups of `pps` pages (default `pages_per_split`) in parallel, then combined;
    one group stores its output directly. `tokens` says how the tokens relate (`TOKENS`): a
    `prefill` chunk past `SPLIT_MAX_TOKENS` tokens goes in blocks of tokens sharing each page
    read (`paged_prefill_attention_kernel`); `write` = (k, v, slots), only for `decode`: the
    tokens' K/V written by the attention programs themselves (no separate write kernel)."""
    if tokens not in TOKENS or (write is not None and tokens != "decode"):
        raise ValueError(f"attention: tokens {tokens!r} (write given: {write is not None})")
    q = _rows(q)
    c, s, rope = _rope_inputs(cos, sin, q)
    n, h, d = q.shape
    kvh, t = kv.shape[4], kv.shape[3]
    g = h // kvh
    if PREFILL_BLOCKS and tokens == "prefill" and n > SPLIT_MAX_TOKENS and pps is None:
        return _launch_prefill_attention(q, c, s, rope, kv, pages, req, pos, layer, scale)
    k, v, slots = (_rows(write[0]), _rows(write[1]), write[2]) if write is not None else (q, q, pos)
    pps = pps or pages_per_split(n, pages.shape[1])
    splits = -(-pages.shape[1] // pps)
    out = torch.empty((n, h, d), dtype=q.dtype, device=q.device)
    if splits == 1:
        part_acc = part_m = part_l = out  # not read or written with one group
    else:
        part_acc = torch.empty((n, splits, h, d), dtype=torch.float32, device=q.device)
        part_m = torch.empty((n, splits, h), dtype=torch.float32, device=q.device)
        part_l = torch.empty((n, splits, h), dtype=torch.float32, device=q.device)
    st = kv.stride()
    _kernel()[(n, kvh, splits)](
        q,
        c,
        s,
        kv,
        pages,
        req,
        pos,
        part_acc,
        part_m,
        part_l,
        out,
        k,
        v,
        slots,
        layer,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        st[0],
        st[1],
        st[2],
        st[3],
        st[4],
        pages.stride(0),
        SCALE=scale,
        H=h,
        G=g,
        GP=max(16, 1 << (g - 1).bit_length()),
        D=d,
        T=t,
        SPLITS=splits,
        PPS=pps,
        PPSP=max(2, 1 << (pps - 1).bit_length()),
        ROPE=rope,
        WRITE=write is not None,
        num_warps=4,
        **_pdl(),
    )
    if splits > 1:
        _combine_kernel()[(n, h)](
            part_acc, part_m, part_l, out, pos, H=h, D=d, T=t, PPS=pps, SPLITS=splits,
            SP=max(2, 1 << (splits - 1).bit_length()), **_pdl(),
        )  # fmt: skip
    return out


def _launch_prefill_attention(
    q: torch.Tensor,
    c: torch.Tensor,
    s: torch.Tensor,
    rope: bool,
    kv: torch.Tensor,
    pages: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    layer: int,
    scale: float,
) -> torch.Tensor:
    """`_launch_attention` for one request's chunk: blocks of `BT` tokens with their G query
    heads each, about `PREFILL_BLOCK_ROWS` query rows per program."""
    n, h, d = q.shape
    kvh, t = kv.shape[4], kv.shape[3]
    g = h // kvh
    gp = 1 << (g - 1).bit_length()
    bt, warps, stages = PREFILL_BLOCK_CONFIG(gp, d)
    out = torch.empty((n, h, d), dtype=q.dtype, device=q.device)
    st = kv.stride()
    _prefill_kernel()[(-(-n // bt), kvh)](
        q,
        c,
        s,
        kv,
        pages,
        req,
        pos,
        out,
        layer,
        n,
        q.stride(0),
        q.stride(1),
        st[0],
        st[1],
        st[2],
        st[3],
        st[4],
        pages.stride(0),
        pages.shape[1],
        SCALE=scale,
        H=h,
        G=g,
        GP=gp,
        D=d,
        T=t,
        BT=bt,
        ROPE=rope,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@functools.cache
def write_attend_op() -> CustomOpDef:
    """`flare::write_attend`: one layer's RoPE, slot-mapping K/V write (a negative slot writes
    nothing) and paged attention over the pages just written, as one opaque op. q/k/v may be
    strided views of the fused QKV projection: rotating inside the kernels means no kernel
    materializes rotated or contiguous copies first (on the H200 the ~1B Llama's decode_b1 went
    from 304 to 244 graph nodes).

    The op writes `kv` in place but declares no mutation, on purpose: a declared mutation of a
    graph input is functionalized, and with one write per layer Inductor could not reinplace the
    first one, so every step copied the whole cache (a KV-sized buffer per graph pool; measured as
    an 812 MiB temporary for SmolLM2 at 576 pages). Not declaring it is sound here because
    - only this op reads `kv` inside a graph, and it reads layer `layer` after writing it, within
      the op (write and read are never reordered);
    - different layers touch disjoint regions of `kv`, so the order between layers is free;
    - the op returns a fresh tensor that the graph consumes, so it is never eliminated.
    The recorder checks the first point's consequence after capture: no graph pool holds a
    KV-sized allocation."""
    from torch.library import custom_op

    # flexible_layout: on the H200 (torch 2.11) decode_b1 still ran two pointwise kernels per
    # layer producing this op's layer-invariant inputs (cos/sin, positions, slots: 32 of its 244
    # kernels). On CPU, the default exact-stride constraint copies a computed input once per call;
    # flexible inputs are stored once and shared. The launches accept any strides (q/k/v by their
    # strides, the rest made dense, free when they already are). Not yet measured on the GPU.
    flexible = getattr(torch.Tag, "flexible_layout", None)

    @custom_op("flare::write_attend", mutates_args=(), tags=(flexible,) if flexible is not None else ())
    def write_attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        kv: torch.Tensor,
        slots: torch.Tensor,
        pages: torch.Tensor,
        req: torch.Tensor,
        pos: torch.Tensor,
        layer: int,
        scale: float,
        tokens: str = "lanes",
    ) -> torch.Tensor:
        """cos/sin None: q and k arrive rotated (partial rotary recipes rotate them before).
        `tokens`: how the tokens relate (`TOKENS`); decode writes K/V inside the attention."""
        slots, pages, req, pos = (t.contiguous() for t in (slots, pages, req, pos))
        if FUSED_DECODE_WRITE and tokens == "decode":
            return _launch_attention(
                q, kv, pages, req, pos, layer, scale, cos=cos, sin=sin, tokens=tokens, write=(k, v, slots)
            )
        _launch_write(k, v, kv, slots, layer, cos, sin)
        return _launch_attention(q, kv, pages, req, pos, layer, scale, cos=cos, sin=sin, tokens=tokens)

    @write_attend.register_fake
    def _(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        kv: torch.Tensor,
        slots: torch.Tensor,
        pages: torch.Tensor,
        req: torch.Tensor,
        pos: torch.Tensor,
        layer: int,
        scale: float,
        tokens: str = "lanes",
    ) -> torch.Tensor:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    return declare(write_attend)
