"""The Triton kernels behind `ignition.capture.gdn` (see it for the state layout and arithmetic).

Kept in its own module, imported only when a GDN operation launches: Triton resolves the helper
functions a kernel calls through the module's globals, and CPU runs never need Triton.
"""

# mypy: disable-error-code="no-untyped-def"
# Triton reads a kernel's parameter annotations to specialize it (tl.constexpr, dtype names), so
# the pointer and scalar parameters stay unannotated: the one exemption from typing.
import triton
import triton.language as tl


@triton.jit
def _silu_rounded(acc, dtype):
    """Transformers' order: the convolution rounded to the activation dtype, then SiLU."""
    a = acc.to(dtype).to(tl.float32)
    return (a / (1.0 + tl.exp(-a))).to(dtype)


@triton.jit
def conv_step_kernel(
    X, HIST, ROWS, W, Y, N, C, sx, sy, sh_r, sh_c, K: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr
):
    """Program (group, channel block): the group's LANES consecutive tokens (lanes
    group*LANES + j, N lanes in all) in order, each one decode-step convolution over the K-1
    stored inputs and the new one, the history shifting by one. Decode: LANES 1, a lane per
    row. A speculative program: a group is one request; lane 0 reads its live row's history,
    lane j > 0 the history lane j - 1 left in column row + j - 1, and lane j's goes to column
    row + j (column 0 is the live row itself). Lanes with a negative row read the null row and
    write nothing (a request's used lanes are a prefix)."""
    group = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < C
    for j in tl.static_range(LANES):
        lane = group * LANES + j
        # int64 offsets: rows of tens of MB, hundreds of them
        row = tl.load(ROWS + lane, mask=lane < N, other=-1).to(tl.int64)
        live = row >= 0
        dst = tl.where(live, row + j, 0)
        src = dst if j == 0 else tl.where(live, row + j - 1, 0)  # j is static: resolved at compile time
        lm = cm & (c * 0 + lane < N)  # full-shape masks (the interpreter rejects scalar masks)
        x = tl.load(X + lane * sx + c, mask=lm, other=0.0)
        acc = x.to(tl.float32) * tl.load(W + c * K + (K - 1), mask=cm, other=0.0).to(tl.float32)
        for i in tl.static_range(K - 1):
            hv = tl.load(HIST + src * sh_r + c * sh_c + i, mask=cm, other=0.0)
            acc += hv.to(tl.float32) * tl.load(W + c * K + i, mask=cm, other=0.0).to(tl.float32)
        tl.store(Y + lane * sy + c, _silu_rounded(acc, x.dtype), mask=lm)
        wm = lm & (c * 0 + row >= 0)
        for i in tl.static_range(K - 2):  # ascending: with src == dst, entry i+1 is read first
            nxt = tl.load(HIST + src * sh_r + c * sh_c + i + 1, mask=cm, other=0.0)
            tl.store(HIST + dst * sh_r + c * sh_c + i, nxt, mask=wm)
        tl.store(HIST + dst * sh_r + c * sh_c + K - 2, x, mask=wm)
        if LANES > 1:
            tl.debug_barrier()  # the next lane reads the column just written


@triton.jit
def commit_columns_kernel(ROWS, LIVE, ACCEPTED, X, OUT, NX, NBYTES, sr, BLOCK: tl.constexpr):
    """Program (request, block): bytes [0, NBYTES) of column LIVE + ACCEPTED copied into the live
    row LIVE (requests with a negative live row or nothing past lane 0 copy nothing); the first
    program of each request also copies its X [NX] vector into OUT, the value the step goes on with."""
    req = tl.program_id(0)
    blk = tl.program_id(1)
    i = blk * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(LIVE + req).to(tl.int64)
    acc = tl.load(ACCEPTED + req).to(tl.int64)
    copy = (row >= 0) & (acc > 0)
    r = tl.where(row >= 0, row, 0)
    m = (i < NBYTES) & (i * 0 + copy.to(tl.int32) > 0)
    v = tl.load(ROWS + (r + acc) * sr + i, mask=m, other=0)
    tl.store(ROWS + r * sr + i, v, mask=m)
    for b in range(0, NX, BLOCK):
        xi = b + tl.arange(0, BLOCK)
        xm = (xi < NX) & (xi * 0 + blk == 0)
        tl.store(OUT + req * NX + xi, tl.load(X + req * NX + xi, mask=xm, other=0.0), mask=xm)


