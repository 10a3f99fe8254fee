"""How one replay step's request metadata is packed, without torch.

Shared by the in-process torch replay (`ignition.capture.runner`) and the torch-free core replay
(`ignition.replay`), so both pack exactly what Helios' GraphExecutor packs: the same values,
the same padding after the last real row, the same page arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

# Padding of every lane after the real rows (slots and rows -1, so padded rows write nothing).
PAD: dict[str, Any] = {
    "token_ids": 0,
    "positions": 0,
    "slot_mapping": -1,
    "page_table": -1,
    "request_slots": -1,
    "query_lengths": 0,
    "context_lengths": 0,
    "state_row_indices": -1,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "rng_seed": 0,
    "rng_counter": 0,
    "sample_flags": 0,
    "grammar_mask": -1,
    "source_rows": -1,
    "destination_rows": -1,
    "expected_consumed": -1,
    "checkpoint_epoch": 0,
}

# A decode lane packed with this token id consumes its row's pending token (the one the row's
# last sampling step stored on the device) instead of a host-packed one. A speculative program's
# lane 0 reads it the same way; its unused lanes are packed with it too (and ignored).
DEVICE_FED_TOKEN = -1

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


def pack_rows(
    page_tokens: int,
    pages_per_request: int,
    rows: list[Row],
    grammar_mask_words: int | None = None,
    lanes: int | None = None,
) -> dict[str, list[Any]]:
    """The values Helios' GraphExecutor packs for these rows (padding is the caller's `PAD`).

    `grammar_mask_words`: the graph's mask length when it has one (all bits set: no grammar).
    `lanes`: a speculative program's lanes per request (W): each row's tokens (the pending token
    or -1, then its proposals) start at a multiple of W, unused lanes packed -1 at position 0."""
    v: dict[str, list[Any]] = {k: [] for k in PAD}
    for r in rows:
        if len(r.pages) > pages_per_request:
            raise ValueError(f"row {r.live_row}: {len(r.pages)} pages exceed {pages_per_request} per request")
        if lanes is not None and len(r.tokens) > lanes:
            raise ValueError(f"row {r.live_row}: {len(r.tokens)} tokens exceed {lanes} lanes")
        for i, tok in enumerate(r.tokens):
            pos = r.start + i
            v["token_ids"].append(tok)
            v["positions"].append(pos)
            v["slot_mapping"].append(r.pages[pos // page_tokens] * page_tokens + pos % page_tokens)
        if lanes is not None:
            v["token_ids"] += [DEVICE_FED_TOKEN] * (lanes - len(r.tokens))
            v["positions"] += [0] * (lanes - len(r.tokens))
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


class StepError(Exception):
    """A request outside what the replayed graphs can run, or a step that did not sample."""


class Stepper(Protocol):
    """One replay of prepared graphs, as `admit` and `generate` drive it."""

    page_tokens: int
    pages_per_request: int
    context_limit: int
    header_words: int
    largest_chunk: int

    def initialize(self, live_row: int) -> None: ...

    def admit_histogram(self, live_row: int, tokens: list[int]) -> None: ...

    def prefill_step(self, rows: list[Row]) -> list[list[int]]:
        """Replays the smallest prefill graph holding the rows' tokens; returns its records."""
        ...

    def decode_step(self, rows: list[Row]) -> list[list[int]]:
        """Replays the smallest decode bucket holding the rows; returns its records."""
        ...


class SpeculativeStepper(Stepper, Protocol):
    """A Stepper whose core has speculative programs."""

    def verify_depth(self, rows: int) -> int:
        """The most proposals per request a speculative program for `rows` requests verifies."""
        ...

    def verify_step(self, rows: list[Row]) -> list[list[int]]:
        """Replays the smallest speculative program holding the rows and their proposals."""
        ...


G = TypeVar("G")


def smallest_holding(graphs: list[G], size: Callable[[G], int], need: int, what: str) -> G:
    """The first of `graphs` (ascending by `size`) whose `size(g)` holds `need`."""
    for g in graphs:
        if size(g) >= need:
            return g
    raise StepError(f"no {what} graph holds {need} (capacities {[size(g) for g in graphs]})")


def histogram_chunks(tokens: list[int], capacity: int) -> list[list[int]]:
    """The prompt in `admit_histogram` chunks, as the executor admits it: -1 pads the last."""
    out = []
    for at in range(0, len(tokens), capacity):
        part = tokens[at : at + capacity]
        out.append(part + [-1] * (capacity - len(part)))
    return out


def sampled_token(record: list[int], header_words: int) -> int:
    if not record[2] & FLAG_SAMPLED:
        raise StepError(f"the graph did not sample: record {record[:header_words]}")
    return record[header_words]


