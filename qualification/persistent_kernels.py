"""Issue 19's persistent decode kernels, as `persistent_layer_probe.py` measured them: every
layer of a dense decode step as one kernel whose programs stay resident and meet at grid
barriers between stages (qkv, attention, combine, o_proj, gate_up, down), instead of six
kernels per layer.

Measured on the H100 (2026-12-06, `qualification/device_2026-12-06_s22.md`), this lost to the
decode graphs' tuned kernels at every configuration: 1.18 to 3.4 times their time per layer
for the best variant of each case, so it never became a preparation option. Kept here, with
the probe, so the result can be measured again (a different projection stage, another device).

Contract: one program per SM, all resident (a barrier gives up after LIMIT spins and sets the
failure word); the barrier's 64-bit ticket counter (word 0 of `counter`) is never reset; words
2.. count arrivals per (row, KV head) for the fused combine and are zero between launches; a
row's arithmetic does not depend on the rows beside it; layer l's weights of each role sit at
layer 0's plus l times one stride.
"""

# mypy: disable-error-code="no-untyped-def"
# Triton reads a kernel's parameter annotations to specialize it (tl.constexpr, dtype names), so
# the pointer and stride parameters stay unannotated: the one exemption from typing.
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ignition.capture.attention_triton import _page_step, _query_rows, _write_token
from ignition.capture.attention_tune import MAX_SPLITS


