"""Runs the GDN kernels (convolution and delta rule, decode and prefill) under Triton's CPU
interpreter (float32) against the torch references of `ignition.capture.gdn`: outputs, the state
written back to live rows at the consumed length, padding lanes that write nothing, rows nobody
named left untouched. Prints one JSON line; exit 1 on a mismatch.
Needs TRITON_INTERPRET=1 in the environment before Triton is imported."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import torch

from ignition.capture import gdn

gen = torch.Generator().manual_seed(0)
R, C, K = 4, 40, 4  # rows (0 is the null row), channels (not a block multiple), kernel width
hk, hv, dk, dv = 2, 4, 16, 24  # value block 16: a partial last block
worst = 0.0
exact = True


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


# -- convolution, decode: lanes on rows 2, padding, 1 --------------------------------------------
w = torch.randn(C, K, generator=gen)
hist = torch.randn(R, C, K - 1, generator=gen)
before = hist.clone()
rows = torch.tensor([2, -1, 1], dtype=torch.int32)
x = torch.randn(3, C, generator=gen)
y = gdn.conv_step(x, hist, rows, w, block=16)
for lane, row in enumerate(rows.tolist()):
    src = before[max(row, 0)]
    want, new = gdn.conv_reference(x[lane : lane + 1], src, w)
    worst = max(worst, err(y[lane : lane + 1], want))
    if row >= 0:
        exact &= torch.equal(hist[row], new)
exact &= torch.equal(hist[0], before[0]) and torch.equal(hist[3], before[3])

# -- convolution, prefill: 7 tokens, lengths 5, 1 (inside the old history) and 0 ------------------
for length in (5, 1, 0):
    hist = torch.randn(R, C, K - 1, generator=gen)
    before = hist.clone()
    xs = torch.randn(7, C, generator=gen)
    y = gdn.conv_prefill(xs, hist, torch.tensor([3], dtype=torch.int32), torch.tensor([length], dtype=torch.int32), w)
    want, new = gdn.conv_reference(xs, before[3], w, length)
    worst = max(worst, err(y, want))
    exact &= torch.equal(hist[3], new) and torch.equal(hist[:3], before[:3])
# Several token blocks (70 tokens in blocks of 16), the history after 45 of them.
hist = torch.randn(R, C, K - 1, generator=gen)
before = hist.clone()
xs = torch.randn(70, C, generator=gen)
forty_five = torch.tensor([45], dtype=torch.int32)
y = gdn.conv_prefill(xs, hist, torch.tensor([1], dtype=torch.int32), forty_five, w, block=16, tokens=16)
want, new = gdn.conv_reference(xs, before[1], w, 45)
worst = max(worst, err(y, want))
exact &= torch.equal(hist[1], new) and torch.equal(hist[[0, 2, 3]], before[[0, 2, 3]])
# A padded prefill (row -1) writes nothing.
hist = torch.randn(R, C, K - 1, generator=gen)
before = hist.clone()
gdn.conv_prefill(xs, hist, torch.tensor([-1], dtype=torch.int32), torch.tensor([7], dtype=torch.int32), w)
exact &= torch.equal(hist, before)


def operands(t: int) -> tuple[torch.Tensor, ...]:
    qkv = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen)  # q/k/v as strided views of one projection
    q = qkv[:, : hk * dk].view(t, hk, dk)
    k = qkv[:, hk * dk : 2 * hk * dk].view(t, hk, dk)
    v = qkv[:, 2 * hk * dk :].view(t, hv, dv)
    g = -torch.rand(t, hv, generator=gen)
    beta = torch.rand(t, hv, generator=gen)
    return q, k, v, g, beta


# -- delta rule, decode ---------------------------------------------------------------------------
state = torch.randn(R, hv, dk, dv, generator=gen) * 0.1
before = state.clone()
q, k, v, g, beta = operands(3)
o = gdn.delta_rule_step(state, rows, q, k, v, g, beta, block_v=16)
state_err = 0.0
for lane, row in enumerate(rows.tolist()):
    want, new = gdn.delta_rule_reference(
        before[max(row, 0)],
        q[lane : lane + 1],
        k[lane : lane + 1],
        v[lane : lane + 1],
        g[lane : lane + 1],
        beta[lane : lane + 1],
    )
    worst = max(worst, err(o[lane : lane + 1], want))
    if row >= 0:
        state_err = max(state_err, err(state[row], new))
exact &= torch.equal(state[0], before[0]) and torch.equal(state[3], before[3])

# -- delta rule, prefill: 9 tokens, 6 real ------------------------------------------------------------
state = torch.randn(R, hv, dk, dv, generator=gen) * 0.1
before = state.clone()
q, k, v, g, beta = operands(9)
one = torch.tensor([2], dtype=torch.int32)
o = gdn.delta_rule_prefill(state, one, torch.tensor([6], dtype=torch.int32), q, k, v, g, beta, block_v=16)
want, new = gdn.delta_rule_reference(before[2], q, k, v, g, beta, 6)
worst = max(worst, err(o, want))
state_err = max(state_err, err(state[2], new))
exact &= torch.equal(state[[0, 1, 3]], before[[0, 1, 3]]) and bool((o[6:] == 0).all())

# -- split vs whole: 10 tokens at once, or 6 then 4 continued from the stored state -----------------
q, k, v, g, beta = operands(10)
whole = torch.zeros(R, hv, dk, dv)
split = torch.zeros(R, hv, dk, dv)
ten, six, four = (torch.tensor([n], dtype=torch.int32) for n in (10, 6, 4))
o_whole = gdn.delta_rule_prefill(whole, one, ten, q, k, v, g, beta, block_v=16)
o_a = gdn.delta_rule_prefill(split, one, six, q[:6], k[:6], v[:6], g[:6], beta[:6], block_v=16)
o_b = gdn.delta_rule_prefill(split, one, four, q[6:], k[6:], v[6:], g[6:], beta[6:], block_v=16)
split_bitwise = torch.equal(whole, split) and torch.equal(o_whole, torch.cat([o_a, o_b]))

# -- delta rule, chunked prefill (chunks of 16, products over key blocks of 16 or 8): lengths across
#    chunk boundaries, 0, padding
chunked_err = 0.0
for t, n, block_k in ((40, 40, 16), (40, 23, 8), (40, 16, 16), (40, 0, 8), (9, 1, 16)):
    state = torch.randn(R, hv, dk, dv, generator=gen) * 0.1
    before = state.clone()
    q, k, v, g, beta = operands(t)
    real = torch.tensor([n], dtype=torch.int32)
    o = gdn.delta_rule_prefill_chunked(state, one, real, q, k, v, g, beta, chunk=16, block_v=16, block_k=block_k)
    want, new = gdn.delta_rule_reference(before[2], q, k, v, g, beta, n)
    chunked_err = max(chunked_err, err(o, want), err(state[2], new))
    exact &= torch.equal(state[[0, 1, 3]], before[[0, 1, 3]]) and bool((o[n:] == 0).all())
state = torch.randn(R, hv, dk, dv, generator=gen)
before = state.clone()
q, k, v, g, beta = operands(20)
twenty = torch.tensor([20], dtype=torch.int32)
gdn.delta_rule_prefill_chunked(state, torch.tensor([-1], dtype=torch.int32), twenty, q, k, v, g, beta, chunk=16)
exact &= torch.equal(state, before)
# Split (23 then 17) against whole (40): not bitwise (other chunk boundaries), within rounding.
q, k, v, g, beta = operands(40)
whole, split = torch.zeros(R, hv, dk, dv), torch.zeros(R, hv, dk, dv)
o_w = gdn.delta_rule_prefill_chunked(
    whole, one, torch.tensor([40], dtype=torch.int32), q, k, v, g, beta, chunk=16, block_v=16
)
parts = []
for lo, hi in ((0, 23), (23, 40)):
    part = torch.tensor([hi - lo], dtype=torch.int32)
    sl = slice(lo, hi)
    parts.append(
        gdn.delta_rule_prefill_chunked(split, one, part, q[sl], k[sl], v[sl], g[sl], beta[sl], chunk=16, block_v=16)
    )
chunked_split_err = max(err(whole, split), err(o_w, torch.cat(parts)))

# -- speculative lanes: 3 per request; slot rows 1-3 and 4-6 (columns), row 7 a snapshot ------------
# Request 0 uses all 3 lanes, request 1 two (lane 5 unused), lane 6 a partial padding group. Each
# lane must be bitwise the decode kernel's step from the column before it, into its own column.
W = 3
lane_rows = torch.tensor([1, 1, 1, 4, 4, -1, -1], dtype=torch.int32)


def decoded_columns(emul: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
    """Each used lane (as a slice) with its column row, after the column before it was copied
    into that column in `emul`: the state a decode step there starts from."""
    for lane, row in enumerate(lane_rows.tolist()):
        if row < 0:
            continue
        j = lane % W
        if j:
            emul[row + j] = emul[row + j - 1]
        yield slice(lane, lane + 1), torch.tensor([row + j], dtype=torch.int32)


hist = torch.randn(8, C, K - 1, generator=gen)
before = hist.clone()
x = torch.randn(7, C, generator=gen)
y = gdn.conv_step(x, hist, lane_rows, w, block=16, lanes=W)
emul = before.clone()
verify_bitwise = True
for sl, column in decoded_columns(emul):
    verify_bitwise &= torch.equal(y[sl], gdn.conv_step(x[sl], emul, column, w, block=16))
verify_bitwise &= torch.equal(hist, emul)  # columns as decoding left them; rows 0, 6, 7 untouched
state = torch.randn(8, hv, dk, dv, generator=gen) * 0.1
before = state.clone()
q, k, v, g, beta = operands(7)
o = gdn.delta_rule_step(state, lane_rows, q, k, v, g, beta, block_v=16, lanes=W)
emul = before.clone()
for sl, column in decoded_columns(emul):
    o_dec = gdn.delta_rule_step(emul, column, q[sl], k[sl], v[sl], g[sl], beta[sl], block_v=16)
    verify_bitwise &= torch.equal(o[sl], o_dec)
verify_bitwise &= torch.equal(state, emul)
# Commit: request 0 accepted its last lane (column 3), request 1 lane 0 (nothing to copy), a padded
# one; 200 bytes in blocks of 16 words (four blocks, the last partial), a 40-wide carried vector.
raw = torch.randint(0, 256, (8, 256), generator=gen, dtype=torch.uint8)
before = raw.clone()
xs = torch.randn(3, 40, generator=gen)
live, accepted = torch.tensor([1, 4, -1], dtype=torch.int32), torch.tensor([W - 1, 0, 1], dtype=torch.int32)
out = gdn.commit_columns(raw, live, accepted, 200, xs, block=16)
want = before.clone()
want[1, :200] = before[3, :200]
commit_exact = torch.equal(raw, want) and torch.equal(out, xs)

report = {"max_abs_err": worst, "state_max_abs_err": state_err, "exact_state_and_padding": exact}
report["verify_lanes_bitwise_decode"] = bool(verify_bitwise)
report["commit_exact"] = bool(commit_exact)
report["split_bitwise"] = split_bitwise
report["chunked_max_abs_err"] = chunked_err
report["chunked_split_vs_whole_max_abs_err"] = chunked_split_err
print(json.dumps(report))
ok = worst < 1e-5 and state_err < 1e-5 and exact and split_bitwise and verify_bitwise and commit_exact
sys.exit(0 if ok and chunked_err < 1e-5 and chunked_split_err < 1e-5 else 1)