def emitted_tokens(record: list[int], header_words: int) -> list[int]:
    """The tokens a record reports, in order (a speculative program's: accepted proposals and
    the sample after them)."""
    if not record[2] & FLAG_SAMPLED:
        raise StepError(f"the graph did not sample: record {record[:header_words]}")
    return record[header_words : header_words + record[3]]


def admit(
    s: Stepper,
    live_row: int,
    pages: list[int],
    prompt: list[int],
    seed: int,
    params: Sampling,
    chunk: int | None = None,
) -> int:
    """initialize + admit_histogram + the prompt in prefill chunks, sampling after the last one;
    returns the first token."""
    if not prompt:
        raise StepError("empty prompt")
    chunk = chunk or s.largest_chunk
    s.initialize(live_row)
    s.admit_histogram(live_row, prompt)
    at, rec = 0, []
    while at < len(prompt):
        part = prompt[at : at + chunk]
        last = at + len(part) == len(prompt)
        rec = s.prefill_step([Row(live_row, pages, at, part, (seed, 0) if last else None, params)])
        at += len(part)
    return sampled_token(rec[0], s.header_words)


def generate(
    s: Stepper,
    prompt: list[int],
    seed: int,
    params: Sampling,
    max_tokens: int,
    eos: tuple[int, ...],
    live_row: int = 1,
    chunk: int | None = None,
    device_fed: bool = False,
) -> list[int]:
    """One request alone on pages 0.., prefill then the batch-1 decode bucket: the reference
    sequence both Python replays run and the Rust replay is compared with.

    `device_fed`: each decode packs DEVICE_FED_TOKEN, so its input is the pending token the
    previous step (the prefill, then each decode) stored; the tokens must not change."""
    need = len(prompt) + max_tokens
    if need > s.context_limit:
        raise StepError(f"{need} tokens exceed the context limit {s.context_limit}")
    pages = list(range(-(-need // s.page_tokens)))
    out = [admit(s, live_row, pages, prompt, seed, params, chunk)]
    while out[-1] not in eos and len(out) < max_tokens:
        tok = DEVICE_FED_TOKEN if device_fed else out[-1]
        rec = s.decode_step([Row(live_row, pages, len(prompt) + len(out) - 1, [tok], (seed, len(out)), params)])
        out.append(sampled_token(rec[0], s.header_words))
    return out


Proposer = Callable[[list[int]], list[int]]


def replaying(tokens: list[int], wrong_every: int = 0, vocab: int = 1) -> Proposer:
    """Proposes the continuation of a known generation `tokens`, each position that is a multiple
    of `wrong_every` (when set) replaced by another id: proposals right, or right with known
    misses, to check that verification emits the same tokens either way."""

    def propose(out: list[int]) -> list[int]:
        at = len(out)
        nxt = tokens[at : at + 16]
        if wrong_every:
            nxt = [(t + 1) % vocab if (at + i) % wrong_every == 0 else t for i, t in enumerate(nxt)]
        return nxt

    return propose


def generate_speculative(
    s: SpeculativeStepper,
    prompt: list[int],
    seed: int,
    params: Sampling,
    max_tokens: int,
    eos: tuple[int, ...],
    propose: Proposer,
    live_row: int = 1,
    device_fed: bool = False,
) -> tuple[list[int], int]:
    """`generate` through the speculative program: each step verifies `propose(tokens so far)`
    (cut to the program's depth and to what `max_tokens` leaves) after the pending token. The
    tokens must equal `generate`'s whatever the proposals are; returns them and the steps taken.
    Pages cover the lanes past the end too (rejected lanes write KV there)."""
    depth = s.verify_depth(1)
    need = len(prompt) + max_tokens + depth
    if need > s.context_limit:
        raise StepError(f"{need} positions exceed the context limit {s.context_limit}")
    pages = list(range(-(-need // s.page_tokens)))
    out = [admit(s, live_row, pages, prompt, seed, params)]
    steps = 0
    while out[-1] not in eos and len(out) < max_tokens:
        proposals = propose(out)[: min(depth, max_tokens - len(out) - 1)]
        tok = DEVICE_FED_TOKEN if device_fed else out[-1]
        start = len(prompt) + len(out) - 1
        rec = s.verify_step([Row(live_row, pages, start, [tok, *proposals], (seed, len(out)), params)])
        got = emitted_tokens(rec[0], s.header_words)
        if not 1 <= len(got) <= len(proposals) + 1 or rec[0][4] != start + len(got):
            raise StepError(f"verify record {rec[0]} for {len(proposals)} proposals at {start}")
        out += got
        steps += 1
    return out, steps
