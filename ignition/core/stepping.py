"""How one replay step's request metadata is packed, without torch.

Shared by the in-process torch replay (`ignition.capture.runner`) and the torch-free core replay
(`ignition.replay`), so both pack exactly what Helios' GraphExecutor packs: the same values,
the same padding after the last real row, the same page arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Padding of every lane after the real rows (slots and rows -1, so padded rows write nothing).
PAD: dict[str, Any] = {
    "token_ids": 0, "positions": 0, "slot_mapping": -1, "page_table": -1, "request_slots": -1,
    "query_lengths": 0, "context_lengths": 0, "state_row_indices": -1, "temperature": 1.0, "top_k": 0,
    "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "rng_seed": 0, "rng_counter": 0, "sample_flags": 0, "grammar_mask": -1,
    "source_rows": -1, "destination_rows": -1, "expected_consumed": -1,
}  # fmt: skip

# Completion record flags (helios_contract::record).
FLAG_SAMPLED, FLAG_EOS, FLAG_GRAMMAR_EXHAUSTED = 1, 2, 4


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass
class Row:
    """One request row of a step: its live row, its page table, the tokens it consumes from
    `start`, and (seed, counter) when it samples."""

    live_row: int
    pages: list[int]
    start: int
    tokens: list[int]
    sample: tuple[int, int] | None = None
    params: Sampling = Sampling()


def pack_rows(page_tokens: int, pages_per_request: int, rows: list[Row],
              grammar_mask_words: int | None = None) -> dict[str, list[Any]]:  # fmt: skip
    """The values Helios' GraphExecutor packs for these rows (padding is the caller's `PAD`).

    `grammar_mask_words`: the graph's mask length when it has one (all bits set: no grammar)."""
    v: dict[str, list[Any]] = {k: [] for k in PAD}
    for r in rows:
        if len(r.pages) > pages_per_request:
            raise ValueError(f"row {r.live_row}: {len(r.pages)} pages exceed {pages_per_request} per request")
        for i, tok in enumerate(r.tokens):
            pos = r.start + i
            v["token_ids"].append(tok)
            v["positions"].append(pos)
            v["slot_mapping"].append(r.pages[pos // page_tokens] * page_tokens + pos % page_tokens)
        v["page_table"] += r.pages + [-1] * (pages_per_request - len(r.pages))
        v["request_slots"].append(r.live_row)
        v["state_row_indices"].append(r.live_row)
        v["query_lengths"].append(len(r.tokens))
        v["context_lengths"].append(r.start + len(r.tokens))
        for k, x in vars(r.params).items():
            v[k].append(x)
        seed, counter = r.sample or (0, 0)
        v["rng_seed"].append(seed if seed < 2**63 else seed - 2**64)
        v["rng_counter"].append(counter)
        v["sample_flags"].append(1 if r.sample else 0)
    if grammar_mask_words is not None:
        v["grammar_mask"] = [-1] * grammar_mask_words
    return v
