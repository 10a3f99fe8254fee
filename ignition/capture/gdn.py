"""Gated DeltaNet (GDN) over explicit state: the short causal convolution with its history and
the gated delta rule with its recurrent matrix, as prepared operations.

A request's GDN state lives in its continuation row (design: null row, live rows per slot,
snapshot rows), per GDN layer:
- the convolution history: the last K-1 inputs of the depthwise convolution, [C, K-1], in the
  activation dtype (the inputs are projections, so storing them loses nothing), oldest first;
- the recurrent matrix S: [Hv, Dk, Dv] in float32.
A step reads the state of the rows it is given and writes the state at the consumed length back
to the same rows; a lane with a negative row (padding) reads the null row and writes nothing. A
speculative program's lanes (groups of W consecutive tokens of one request) run the decode
update lane after lane, lane j's state going to column row + j; `commit_columns` then installs
the accepted column in the live row.

This module holds the torch reference of each operation (the arithmetic contract, checked
against Transformers' `qwen3_5` functions on identical operands) and launches the Triton
kernels in `gdn_triton.py` that the graphs run.

Arithmetic (Transformers' order): the convolution in float32 over the activation-dtype inputs,
rounded to the activation dtype, then SiLU; q and k L2-normalized in float32 (eps 1e-6), q scaled by
Dk^-1/2; per token S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ignition.capture.fallback import declare

if TYPE_CHECKING:
    from torch._library.custom_ops import CustomOpDef

L2_EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# Reference (eager torch)


def conv_reference(
    x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] one request's new inputs; history [C, K-1]; weight [C, K]. Returns the outputs
    [T, C] (SiLU applied, activation dtype) and the history after the first `length` inputs
    (default all): the last K-1 of history followed by x[:length]."""
    t = x.shape[0]
    n = t if length is None else length
    k = weight.shape[1]
    full = torch.cat([history, x.t()], 1).float()  # [C, K-1+T]
    windows = full.unfold(1, k, 1)  # [C, T, K]
    y = F.silu((windows * weight.float()[:, None, :]).sum(-1).to(x.dtype)).t()
    new_history = torch.cat([history, x[:n].t()], 1)[:, n : n + k - 1]
    return y, new_history.contiguous()


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def delta_rule_reference(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, token by token. state [Hv, Dk, Dv] float32; q, k [T, Hk, Dk]; v [T, Hv, Dv];
    g, beta [T, Hv]. Returns o [T, Hv, Dv] (activation dtype of v; tokens past `length` give 0)
    and the state after the first `length` tokens (default all)."""
    t, hk, dk = q.shape
    hv = v.shape[1]
    n = t if length is None else length
    rep = hv // hk
    qf = l2norm(q.float().repeat_interleave(rep, 1)) * dk**-0.5
    kf = l2norm(k.float().repeat_interleave(rep, 1))
    s = state.clone()
    out = torch.zeros(t, hv, v.shape[2], dtype=torch.float32, device=v.device)
    for i in range(n):
        s = s * g[i].float().exp()[:, None, None]
        mem = (s * kf[i][:, :, None]).sum(1)  # [Hv, Dv]
        delta = (v[i].float() - mem) * beta[i].float()[:, None]
        s = s + kf[i][:, :, None] * delta[:, None, :]
        out[i] = (s * qf[i][:, :, None]).sum(1)
    return out.to(v.dtype), s


# ---------------------------------------------------------------------------------------------
# Kernels (Triton); the state lives in rows of a byte buffer


@functools.cache
def _kernels() -> Any:
    from ignition.capture import gdn_triton

    return gdn_triton


def conv_step(
    x: torch.Tensor, hist: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, block: int = 128, lanes: int = 1
) -> torch.Tensor:
    """Decode (`lanes` 1): x [N, C] one input per lane; hist [R, C, K-1] a view of the rows'
    histories; rows [N] int32 (negative: padding, reads row 0, writes nothing); each live lane's
    history updated in place. A speculative program (`lanes` > 1): lanes in groups of `lanes`
    consecutive tokens of one request, rows the request's live row on each used lane; lane j
    continues from the history lane j - 1 left (lane 0: the live row's) and leaves its own in
    column row + j. Returns y [N, C]."""
    n, c = x.shape
    k = weight.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    strides = (x.stride(0), y.stride(0), hist.stride(0), hist.stride(1))
    _kernels().conv_step_kernel[(-(-n // lanes), -(-c // block))](
        x, hist, rows, weight, y, n, c, *strides, K=k, BLOCK=block, LANES=lanes
    )
    return y


def conv_prefill(
    x: torch.Tensor,
    hist: torch.Tensor,
    row: torch.Tensor,
    length: torch.Tensor,
    weight: torch.Tensor,
    block: int = 64,
    tokens: int = 32,
) -> torch.Tensor:
    """Prefill of one request: x [T, C]; hist [R, C, K-1]; row [1] int32 (negative: write
    nothing); length [1] int32, the real tokens (the history after them is stored). Returns y.
    One program per `block` channels and `tokens` tokens."""
    t, c = x.shape
    k = weight.shape[1]
    if tokens < k - 1:
        raise ValueError("gdn: a token block must cover the history the first one reads")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    strides = (x.stride(0), y.stride(0), hist.stride(0), hist.stride(1))
    grid = (-(-c // block), max(1, -(-t // tokens)))
    _kernels().conv_prefill_kernel[grid](x, hist, row, length, weight, y, t, c, *strides, K=k, BLOCK=block, TB=tokens)
    return y


def delta_rule_step(
    state: torch.Tensor,
    rows: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    block_v: int = 32,
    lanes: int = 1,
) -> torch.Tensor:
    """Decode (`lanes` 1): one token per lane. state [R, Hv, Dk, Dv] float32 view of the rows;
    rows [N]; q, k [N, Hk, Dk] and v [N, Hv, Dv] (strided views allowed, unit last stride);
    g, beta [N, Hv] float32; each live lane's state updated in place. A speculative program
    (`lanes` > 1): groups of `lanes` consecutive tokens of one request (rows: its live row on
    each used lane) run from the live row's state, one decode update per lane, the state after
    lane j stored in column row + j (column 0 the live row). Returns o [N, Hv, Dv]."""
    n = q.shape[0]
    hv, dv = v.shape[1], v.shape[2]
    o = torch.empty(n, hv, dv, dtype=v.dtype, device=v.device)
    if n == 0:
        return o
    grid = (-(-n // lanes), hv, -(-dv // block_v))
    _launch_delta_rule(grid, state, rows, None, q, k, v, g, beta, o, block_v, lanes)
    return o


def commit_columns(
    rows: torch.Tensor, live: torch.Tensor, accepted: torch.Tensor, nbytes: int, x: torch.Tensor, block: int = 4096
) -> torch.Tensor:
    """After a speculative program: for each request with a live row (live [B] int32, negative:
    none) and accepted [B] int32 > 0, bytes [0, nbytes) of column live + accepted (the state
    after its last consumed lane) into the live row. Returns a copy of x [B, N], the value the
    step goes on with."""
    b = live.shape[0]
    out = torch.empty_like(x)
    if b == 0:
        return out
    if nbytes % 4 or rows.shape[1] % 4:
        raise ValueError("gdn: the committed span and the rows must be whole 32-bit words")
    words = rows.view(torch.int32)
    grid = (b, max(1, -(-(nbytes // 4) // block)))
    _kernels().commit_columns_kernel[grid](
        words, live, accepted, x, out, x.shape[1], nbytes // 4, words.stride(0), BLOCK=block
    )
    return out


def delta_rule_prefill(
    state: torch.Tensor,
    row: torch.Tensor,
    length: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    block_v: int = 32,
) -> torch.Tensor:
    """Prefill of one request: T tokens, the first `length` real. Scans the tokens in order with
    the state in registers (one program per value head and value block), writes the state at
    `length` to `row`; returns o [T, Hv, Dv] (zeros past `length`)."""
    t = q.shape[0]
    hv, dv = v.shape[1], v.shape[2]
    o = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)
    _launch_delta_rule((1, hv, -(-dv // block_v)), state, row, length, q, k, v, g, beta, o, block_v)
    return o


def delta_rule_prefill_chunked(
    state: torch.Tensor,
    row: torch.Tensor,
    length: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = 32,
    block_v: int = 32,
    block_k: int = 32,
) -> torch.Tensor:
    """`delta_rule_prefill` in chunks of `chunk` tokens (matrix products within a chunk, the
    state carried between chunks): same operands, outputs and state, different float32
    rounding. Three launches: every chunk's state-free part at once (program per value head and
    chunk), the serial recurrence over chunks with two products per chunk (program per value
    head and value block), then every chunk's outputs at once. Block sizes: value and key blocks of
    32 were the fastest of 16/32 each on an H100 at the 0.8B geometry (0.22 ms for 512 tokens,
    the token scan 0.65 ms; `gdn_components.py`, 2026-12-05), and none of the three kernels
    spills registers on sm_90 with them."""
    t = q.shape[0]
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    o = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)
    if g.stride() != beta.stride():
        raise ValueError("gdn: g and beta must share a layout")
    nc = -(-t // chunk)
    kb = min(block_k, dk)

    def scratch(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.float32, device=v.device)

    u, w = scratch(hv, nc, chunk, dv), scratch(hv, nc, chunk, dv)
    wk, kd = scratch(hv, nc, chunk, dk), scratch(hv, nc, chunk, dk)
    qk, gamma, decay = scratch(hv, nc, chunk, chunk), scratch(hv, nc, chunk), scratch(hv, nc)
    h = scratch(hv, nc + 1, dk, dv)  # the state entering each chunk, and after the last
    kern = _kernels()
    dims = {"HK": hk, "HV": hv, "DK": dk, "DV": dv, "C": chunk, "KB": kb}
    kern.delta_rule_chunk_prep_kernel[(hv, nc)](
        length, q, k, v, g, beta, u, wk, kd, qk, gamma, decay, nc, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), g.stride(0), **dims, num_warps=8,
    )  # fmt: skip
    blocks = -(-dv // block_v)
    kern.delta_rule_chunk_state_kernel[(hv, blocks)](
        state, row, length, u, wk, kd, decay, w, h, nc, state.stride(0), state.stride(1), state.stride(2),
        DK=dk, DV=dv, BV=block_v, C=chunk, KB=kb, num_warps=8,
    )  # fmt: skip
    kern.delta_rule_chunk_output_kernel[(hv, nc, blocks)](
        length, q, qk, gamma, w, h, o, nc, t, q.stride(0), q.stride(1), o.stride(0), o.stride(1), BV=block_v, **dims
    )
    return o


def _strides(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, o: torch.Tensor
) -> tuple[int, ...]:
    """The delta-rule kernels' stride arguments, in their order."""
    return (
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        o.stride(0),
        o.stride(1),
    )


def _dims(q: torch.Tensor, v: torch.Tensor, block_v: int) -> dict[str, int]:
    return {"HK": q.shape[1], "HV": v.shape[1], "DK": q.shape[2], "DV": v.shape[2], "BV": block_v}


def _launch_delta_rule(
    grid: tuple[int, int, int],
    state: torch.Tensor,
    rows: torch.Tensor,
    length: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    o: torch.Tensor,
    block_v: int,
    lanes: int = 1,
) -> None:
    if g.stride() != beta.stride():
        raise ValueError("gdn: g and beta must share a layout")
    _kernels().delta_rule_kernel[grid](
        state,
        rows,
        q,
        k,
        v,
        g,
        beta,
        o,
        q.shape[0],
        *_strides(state, q, k, v, g, o),
        **_dims(q, v, block_v),
        PREFILL=length is not None,
        LENGTH=length,
        LANES=lanes,
    )


def store_rows(
    h: torch.Tensor,
    rows: torch.Tensor,
    live: torch.Tensor,
    stamps: torch.Tensor,
    consumed: torch.Tensor,
    block: int = 256,
) -> torch.Tensor:
    """h [B, N] into rows [R, N] (a strided view) at each lane's live row (negative: nowhere), and
    the lane's consumed count into that row's stamp (`stamps` [R, 2] int32, a strided view;
    the epoch word is left as it is); returns a fresh copy of h, for the step to consume."""
    b, n = h.shape
    out = torch.empty_like(h)
    if b:
        grid = (b, -(-n // block))
        _kernels().store_row_kernel[grid](
            h, rows, live, out, stamps, consumed, n, h.stride(0), rows.stride(0), stamps.stride(0), BLOCK=block
        )
    return out


def _int32(live: torch.Tensor, length: torch.Tensor | None) -> None:
    """The ops launch kernels only (an ATen cast inside would be a library kernel in the graph),
    so their index inputs arrive as contiguous int32."""
    for t in (live, length):
        if t is not None and (t.dtype != torch.int32 or not t.is_contiguous()):
            raise ValueError("gdn ops: live rows and lengths must be contiguous int32 (cast them in the graph)")


def _region(rows: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return rows[:, offset : offset + nbytes].view(dtype).view(rows.shape[0], *shape)


# Tokens per chunk of the chunked prefill; `None`: the token scan. Set before capture (the op's
# choice is recorded into the graphs), by the model the recipe builds.
PREFILL_CHUNK: int | None = None


@functools.cache
def gdn_ops() -> tuple[CustomOpDef, CustomOpDef, CustomOpDef]:
    """`flare::gdn_conv`, `flare::gdn_delta` and `flare::store_row`: the GDN layer's state
    updates and the hidden-vector store as opaque ops over the continuation rows (a uint8
    [R, row_bytes] buffer, regions given by byte offset).

    Like `flare::write_attend`, they write `rows` in place without declaring it: a declared
    mutation would be functionalized into copies of the whole rows buffer. Sound because within
    a decode or prefill graph only these ops touch `rows` (nothing else writes or reads it
    there), each layer's ops touch that layer's regions only and read them before writing, and
    each returns a fresh tensor the step consumes, so none is eliminated or reordered past its
    consumer."""
    from torch.library import custom_op

    @custom_op("flare::gdn_conv", mutates_args=())
    def conv(
        x: torch.Tensor,
        weight: torch.Tensor,
        rows: torch.Tensor,
        live: torch.Tensor,
        length: torch.Tensor | None,
        offset: int,
        kernel: int,
        lanes: int = 1,
    ) -> torch.Tensor:
        c = x.shape[1]
        hist = _region(rows, offset, c * (kernel - 1) * x.element_size(), x.dtype, (c, kernel - 1))
        _int32(live, length)
        if length is None:
            return conv_step(x, hist, live, weight, lanes=lanes)
        return conv_prefill(x, hist, live, length, weight)

    @conv.register_fake
    def _(
        x: torch.Tensor,
        weight: torch.Tensor,
        rows: torch.Tensor,
        live: torch.Tensor,
        length: torch.Tensor | None,
        offset: int,
        kernel: int,
        lanes: int = 1,
    ) -> torch.Tensor:
        return torch.empty_like(x)

    @custom_op("flare::gdn_delta", mutates_args=())
    def delta(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: torch.Tensor,
        live: torch.Tensor,
        length: torch.Tensor | None,
        offset: int,
        lanes: int = 1,
    ) -> torch.Tensor:
        hv, dk, dv = v.shape[1], q.shape[2], v.shape[2]
        state = _region(rows, offset, hv * dk * dv * 4, torch.float32, (hv, dk, dv))
        _int32(live, length)
        if g.dtype != torch.float32 or beta.dtype != torch.float32 or not (g.is_contiguous() and beta.is_contiguous()):
            raise ValueError("gdn_delta: g and beta must be contiguous float32 (cast them in the graph)")
        if length is None:
            return delta_rule_step(state, live, q, k, v, g, beta, lanes=lanes)
        if PREFILL_CHUNK is not None:
            return delta_rule_prefill_chunked(state, live, length, q, k, v, g, beta, chunk=PREFILL_CHUNK)
        return delta_rule_prefill(state, live, length, q, k, v, g, beta)

    @delta.register_fake
    def _(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: torch.Tensor,
        live: torch.Tensor,
        length: torch.Tensor | None,
        offset: int,
        lanes: int = 1,
    ) -> torch.Tensor:
        return torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)

    @custom_op("flare::store_row", mutates_args=())
    def store(
        h: torch.Tensor, rows: torch.Tensor, live: torch.Tensor, offset: int, consumed: torch.Tensor, stamp: int
    ) -> torch.Tensor:
        view = _region(rows, offset, h.shape[1] * h.element_size(), h.dtype, (h.shape[1],))
        stamps = _region(rows, stamp, 8, torch.int32, (2,))
        _int32(live, None)
        _int32(consumed, None)
        return store_rows(h.contiguous(), view, live, stamps, consumed)

    @store.register_fake
    def _(
        h: torch.Tensor, rows: torch.Tensor, live: torch.Tensor, offset: int, consumed: torch.Tensor, stamp: int
    ) -> torch.Tensor:
        return torch.empty_like(h)

    return declare(conv), declare(delta), declare(store)


@functools.cache
def commit_op() -> CustomOpDef:
    """`flare::commit_columns`: after a speculative program, each request's accepted column
    (the state after its last consumed lane) becomes its live row's state: bytes [0, nbytes) of
    row live + accepted copied into row live (`commit_columns`). Writes `rows` undeclared, as
    the `gdn_ops` do and for their reasons: it runs after every GDN op of the step (its
    `accepted` input comes from the sampled lanes) and returns `x` copied, which the step goes
    on with."""
    from torch.library import custom_op

    @custom_op("flare::commit_columns", mutates_args=())
    def commit(
        x: torch.Tensor, rows: torch.Tensor, live: torch.Tensor, accepted: torch.Tensor, nbytes: int
    ) -> torch.Tensor:
        _int32(live, accepted)
        return commit_columns(rows, live, accepted, nbytes, x.contiguous())

    @commit.register_fake
    def _(x: torch.Tensor, rows: torch.Tensor, live: torch.Tensor, accepted: torch.Tensor, nbytes: int) -> torch.Tensor:
        return torch.empty_like(x)

    return declare(commit)
