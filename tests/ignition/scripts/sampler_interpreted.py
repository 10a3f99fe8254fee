"""Runs the fused sampler (`flare::sample`'s kernel) under Triton's CPU interpreter against the
torch definition (`ignition.capture.sampling.sample`): random logits (float32 and bfloat16) with
every filter, penalty and grammar mix, ties at the top-k threshold, fully masked rows, the top-p
climb and its bisection, the histogram rows given by index. Also checks that a row's token does
not depend on the rows launched with it, nor on the block size, the climb limit or the chunking. Prints one
JSON line; exit 1 on a mismatch. Needs TRITON_INTERPRET=1 before Triton is imported."""

from __future__ import annotations

import json
import sys

import torch
from torch._inductor.utils import run_and_get_code

from ignition.capture.sampling import (
    CAND_BLOCK,
    CLIMBS,
    FINAL_BLOCK,
    KERNEL_BLOCK,
    KERNEL_CHUNK,
    Sampler,
    launch,
    parameters,
    sample,
)

gen = torch.Generator().manual_seed(0)
mismatches: list[str] = []
cases = 0
climb_paths = 0


def params(b: int, v: int) -> dict[str, torch.Tensor]:
    def pick(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)[torch.randint(len(values), (b,), generator=gen)]

    return {
        "temperature": pick([0.3, 0.7, 1.0, 1.5]),
        "top_k": pick([0, -1, 1, 2, 5, 40, v, v + 3], torch.int32),
        "top_p": pick([1.0, 0.95, 0.8, 0.5, 0.1, 0.01]),
        "min_p": pick([0.0, 0.0, 0.05, 0.3]),
        "repetition": pick([1.0, 1.0, 1.3, 0.8]),
        "presence": pick([0.0, 0.0, 0.5, -1.0]),
        "frequency": pick([0.0, 0.0, 0.2]),
        "seed": torch.randint(-(2**62), 2**62, (b,), generator=gen),
        "counter": torch.randint(0, 2**40, (b,), generator=gen),
    }