@triton.jit
def grid_barrier(CNT, FAIL, P: tl.constexpr, LIMIT: tl.constexpr, POLL_LOAD: tl.constexpr):
    """Waits until all P programs arrived. CNT is a 64-bit ticket counter that is never reset:
    an arrival takes ticket t and waits for the counter to reach (t // P + 1) * P. Every
    program arrives once at every barrier, so each barrier's arrivals end on a multiple of P and
    the next launch (a graph replay) needs no memset first. After LIMIT spins a program stops
    waiting and sets FAIL (programs that are not all resident would otherwise wait forever).
    The wait polls with acquiring read-modify-writes, which all programs' polls queue behind at
    one L2 address; POLL_LOAD polls with volatile loads instead and acquires once after (an
    acquiring RMW that reads the target or later reads from every arrival's release)."""
    tl.debug_barrier()  # every thread's stores issued before the arrival's release
    ticket = tl.atomic_add(CNT, 1, sem="acq_rel")
    target = (ticket // P + 1) * P
    spins = 0
    if POLL_LOAD:
        while (tl.load(CNT, volatile=True) < target) & (spins < LIMIT):
            spins += 1
        tl.atomic_add(CNT, 0, sem="acquire")
    else:
        while (tl.atomic_add(CNT, 0, sem="acquire") < target) & (spins < LIMIT):
            spins += 1
    if spins >= LIMIT:
        tl.store(FAIL, 1)


@triton.jit
def _inv_rms(X, b, x_stride, eps, K: tl.constexpr, BK: tl.constexpr):
    """1 / rms of row b of X over K columns (read past L1: other programs wrote it)."""
    sq = tl.zeros([BK], tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(X + b * x_stride + ks, mask=ks < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        sq += x * x
    return 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)


@triton.jit
def _input_chunk(X, b, x_stride, NORM, inv, k0, K: tl.constexpr, BK: tl.constexpr, IS_NORM: tl.constexpr,
                 GLU: tl.constexpr):  # fmt: skip
    """Columns k0..k0+BK of row b of a stage's input as fp32: RMS-normed (cast to bf16, then
    scaled by the norm weight, as Transformers' LlamaRMSNorm), SiLU(gate) * up from [gate | up]
    halves (each product rounded as the eager MLP rounds it), or as stored."""
    ks = k0 + tl.arange(0, BK)
    km = ks < K
    x = tl.load(X + b * x_stride + ks, mask=km, other=0.0, cache_modifier=".cg").to(tl.float32)
    if GLU:
        u = tl.load(X + b * x_stride + K + ks, mask=km, other=0.0, cache_modifier=".cg").to(tl.float32)
        g = (x / (1.0 + tl.exp(-x))).to(X.dtype.element_ty).to(tl.float32)
        x = (g * u).to(X.dtype.element_ty).to(tl.float32)
    if IS_NORM:
        w = tl.load(NORM + ks, mask=km, other=0.0).to(tl.float32)
        x = ((x * inv).to(X.dtype.element_ty).to(tl.float32) * w).to(X.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def projection_stage(X, x_stride, W, NORM, RES, Y, B: tl.constexpr, eps, N: tl.constexpr, K: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, P: tl.constexpr, IS_NORM: tl.constexpr, GLU: tl.constexpr,
                     HAS_RES: tl.constexpr):  # fmt: skip
    """Y[b, n] = (RES[b, n] +) W[n, :] . input(b) for this program's row blocks (every P-th block
    of BN rows from its own). Each row b runs the same instructions whatever B is (a loop over
    rows around one 2-D tile; the weight tile comes from L1 after the first row), so a row's
    result does not depend on the bucket it was packed into."""
    pid = tl.program_id(0)
    for n0 in range(pid * BN, N, P * BN):
        ns = n0 + tl.arange(0, BN)
        nm = ns < N
        for b in range(B):
            inv = 1.0
            if IS_NORM:
                inv = _inv_rms(X, b, x_stride, eps, K, BK)
            acc = tl.zeros([BN], tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                w = tl.load(W + ns[:, None].to(tl.int64) * K + ks[None, :], mask=nm[:, None] & (ks < K)[None, :],
                            other=0.0)  # fmt: skip
                x = _input_chunk(X, b, x_stride, NORM, inv, k0, K, BK, IS_NORM, GLU)
                acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
            if HAS_RES:
                acc += tl.load(RES + b * N + ns, mask=nm, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(Y + b * N + ns, acc.to(Y.dtype.element_ty), mask=nm)


@triton.jit
def _combine_head(PM, PL, PACC, OUT, b, hd, groups, HEADS: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                  SP: tl.constexpr, CB: tl.constexpr):  # fmt: skip
    """Head hd of row b: its first `groups` page groups' states rescaled to their common max and
    normalized, into OUT [B, HEADS * D]; partials read past L1. CB groups at a time (one page
    per group over a long table would otherwise hold every group's D floats at once and spill)."""
    si = tl.arange(0, SP)
    ci = tl.arange(0, CB)
    di = tl.arange(0, D)
    m_all = tl.load(PM + (b * S + si) * HEADS + hd, mask=si < groups, other=float("-inf"), cache_modifier=".cg")
    mx = tl.max(m_all, 0)
    acc = tl.zeros([D], tl.float32)
    den = tl.zeros([CB], tl.float32)
    for c0 in range(0, groups, CB):
        gm = (c0 + ci) < groups
        at = (b * S + c0 + ci) * HEADS + hd
        m = tl.load(PM + at, mask=gm, other=float("-inf"), cache_modifier=".cg")
        w = tl.where(gm, tl.exp(m - mx), 0.0)
        den += tl.load(PL + at, mask=gm, other=0.0, cache_modifier=".cg") * w
        part = tl.load(PACC + at[:, None] * D + di[None, :], mask=gm[:, None], other=0.0, cache_modifier=".cg")
        acc += tl.sum(part * w[:, None], 0)
    out = acc / tl.sum(den, 0)
    tl.store(OUT + b * HEADS * D + hd * D + di, out.to(OUT.dtype.element_ty))


@triton.jit
def attention_stage(QKV, KV, PT, REQ, POS, SLOT, COS, SIN, PM, PL, PACC, ARR, OUT, layer, s_page, s_layer, s_sel,
                    s_tok, s_head, pt_stride, B: tl.constexpr, HEADS: tl.constexpr, KVH: tl.constexpr,
                    D: tl.constexpr, T: tl.constexpr, PPS: tl.constexpr, S: tl.constexpr, GP: tl.constexpr,
                    NQKV: tl.constexpr, SCALE: tl.constexpr, P: tl.constexpr, FUSED: tl.constexpr,
                    SP: tl.constexpr, CB: tl.constexpr):  # fmt: skip
    """Decode attention's page groups as work items (row, KV head, group) over the programs,
    each as `paged_attention_kernel` computes a group, with its helpers (RoPE on q and k; the
    group holding the token's position writes its K/V first, unless its slot is negative):
    partial softmax states into PM/PL/PACC. q, k and v are read past L1 (other programs wrote
    them). FUSED: each item then counts itself in ARR [B * KVH] (zeros between launches), and
    the last of a (row, KV head)'s groups to arrive combines its heads into OUT and puts the
    count back to zero, so no barrier and combine stage follow."""
    pid = tl.program_id(0)
    g: tl.constexpr = HEADS // KVH
    gi = tl.arange(0, GP)
    di = tl.arange(0, D)
    ti = tl.arange(0, T)
    qmask = gi < g
    for item in range(pid, B * KVH * S, P):
        b = item // (KVH * S)
        kh = (item // S) % KVH
        sp = item % S
        pos = tl.load(POS + b).to(tl.int64)
        r = tl.load(REQ + b).to(tl.int64)
        first = sp.to(tl.int64) * PPS
        last = tl.minimum(first + PPS, pos // T + 1)
        if first < last:
            if sp == (pos // T) // PPS:  # the group holding the token writes its K/V first
                slot = tl.load(SLOT + b).to(tl.int64)
                if slot >= 0:
                    _write_token(QKV + HEADS * D, QKV + (HEADS + KVH) * D, COS, SIN, KV, slot, b, kh, layer, NQKV, D,
                                 NQKV, D, s_page, s_layer, s_sel, s_tok, s_head, D, T, True, ".cg")  # fmt: skip
                tl.debug_barrier()
            qp = QKV + b * NQKV + (kh * g + gi)[:, None] * D
            q = _query_rows(qp, qmask, b * D + di[None, :], COS, SIN, di, D, True, KV.dtype.element_ty, ".cg")
            m = tl.full([GP], float("-inf"), tl.float32)
            lsum = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, D], tl.float32)
            base = KV + layer * s_layer + kh * s_head
            for j in range(first, last):
                page = tl.maximum(tl.load(PT + r * pt_stride + j), 0).to(tl.int64)
                kpage = base + page * s_page + ti[:, None] * s_tok + di[None, :]
                m, lsum, acc = _page_step(q, kpage, s_sel, j * T, ti, pos, pos, m, lsum, acc, SCALE)
            at = (b * S + sp) * HEADS + kh * g + gi
            tl.store(PM + at, m, mask=qmask)
            tl.store(PL + at, lsum, mask=qmask)
            tl.store(PACC + at[:, None] * D + di[None, :], acc, mask=qmask[:, None])
            if FUSED:
                tl.debug_barrier()  # every thread's partials issued before the arrival's release
                groups = tl.minimum((pos // T) // PPS + 1, S)
                if tl.atomic_add(ARR + b * KVH + kh, 1, sem="acq_rel") == groups - 1:
                    tl.atomic_xchg(ARR + b * KVH + kh, 0, sem="relaxed")  # the next use is past a barrier
                    for hq in range(g):
                        _combine_head(PM, PL, PACC, OUT, b, kh * g + hq, groups, HEADS, D, S, SP, CB)


@triton.jit
def combine_stage(PM, PL, PACC, POS, OUT, B: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                  PPS: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, CB: tl.constexpr, P: tl.constexpr):  # fmt: skip
    """Every (row, head)'s page groups up to the row's last page combined (`_combine_head`), the
    items spread over the programs."""
    pid = tl.program_id(0)
    for item in range(pid, B * HEADS, P):
        b = item // HEADS
        groups = tl.minimum((tl.load(POS + b) // T) // PPS + 1, S)
        _combine_head(PM, PL, PACC, OUT, b, item % HEADS, groups, HEADS, D, S, SP, CB)


@triton.jit
def decode_layers_kernel(X, X2, QKV, GU, ATT, PM, PL, PACC, KV, PT, REQ, POS, SLOT, COS, SIN, WQKV, WO, WGU, WD, NQ,
                         NP, CNT, FAIL, ARR, eps, L, lq, lo, lg, ld, ln, s_page, s_layer, s_sel, s_tok, s_head,
                         pt_stride,
                         B: tl.constexpr, H: tl.constexpr, HEADS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                         T: tl.constexpr, PPS: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, GP: tl.constexpr,
                         NQKV: tl.constexpr, F: tl.constexpr, SCALE: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, CB: tl.constexpr, P: tl.constexpr, LIMIT: tl.constexpr,
                         FUSED: tl.constexpr, POLL_LOAD: tl.constexpr):  # fmt: skip
    """Every layer of a dense Llama decode step for B rows (each its own request): qkv (input
    norm), attention (K/V write, page groups), combine (inside the attention stage when FUSED),
    o_proj (residual), gate_up (post-attention norm), down (SiLU gate, residual), a grid barrier
    after each (`grid_barrier`, polling as POLL_LOAD says). X [B, H] in and out; X2, QKV, GU,
    ATT and the partials are scratch. Layer l's weights sit at layer 0's plus l times
    lq/lo/lg/ld elements (ln for the norms)."""
    HQ: tl.constexpr = HEADS * D
    for i in range(L):
        li = i + tl.zeros([], tl.int64)  # 64-bit offsets (a loop index is i32)
        projection_stage(X, H, WQKV + li * lq, NQ + li * ln, X, QKV, B, eps, NQKV, H, BN, BK, P, True, False, False)
        grid_barrier(CNT, FAIL, P, LIMIT, POLL_LOAD)
        attention_stage(QKV, KV, PT, REQ, POS, SLOT, COS, SIN, PM, PL, PACC, ARR, ATT, li, s_page, s_layer, s_sel,
                        s_tok, s_head, pt_stride, B, HEADS, KVH, D, T, PPS, S, GP, NQKV, SCALE, P, FUSED, SP,
                        CB)  # fmt: skip
        grid_barrier(CNT, FAIL, P, LIMIT, POLL_LOAD)
        if not FUSED:
            combine_stage(PM, PL, PACC, POS, ATT, B, HEADS, D, T, PPS, S, SP, CB, P)
            grid_barrier(CNT, FAIL, P, LIMIT, POLL_LOAD)
        projection_stage(ATT, HQ, WO + li * lo, NQ, X, X2, B, eps, H, HQ, BN, BK, P, False, False, True)
        grid_barrier(CNT, FAIL, P, LIMIT, POLL_LOAD)
        projection_stage(X2, H, WGU + li * lg, NP + li * ln, X2, GU, B, eps, 2 * F, H, BN, BK, P, True, False, False)
        grid_barrier(CNT, FAIL, P, LIMIT, POLL_LOAD)
        projection_stage(GU, 2 * F, WD + li * ld, NQ, X2, X, B, eps, H, F, BN, BK, P, False, True, True)
        grid_barrier(CNT, FAIL, P, LIMIT, POLL_LOAD)


# Pages per attention group (more where a table would make over `MAX_SPLITS` groups) and groups
# the combine reads at once.
PAGES_PER_GROUP = 1
COMBINE_GROUPS = 16
# Spins at one barrier before a program gives up and sets the failure word (~1 s).
SPIN_LIMIT = 1 << 20


def launch(
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
    config: tuple[int, int, int],
    programs: int,
    fused: bool,
    poll_load: bool,
) -> torch.Tensor:
    """x [B, H] through every layer (a new tensor). weights: layer 0's qkv, o_proj, gate_up,
    down, input_norm, post_attention_norm; strides: elements from layer 0's to layer 1's for
    the first five (the norms share one); dims: layers, heads, KV heads, head dim, ffn;
    config: rows per weight tile, columns per tile, warps; `fused`: the combine inside the
    attention stage; `poll_load`: barriers wait on volatile loads."""
    layers, heads, kvh, d, ffn = dims
    b, h = x.shape
    if counter.numel() < 2 + b * kvh:
        raise ValueError(f"the counter holds arrivals for {(counter.numel() - 2) // kvh} rows, not {b}")
    bn, bk, warps = config
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
    decode_layers_kernel[(programs,)](
        out, x2, qkv, gu, att, pm, pl, pacc, kv, pages, req, pos, slots, cos, sin, wq, wo, wg, wd, nq, np_,
        counter, counter[1:], counter[2:], eps, layers, lq, lo, lg, ld, ln, st[0], st[1], st[2], st[3], st[4],
        pages.stride(0),
        B=b, H=h, HEADS=heads, KVH=kvh, D=d, T=kv.shape[3], PPS=pps, S=splits,
        SP=max(2, triton.next_power_of_2(splits)), GP=max(16, triton.next_power_of_2(heads // kvh)), NQKV=nqkv,
        F=ffn, SCALE=d**-0.5, BN=bn, BK=bk, CB=COMBINE_GROUPS, P=programs, LIMIT=SPIN_LIMIT, FUSED=fused,
        POLL_LOAD=poll_load, num_warps=warps,
    )  # fmt: skip
    return out
