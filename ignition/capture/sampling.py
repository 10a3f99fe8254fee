"""The sampling step inside every sampling graph: penalties, grammar mask, temperature, top-k,
top-p, min-p, and a counter-based draw. Plain torch ops, so Inductor emits Triton kernels.

Invariants:
- No sort and no generator: top-k and top-p thresholds are found by an exact search over the bit
  patterns of the float32 probabilities (non-negative floats order like their bits), `RADIX_BITS`
  per pass, so ties at a threshold are all kept, never truncated to a candidate count.
- The draw is an exponential race, `argmax(p / E)` with `E = -log(u)`, which samples exactly from
  the kept, renormalized distribution. `u` hashes (seed, counter, token id) only: a request's
  stream does not depend on its batch row, its bucket or its neighbours.
- A row whose grammar mask allows nothing is not sampled; its record says grammar-exhausted.
- Disabled filters are no-ops: top_k <= 0 or >= vocab, top_p >= 1, min_p <= 0.
"""

from __future__ import annotations

import torch

M32 = 0xFFFF_FFFF
# Bits the threshold search settles per pass: 8 gives 4 passes of 255 candidates per filter. The
# measured 4-bit search (8 passes of 15) ran 15 programs per row per pass, 250-285 us of a
# SmolLM2 resume step; fewer, wider passes launch half the kernels. Any divisor of 32 finds the
# same threshold.
RADIX_BITS = 8
# Multipliers below 2^31, so every product of a 32-bit value stays inside int64.
_MIX_A = 0x7FEB_352D
_MIX_B = 0x5BD1_E995
_GOLDEN = 0x9E37_79B9


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) over int64 holding values < 2^32."""
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * _MIX_A) & M32
    x = x ^ (x >> 15)
    x = (x * _MIX_B) & M32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float32 in (0, 1), a function of (seed, counter, token id) per row only."""
    s = seed.long()
    c = counter.long()
    key = mix32((s >> 32) ^ mix32(s ^ mix32((c >> 32) ^ mix32(c + _GOLDEN))))  # [B]
    idx = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    bits = mix32(key[:, None] ^ mix32(idx[None, :] * 2 + 1))
    # 23 bits: (2^23 - 0.5) / 2^23 is exactly representable, so u < 1 and -log(u) > 0.
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _largest_threshold(
    key: torch.Tensor, weight: torch.Tensor | None, target: torch.Tensor, bits: int = RADIX_BITS
) -> torch.Tensor:
    """Per row, the largest t in [0, 2^32) with S(t) >= target, where S(t) counts (or sums
    `weight` over) the entries with key >= t. S is non-increasing and S(0) covers the row,
    so 32 / bits passes of 2^bits - 1 candidates find t exactly."""
    if 32 % bits:
        raise ValueError(f"radix bits {bits} must divide 32")
    lo = torch.zeros(key.shape[0], dtype=torch.int64, device=key.device)
    steps = torch.arange(1, 1 << bits, device=key.device, dtype=torch.int64)
    for shift in range(32 - bits, -1, -bits):
        cand = lo[:, None] + (steps << shift)  # [B, 2^bits - 1]
        hit = key[:, None, :] >= cand[:, :, None]  # [B, 2^bits - 1, V]
        s = hit.sum(-1) if weight is None else (hit * weight[:, None, :]).sum(-1)
        lo = lo + ((s >= target[:, None]).sum(-1) << shift)
    return lo


def expand_mask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, ceil(V/32)] packed allow-bits (int32 holding u32) -> [B, V] bool."""
    idx = torch.arange(vocab, device=words.device, dtype=torch.int64)
    w = words[:, idx >> 5]
    return ((w >> (idx & 31).to(w.dtype)[None, :]) & 1) != 0


def sample(
    logits: torch.Tensor,
    histogram: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    grammar: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [B] int64, allowed [B] bool). `histogram` [B, V] counts earlier tokens."""
    v = logits.shape[1]
    x = logits.float()
    counts = histogram.float()
    seen = histogram > 0
    rp = repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    x = x - presence[:, None] * seen.float() - frequency[:, None] * counts
    allow = expand_mask(grammar, v) if grammar is not None else torch.ones_like(seen)
    allowed = allow.any(-1)
    # A fully masked row keeps finite logits (no NaN); it is reported, not sampled.
    allow = allow | ~allowed[:, None]
    x = torch.where(allow, x / temperature[:, None], float("-inf"))
    p = torch.softmax(x, -1)
    key = p.view(torch.int32).to(torch.int64)
    k = top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k >= v), v, k)
    tk = _largest_threshold(key, None, k)
    in_k = key >= tk[:, None]
    pk = torch.where(in_k, p, 0.0)
    tp = _largest_threshold(key, pk, top_p * pk.sum(-1))
    tp = torch.where(top_p >= 1.0, 0, tp)
    pmax = p.amax(-1)
    keep = in_k & (key >= tp[:, None]) & (p >= (min_p * pmax)[:, None]) & (p > 0)
    e = -torch.log(uniform(seed, counter, v))
    score = torch.where(keep, p / e, -1.0)
    return score.argmax(-1), allowed
