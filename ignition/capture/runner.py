"""In-process replay of a Program's captured graphs, packed the way Helios' GraphExecutor packs
them (same padding values), for numerics against Transformers and for reference generations.

This is the Python replay floor: one `CUDAGraph.replay()` per step, host inputs copied into the
staging views, records read back after each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ignition.capture.paged import FLAG_SAMPLED, HEADER_WORDS
from ignition.capture.program import GraphSpec, Program

PAD = {"token_ids": 0, "positions": 0, "slot_mapping": -1, "page_table": -1, "request_slots": -1,
       "query_lengths": 0, "context_lengths": 0, "state_row_indices": -1, "temperature": 1.0, "top_k": 0,
       "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
       "frequency_penalty": 0.0, "rng_seed": 0, "rng_counter": 0, "sample_flags": 0, "grammar_mask": -1,
       "source_rows": -1, "destination_rows": -1, "expected_consumed": -1}  # fmt: skip


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


def _sync(p: Program) -> None:
    if p.kv_all.is_cuda:
        torch.cuda.synchronize()


def fill(g: GraphSpec, values: dict[str, list[Any]]) -> None:
    """Writes `values` into the graph's staging views, padding every lane after them."""
    for value, t in g.inputs.items():
        data = values.get(value, [])
        flat = t.view(-1)
        host = torch.full((flat.numel(),), PAD[value], dtype=flat.dtype)
        if data:
            host[: len(data)] = torch.tensor(data, dtype=flat.dtype)
        flat.copy_(host)


def pack_rows(geo: Any, g: GraphSpec, rows: list[Row]) -> dict[str, list[Any]]:
    """The values Helios' GraphExecutor packs for these rows."""
    v: dict[str, list[Any]] = {k: [] for k in PAD}
    for r in rows:
        for i, tok in enumerate(r.tokens):
            pos = r.start + i
            v["token_ids"].append(tok)
            v["positions"].append(pos)
            v["slot_mapping"].append(r.pages[pos // geo.page_tokens] * geo.page_tokens + pos % geo.page_tokens)
        v["page_table"] += r.pages + [-1] * (geo.pages_per_request - len(r.pages))
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
    if "grammar_mask" in g.inputs:
        v["grammar_mask"] = [-1] * g.inputs["grammar_mask"].numel()
    return v


class GraphRunner:
    def __init__(self, program: Program) -> None:
        self.p = program
        self.decode = sorted((g for g in program.graphs if g.kind == "decode"), key=lambda g: g.request_count)
        self.prefill = sorted((g for g in program.graphs if g.kind == "prefill"), key=lambda g: g.token_capacity)
        self.by_name = {g.name: g for g in program.graphs}

    def replay(self, g: GraphSpec, rows: list[Row]) -> tuple[torch.Tensor, list[list[int]]]:
        fill(g, pack_rows(self.p.geo, g, rows))
        assert g.records is not None
        g.records.zero_()
        g.graph.replay()
        _sync(self.p)
        assert g.output is not None
        return g.output.clone(), g.records.cpu().tolist()

    def maintenance(self, name: str, destination: int, source: int | None = None) -> None:
        g = self.by_name[name]
        fill(g, {"destination_rows": [destination], "source_rows": [] if source is None else [source],
                       "expected_consumed": [-1]})  # fmt: skip
        g.graph.replay()
        _sync(self.p)

    def admit_histogram(self, live_row: int, tokens: list[int]) -> None:
        """As the executor does at admission: the prompt, in chunks, -1 padding the last."""
        g = self.by_name.get("admit_histogram")
        if g is None:
            return
        cap = g.token_capacity
        for at in range(0, len(tokens), cap):
            part = tokens[at : at + cap]
            fill(g, {"request_slots": [live_row], "token_ids": part + [-1] * (cap - len(part))})
            g.graph.replay()
            _sync(self.p)

    def prefill_graph(self, tokens: int) -> GraphSpec:
        for g in self.prefill:
            if g.token_capacity >= tokens:
                return g
        raise ValueError(f"no prefill graph holds {tokens} tokens")

    def decode_graph(self, rows: int) -> GraphSpec:
        for g in self.decode:
            if g.request_count >= rows:
                return g
        raise ValueError(f"no decode graph holds {rows} rows")

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompt: list[int], seed: int, params: Sampling, max_tokens: int, live_row: int = 1,
                 chunk: int | None = None) -> list[int]:  # fmt: skip
        """One request, alone: prefill in chunks of the largest graph, then decode_b1."""
        geo = self.p.geo
        chunk = chunk or self.prefill[-1].token_capacity
        need = len(prompt) + max_tokens
        if need > geo.context_limit:
            raise ValueError(f"{need} tokens exceed the context limit {geo.context_limit}")
        pages = list(range(geo.pages_per_request))[: math.ceil(need / geo.page_tokens)]
        self.maintenance("initialize", live_row)
        self.admit_histogram(live_row, prompt)
        out: list[int] = []
        at = 0
        rec: list[list[int]] = []
        while at < len(prompt):
            part = prompt[at : at + chunk]
            last = at + len(part) == len(prompt)
            row = Row(live_row, pages, at, part, (seed, 0) if last else None, params)
            _, rec = self.replay(self.prefill_graph(len(part)), [row])
            at += len(part)
        g1 = self.decode_graph(1)
        while True:
            r = rec[0]
            if not r[2] & FLAG_SAMPLED:
                raise RuntimeError(f"graph did not sample: record {r[:HEADER_WORDS]}")
            tok = r[HEADER_WORDS]
            out.append(tok)
            if tok in geo.eos_token_ids or len(out) >= max_tokens:
                return out
            _, rec = self.replay(g1, [Row(live_row, pages, len(prompt) + len(out) - 1, [tok], (seed, len(out)), params)])
