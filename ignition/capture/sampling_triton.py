"""The fused sampler's Triton kernel (`flare::sample`): one program per row, every filter of
`ignition.capture.sampling` in a few passes over the row, disabled filters skipped at run time.

Why a kernel of its own: the torch sampler compiles into ~19 kernels whose threshold searches
compare every entry against 255 candidates per pass whether or not the request asked for the
filter (156 us of a 1.1 ms Qwen3.5 decode step over a 49,152-entry vocabulary). Here a request
with only a temperature costs two passes over its logits.

What it computes (the torch sampler's definition, on unnormalized weights): with x the penalized
logits over temperature (-inf outside the grammar mask) and e_i = exp(x_i - max x), a token is
kept when it is among the top_k largest e (ties at the threshold all kept), inside the top_p
nucleus (W(t) = sum of kept e over e >= t must not drop below top_p times the top-k mass), at
least min_p * max e, and e > 0; the token is argmax over kept i of e_i / E_i, E_i = -log(u_i),
u_i hashing (seed, counter, i) as `sampling.uniform` does. Dividing every e by their sum would
not change any of these decisions, so no pass normalizes.

How (per row, `BLOCK` entries at a time). Passes 1 and 2 run as programs over `CHUNK`-entry
chunks of the row (`flare_sample_max`, `flare_sample_weights`: a row fills as many SMs as it has
chunks instead of one), and `flare_sample`, one program per row, combines what they found (maxima,
integer counts and a first-best: exact whatever the order) and runs the rest:
1. logits -> whether the grammar allows anything, the max over allowed entries (or over all when
   none is: that row is reported, not sampled);
2. logits -> e, stored in the row's scratch; its max; the top byte histogram of e's bit patterns
   (non-negative floats order like their bits). A row without filters draws here and stops;
   so does a top-1 row (its draw is the race among the entries at the max weight). A row
   without top-k also makes its first draw of step 4 here, and sums its top-p mass: every pass
   left to `flare_sample` is then a top-p miss's.
3. top-k: radix select over e's bits, one 256-bin histogram pass per further byte (k = 1 needs
   none: the threshold is max e). The first of these passes runs chunk by chunk too
   (`flare_sample_narrow`) and lists the ids whose top byte is at or above the first digit, a
   superset of the top k; every later pass reads only those. (One program walking a
   128,256-entry row for it took ~170 us on an H100, 2026-12-06.)
4. the draw among e >= L (L from top-k, min-p and e > 0), with the top-k mass for top-p.
5. top-p: the drawn token is inside the nucleus exactly when the mass strictly above it is below
   the target; if it is not, no token at or below it is either, so L moves past it and step 4
   runs again. After `CLIMBS` misses the nucleus threshold is found by bisection over bit
   patterns (at most 31 passes), so the passes per row stay bounded.
Every decision is an exact integer comparison or a float sum in a fixed order: deterministic,
and a row's token does not depend on the other rows.

Each pass keeps running values per lane of the block (maxima, first best scores with their ids,
partial sums) and reduces across lanes once, after its last block. Reducing every block
instead cost a cross-warp reduction per 2,048 entries: on an H100 one pass over 49,152 entries
took ~27 us where its loads need an estimated ~2 us (2026-12-05, before this change).
`flare_sample`'s one program per row reads wider blocks with more warps than the chunked passes:
its passes are a chain of dependent loads (2026-12-06, H100: ~13 us per pass over 49,152 entries
at 2,048, so a nucleus row took 47 us and a top-k/top-p row 86 us against 8.7 without filters).
"""

