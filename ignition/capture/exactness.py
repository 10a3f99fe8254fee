"""Exactness of continuation state through the captured graphs (prepare's check, any recipe):

- **restore**: a request prefilled, snapshotted into a snapshot row, then decoded; the same
  snapshot restored into another live row and decoded with the same tokens over the same KV
  bytes gives the same hidden vectors and the same final row bytes, bitwise;
- **restore into a reused row**: as above, into a live row another request has just used up to
  the same position (its state must not leak into the restored one);
- **split against whole prefill**: the prompt in the largest chunks or in the smallest ones,
  the rows after it (recurrent state, hidden vector) compared as relative L2 — equal bytes are
  not expected where GEMMs see different row counts, so this is measured, not asserted; and
  again split at `UNALIGNED`-token steps (fewer when the smallest capacity is smaller), where
  message endpoints fall: a chunked recurrence groups its tokens from each chunk's start, so
  these splits round differently, and solo runs compare with batched ones only at equal splits.

Works on a `GraphRunner` (the torch replay of the captured graphs, or eager steps on CPU).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ignition.capture.runner import GraphRunner, Row

# Tokens per prefill step in the unaligned split: a message's length, no power of two.
UNALIGNED = 90


def _against_whole(p: Any, whole: torch.Tensor, other: torch.Tensor) -> dict[str, Any]:
    """Rows after a split prefill against the rows after the whole one: bitwise, and the hidden
    vector's and every recurrent state's relative L2."""
    hidden = p.model.hidden_rows(torch.stack([whole, other])).float()
    out: dict[str, Any] = {
        "rows_bitwise": bool(torch.equal(whole, other)),
        "hidden_rel_l2": float((hidden[0] - hidden[1]).norm() / hidden[0].norm().clamp(min=1e-30)),
    }
    states = p.model.recurrent_states(torch.stack([whole, other]))
    if states:
        out["recurrent_rel_l2_max"] = max(float((s[0] - s[1]).norm() / s[0].norm().clamp(min=1e-30)) for s in states)
    return out


def _prefill(runner: GraphRunner, row: int, pages: list[int], ids: list[int], chunk: int) -> None:
    runner.initialize(row)
    at = 0
    while at < len(ids):
        part = ids[at : at + chunk]
        runner.replay(runner.prefill_graph(len(part)), [Row(row, pages, at, part)])
        at += len(part)


def _decode(runner: GraphRunner, row: int, pages: list[int], ids: list[int], start: int) -> list[torch.Tensor]:
    g = runner.decode[0]
    return [runner.replay(g, [Row(row, pages, start + i, [t])])[0][:1].clone() for i, t in enumerate(ids)]


def check(runner: GraphRunner, prompt_len: int = 300, steps: int = 8, seed: int = 0) -> dict[str, Any]:
    p = runner.p
    geo = p.geo
    if geo.request_slots < 2 or geo.snapshot_rows < 1:
        return {"skipped": "needs two live rows and a snapshot row"}
    rng = random.Random(seed)
    prompt_len = min(prompt_len, geo.context_limit - steps - 1)
    ids = [rng.randrange(geo.vocab) for _ in range(prompt_len + steps)]
    other = [rng.randrange(geo.vocab) for _ in range(prompt_len)]
    need = -(-(prompt_len + steps) // geo.page_tokens)
    pool = rng.sample(range(geo.max_kv_pages), 2 * need)
    pages, other_pages = pool[:need], pool[need:]
    a, b = geo.live_row(0), geo.live_row(1)
    snap = geo.snapshot_row(0)
    largest = runner.prefill[-1].token_capacity

    _prefill(runner, a, pages, ids[:prompt_len], largest)
    runner.maintenance("snapshot", snap, a)
    kv = p.kv_all.clone()
    straight = _decode(runner, a, pages, ids[prompt_len:], prompt_len)
    row_after = p.rows[a].clone()

    def resumed_into(row: int) -> tuple[bool, bool]:
        p.kv_all.copy_(kv)
        runner.maintenance("restore", row, snap)
        out = _decode(runner, row, pages, ids[prompt_len:], prompt_len)
        same = all(torch.equal(x, y) for x, y in zip(straight, out, strict=True))
        return same, bool(torch.equal(p.rows[row], row_after))

    hidden_equal, row_equal = resumed_into(b)
    # Row b again, after another request used it up to the same position.
    _prefill(runner, b, other_pages, other, largest)
    reused_hidden, reused_row = resumed_into(b)

    # The same prompt in the smallest chunks, on row b, against row a's prefill in the largest.
    p.kv_all.copy_(kv)
    _prefill(runner, a, pages, ids[:prompt_len], largest)
    whole = p.rows[a].clone()
    smallest = runner.prefill[0].token_capacity
    _prefill(runner, b, pages, ids[:prompt_len], smallest)
    split = p.rows[b].clone()
    step = min(UNALIGNED, smallest - 1)
    _prefill(runner, b, pages, ids[:prompt_len], step)
    unaligned = p.rows[b].clone()
    return {
        "prompt_tokens": prompt_len,
        "decode_steps": steps,
        "restore_bitwise": hidden_equal and row_equal,
        "restore_into_reused_row_bitwise": reused_hidden and reused_row,
        "split_vs_whole": {"chunks": [smallest, largest], **_against_whole(p, whole, split)},
        "split_unaligned_vs_whole": {"step": step, **_against_whole(p, whole, unaligned)},
    }
