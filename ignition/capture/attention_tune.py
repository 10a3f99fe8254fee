"""Pages per decode attention program, chosen at preparation on the device that will serve.

A decode token's attention is split over page groups of `attention.PAGES_PER_SPLIT` pages, each
reduced by its own program, and the groups' partial softmax states combined afterwards. Fewer
pages per program means more programs walking fewer pages one after another, and a wider combine.
Which wins depends on the geometry and on the number of requests in the step (H100, 2026-12-06,
`qualification/attention_check.py`, 72-page tables): one page per program was fastest for a
single request on all three geometries measured (SmolLM2 5.4 against 7.3 us per layer at 256
tokens with four), while at four requests the ~1B's and Qwen3.5's geometries were fastest with two
to eight (one page: up to 4 us per layer slower). So preparation times the candidates here.

One value serves every program of a core: decode buckets, speculative lanes and short prefill
chunks all split the same way, so a row's arithmetic does not depend on the bucket it was packed
into (the lifecycle checks compare batched requests with their solo runs bitwise).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ignition.capture import attention
from ignition.capture.attention import _launch_attention
from ignition.capture.gemv import COLD_BYTES, time_graphs

# Pages per program tried; a candidate that would split a page table into more than `MAX_SPLITS`
# groups is skipped (each group is a program and a partial state, even past the request's end).
CANDIDATES = (1, 2, 4, 8)
MAX_SPLITS = 128
# Contexts timed (those within the core's context limit, else the limit alone): agent turns run
# from a few hundred to several thousand tokens.
CONTEXTS = (256, 1024, 4096)
# Requests per step timed: the decode buckets up to this many (an agent's concurrency).
MAX_ROWS = 4
# Attention layers per timed graph, at most; copies of the K/V replays cycle through, at most.
MAX_LAYERS = 8
MAX_COPIES = 32
REPS = 20


def time_decode(heads: int, kv_heads: int, head_dim: int, page_tokens: int, table_pages: int, layers: int,
                rows: int, context: int, pps: int, rope: bool) -> tuple[float, torch.Tensor]:  # fmt: skip
    """Milliseconds of one decode step's attention over `layers` layers (CUDA graphs, as a core
    replays them, over K/V that is not in L2): `rows` requests, each at position `context - 1`
    of its own `table_pages`-wide page table, writing its token's K/V inside the attention as
    decode programs do; and the output of the last layer (the operands are seeded: calls with
    other `pps` compare)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    used = -(-context // page_tokens)
    shape = (rows * used + 1, layers, 2, page_tokens, kv_heads, head_dim)
    kv = torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16)
    table = torch.full((rows, table_pages), -1, dtype=torch.int32, device=dev)
    table[:, :used] = torch.randperm(rows * used + 1, generator=gen, device=dev)[: rows * used].int().view(rows, used)
    req = torch.arange(rows, dtype=torch.int32, device=dev)
    pos = torch.full((rows,), context - 1, dtype=torch.int32, device=dev)
    slots = (table[:, used - 1].long() * page_tokens + (context - 1) % page_tokens).contiguous()
    q, k, v = (
        torch.randn(rows, n, head_dim, generator=gen, device=dev, dtype=torch.bfloat16)
        for n in (heads, kv_heads, kv_heads)
    )
    cos = sin = None
    if rope:
        inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim)
        ang = pos.float()[:, None] * inv[None, :]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def step(pool: torch.Tensor) -> torch.Tensor:
        out = q
        for layer in range(layers):
            out = _launch_attention(q, pool, table, req, pos, layer, head_dim**-0.5, pps, cos=cos, sin=sin,
                                    tokens="decode", write=(k, v, slots))  # fmt: skip
        return out

    # In a step the K/V arrives from HBM (the weights stream through L2 between attention layers),
    # so replays cycle through copies of it that together pass `COLD_BYTES`, as the gemv tuner
    # does with weights: one replay's K/V is not in L2 when the next copy's turn comes.
    copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // (kv.numel() * kv.element_size()))))
    pools = [kv] + [kv.clone() for _ in range(copies - 1)]
    out = step(kv)
    return time_graphs([functools.partial(step, p) for p in pools], REPS), out


def tune(heads: int, kv_heads: int, head_dim: int, page_tokens: int, table_pages: int, layers: int,
         buckets: list[int], rope: bool) -> dict[str, Any]:  # fmt: skip
    """Times every candidate (`CANDIDATES`, within `MAX_SPLITS`) at each timed bucket and
    context, keeps the fastest total and sets `attention.PAGES_PER_SPLIT` to it (before capture:
    the graphs bake it in). Returns a report: the choice and every candidate's times."""
    limit = table_pages * page_tokens
    contexts = [c for c in CONTEXTS if c <= limit] or [limit]
    rows = [b for b in buckets if b <= MAX_ROWS] or [min(buckets)]
    layers = max(1, min(layers, MAX_LAYERS))
    candidates = [p for p in CANDIDATES if -(-table_pages // p) <= MAX_SPLITS]
    if not candidates:  # a table this wide: the fewest groups the largest candidate gives
        candidates = [-(-table_pages // MAX_SPLITS)]
    timed: dict[int, dict[str, float]] = {}
    skipped: dict[str, str] = {}
    for pps in candidates:
        try:
            points = {}
            for r in rows:
                for c in contexts:
                    ms, _ = time_decode(heads, kv_heads, head_dim, page_tokens, table_pages, layers, r, c, pps, rope)
                    points[f"rows{r}_ctx{c}"] = round(ms * 1e3 / layers, 2)
        except Exception as e:  # a group size the compiler cannot fit: reported, never chosen
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # a fault that broke the context raises here, not skipped
            skipped[str(pps)] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        timed[pps] = points
    if not timed:
        raise RuntimeError(f"attention tuning: no pages-per-program candidate ran: {skipped}")
    best = min(timed, key=lambda p: sum(timed[p].values()))
    attention.PAGES_PER_SPLIT = best
    torch.cuda.empty_cache()
    return {
        "pages_per_split": best,
        "splits": -(-table_pages // best),
        "us_per_layer": {str(p): t for p, t in timed.items()},
        "skipped": skipped,
        "layers_timed": layers,
    }