@triton.jit
def conv_prefill_kernel(
    X, HIST, ROW, LENGTH, W, Y, T, C, sx, sy, sh_r, sh_c, K: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr
):
    """Program (channel block, token block) of one request's chunk: the block's convolutions at
    once (inputs before the chunk come from the history); the first token block, the only one
    that reads the history (TB >= K - 1), then writes the history after the first LENGTH
    tokens, once its reads are done."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t = tl.program_id(1) * TB + tl.arange(0, TB)
    cm = c < C
    m = (t < T)[:, None] & cm[None, :]
    row = tl.load(ROW).to(tl.int64)
    n = tl.load(LENGTH)
    live = row >= 0
    r = tl.where(live, row, 0)
    acc = tl.zeros([TB, BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        src = t[:, None] - (K - 1) + j + c[None, :] * 0
        from_x = tl.load(X + src * sx + c[None, :], mask=m & (src >= 0), other=0.0)
        from_h = tl.load(HIST + r * sh_r + c[None, :] * sh_c + (K - 1 + src), mask=m & (src < 0), other=0.0)
        v = tl.where(src >= 0, from_x, from_h)
        acc += v.to(tl.float32) * tl.load(W + c * K + j, mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + t[:, None] * sy + c[None, :], _silu_rounded(acc, Y.dtype.element_ty), mask=m)
    tl.debug_barrier()  # every lane's history reads above land before any write below
    # Only the first token block writes (the others' stores are masked off).
    wm = cm & (c * 0 + row >= 0) & (c * 0 + tl.program_id(1) == 0)
    for j in tl.static_range(K - 1):  # ascending: a history entry read (j + n > j) is not yet overwritten
        p = c * 0 + (n - (K - 1) + j)
        from_x = tl.load(X + p * sx + c, mask=cm & (p >= 0), other=0.0)
        from_h = tl.load(HIST + r * sh_r + c * sh_c + (K - 1 + p), mask=cm & (p < 0), other=0.0)
        tl.store(HIST + r * sh_r + c * sh_c + j, tl.where(p >= 0, from_x, from_h), mask=wm)


@triton.jit
def _unit(x):
    """L2 normalization (Transformers' l2norm, eps 1e-6)."""
    return x / tl.sqrt(tl.sum(x * x, 0) + 1e-6)


@triton.jit
def delta_rule_kernel(
    STATE,
    ROWS,
    Q,
    K,
    V,
    G,
    BETA,
    OUT,
    T,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    sg_t,
    ss_r,
    ss_h,
    ss_k,
    so_t,
    so_h,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    PREFILL: tl.constexpr,
    LENGTH=None,
    LANES: tl.constexpr = 1,
):
    """Program (group, value head, value block). Decode and speculative programs: a group is
    LANES consecutive tokens of one request (decode: LANES 1, a lane per row), run in order from
    its live row's state (its first lane's row), the state after lane j written to column
    row + j while lane j is live (a request's used lanes are a prefix; column 0 is the live row).
    Prefill: one request, the first LENGTH of T tokens in order (the rest output zeros and leave
    the state alone), the state at LENGTH written back. The state block [DK, BV] stays in
    registers and is written for live rows only; every mode runs the same update per token, so
    a speculative lane's output and column are bitwise what a decode step computes."""
    group = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = dv < DV
    dk = tl.arange(0, DK)
    kh = h // (HV // HK)
    if PREFILL:
        row = tl.load(ROWS).to(tl.int64)
        n = tl.load(LENGTH)
        t0 = 0
    else:
        t0 = group * LANES
        row = tl.load(ROWS + t0, mask=t0 < T, other=-1).to(tl.int64)
        n = tl.minimum(T - t0, LANES)
    live = row >= 0
    r = tl.where(live, row, 0)
    sp = STATE + r * ss_r + h * ss_h + dk[:, None] * ss_k + dv[None, :]
    s = tl.load(sp, mask=vm[None, :], other=0.0)
    scale = 1.0 / tl.sqrt(DK * 1.0)
    for i in range(0, n):
        t = t0 + i
        q = _unit(tl.load(Q + t * sq_t + kh * sq_h + dk).to(tl.float32)) * scale
        k = _unit(tl.load(K + t * sk_t + kh * sk_h + dk).to(tl.float32))
        v = tl.load(V + t * sv_t + h * sv_h + dv, mask=vm, other=0.0).to(tl.float32)
        g = tl.load(G + t * sg_t + h).to(tl.float32)
        b = tl.load(BETA + t * sg_t + h).to(tl.float32)
        s = s * tl.exp(g)
        mem = tl.sum(s * k[:, None], 0)
        s = s + k[:, None] * ((v - mem) * b)[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(OUT + t * so_t + h * so_h + dv, o.to(OUT.dtype.element_ty), mask=vm)
        if not PREFILL:  # the column of lane i, while the lane is live
            lane_row = tl.load(ROWS + t)
            cp = STATE + (r + i) * ss_r + h * ss_h + dk[:, None] * ss_k + dv[None, :]
            tl.store(cp, s, mask=vm[None, :] & (dk[:, None] * 0 + lane_row >= 0) & (dk[:, None] * 0 + row >= 0))
    if PREFILL:
        for t in range(n, T):
            tl.store(OUT + t * so_t + h * so_h + dv, tl.zeros([BV], dtype=OUT.dtype.element_ty), mask=vm)
        tl.store(sp, s, mask=vm[None, :] & (dk[:, None] * 0 + row >= 0))


@triton.jit
def _inverse_norms(X, t, real, sx_t, head_offset, DK: tl.constexpr, KB: tl.constexpr):
    """1 / |x| (Transformers' l2norm, eps 1e-6) of rows t of a [T, heads, DK] operand, over DK in
    blocks of KB (a whole row in registers would spill: see `delta_rule_chunk_prep_kernel`)."""
    acc = tl.zeros([t.shape[0]], dtype=tl.float32)
    for k0 in range(0, DK, KB):
        dk = k0 + tl.arange(0, KB)
        x = tl.load(X + t[:, None] * sx_t + head_offset + dk[None, :], mask=real[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(x * x, 1)
    return 1.0 / tl.sqrt(acc + 1e-6)


@triton.jit
def delta_rule_chunk_prep_kernel(
    LENGTH,
    Q,
    K,
    V,
    G,
    BETA,
    U,
    WK,
    KD,
    QK,
    GAMMA,
    DECAY,
    NC,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    sg_t,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    C: tl.constexpr,
    KB: tl.constexpr,
):
    """Chunked prefill, phase 1, program (value head, chunk): everything of a chunk that does not
    depend on the state entering it, for every chunk at once. With G the running log decay and A
    the strictly lower beta_i exp(G_i - G_j) k_i.k_j (unit keys), T = (I + A)^-1 by forward
    substitution, then U = T (beta V), WK = T diag(beta exp G) K, KD = diag(exp(G_last - G)) K,
    the causal QK = (Q K^T)_ij exp(G_i - G_j) (unit queries over sqrt(DK)), GAMMA = exp G and
    DECAY = exp G_last. Scratch is laid out [head, chunk, ...].
    Every product runs over blocks of KB: an FMA product holds its whole reduction axis per
    thread, and over DK = 128 that spilled kilobytes of stack per thread on sm_90."""
    h = tl.program_id(0)
    c = tl.program_id(1)
    c0 = c * C
    n = tl.load(LENGTH)
    if c0 < n:
        ci = tl.arange(0, C)
        t = c0 + ci
        real = t < n
        kh = h // (HV // HK)
        kinv = _inverse_norms(K, t, real, sk_t, kh * sk_h, DK, KB)
        qinv = _inverse_norms(Q, t, real, sq_t, kh * sq_h, DK, KB) * (1.0 / tl.sqrt(DK * 1.0))
        kk = tl.zeros([C, C], dtype=tl.float32)
        qk = tl.zeros([C, C], dtype=tl.float32)
        for k0 in range(0, DK, KB):
            dk = k0 + tl.arange(0, KB)
            k = tl.load(K + t[:, None] * sk_t + kh * sk_h + dk[None, :], mask=real[:, None], other=0.0).to(tl.float32)
            q = tl.load(Q + t[:, None] * sq_t + kh * sq_h + dk[None, :], mask=real[:, None], other=0.0).to(tl.float32)
            k = k * kinv[:, None]
            kk += tl.dot(k, tl.trans(k), input_precision="ieee")
            qk += tl.dot(q * qinv[:, None], tl.trans(k), input_precision="ieee")
        g = tl.load(G + t * sg_t + h, mask=real, other=0.0).to(tl.float32)
        b = tl.load(BETA + t * sg_t + h, mask=real, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)
        lower = ci[:, None] > ci[None, :]
        causal = ci[:, None] >= ci[None, :]
        eye = tl.where(ci[:, None] == ci[None, :], 1.0, 0.0)
        # exp(G_i - G_j) where i >= j (at most 1); elsewhere unused, kept finite.
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0))
        a = tl.where(lower, b[:, None] * decay * kk, 0.0)
        tm = eye
        for i in range(1, C):
            ai = tl.sum(tl.where(ci[:, None] == i, a, 0.0), 0)
            ri = -tl.sum(ai[:, None] * tm, 0)
            tm = tl.where(ci[:, None] == i, eye + ri[None, :], tm)
        gamma = tl.exp(gc)
        glast = tl.sum(g, 0)
        base = h.to(tl.int64) * NC + c
        rows = (base * C + ci)[:, None]
        tl.store(QK + rows * C + ci[None, :], tl.where(causal, qk * decay, 0.0))
        tl.store(GAMMA + base * C + ci, gamma)
        tl.store(DECAY + base, tl.exp(glast))
        for v0 in range(0, DV, KB):
            dv = v0 + tl.arange(0, KB)
            vm = dv < DV
            v = tl.load(V + t[:, None] * sv_t + h * sv_h + dv[None, :], mask=real[:, None] & vm[None, :], other=0.0)
            u = tl.dot(tm, b[:, None] * v.to(tl.float32), input_precision="ieee")
            tl.store(U + rows * DV + dv[None, :], u, mask=vm[None, :])
        for k0 in range(0, DK, KB):
            dk = k0 + tl.arange(0, KB)
            k = tl.load(K + t[:, None] * sk_t + kh * sk_h + dk[None, :], mask=real[:, None], other=0.0).to(tl.float32)
            k = k * kinv[:, None]
            tl.store(WK + rows * DK + dk[None, :], tl.dot(tm, (b * gamma)[:, None] * k, input_precision="ieee"))
            tl.store(KD + rows * DK + dk[None, :], k * tl.exp(glast - gc)[:, None])


@triton.jit
def delta_rule_chunk_state_kernel(
    STATE,
    ROW,
    LENGTH,
    U,
    WK,
    KD,
    DECAY,
    W,
    H,
    NC,
    ss_r,
    ss_h,
    ss_k,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    KB: tl.constexpr,
):
    """Chunked prefill, phase 2, program (value head, value block): the only serial part, two
    matrix products per chunk. H[c] holds the state entering chunk c (H has NC + 1 entries);
    from it the corrections W = U - WK H[c], then H[c + 1] = exp(G_last) H[c] + KD^T W. The state
    after the last real chunk goes back to the row (none for a negative row). The state stays in
    H (L2-resident) rather than registers so that every product runs over blocks of KB."""
    h = tl.program_id(0)
    dv = tl.program_id(1) * BV + tl.arange(0, BV)
    vm = dv < DV
    ci = tl.arange(0, C)
    row = tl.load(ROW).to(tl.int64)
    n = tl.load(LENGTH)
    r = tl.where(row >= 0, row, 0)
    hb = h.to(tl.int64) * (NC + 1)
    for k0 in range(0, DK, KB):
        dk = k0 + tl.arange(0, KB)
        s = tl.load(STATE + r * ss_r + h * ss_h + dk[:, None] * ss_k + dv[None, :], mask=vm[None, :], other=0.0)
        tl.store(H + (hb * DK + dk[:, None]) * DV + dv[None, :], s, mask=vm[None, :])
    chunks = tl.cdiv(n, C)
    for c in range(0, chunks):
        tl.debug_barrier()  # H[c] was written by other threads of this program
        base = h.to(tl.int64) * NC + c
        rows = (base * C + ci)[:, None]
        w = tl.load(U + rows * DV + dv[None, :], mask=vm[None, :], other=0.0)
        for k0 in range(0, DK, KB):
            dk = k0 + tl.arange(0, KB)
            s = tl.load(H + ((hb + c) * DK + dk[:, None]) * DV + dv[None, :], mask=vm[None, :], other=0.0)
            w -= tl.dot(tl.load(WK + rows * DK + dk[None, :]), s, input_precision="ieee")
        tl.store(W + rows * DV + dv[None, :], w, mask=vm[None, :])
        decay = tl.load(DECAY + base)
        for k0 in range(0, DK, KB):
            dk = k0 + tl.arange(0, KB)
            s = tl.load(H + ((hb + c) * DK + dk[:, None]) * DV + dv[None, :], mask=vm[None, :], other=0.0)
            kd = tl.load(KD + rows * DK + dk[None, :])
            s = decay * s + tl.dot(tl.trans(kd), w, input_precision="ieee")
            tl.store(H + ((hb + c + 1) * DK + dk[:, None]) * DV + dv[None, :], s, mask=vm[None, :])
    tl.debug_barrier()
    for k0 in range(0, DK, KB):
        dk = k0 + tl.arange(0, KB)
        s = tl.load(H + ((hb + chunks) * DK + dk[:, None]) * DV + dv[None, :], mask=vm[None, :], other=0.0)
        sp = STATE + r * ss_r + h * ss_h + dk[:, None] * ss_k + dv[None, :]
        tl.store(sp, s, mask=vm[None, :] & (dk[:, None] * 0 + row >= 0))


@triton.jit
def delta_rule_chunk_output_kernel(
    LENGTH,
    Q,
    QK,
    GAMMA,
    W,
    H,
    OUT,
    NC,
    T,
    sq_t,
    sq_h,
    so_t,
    so_h,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    KB: tl.constexpr,
):
    """Chunked prefill, phase 3, program (value head, chunk, value block), every chunk at once:
    outputs exp(G) Q H[c] + QK W from the state H[c] entering the chunk; zeros past LENGTH."""
    h = tl.program_id(0)
    c = tl.program_id(1)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = dv < DV
    ci = tl.arange(0, C)
    n = tl.load(LENGTH)
    t = c * C + ci
    real = t < n
    om = (t < T)[:, None] & vm[None, :]
    if c * C < n:
        kh = h // (HV // HK)
        base = h.to(tl.int64) * NC + c
        hc = h.to(tl.int64) * (NC + 1) + c
        qinv = _inverse_norms(Q, t, real, sq_t, kh * sq_h, DK, KB) * (1.0 / tl.sqrt(DK * 1.0))
        acc = tl.zeros([C, BV], dtype=tl.float32)
        for k0 in range(0, DK, KB):
            dk = k0 + tl.arange(0, KB)
            q = tl.load(Q + t[:, None] * sq_t + kh * sq_h + dk[None, :], mask=real[:, None], other=0.0).to(tl.float32)
            s = tl.load(H + (hc * DK + dk[:, None]) * DV + dv[None, :], mask=vm[None, :], other=0.0)
            acc += tl.dot(q * qinv[:, None], s, input_precision="ieee")
        rows = (base * C + ci)[:, None]
        qk = tl.load(QK + rows * C + ci[None, :])
        w = tl.load(W + rows * DV + dv[None, :], mask=vm[None, :], other=0.0)
        gamma = tl.load(GAMMA + base * C + ci)
        o = tl.where(real[:, None], gamma[:, None] * acc + tl.dot(qk, w, input_precision="ieee"), 0.0)
        tl.store(OUT + t[:, None] * so_t + h * so_h + dv[None, :], o.to(OUT.dtype.element_ty), mask=om)
    else:
        zeros = tl.zeros([C, BV], dtype=OUT.dtype.element_ty)
        tl.store(OUT + t[:, None] * so_t + h * so_h + dv[None, :], zeros, mask=om)


@triton.jit
def store_row_kernel(H, ROWS, LIVE, OUT, STAMPS, CONSUMED, N, sh, sr, ss, BLOCK: tl.constexpr):
    """Program (lane, block): the lane's vector into its live row (none for a negative row) and
    into OUT, the copy the step consumes downstream; block 0 also writes the lane's consumed
    count into the row's stamp (word 0; the epoch, word 1, is not touched)."""
    lane = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    row = tl.load(LIVE + lane).to(tl.int64)
    x = tl.load(H + lane * sh + i, mask=m, other=0.0)
    tl.store(OUT + lane * sh + i, x, mask=m)
    tl.store(ROWS + tl.where(row >= 0, row, 0) * sr + i, x, mask=m & (i * 0 + row >= 0))
    c = tl.load(CONSUMED + lane + i * 0)
    tl.store(STAMPS + tl.where(row >= 0, row, 0) * ss + i * 0, c, mask=(i == 0) & (i * 0 + row >= 0))
