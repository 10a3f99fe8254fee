"""In-process replay of a Program's captured graphs, packed the way Helios' GraphExecutor packs
them (same padding values), for numerics against Transformers and for reference generations.

This is the Python replay floor: one `CUDAGraph.replay()` per step, host inputs copied into the
staging views, records read back after each step.
"""

from __future__ import annotations

from typing import Any

import torch

from ignition.capture.paged import HEADER_WORDS
from ignition.capture.program import GraphSpec, Program
from ignition.core.stepping import PAD, Proposer, Row, Sampling, StepError, histogram_chunks, smallest_holding
from ignition.core.stepping import generate as _generate
from ignition.core.stepping import generate_speculative as _generate_speculative
from ignition.core.stepping import pack_rows as _pack

__all__ = ["PAD", "GraphRunner", "Row", "Sampling", "fill", "pack_rows"]


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
    mask = g.inputs["grammar_mask"].numel() if "grammar_mask" in g.inputs else None
    lanes = g.proposal_depth + 1 if g.kind == "speculative" else None
    return _pack(geo.page_tokens, geo.pages_per_request, rows, mask, lanes)


class GraphRunner:
    def __init__(self, program: Program) -> None:
        self.p = program
        self.decode = sorted((g for g in program.graphs if g.kind == "decode"), key=lambda g: g.request_count)
        self.prefill = sorted((g for g in program.graphs if g.kind == "prefill"), key=lambda g: g.token_capacity)
        self.verify = sorted(
            (g for g in program.graphs if g.kind == "speculative"), key=lambda g: (g.token_capacity, g.request_count)
        )
        self.by_name = {g.name: g for g in program.graphs}
        geo = program.geo
        self.page_tokens, self.pages_per_request = geo.page_tokens, geo.pages_per_request
        self.context_limit = geo.context_limit
        self.header_words = HEADER_WORDS
        self.largest_chunk = self.prefill[-1].token_capacity

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
        fill(
            g,
            {
                "destination_rows": [destination],
                "source_rows": [] if source is None else [source],
                "expected_consumed": [-1],
            },
        )
        g.graph.replay()
        _sync(self.p)

    def initialize(self, live_row: int) -> None:
        self.maintenance("initialize", live_row)

    def admit_histogram(self, live_row: int, tokens: list[int]) -> None:
        """As the executor does at admission: the prompt, in chunks, -1 padding the last."""
        g = self.by_name.get("admit_histogram")
        if g is None:
            return
        for chunk in histogram_chunks(tokens, g.token_capacity):
            fill(g, {"request_slots": [live_row], "token_ids": chunk})
            g.graph.replay()
            _sync(self.p)

    def prefill_graph(self, tokens: int) -> GraphSpec:
        return smallest_holding(self.prefill, lambda g: g.token_capacity, tokens, "prefill")

    def decode_graph(self, rows: int) -> GraphSpec:
        return smallest_holding(self.decode, lambda g: g.request_count, rows, "decode")

    def verify_graph(self, rows: list[Row]) -> GraphSpec:
        """The speculative program with the fewest lanes that holds these rows and proposals."""
        depth = max(len(r.tokens) for r in rows) - 1
        for g in self.verify:
            if g.request_count >= len(rows) and g.proposal_depth >= depth:
                return g
        raise StepError(f"no speculative program holds {len(rows)} rows of {depth} proposals")

    # -- the Stepper protocol (ignition.core.stepping) ---------------------------------------
    def prefill_step(self, rows: list[Row]) -> list[list[int]]:
        return self.replay(self.prefill_graph(sum(len(r.tokens) for r in rows)), rows)[1]

    def decode_step(self, rows: list[Row]) -> list[list[int]]:
        return self.replay(self.decode_graph(len(rows)), rows)[1]

    def verify_depth(self, rows: int) -> int:
        return max((g.proposal_depth for g in self.verify if g.request_count >= rows), default=0)

    def verify_step(self, rows: list[Row]) -> list[list[int]]:
        return self.replay(self.verify_graph(rows), rows)[1]

    def generate(
        self,
        prompt: list[int],
        seed: int,
        params: Sampling,
        max_tokens: int,
        live_row: int = 1,
        chunk: int | None = None,
        device_fed: bool = False,
    ) -> list[int]:
        """One request, alone: prefill in chunks of the largest graph, then decode_b1 (its input
        token from the device's pending token with `device_fed`)."""
        return _generate(self, prompt, seed, params, max_tokens, self.p.geo.eos_token_ids, live_row, chunk, device_fed)

    def generate_speculative(
        self,
        prompt: list[int],
        seed: int,
        params: Sampling,
        max_tokens: int,
        propose: Proposer,
        live_row: int = 1,
        device_fed: bool = False,
    ) -> tuple[list[int], int]:
        """`generate` through the speculative programs (see `ignition.core.stepping`)."""
        eos = self.p.geo.eos_token_ids
        return _generate_speculative(self, prompt, seed, params, max_tokens, eos, propose, live_row, device_fed)
