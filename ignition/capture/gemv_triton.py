"""The Triton kernel behind `flare::gemv` (see `ignition.capture.gemv` for its contract).

Kept in its own module, imported only when a projection launches: Triton resolves the helper
functions a kernel calls through the module's globals, and CPU runs never need Triton.
"""

# mypy: disable-error-code="no-untyped-def"
# Triton reads a kernel's parameter annotations to specialize it (tl.constexpr, dtype names), so
# the pointer and scalar parameters stay unannotated: the one exemption from typing.
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL launches do nothing more

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


# Bytes one bulk L2 prefetch covers at most (PDL mode 3).
PF_SEG = tl.constexpr(1024)


@triton.jit
def _prefetch_l2(W, row0, N, K, stride_w, BLOCK_N: tl.constexpr, PF_K: tl.constexpr, ESIZE: tl.constexpr):
    """Bulk-prefetches into L2 the first PF_K columns (a power of two) of weight rows
    [row0, +BLOCK_N), in segments of at most PF_SEG bytes, one `cp.async.bulk.prefetch.L2` each
    (sm_90; a hint: it writes nothing and faults on nothing). Segments past a row's end repeat
    its first; rows past N repeat row N-1. Sizes stay multiples of 16 bytes."""
    SEG: tl.constexpr = PF_SEG if PF_K * ESIZE >= PF_SEG else PF_K * ESIZE
    SEGS: tl.constexpr = PF_K * ESIZE // SEG
    rows = tl.minimum(row0 + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    row_bytes = K * ESIZE
    off = tl.arange(0, SEGS) * SEG
    past = off >= row_bytes
    off = tl.where(past, 0, off)
    size = (tl.minimum(SEG, row_bytes - off) // 16) * 16
    ptr = W + rows[:, None] * stride_w + (off // ESIZE)[None, :]
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
        "=r,l,r",
        [ptr, tl.broadcast_to(size[None, :], [BLOCK_N, SEGS])],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _row_input(X, NW, row, ks, kmask, stride_x, K, rstd, NORM: tl.constexpr, GLU: tl.constexpr):
    """One activation row's projection input over the K block `ks`, in the activation dtype."""
    if GLU:
        g = tl.load(X + row * stride_x + ks, mask=kmask, other=0.0)
        u = tl.load(X + row * stride_x + K + ks, mask=kmask, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        # Products in float32, rounded once: what a bf16 multiply computes (the exact product of
        # two bf16 values fits a float32), spelled out so Triton's interpreter computes it too.
        h = (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    else:
        h = tl.load(X + row * stride_x + ks, mask=kmask, other=0.0)
        if NORM == 2:  # zero-centred (Qwen3.5): (x * rstd * (1 + w)) in float32, rounded once
            nw = tl.load(NW + ks, mask=kmask, other=0.0)
            h = (h.to(tl.float32) * rstd * (1.0 + nw.to(tl.float32))).to(h.dtype)
        elif NORM == 1:
            nw = tl.load(NW + ks, mask=kmask, other=0.0)
            n = (h.to(tl.float32) * rstd).to(h.dtype)
            h = (nw.to(tl.float32) * n.to(tl.float32)).to(h.dtype)
    return h


@triton.jit
def _row_rstd(X, row, stride_x, K, eps, BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    """1/RMS of one activation row (float32), or 1 without the norm prologue."""
    if NORM:
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(X + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
            ss += v * v
        return 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
    else:
        return 1.0


@triton.jit
def _zeros(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDE: tl.constexpr):
    """A row's accumulator: per weight row ([BLOCK_N]), or per tile element ([BLOCK_N, BLOCK_K],
    reduced once at the end: no cross-thread reduction inside the K loop)."""
    if WIDE:
        return tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_N], dtype=tl.float32)


@triton.jit
def _accumulate(
    acc, w, X, NW, row, ks, kmask, stride_x, K, rstd, NORM: tl.constexpr, GLU: tl.constexpr, WIDE: tl.constexpr
):
    h = _row_input(X, NW, row, ks, kmask, stride_x, K, rstd, NORM, GLU)
    if WIDE:
        return acc + w * h.to(tl.float32)[None, :]
    else:
        return acc + tl.sum(w * h.to(tl.float32)[None, :], 1)


@triton.jit
def _store(
    Y,
    R,
    B,
    acc,
    row,
    m,
    M,
    cols,
    nmask,
    stride_y,
    stride_r,
    BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    WIDE: tl.constexpr,
):
    if WIDE:  # noqa: SIM108 (a constexpr branch; Triton compiles statements, not every expression form)
        y = tl.sum(acc, 1)
    else:
        y = acc
    if BIAS:
        y += tl.load(B + cols, mask=nmask, other=0.0).to(tl.float32)
    y = y.to(Y.dtype.element_ty)
    if RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=nmask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + cols, y, mask=nmask & (cols * 0 + m < M))


@triton.jit
def _store_partial(P, acc, m, M, N, cols, nmask, WIDE: tl.constexpr):
    if WIDE:  # noqa: SIM108 (a constexpr branch; Triton compiles statements, not every expression form)
        y = tl.sum(acc, 1)
    else:
        y = acc
    tl.store(P + m * N + cols, y, mask=nmask & (cols * 0 + m < M))


@triton.jit
def flare_gemv_reduce(
    P,
    B,
    R,
    Y,
    M,
    N,
    stride_r,
    stride_y,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Program (m, c): row m's columns [c*BLOCK, +BLOCK) of a split projection: the SPLIT partial
    sums added in slice order (fixed: a row's result does not depend on the other rows), then
    `_store`'s epilogue (bias in float32, one rounding, the residual added and rounded).
    PDL > 0: launched as a programmatic dependent of the partial sums' kernel; it waits for
    them, then lets the next kernel launch at once."""
    if PDL > 0:
        gdc_wait()
        gdc_launch_dependents()
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = cols < N
    y = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        y += tl.load(P + (s * M + m).to(tl.int64) * N + cols, mask=nmask, other=0.0)
    if BIAS:
        y += tl.load(B + cols, mask=nmask, other=0.0).to(tl.float32)
    y = y.to(Y.dtype.element_ty)
    if RESIDUAL:
        r = tl.load(R + m * stride_r + cols, mask=nmask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + m * stride_y + cols, y, mask=nmask)


@triton.jit
def flare_gemv(
    X,
    W,
    B,
    NW,
    R,
    Y,
    P,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_r,
    stride_y,
    eps,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    GLU: tl.constexpr,
    BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    WIDE: tl.constexpr,
    PDL: tl.constexpr = 0,
    SPLIT: tl.constexpr = 1,
    PF_K: tl.constexpr = 0,
    ESIZE: tl.constexpr = 2,
    ADDR64: tl.constexpr = False,
):
    """Program (n * groups + g, 0, s): weight rows [n*BLOCK_N, +BLOCK_N) against activation rows
    [g*ROWS, +ROWS), over K slice s of SPLIT (BLOCK_K-aligned). With SPLIT > 1 each slice's
    float32 sums go to P [SPLIT, M, N] and `flare_gemv_reduce` finishes the rows (more programs
    for a weight with few, long rows: N / BLOCK_N alone may not fill the GPU).
    Each row has its own accumulator and its own copy of the per-row code (rows past M
    recompute the last row and store nothing), so a row's arithmetic is the same whatever ROWS
    is. PDL (launched as a programmatic dependent): 1 waits for the previous kernel before
    anything else, 2 first loads its first weight tile (weights are nobody's output) and then
    waits; both let the next kernel launch once their loads are done. 3 prefetches the first
    PF_K columns of its weight rows into L2 (`_prefetch_l2`), waits, and lets the next kernel
    launch at once: the next kernel's prefetch then overlaps this one's whole loop; 4 prefetches
    as 3 does and lets the next kernel launch after its loop, as 1 does. The
    arithmetic is the same in every mode (the first tile accumulated first either way)."""
    # Program (n, g) is linear id n * groups + g: the groups reading one weight tile run side by
    # side, so the tile is read from HBM once and from L2 by the others.
    groups = tl.cdiv(M, ROWS)
    pid_n = tl.program_id(0) // groups
    m0 = (tl.program_id(0) % groups) * ROWS
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < N
    wrow = tl.minimum(cols, N - 1)  # out-of-range weight rows read row N-1, never stored
    WT = W  # the weight rows' base: W, or with ADDR64 (2**31 elements or more) this tile's first row
    if ADDR64:  # one int64 scalar offset; the lanes' offsets within the tile stay int32
        WT = W + (pid_n * BLOCK_N).to(tl.int64) * stride_w
        wrow = wrow - pid_n * BLOCK_N
    k_first = 0
    if PDL == 2:
        ks0 = tl.arange(0, BLOCK_K)
        w0 = tl.load(WT + wrow[:, None] * stride_w + ks0[None, :], mask=(ks0 < K)[None, :], other=0.0).to(tl.float32)
        k_first = BLOCK_K
    if PDL >= 3 and PF_K > 0:
        _prefetch_l2(W, pid_n * BLOCK_N, N, K, stride_w, BLOCK_N, PF_K, ESIZE)
    if PDL > 0:
        gdc_wait()
    if PDL == 3:
        gdc_launch_dependents()
    r0 = tl.minimum(m0 + 0, M - 1)
    r1 = tl.minimum(m0 + 1, M - 1)
    r2 = tl.minimum(m0 + 2, M - 1)
    r3 = tl.minimum(m0 + 3, M - 1)
    r4 = tl.minimum(m0 + 4, M - 1)
    r5 = tl.minimum(m0 + 5, M - 1)
    r6 = tl.minimum(m0 + 6, M - 1)
    r7 = tl.minimum(m0 + 7, M - 1)
    s0 = _row_rstd(X, r0, stride_x, K, eps, BLOCK_K, NORM)
    s1 = s0
    s2 = s0
    s3 = s0
    s4 = s0
    s5 = s0
    s6 = s0
    s7 = s0
    if ROWS > 1:
        s1 = _row_rstd(X, r1, stride_x, K, eps, BLOCK_K, NORM)
    if ROWS > 2:
        s2 = _row_rstd(X, r2, stride_x, K, eps, BLOCK_K, NORM)
    if ROWS > 3:
        s3 = _row_rstd(X, r3, stride_x, K, eps, BLOCK_K, NORM)
    if ROWS > 4:
        s4 = _row_rstd(X, r4, stride_x, K, eps, BLOCK_K, NORM)
    if ROWS > 5:
        s5 = _row_rstd(X, r5, stride_x, K, eps, BLOCK_K, NORM)
    if ROWS > 6:
        s6 = _row_rstd(X, r6, stride_x, K, eps, BLOCK_K, NORM)
    if ROWS > 7:
        s7 = _row_rstd(X, r7, stride_x, K, eps, BLOCK_K, NORM)
    a0 = _zeros(BLOCK_N, BLOCK_K, WIDE)
    a1 = _zeros(BLOCK_N, BLOCK_K, WIDE)
    a2 = _zeros(BLOCK_N, BLOCK_K, WIDE)
    a3 = _zeros(BLOCK_N, BLOCK_K, WIDE)
    a4 = _zeros(BLOCK_N, BLOCK_K, WIDE)
    a5 = _zeros(BLOCK_N, BLOCK_K, WIDE)
    a6 = _zeros(BLOCK_N, BLOCK_K, WIDE)
    a7 = _zeros(BLOCK_N, BLOCK_K, WIDE)
    if PDL == 2:  # the prefetched tile: the loop's first step, in the same order
        ks = tl.arange(0, BLOCK_K)
        kmask = ks < K
        a0 = _accumulate(a0, w0, X, NW, r0, ks, kmask, stride_x, K, s0, NORM, GLU, WIDE)
        if ROWS > 1:
            a1 = _accumulate(a1, w0, X, NW, r1, ks, kmask, stride_x, K, s1, NORM, GLU, WIDE)
        if ROWS > 2:
            a2 = _accumulate(a2, w0, X, NW, r2, ks, kmask, stride_x, K, s2, NORM, GLU, WIDE)
        if ROWS > 3:
            a3 = _accumulate(a3, w0, X, NW, r3, ks, kmask, stride_x, K, s3, NORM, GLU, WIDE)
        if ROWS > 4:
            a4 = _accumulate(a4, w0, X, NW, r4, ks, kmask, stride_x, K, s4, NORM, GLU, WIDE)
        if ROWS > 5:
            a5 = _accumulate(a5, w0, X, NW, r5, ks, kmask, stride_x, K, s5, NORM, GLU, WIDE)
        if ROWS > 6:
            a6 = _accumulate(a6, w0, X, NW, r6, ks, kmask, stride_x, K, s6, NORM, GLU, WIDE)
        if ROWS > 7:
            a7 = _accumulate(a7, w0, X, NW, r7, ks, kmask, stride_x, K, s7, NORM, GLU, WIDE)
    k_end = K
    if SPLIT > 1:  # PDL is 0 or 1 here (the launch refuses the rest): k_first is 0
        span = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
        k_first = tl.program_id(2) * span
        k_end = tl.minimum(K, k_first + span)
    for k0 in range(k_first, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        w = tl.load(WT + wrow[:, None] * stride_w + ks[None, :], mask=kmask[None, :], other=0.0).to(tl.float32)
        a0 = _accumulate(a0, w, X, NW, r0, ks, kmask, stride_x, K, s0, NORM, GLU, WIDE)
        if ROWS > 1:
            a1 = _accumulate(a1, w, X, NW, r1, ks, kmask, stride_x, K, s1, NORM, GLU, WIDE)
        if ROWS > 2:
            a2 = _accumulate(a2, w, X, NW, r2, ks, kmask, stride_x, K, s2, NORM, GLU, WIDE)
        if ROWS > 3:
            a3 = _accumulate(a3, w, X, NW, r3, ks, kmask, stride_x, K, s3, NORM, GLU, WIDE)
        if ROWS > 4:
            a4 = _accumulate(a4, w, X, NW, r4, ks, kmask, stride_x, K, s4, NORM, GLU, WIDE)
        if ROWS > 5:
            a5 = _accumulate(a5, w, X, NW, r5, ks, kmask, stride_x, K, s5, NORM, GLU, WIDE)
        if ROWS > 6:
            a6 = _accumulate(a6, w, X, NW, r6, ks, kmask, stride_x, K, s6, NORM, GLU, WIDE)
        if ROWS > 7:
            a7 = _accumulate(a7, w, X, NW, r7, ks, kmask, stride_x, K, s7, NORM, GLU, WIDE)
    if PDL == 1 or PDL == 2 or PDL == 4:
        gdc_launch_dependents()
    if SPLIT > 1:
        # Partial sums of slice s: P[s, m, cols] (float32; rows past M store nothing).
        P += tl.program_id(2).to(tl.int64) * M * N
        _store_partial(P, a0, m0 + 0, M, N, cols, nmask, WIDE)
        if ROWS > 1:
            _store_partial(P, a1, m0 + 1, M, N, cols, nmask, WIDE)
        if ROWS > 2:
            _store_partial(P, a2, m0 + 2, M, N, cols, nmask, WIDE)
        if ROWS > 3:
            _store_partial(P, a3, m0 + 3, M, N, cols, nmask, WIDE)
        if ROWS > 4:
            _store_partial(P, a4, m0 + 4, M, N, cols, nmask, WIDE)
        if ROWS > 5:
            _store_partial(P, a5, m0 + 5, M, N, cols, nmask, WIDE)
        if ROWS > 6:
            _store_partial(P, a6, m0 + 6, M, N, cols, nmask, WIDE)
        if ROWS > 7:
            _store_partial(P, a7, m0 + 7, M, N, cols, nmask, WIDE)
    else:
        _store(Y, R, B, a0, r0, m0 + 0, M, cols, nmask, stride_y, stride_r, BIAS, RESIDUAL, WIDE)
        if ROWS > 1:
            _store(Y, R, B, a1, r1, m0 + 1, M, cols, nmask, stride_y, stride_r, BIAS, RESIDUAL, WIDE)
        if ROWS > 2:
            _store(Y, R, B, a2, r2, m0 + 2, M, cols, nmask, stride_y, stride_r, BIAS, RESIDUAL, WIDE)
        if ROWS > 3:
            _store(Y, R, B, a3, r3, m0 + 3, M, cols, nmask, stride_y, stride_r, BIAS, RESIDUAL, WIDE)
        if ROWS > 4:
            _store(Y, R, B, a4, r4, m0 + 4, M, cols, nmask, stride_y, stride_r, BIAS, RESIDUAL, WIDE)
        if ROWS > 5:
            _store(Y, R, B, a5, r5, m0 + 5, M, cols, nmask, stride_y, stride_r, BIAS, RESIDUAL, WIDE)
        if ROWS > 6:
            _store(Y, R, B, a6, r6, m0 + 6, M, cols, nmask, stride_y, stride_r, BIAS, RESIDUAL, WIDE)
        if ROWS > 7:
            _store(Y, R, B, a7, r7, m0 + 7, M, cols, nmask, stride_y, stride_r, BIAS, RESIDUAL, WIDE)


@triton.jit
def flare_gemv_dot(
    X,
    W,
    B,
    NW,
    R,
    Y,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_r,
    stride_y,
    eps,
    P,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    GLU: tl.constexpr,
    BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr = 0,
    SPLIT: tl.constexpr = 1,
    PF_K: tl.constexpr = 0,
    ESIZE: tl.constexpr = 2,
    ADDR64: tl.constexpr = False,
):
    """The tensor-core variant: program (n, g) multiplies activation rows [g*BLOCK_M, +BLOCK_M)
    (rows past M are zeros) by weight rows [n*BLOCK_N, +BLOCK_N) with `tl.dot`. A row's result
    does not depend on the other rows' values (an MMA reduces each output element on its own)
    and every bucket launches the same BLOCK_M, so buckets agree bitwise here too. PDL > 0:
    waits for the previous kernel first and lets the next launch after the loop (1), or
    prefetches its weight rows into L2 first and lets the next launch right after the wait (3)
    or after the loop (4), as `flare_gemv`'s. SPLIT > 1: program (n, g, s) covers K slice s only
    (BLOCK_K-aligned, as `flare_gemv`'s) and stores its float32 sums to P [SPLIT, M, N] for
    `flare_gemv_reduce`: a weight with few rows then still has a program per SM, and its loop
    is the pipelined tensor-core one."""
    pid_n = tl.program_id(0)
    if PDL >= 3 and PF_K > 0:
        _prefetch_l2(W, pid_n * BLOCK_N, N, K, stride_w, BLOCK_N, PF_K, ESIZE)
    if PDL > 0:
        gdc_wait()
    if PDL == 3:
        gdc_launch_dependents()
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < N
    wrow = tl.minimum(cols, N - 1)
    WT = W  # as in `flare_gemv`
    if ADDR64:
        WT = W + (pid_n * BLOCK_N).to(tl.int64) * stride_w
        wrow = wrow - pid_n * BLOCK_N
    dt = Y.dtype.element_ty
    rstd = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if NORM:
        ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :], other=0.0)
            xs = xs.to(tl.float32)
            ss += xs * xs
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 1) / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_first = 0
    k_end = K
    if SPLIT > 1:
        span = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
        k_first = tl.program_id(2) * span
        k_end = tl.minimum(K, k_first + span)
    for k0 in range(k_first, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xm = rmask[:, None] & (ks < K)[None, :]
        if GLU:
            g = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=xm, other=0.0).to(tl.float32)
            u = tl.load(X + rows[:, None] * stride_x + K + ks[None, :], mask=xm, other=0.0)
            h = (g / (1.0 + tl.exp(-g))).to(u.dtype) * u
        else:
            h = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=xm, other=0.0)
            if NORM == 2:
                nw = tl.load(NW + ks, mask=ks < K, other=0.0)
                h = (h.to(tl.float32) * rstd[:, None] * (1.0 + nw.to(tl.float32))[None, :]).to(h.dtype)
            elif NORM == 1:
                nw = tl.load(NW + ks, mask=ks < K, other=0.0)
                h = nw[None, :] * (h.to(tl.float32) * rstd[:, None]).to(h.dtype)
        w = tl.load(WT + wrow[:, None] * stride_w + ks[None, :], mask=(ks < K)[None, :], other=0.0)
        acc = tl.dot(h.to(w.dtype), tl.trans(w), acc)
    if PDL == 1 or PDL == 2 or PDL == 4:
        gdc_launch_dependents()
    if SPLIT > 1:  # slice s's sums: P[s, rows, cols] (rows past M store nothing)
        P += tl.program_id(2).to(tl.int64) * M * N
        tl.store(P + rows[:, None] * N + cols[None, :], acc, mask=rmask[:, None] & nmask[None, :])
    else:
        y = acc
        if BIAS:
            y += tl.load(B + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
        y = y.to(dt)
        out_mask = rmask[:, None] & nmask[None, :]
        if RESIDUAL:
            r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=out_mask, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=out_mask)
