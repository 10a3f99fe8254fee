"""The Triton kernels behind `flare::write_attend` (see `ignition.capture.attention` for the
layout and the contract): paged attention over page groups and its combine, the prefill block
kernel, and the KV write.

Kept in its own module, imported only when a kernel launches: Triton resolves the helper
functions a kernel calls through the module's globals, and CPU runs never need Triton.
"""

# mypy: disable-error-code="no-untyped-def"
# Triton reads a kernel's parameter annotations to specialize it (tl.constexpr, dtype names), so
# the pointer and stride parameters stay unannotated: the one exemption from typing.
import triton
import triton.language as tl

from ignition.capture.gemv_triton import gdc_launch_dependents, gdc_wait


@triton.jit
def _query_rows(qp, valid, cs, COS, SIN, di, D: tl.constexpr, ROPE: tl.constexpr, dtype: tl.constexpr,
                CACHE: tl.constexpr):  # fmt: skip
    """Query rows at `qp` (D contiguous elements each), rotated-half with the cos/sin at offsets
    `cs` when `ROPE`, so no kernel materializes rotated copies first. `CACHE`: the cache
    modifier of the query loads ("" or ".cg" where another program of the same launch wrote
    them: `qualification/persistent_kernels.py`)."""
    q = tl.load(qp + di[None, :], mask=valid[:, None], other=0.0, cache_modifier=CACHE)
    if ROPE:
        rot = (di + D // 2) % D
        sign = tl.where(di < D // 2, -1.0, 1.0)
        qr = tl.load(qp + rot[None, :], mask=valid[:, None], other=0.0, cache_modifier=CACHE).to(tl.float32)
        c = tl.load(COS + cs, mask=valid[:, None], other=0.0).to(tl.float32)
        s_ = tl.load(SIN + cs, mask=valid[:, None], other=0.0).to(tl.float32)
        q = (q.to(tl.float32) * c + sign[None, :] * qr * s_).to(dtype)
    return q


@triton.jit
def _page_step(q, kp, s_sel, first, ti, pos, last_pos, m, lsum, acc, SCALE: tl.constexpr):
    """One KV page (K at `kp`, V `s_sel` past it; its first position `first`) into the rows'
    online-softmax state (m, lsum, acc); positions past a row's `pos` are masked. A fully
    masked page leaves the state exactly as it was (alpha = 1, p = 0). V past `last_pos` (the
    last position any row reads) is not loaded: a recycled page may still hold another
    request's values there, and p = 0 times a non-finite one would still be NaN. K needs no
    mask: its scores there are replaced by -inf."""
    k = tl.load(kp)
    v = tl.load(kp + s_sel, mask=((first + ti) <= last_pos)[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * SCALE
    s = tl.where((first + ti)[None, :] <= pos, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, lsum, acc


@triton.jit
def _write_token(K, V, COS, SIN, KV, slot, n, h, layer, k_row, k_head, v_row, v_head, s_page, s_layer, s_sel, s_tok,
                 s_head, D: tl.constexpr, T: tl.constexpr, ROPE: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
    """Token n's K (rotated when `ROPE`) and V of KV head h into its slot (the slot is >= 0);
    `CACHE` as for `_query_rows`, for the K and V loads."""
    di = tl.arange(0, D)
    kp = K + n * k_row + h * k_head
    k = tl.load(kp + di, cache_modifier=CACHE)
    if ROPE:
        rot = (di + D // 2) % D
        sign = tl.where(di < D // 2, -1.0, 1.0)
        c = tl.load(COS + n * D + di).to(tl.float32)
        s_ = tl.load(SIN + n * D + di).to(tl.float32)
        k = k.to(tl.float32) * c + sign * tl.load(kp + rot, cache_modifier=CACHE).to(tl.float32) * s_
    dst = KV + (slot // T) * s_page + layer * s_layer + (slot % T) * s_tok + h * s_head + di
    tl.store(dst, k.to(KV.dtype.element_ty))
    tl.store(dst + s_sel, tl.load(V + n * v_row + h * v_head + di, cache_modifier=CACHE))


@triton.jit
def paged_attention_kernel(
    Q,
    COS,
    SIN,
    KV,
    PT,
    REQ,
    POS,
    PACC,
    PM,
    PL,
    OUT,
    K,
    V,
    SLOT,
    layer,
    q_row,
    q_head,
    k_row,
    k_head,
    v_row,
    v_head,
    s_page,
    s_layer,
    s_sel,
    s_tok,
    s_head,
    pt_stride,
    SCALE: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    T: tl.constexpr,
    SPLITS: tl.constexpr,
    PPS: tl.constexpr,
    PPSP: tl.constexpr,
    ROPE: tl.constexpr,
    WRITE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One (token, KV head, page group): the group's unnormalized softmax state (m, l, acc);
    with a single group, the normalized output itself (into OUT). `ROPE`: q is rotated here
    (rotate-half with the token's cos/sin), so no kernel materializes it first.
    `WRITE` (decode: every token of its own request): the group holding the token's position
    first writes the token's K/V into its slot, then reads the page after a barrier; no other
    program reads that position, so the separate write kernel is not needed. `PDL` (launched
    as a programmatic dependent): waits for the previous kernel before anything else, then lets
    the next one launch (its own wait covers this kernel's writes)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    n = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    pos = tl.load(POS + n).to(tl.int64)
    r = tl.load(REQ + n).to(tl.int64)
    if WRITE:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if sp == (pos // T) // PPS:
            slot = tl.load(SLOT + n).to(tl.int64)
            if slot >= 0:
                _write_token(K, V, COS, SIN, KV, slot, n, kh, layer, k_row, k_head, v_row, v_head, s_page, s_layer,
                             s_sel, s_tok, s_head, D, T, ROPE, "")  # fmt: skip
            tl.debug_barrier()
    gi = tl.arange(0, GP)
    di = tl.arange(0, D)
    ti = tl.arange(0, T)
    qmask = gi < G
    head = kh * G + gi
    qp = Q + n * q_row + head[:, None] * q_head
    q = _query_rows(qp, qmask, n * D + di[None, :], COS, SIN, di, D, ROPE, KV.dtype.element_ty, "")
    m = tl.full([GP], float("-inf"), tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    base = KV + layer * s_layer + kh * s_head
    first = sp.to(tl.int64) * PPS
    last = tl.minimum(first + PPS, pos // T + 1)
    # The group's page ids in one load (a page's K/V load no longer waits for its id's).
    # Loading each page's K/V while folding in the one before measured no faster on an H100
    # (2026-12-06, sessions 21 and 22) and was removed.
    gi_ = tl.arange(0, PPSP)
    ids = tl.load(PT + r * pt_stride + first + gi_, mask=(first + gi_) < last, other=0).to(tl.int64)
    ids = tl.maximum(ids, 0)
    for j in range(first, last):
        page = tl.sum(tl.where(gi_ == j - first, ids, 0), 0)
        kp = base + page * s_page + ti[:, None] * s_tok + di[None, :]
        m, lsum, acc = _page_step(q, kp, s_sel, j * T, ti, pos, pos, m, lsum, acc, SCALE)
    if SPLITS == 1:
        # Page 0 is always walked, so lsum > 0.
        out = acc / lsum[:, None]
        tl.store(OUT + (n * H + head[:, None]) * D + di[None, :], out.to(OUT.dtype.element_ty), mask=qmask[:, None])
    else:
        at = (n * SPLITS + sp) * H + head
        tl.store(PM + at, m, mask=qmask)
        tl.store(PL + at, lsum, mask=qmask)
        tl.store(PACC + at[:, None] * D + di[None, :], acc, mask=qmask[:, None])


@triton.jit
def paged_prefill_attention_kernel(
    Q,
    COS,
    SIN,
    KV,
    PT,
    REQ,
    POS,
    OUT,
    layer,
    N,
    q_row,
    q_head,
    s_page,
    s_layer,
    s_sel,
    s_tok,
    s_head,
    pt_stride,
    pt_cols,
    SCALE: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    T: tl.constexpr,
    BT: tl.constexpr,
    ROPE: tl.constexpr,
):
    """One (block of BT consecutive tokens of one request, KV head): the block's query rows
    (token-major, the G heads of the KV head each) against each page up to the block's last
    position, so a page is read once per block instead of once per token. Per row it is
    `paged_attention_kernel`'s single-group arithmetic: pages past a row's position are fully
    masked, and a fully masked page leaves the row's state exactly as it was."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    i = tl.arange(0, BT * GP)
    n = b * BT + i // GP
    g = i % GP
    di = tl.arange(0, D)
    ti = tl.arange(0, T)
    valid = (n < N) & (g < G)
    head = kh * G + g
    qp = Q + n.to(tl.int64)[:, None] * q_row + head[:, None] * q_head
    q = _query_rows(qp, valid, n[:, None] * D + di[None, :], COS, SIN, di, D, ROPE, KV.dtype.element_ty, "")
    pos = tl.load(POS + n, mask=valid, other=0).to(tl.int64)
    r = tl.load(REQ + b * BT).to(tl.int64)
    m = tl.full([BT * GP], float("-inf"), tl.float32)
    lsum = tl.zeros([BT * GP], tl.float32)
    acc = tl.zeros([BT * GP, D], tl.float32)
    base = KV + layer * s_layer + kh * s_head
    last = tl.minimum(tl.max(pos, 0) // T + 1, pt_cols)
    for j in range(0, last):
        page = tl.maximum(tl.load(PT + r * pt_stride + j).to(tl.int64), 0)
        kp = base + page * s_page + ti[:, None] * s_tok + di[None, :]
        m, lsum, acc = _page_step(q, kp, s_sel, j * T, ti, pos[:, None], tl.max(pos, 0), m, lsum, acc, SCALE)
    # Page 0 is always walked, so lsum > 0 on every valid row.
    out = acc / lsum[:, None]
    dst = OUT + (n.to(tl.int64)[:, None] * H + head[:, None]) * D + di[None, :]
    tl.store(dst, out.to(OUT.dtype.element_ty), mask=valid[:, None])


@triton.jit
def paged_attention_combine(
    PACC, PM, PL, OUT, POS, H: tl.constexpr, D: tl.constexpr, T: tl.constexpr, PPS: tl.constexpr,
    SPLITS: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """One (token, head): the page groups' states rescaled to their common max and normalized.
    Group 0 always holds the token's first page, so the max is finite. Only the groups up to
    the token's last page are read (one page per group over a long table leaves most groups
    empty); the others enter the reduction as the empty state they hold (m -inf, l and acc 0),
    so the arithmetic is what reading them gave. `PDL`: as `paged_attention_kernel`'s."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    n = tl.program_id(0)
    h = tl.program_id(1)
    si = tl.arange(0, SP)
    di = tl.arange(0, D)
    pos = tl.load(POS + n)
    smask = (si < SPLITS) & (si <= (pos // T) // PPS)
    at = (n * SPLITS + si) * H + h
    m = tl.load(PM + at, mask=smask, other=float("-inf"))
    lsum = tl.load(PL + at, mask=smask, other=0.0)
    mx = tl.max(m, 0)
    w = tl.where(smask, tl.exp(m - mx), 0.0)
    acc = tl.load(PACC + at[:, None] * D + di[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(OUT + (n * H + h) * D + di, out.to(OUT.dtype.element_ty))


@triton.jit
def kv_write_kernel(
    K,
    V,
    COS,
    SIN,
    KV,
    SLOT,
    layer,
    k_row,
    k_head,
    v_row,
    v_head,
    s_page,
    s_layer,
    s_sel,
    s_tok,
    s_head,
    D: tl.constexpr,
    T: tl.constexpr,
    ROPE: tl.constexpr,
):
    """One (token, KV head): K (rotated here when `ROPE`) and V into the token's slot."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SLOT + n).to(tl.int64)
    if slot >= 0:
        _write_token(K, V, COS, SIN, KV, slot, n, h, layer, k_row, k_head, v_row, v_head, s_page, s_layer, s_sel,
                     s_tok, s_head, D, T, ROPE, "")  # fmt: skip
