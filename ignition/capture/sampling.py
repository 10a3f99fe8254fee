"""The sampling step inside every sampling graph: penalties, grammar mask, temperature, top-k,
top-p, min-p, and a counter-based draw. `sample` is the definition, in plain torch ops (Inductor
compiles it; CPU runs use it); `flare::sample` (`Sampler` with the kernel on, `--sampler kernel`)
makes the same decisions in three Triton kernels (`sampling_triton`).

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

import functools
from typing import TYPE_CHECKING, Any

import torch

from ignition.capture.fallback import declare

if TYPE_CHECKING:
    from torch._library.custom_ops import CustomOpDef

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


_T = torch.Tensor
RowParameters = tuple[_T, _T, _T, _T, _T, _T, _T, _T, _T]


def parameters(p: dict[str, torch.Tensor]) -> RowParameters:
    """`sample`'s per-row parameters after the logits and the histogram, in order (the grammar
    mask follows them), from a mapping that names them as `sample` does."""
    return (
        p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["repetition"], p["presence"], p["frequency"],
        p["seed"], p["counter"],
    )  # fmt: skip


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


# ---------------------------------------------------------------------------------------------
# The fused sampler (`flare::sample`, `sampling_triton.flare_sample`)

# Entries per step of the kernel's passes, and its warps: one program per row reads the row a
# block at a time (a 2,048-entry block of float32 is 8 KiB in flight per pass).
KERNEL_BLOCK = 2048
KERNEL_WARPS = 8
# The same for `flare_sample`'s one program per row (the filters' passes after the chunked
# ones): wider blocks keep more loads in flight, 32 KiB per step. Compiled for sm_90 (Triton
# 3.9), 8,192 entries on 16 warps use 128 registers and no stack; 16,384 spill, and so did
# 2,048 on 8 warps (16 bytes per thread).
FINAL_BLOCK = 8192
FINAL_WARPS = 16
# The same program's block over a top-k row's candidate list (the ids past the first radix
# digit: tens to a few thousand): at 128,256 entries on an H100 a top-k row took 32 us at
# 2,048/8 and 42 us at 8,192/16 while a nucleus row (whole-row passes) took 34 and 25 us
# (2026-12-06); narrow blocks for the list, wide ones for the row.
CAND_BLOCK = 2048
# Entries per program of the first two passes (a multiple of the block): a 49,152-entry row runs
# on 12 programs where one program read it all (46 us of a ~1B decode step, 2026-12-06).
KERNEL_CHUNK = 4096
# Top-p misses the kernel climbs past before it bisects for the nucleus threshold.
CLIMBS = 3


@functools.cache
def _kernel() -> Any:  # a triton.JITFunction (Triton ships no type information)
    from ignition.capture.sampling_triton import flare_sample

    return flare_sample


@functools.cache
def _max_kernel() -> Any:
    from ignition.capture.sampling_triton import flare_sample_max

    return flare_sample_max


@functools.cache
def _weights_kernel() -> Any:
    from ignition.capture.sampling_triton import flare_sample_weights

    return flare_sample_weights


@functools.cache
def _narrow_kernel() -> Any:
    from ignition.capture.sampling_triton import flare_sample_narrow

    return flare_sample_narrow


def launch(
    logits: torch.Tensor,
    histogram: torch.Tensor,
    hist_rows: torch.Tensor,
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
    block: int = KERNEL_BLOCK,
    climbs: int = CLIMBS,
    chunk: int = KERNEL_CHUNK,
    final_block: int = FINAL_BLOCK,
    final_warps: int = FINAL_WARPS,
    cand_block: int = CAND_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `flare::sample` runs: `sample` over `histogram[hist_rows]` without gathering it.
    Four launches: the first two passes over `chunk`-entry chunks of every row, the top-k rows'
    first candidate listing over the same chunks, then one program per row; a row's scratch
    (`[B, V]` float32) holds its unnormalized weights, and a `[B, V]` int32 one the ids a top-k
    row's later passes read.
    `block`, `climbs`, `chunk`, `final_block`, `final_warps` and `cand_block` change the passes,
    never the token (the tests vary them)."""
    if chunk <= 0 or chunk % block:
        raise ValueError(f"sample: chunk {chunk} is not a positive multiple of the block {block}")
    b, v = logits.shape
    if histogram.dim() != 2 or histogram.shape[1] != v or histogram.stride(1) != 1:
        raise ValueError(f"sample: histogram {tuple(histogram.shape)} does not match logits {tuple(logits.shape)}")
    if grammar is not None and (grammar.shape[0] != b or grammar.shape[1] * 32 < v):
        raise ValueError(f"sample: grammar mask {tuple(grammar.shape)} does not cover {b} rows of {v}")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    tok = torch.empty(b, dtype=torch.int64, device=logits.device)
    allowed = torch.empty(b, dtype=torch.bool, device=logits.device)
    if b == 0:
        return tok, allowed
    scratch = torch.empty(b, v, dtype=torch.float32, device=logits.device)
    candidates = torch.empty(b, v, dtype=torch.int32, device=logits.device)
    words = grammar.contiguous() if grammar is not None else scratch

    def f32(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32).contiguous()

    chunks = -(-v // chunk)
    smax = max(2, 1 << (chunks - 1).bit_length())
    # Per (row, chunk): pass 1's any-allowed and maxima, pass 2's max weight and best score
    # (float32, 8 slots), the best's id, and a top-k row's 256-bin histogram.
    stats = torch.empty(b, chunks, 8, dtype=torch.float32, device=logits.device)
    wins = torch.empty(b, chunks, dtype=torch.int32, device=logits.device)
    counts = torch.empty(b, chunks, 256, dtype=torch.int32, device=logits.device)
    counts1 = torch.empty(b, chunks, 256, dtype=torch.int32, device=logits.device)  # the second byte's
    rows = hist_rows.to(torch.int64).contiguous()
    temp, top_k32 = f32(temperature), top_k.to(torch.int32).contiguous()
    tp, mp = f32(top_p), f32(min_p)
    rep, pres, freq = f32(repetition), f32(presence), f32(frequency)
    seeds, counters = seed.to(torch.int64).contiguous(), counter.to(torch.int64).contiguous()
    strides = (logits.stride(0), histogram.stride(0), words.stride(0))
    flags = {"HAS_GRAMMAR": grammar is not None, "BLOCK": block, "num_warps": KERNEL_WARPS}
    _max_kernel()[(b, chunks)](
        logits, histogram, rows, words, temp, rep, pres, freq, stats, v, *strides, CHUNK=chunk, **flags
    )
    _weights_kernel()[(b, chunks)](
        logits, histogram, rows, words, temp, top_k32, tp, mp, rep, pres, freq, seeds, counters, scratch, stats,
        wins, counts, v, *strides, scratch.stride(0), CHUNK=chunk, SMAX=smax, **flags,
    )  # fmt: skip
    _narrow_kernel()[(b, chunks)](
        top_k32, tp, mp, scratch, candidates, counts, counts1, v, scratch.stride(0), CHUNK=chunk, BLOCK=block,
        num_warps=KERNEL_WARPS,
    )  # fmt: skip
    _kernel()[(b,)](
        top_k32, tp, mp, seeds, counters, scratch, candidates, tok, allowed, stats, wins, counts, counts1, v, chunks,
        scratch.stride(0), SMAX=smax, BLOCK=final_block, CBLOCK=cand_block, CLIMBS=climbs, num_warps=final_warps,
    )  # fmt: skip
    return tok, allowed


@functools.cache
def sample_op() -> CustomOpDef:
    """`flare::sample`: the sampler as one opaque op (four kernels instead of ~19)."""
    from torch.library import custom_op

    @custom_op("flare::sample", mutates_args=())
    def sample_kernel(
        logits: torch.Tensor,
        histogram: torch.Tensor,
        hist_rows: torch.Tensor,
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
        return launch(
            logits,
            histogram,
            hist_rows,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition,
            presence,
            frequency,
            seed,
            counter,
            grammar,
        )

    @sample_kernel.register_fake
    def _(logits: torch.Tensor, *_: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b = logits.shape[0]
        return (
            torch.empty(b, dtype=torch.int64, device=logits.device),
            torch.empty(b, dtype=torch.bool, device=logits.device),
        )

    return declare(sample_kernel)


class Sampler:
    """The sampling step of a prepared forward: `flare::sample` when the kernel is on, else the
    torch definition (`sample`; every CPU run, and cores prepared with `--sampler torch`)."""

    def __init__(self, kernel: bool) -> None:
        # Created before tracing (Dynamo does not trace its creation).
        self.op = sample_op() if kernel else None

    def __call__(
        self,
        logits: torch.Tensor,
        histogram: torch.Tensor,
        hist_rows: torch.Tensor,
        s: dict[str, torch.Tensor],
        counter: torch.Tensor,
        grammar: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples row i of `logits` with the penalty histogram `histogram[hist_rows[i]]` and the
        values `s[name][i]` (the step's sampling inputs), drawing with `counter`."""
        args = (
            s["temperature"],
            s["top_k"],
            s["top_p"],
            s["min_p"],
            s["repetition_penalty"],
            s["presence_penalty"],
            s["frequency_penalty"],
            s["rng_seed"],
            counter,
            grammar,
        )
        if self.op is not None:
            out: tuple[torch.Tensor, torch.Tensor] = self.op(logits, histogram, hist_rows, *args)
            return out
        return sample(logits, histogram[hist_rows], *args)