# mypy: disable-error-code="no-untyped-def"
# Triton reads a kernel's parameter annotations to specialize it (tl.constexpr, dtype names), so
# the pointer and scalar parameters stay unannotated: the one exemption from typing.
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    """`sampling.mix32` on uint32 (its products wrap modulo 2^32 as the masked int64 ones do)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x5BD1E995
    return x ^ (x >> 16)


@triton.jit
def _race_weight(key, idx):
    """E = -log(u) for entries `idx` of the row whose hashed key is `key` (`sampling.uniform`)."""
    bits = _mix32(key ^ _mix32(idx.to(tl.uint32) * 2 + 1))
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(u)


@triton.jit
def _logits_block(logits_ptr, hist_ptr, grammar_ptr, idx, valid, rep, pres, freq, penalized, HAS_GRAMMAR: tl.constexpr):
    """Penalized logits of one block and the grammar's allow bits (the torch sampler's order)."""
    x = tl.load(logits_ptr + idx, mask=valid, other=0.0).to(tl.float32)
    if penalized:
        cnt = tl.load(hist_ptr + idx, mask=valid, other=0)
        seen = cnt > 0
        x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
        x = x - pres * seen.to(tl.float32) - freq * cnt.to(tl.float32)
    if HAS_GRAMMAR:
        words = tl.load(grammar_ptr + (idx >> 5), mask=valid, other=0)
        allow = valid & (((words >> (idx & 31).to(tl.int32)) & 1) != 0)
    else:
        allow = valid
    return x, allow


@triton.jit
def _entries(cand_ptr, n, use_cand, start, offs):
    """Entries start + offs of the row's list: token ids from the candidate list when `use_cand`
    (n of them, in increasing id order), else the ids themselves (n = V)."""
    j = start + offs
    valid = j < n
    idx = tl.where(use_cand, tl.load(cand_ptr + j, mask=valid & use_cand, other=0), j)
    return idx, valid


@triton.jit
def _first_best(best_v, win_v, none):
    """The lanes' running (score, id) pairs reduced once: the highest score, lowest id on ties
    (each lane keeps its first best, and lanes see ids in increasing order)."""
    best = tl.max(best_v, 0)
    return best, tl.min(tl.where(best_v == best, win_v, none), 0)


@triton.jit
def _draw(e_ptr, cand_ptr, n, use_cand, lo, key, BLOCK: tl.constexpr):
    """argmax of e / E over entries with bits(e) >= lo (first id on ties); -1 when none. The
    entries are the candidates when `use_cand` (every entry with bits(e) >= lo must be one).
    Running per-lane maxima, reduced once at the end: no cross-warp reduction per block."""
    offs = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], -1.0, tl.float32)
    win_v = tl.full([BLOCK], -1, tl.int32)
    for start in range(0, n, BLOCK):
        idx, valid = _entries(cand_ptr, n, use_cand, start, offs)
        e = tl.load(e_ptr + idx, mask=valid, other=0.0)
        cand = valid & (e.to(tl.int32, bitcast=True) >= lo)
        # The hash and log cost more than the load: a block without a candidate skips them
        # (after a top-p miss, most blocks of a peaked row).
        if tl.max(cand.to(tl.int32), 0) > 0:
            score = tl.where(cand, e / _race_weight(key, idx), -1.0)
            better = score > best_v
            win_v = tl.where(better, idx, win_v)
            best_v = tl.where(better, score, best_v)
    best, win = _first_best(best_v, win_v, 2147483647)
    return tl.where(best > -1.0, win, -1)


@triton.jit
def _mass_from(e_ptr, cand_ptr, n, use_cand, lo, BLOCK: tl.constexpr):
    """Sum of e over entries with bits(e) >= lo: per-lane sums in id order, then one sum over the
    lanes (over the candidates when `use_cand`, as `_draw`)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        idx, valid = _entries(cand_ptr, n, use_cand, start, offs)
        e = tl.load(e_ptr + idx, mask=valid, other=0.0)
        acc += tl.where(e.to(tl.int32, bitcast=True) >= lo, e, 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _draw_in(e_ptr, cand_ptr, n, use_cand, lo, key, BLOCK: tl.constexpr, CBLOCK: tl.constexpr):
    """`_draw` in CBLOCK-entry blocks over the candidate list (short: a narrow block reduces
    sooner), in BLOCK-entry blocks over the whole row."""
    if use_cand:
        win = _draw(e_ptr, cand_ptr, n, use_cand, lo, key, CBLOCK)
    else:
        win = _draw(e_ptr, cand_ptr, n, use_cand, lo, key, BLOCK)
    return win


@triton.jit
def _mass_in(e_ptr, cand_ptr, n, use_cand, lo, BLOCK: tl.constexpr, CBLOCK: tl.constexpr):
    """`_mass_from` in blocks as `_draw_in` reads them."""
    if use_cand:
        mass = _mass_from(e_ptr, cand_ptr, n, use_cand, lo, CBLOCK)
    else:
        mass = _mass_from(e_ptr, cand_ptr, n, use_cand, lo, BLOCK)
    return mass


@triton.jit
def _row_key(seed_ptr, counter_ptr, r):
    """The row's draw key: `sampling.uniform`'s hash of (seed, counter)."""
    seed = tl.load(seed_ptr + r)
    counter = tl.load(counter_ptr + r)
    c = _mix32(counter.to(tl.uint32) + 0x9E3779B9)
    c = _mix32((counter >> 32).to(tl.uint32) ^ c)
    return _mix32((seed >> 32).to(tl.uint32) ^ _mix32(seed.to(tl.uint32) ^ c))


@triton.jit
def _is_plain(topk_ptr, topp_ptr, minp_ptr, r, V):
    """The row's top-k (0 when off) and whether it asks for no filter at all."""
    top_k = tl.load(topk_ptr + r).to(tl.int32)
    top_k = tl.where((top_k <= 0) | (top_k >= V), 0, top_k)
    plain = (top_k == 0) & (tl.load(topp_ptr + r) >= 1.0) & (tl.load(minp_ptr + r) <= 0.0)
    return top_k, plain


@triton.jit
def _row_inputs(logits_ptr, hist_ptr, hist_rows_ptr, grammar_ptr, temp_ptr, rep_ptr, pres_ptr, freq_ptr, r, ls, hs, gs):
    """Row r's logits, histogram and grammar rows, and its temperature and penalties (with
    whether any penalty applies): what both chunked passes read."""
    temp = tl.load(temp_ptr + r)
    rep = tl.load(rep_ptr + r)
    pres = tl.load(pres_ptr + r)
    freq = tl.load(freq_ptr + r)
    penalized = (rep != 1.0) | (pres != 0.0) | (freq != 0.0)
    hist_ptr += tl.load(hist_rows_ptr + r) * hs
    return logits_ptr + r * ls, hist_ptr, grammar_ptr + r * gs, temp, rep, pres, freq, penalized


@triton.jit
def flare_sample_max(
    logits_ptr,
    hist_ptr,
    hist_rows_ptr,
    grammar_ptr,
    temp_ptr,
    rep_ptr,
    pres_ptr,
    freq_ptr,
    stats_ptr,
    V,
    logits_stride,
    hist_stride,
    grammar_stride,
    CHUNK: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (r, c), pass 1 over entries [c*CHUNK, +CHUNK) of row r: whether any is allowed,
    the max over the allowed ones and over all of them (penalized, over temperature), to
    stats[r, c, 0:3]. Maxima are exact in any order, so the chunks' combine equals one pass."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    logits_ptr, hist_ptr, grammar_ptr, temp, rep, pres, freq, penalized = _row_inputs(
        logits_ptr, hist_ptr, hist_rows_ptr, grammar_ptr, temp_ptr, rep_ptr, pres_ptr, freq_ptr, r,
        logits_stride, hist_stride, grammar_stride,
    )  # fmt: skip
    allowed_v = tl.zeros([BLOCK], tl.int32)
    m_allowed_v = tl.full([BLOCK], float("-inf"), tl.float32)
    m_all_v = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(c * CHUNK, tl.minimum(V, c * CHUNK + CHUNK), BLOCK):
        idx = start + offs
        valid = idx < V
        x, allow = _logits_block(logits_ptr, hist_ptr, grammar_ptr, idx, valid, rep, pres, freq, penalized, HAS_GRAMMAR)
        x = x / temp
        allowed_v = tl.maximum(allowed_v, allow.to(tl.int32))
        m_allowed_v = tl.maximum(m_allowed_v, tl.where(allow, x, float("-inf")))
        m_all_v = tl.maximum(m_all_v, tl.where(valid, x, float("-inf")))
    out = stats_ptr + (r * tl.num_programs(1) + c) * 8
    tl.store(out, tl.max(allowed_v, 0).to(tl.float32))
    tl.store(out + 1, tl.max(m_allowed_v, 0))
    tl.store(out + 2, tl.max(m_all_v, 0))


@triton.jit
def _row_max(stats_ptr, r, S, SMAX: tl.constexpr):
    """The row's pass-1 result from its chunks: (any allowed, the max its weights subtract)."""
    cs = tl.arange(0, SMAX)
    row = stats_ptr + (r * S + cs) * 8
    live = cs < S
    any_allowed = tl.max(tl.load(row, mask=live, other=0.0), 0)
    m_allowed = tl.max(tl.load(row + 1, mask=live, other=float("-inf")), 0)
    m_all = tl.max(tl.load(row + 2, mask=live, other=float("-inf")), 0)
    return any_allowed > 0.0, tl.where(any_allowed > 0.0, m_allowed, m_all)


@triton.jit
def _race_floor(top_k, min_p, m):
    """The least weight bits a row without top-k (or with top-1) races over in pass 2, the
    `lo` of `flare_sample`'s first draw: for top-1 the bits of exp(0), what an entry at the max
    weighs; otherwise any e > 0 (bits >= 1) and, with min-p, at least min_p times exp(0).
    exp(0) is the row's max weight unless exp is not monotone: `flare_sample` checks that and
    otherwise draws itself."""
    top = tl.exp(m - m)
    floor = tl.where(min_p > 0.0, tl.maximum((min_p * top).to(tl.int32, bitcast=True), 1), 1)
    return tl.where(top_k == 1, top.to(tl.int32, bitcast=True), floor)


@triton.jit
def flare_sample_weights(
    logits_ptr,
    hist_ptr,
    hist_rows_ptr,
    grammar_ptr,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    minp_ptr,
    rep_ptr,
    pres_ptr,
    freq_ptr,
    seed_ptr,
    counter_ptr,
    e_ptr,
    stats_ptr,
    wins_ptr,
    counts_ptr,
    V,
    logits_stride,
    hist_stride,
    grammar_stride,
    e_stride,
    CHUNK: tl.constexpr,
    SMAX: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (r, c), pass 2 over the same chunk: e = exp(x - max) with the row's max from every
    chunk's stats; its max to stats[r, c, 3]; for a row without top-k (or with top-1) the
    chunk's best race score over `_race_floor` to stats[r, c, 4] and its first id to wins[r, c],
    and with top-p the chunk's sum of e to stats[r, c, 5]; for any row but a plain one e to its
    scratch and, with top-k > 1, the chunk's top-byte histogram to counts[r, c]. Each value is
    what the one-program pass computes for those entries: the same float operations, entry by
    entry (the sums: per lane in id order, then over the lanes)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    S = tl.num_programs(1)
    offs = tl.arange(0, BLOCK)
    logits_ptr, hist_ptr, grammar_ptr, temp, rep, pres, freq, penalized = _row_inputs(
        logits_ptr, hist_ptr, hist_rows_ptr, grammar_ptr, temp_ptr, rep_ptr, pres_ptr, freq_ptr, r,
        logits_stride, hist_stride, grammar_stride,
    )  # fmt: skip
    e_ptr += r * e_stride
    top_k, plain = _is_plain(topk_ptr, topp_ptr, minp_ptr, r, V)
    key = _row_key(seed_ptr, counter_ptr, r)
    any_allowed, m = _row_max(stats_ptr, r, S, SMAX)
    raced = top_k <= 1
    massed = (top_k == 0) & (tl.load(topp_ptr + r) < 1.0)
    floor = _race_floor(top_k, tl.load(minp_ptr + r), m)
    e_max_v = tl.zeros([BLOCK], tl.float32)
    mass_v = tl.zeros([BLOCK], tl.float32)
    counts = tl.zeros((256,), tl.int32)
    best_v = tl.full([BLOCK], -1.0, tl.float32)
    win_v = tl.zeros([BLOCK], tl.int32)
    for start in range(c * CHUNK, tl.minimum(V, c * CHUNK + CHUNK), BLOCK):
        idx = start + offs
        valid = idx < V
        x, allow = _logits_block(logits_ptr, hist_ptr, grammar_ptr, idx, valid, rep, pres, freq, penalized, HAS_GRAMMAR)
        allow = allow | (valid & (not any_allowed))
        e = tl.where(allow, tl.exp(x / temp - m), 0.0)
        e_max_v = tl.maximum(e_max_v, e)
        if raced:
            score = tl.where(e.to(tl.int32, bitcast=True) >= floor, e / _race_weight(key, idx), -1.0)
            better = score > best_v
            win_v = tl.where(better, idx, win_v)
            best_v = tl.where(better, score, best_v)
        if massed:
            mass_v += e
        if not plain:  # (a raced row keeps its weights too, for the filters and the fallback)
            tl.store(e_ptr + idx, e, mask=valid)
            if top_k > 1:
                counts += tl.histogram(e.to(tl.int32, bitcast=True) >> 24, 256, mask=valid)
    out = stats_ptr + (r * S + c) * 8
    tl.store(out + 3, tl.max(e_max_v, 0))
    if massed:
        tl.store(out + 5, tl.sum(mass_v, 0))
    if raced:
        best, win = _first_best(best_v, win_v, V)
        tl.store(out + 4, best)
        tl.store(wins_ptr + r * S + c, win)
    elif top_k > 1:
        tl.store(counts_ptr + (r * S + c) * 256 + tl.arange(0, 256), counts)


@triton.jit
def flare_sample_narrow(
    topk_ptr,
    topp_ptr,
    minp_ptr,
    e_ptr,
    cand_ptr,
    counts_ptr,
    counts1_ptr,
    V,
    e_stride,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (r, c), for a row with top-k > 1, after pass 2: the radix select's first digit
    from every chunk's top-byte histogram (as `flare_sample` finds it), then this chunk's ids
    whose top byte is at or above it listed into the row's candidates at the chunk's offset (the
    earlier chunks' counts at or above the digit: the list is in id order, as one pass would
    write it), and the second-byte histogram of the ids at the digit to counts1[r, c]."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    S = tl.num_programs(1)
    top_k = _is_plain(topk_ptr, topp_ptr, minp_ptr, r, V)[0]
    if top_k > 1:
        bins = tl.arange(0, 256)
        total = tl.zeros((256,), tl.int32)
        before = tl.zeros((256,), tl.int32)
        for ci in range(0, S):
            h = tl.load(counts_ptr + (r * S + ci) * 256 + bins)
            total += h
            before += tl.where(ci < c, h, 0)
        at_or_above = tl.sum(total, 0) - tl.cumsum(total, 0) + total
        digit = tl.max(tl.where(at_or_above >= top_k, bins, -1), 0)
        listed = tl.sum(tl.where(bins >= digit, before, 0), 0)
        e_ptr += r * e_stride
        cand_ptr += r * e_stride
        offs = tl.arange(0, BLOCK)
        counts1 = tl.zeros((256,), tl.int32)
        for start in range(c * CHUNK, tl.minimum(V, c * CHUNK + CHUNK), BLOCK):
            idx = start + offs
            valid = idx < V
            bits = tl.load(e_ptr + idx, mask=valid, other=0.0).to(tl.int32, bitcast=True)
            keep = valid & ((bits >> 24) >= digit)
            at = listed + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(cand_ptr + at, idx, mask=keep)
            listed += tl.sum(keep.to(tl.int32), 0)
            counts1 += tl.histogram((bits >> 16) & 255, 256, mask=valid & ((bits >> 24) == digit))
        tl.store(counts1_ptr + (r * S + c) * 256 + bins, counts1)


@triton.jit
def flare_sample(
    topk_ptr,
    topp_ptr,
    minp_ptr,
    seed_ptr,
    counter_ptr,
    e_ptr,
    cand_ptr,
    tok_ptr,
    allowed_ptr,
    stats_ptr,
    wins_ptr,
    counts_ptr,
    counts1_ptr,
    V,
    S,
    e_stride,
    SMAX: tl.constexpr,
    BLOCK: tl.constexpr,
    CBLOCK: tl.constexpr,
    CLIMBS: tl.constexpr,
):
    """Program r, after `flare_sample_max` and `flare_sample_weights` over row r's S chunks:
    their results combined (maxima and integer counts: exact in any order; the plain row's
    draw: the highest chunk score, lowest id on ties, as one pass's lanes reduce), then the
    filters over the row's scratch."""
    r = tl.program_id(0).to(tl.int64)
    e_ptr += r * e_stride
    cand_ptr += r * e_stride  # [B, V] int32, laid out as the weights' scratch
    top_k, plain = _is_plain(topk_ptr, topp_ptr, minp_ptr, r, V)
    top_p = tl.load(topp_ptr + r)
    min_p = tl.load(minp_ptr + r)
    key = _row_key(seed_ptr, counter_ptr, r)
    any_allowed, m = _row_max(stats_ptr, r, S, SMAX)
    tl.store(allowed_ptr + r, any_allowed)
    cs = tl.arange(0, SMAX)
    live = cs < S
    row = stats_ptr + (r * S + cs) * 8
    e_max = tl.max(tl.load(row + 3, mask=live, other=0.0), 0)
    win = tl.full([], 0, tl.int32)
    # Pass 2 raced over `_race_floor`, which is this row's `lo` when the max weight is exp(0).
    as_raced = e_max.to(tl.int32, bitcast=True) == tl.exp(m - m).to(tl.int32, bitcast=True)
    # A top-1 row keeps exactly the entries at the max weight, and min-p (at most 1) and top-p
    # (the mass above a max entry is 0) keep all of them: pass 2's race over them is its draw.
    top1 = (top_k == 1) & (min_p <= 1.0) & (top_p > 0.0)
    raced = plain | (top1 & as_raced)
    # Without top-k, pass 2's race is the first draw (step 4), and its sums the top-p mass.
    first = raced | ((top_k == 0) & ((min_p <= 0.0) | as_raced))
    if first:
        chunk_best = tl.load(row + 4, mask=live, other=-2.0)
        wins = tl.load(wins_ptr + r * S + cs, mask=live, other=V)
        win = tl.min(tl.where(chunk_best == tl.max(chunk_best, 0), wins, V), 0)
        win = tl.where(tl.max(chunk_best, 0) > -1.0, win, -1)  # as `_draw` reports none
    counts = tl.zeros((256,), tl.int32)
    if top_k > 1:
        for ci in range(0, S):
            counts += tl.load(counts_ptr + (r * S + ci) * 256 + tl.arange(0, 256))
    if not raced:
        tl.debug_barrier()
        # 3. Top-k threshold: the k-th largest bit pattern, one byte per level. The second
        # level's pass ran chunk by chunk (`flare_sample_narrow`), listing the ids whose top byte
        # is at or above the first digit (in id order): every entry at or above the threshold is
        # among them, so the later passes read only those.
        tk = 0
        n = V
        use_cand = tl.full([], False, tl.int1)
        if top_k == 1:
            tk = e_max.to(tl.int32, bitcast=True)
        elif top_k > 1:
            bins = tl.arange(0, 256)
            need = top_k
            for level in tl.static_range(4):
                shift = 24 - 8 * level
                if level == 1:
                    n = tl.sum(tl.where(bins >= (tk >> 24), counts, 0), 0)  # what the chunks listed
                    counts = tl.zeros((256,), tl.int32)
                    for ci in range(0, S):
                        counts += tl.load(counts1_ptr + (r * S + ci) * 256 + bins)
                    use_cand = tl.full([], True, tl.int1)
                elif level > 1:
                    counts = tl.zeros((256,), tl.int32)
                    for start in range(0, n, CBLOCK):
                        idx, valid = _entries(cand_ptr, n, use_cand, start, tl.arange(0, CBLOCK))
                        bits = tl.load(e_ptr + idx, mask=valid, other=0.0).to(tl.int32, bitcast=True)
                        match = valid & ((bits >> (shift + 8)) == (tk >> (shift + 8)))
                        counts += tl.histogram((bits >> shift) & 255, 256, mask=match)
                at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
                digit = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
                need -= tl.sum(tl.where(bins > digit, counts, 0), 0)
                tk = tk | (digit << shift)
        # 4. The draw among e >= lo; 5. top-p by climbing past drawn tokens outside the nucleus.
        lo = tl.maximum(tk, 1)
        if min_p > 0.0:
            lo = tl.maximum(lo, (min_p * e_max).to(tl.int32, bitcast=True))
        target = 0.0
        if top_p < 1.0:
            if top_k == 0:  # the mass of the whole row, summed in pass 2 chunk by chunk
                target = top_p * tl.sum(tl.load(row + 5, mask=live, other=0.0), 0)
            else:
                target = top_p * _mass_in(e_ptr, cand_ptr, n, use_cand, tk, BLOCK, CBLOCK)
        if not first:
            win = _draw_in(e_ptr, cand_ptr, n, use_cand, lo, key, BLOCK, CBLOCK)
        misses = 0
        go = (top_p < 1.0) & (win >= 0)
        while go:
            past = tl.load(e_ptr + win).to(tl.int32, bitcast=True) + 1
            if _mass_in(e_ptr, cand_ptr, n, use_cand, past, BLOCK, CBLOCK) < target:
                go = False
            else:
                lo = past
                misses += 1
                if misses >= CLIMBS:
                    # W(lo) >= target (the nucleus threshold is at or past lo), W(hi) = 0.
                    hi = e_max.to(tl.int32, bitcast=True) + 1
                    while hi - lo > 1:
                        mid = lo + (hi - lo) // 2
                        if _mass_in(e_ptr, cand_ptr, n, use_cand, mid, BLOCK, CBLOCK) >= target:
                            lo = mid
                        else:
                            hi = mid
                    go = False
                win = _draw_in(e_ptr, cand_ptr, n, use_cand, lo, key, BLOCK, CBLOCK)
                go = go & (win >= 0)
    tl.store(tok_ptr + r, tl.maximum(win, 0).to(tl.int64))