def run(
    logits: torch.Tensor,
    hist: torch.Tensor,
    rows: torch.Tensor,
    p: dict[str, torch.Tensor],
    grammar: torch.Tensor | None,
    block: int = KERNEL_BLOCK,
    climbs: int = CLIMBS,
    chunk: int = KERNEL_CHUNK,
    final_block: int = FINAL_BLOCK,
    cand_block: int = CAND_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    return launch(
        logits, hist, rows, *parameters(p), grammar, block=block, climbs=climbs, chunk=chunk, final_block=final_block,
        cand_block=cand_block,
    )  # fmt: skip


def check(name: str, logits: torch.Tensor, p: dict[str, torch.Tensor], grammar: torch.Tensor | None) -> None:
    global cases
    b, v = logits.shape
    hist = torch.randint(0, 3, (b + 2, v), generator=gen, dtype=torch.int32) * (
        torch.rand(b + 2, v, generator=gen) < 0.05
    )
    rows = torch.randperm(b + 2, generator=gen)[:b]
    want, want_ok = sample(logits, hist[rows], *parameters(p), grammar)
    got, ok = run(logits, hist, rows, p, grammar)
    cases += b
    if not (torch.equal(got, want) and torch.equal(ok, want_ok)):
        bad = (got != want).nonzero().flatten().tolist()
        mismatches.append(f"{name}: rows {bad} got {got[bad].tolist()} want {want[bad].tolist()}")
    # The same rows alone, reversed, with other block sizes, climb limit and chunking (one
    # chunk for the whole row, many, and a last partial one): the same tokens.
    for block, climbs, chunk, final, cand in (
        (512, CLIMBS, 512, 512, 16),
        (KERNEL_BLOCK, 0, 8192, KERNEL_BLOCK, 8192),
        (KERNEL_BLOCK, 1, 2048, 16384, 256),
        (1024, 64, 3072, 1024, 1024),
    ):
        alt, _ = run(logits, hist, rows, p, grammar, block, climbs, chunk, final, cand)
        if not torch.equal(alt, got):
            mismatches.append(
                f"{name}: blocks {block}/{final}/{cand}, climbs {climbs}, chunk {chunk} changed the tokens"
            )
    flip = torch.arange(b - 1, -1, -1)
    sub = {key: t[flip] for key, t in p.items()}
    alone, _ = run(logits[flip], hist, rows[flip], sub, grammar[flip] if grammar is not None else None)
    if not torch.equal(alone.flip(0), got):
        mismatches.append(f"{name}: a row's token depends on the rows launched with it")


for v in (4096, 5003):
    for dtype in (torch.float32, torch.bfloat16):
        for scale in (1.0, 4.0):
            b = 9
            logits = (torch.randn(b, v, generator=gen) * scale).to(dtype)
            check(f"v{v} {dtype} x{scale}", logits, params(b, v), None)
    # Grammar masks: dense, sparse, a single allowed token, nothing allowed.
    b = 6
    logits = torch.randn(b, v, generator=gen) * 2
    words = torch.randint(-(2**31), 2**31, (b, (v + 31) // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    words[1] &= torch.randint(-(2**31), 2**31, words[1].shape, generator=gen, dtype=torch.int64).to(torch.int32)
    words[2] = 0
    words[2, 7] = 1 << 5
    words[3] = 0
    check(f"v{v} grammar", logits, params(b, v), words)
    # Ties: logits on a coarse grid, so thresholds fall inside runs of equal weights.
    logits = torch.randint(0, 6, (b, v), generator=gen).float()
    p = params(b, v)
    p["top_k"] = torch.tensor([1, 3, 40, 100, 700, 0], dtype=torch.int32)
    p["repetition"] = torch.ones(b)
    p["presence"] = torch.zeros(b)
    p["frequency"] = torch.zeros(b)
    check(f"v{v} ties", logits, p, None)

# The climb and the bisection: flat rows with a small nucleus (the first draw is outside it).
b, v = 8, 3000
logits = torch.randn(b, v, generator=gen) * 0.3
p = params(b, v)
p["top_k"] = torch.zeros(b, dtype=torch.int32)
p["top_p"] = torch.tensor([0.01, 0.02, 0.05, 0.01, 0.3, 0.5, 0.03, 0.01])
p["min_p"] = torch.zeros(b)
check("flat nucleus", logits, p, None)
# Without top-k the first draw and the top-p mass come from the chunked pass: min-p floors with
# top-p, min-p alone, and top-p with penalties, over several chunks.
p2 = params(b, v)
p2["top_k"] = torch.tensor([0, -1, 0, v, 0, 0, 0, 0], dtype=torch.int32)
p2["top_p"] = torch.tensor([0.9, 0.5, 1.0, 0.3, 0.02, 1.0, 0.7, 0.05])
p2["min_p"] = torch.tensor([0.0, 0.2, 0.05, 0.3, 0.0, 0.9, 0.01, 0.4])
check("no top-k", torch.randn(b, v, generator=gen) * 3, p2, None)
rows = torch.arange(b)
hist = torch.zeros(b, v, dtype=torch.int32)
first, _ = run(logits, hist, rows, {**p, "top_p": torch.ones(b)}, None)
nucleus, _ = run(logits, hist, rows, p, None)
climb_paths = int((first != nucleus).sum())

# Inside a compiled step the op is called, not traced through, and samples what eager torch does.
b, v = 4, 2000
logits = torch.randn(b, v, generator=gen) * 2
hist = torch.randint(0, 2, (b + 1, v), generator=gen, dtype=torch.int32)
rows = torch.tensor([4, 0, 2, 1])
p = params(b, v)
s = {
    "temperature": p["temperature"],
    "top_k": p["top_k"],
    "top_p": p["top_p"],
    "min_p": p["min_p"],
    "repetition_penalty": p["repetition"],
    "presence_penalty": p["presence"],
    "frequency_penalty": p["frequency"],
    "rng_seed": p["seed"],
}


def step(x: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    tok, _ = sampler(x * 1.5, hist, rows, s, p["counter"] + 1, None)
    return tok


want = step(logits, Sampler(kernel=False))
got, code = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False), logits, Sampler(kernel=True))
op_calls = sum(src.count("flare.sample") for src in code)
if not torch.equal(got, want):
    mismatches.append(f"compiled: got {got.tolist()} want {want.tolist()}")

out = {"cases": cases, "mismatches": mismatches, "rows_outside_the_first_draw": climb_paths, "op_calls": op_calls}
print(json.dumps(out))
sys.exit(1 if mismatches or climb_paths == 0 or op_calls < 1 else 0)
