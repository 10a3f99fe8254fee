"""The catalog of graphs a Llama-family core carries, their staging layout and their state.

One `Program` owns the state tensors (weights, KV pages, continuation rows, penalty histograms,
pending tokens, completion records) and one staging buffer. Every value kind has one region in
the staging buffer, sized for the largest graph that binds it; each graph views the start of that
region (the executor packs only the graph it is about to replay).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ignition.capture.paged import HEADER_WORDS, Geometry, PagedLlama

COMPLETION_TOKENS = 1
STAGING_ALIGN = 256

# value kind -> (torch dtype, manifest dtype)
VALUE_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "token_ids": (torch.int32, "i32"),
    "positions": (torch.int32, "i32"),
    "slot_mapping": (torch.int64, "i64"),
    "page_table": (torch.int32, "i32"),
    "request_slots": (torch.int32, "i32"),
    "query_lengths": (torch.int32, "i32"),
    "context_lengths": (torch.int32, "i32"),
    "state_row_indices": (torch.int32, "i32"),
    "temperature": (torch.float32, "f32"),
    "top_k": (torch.int32, "i32"),
    "top_p": (torch.float32, "f32"),
    "min_p": (torch.float32, "f32"),
    "repetition_penalty": (torch.float32, "f32"),
    "presence_penalty": (torch.float32, "f32"),
    "frequency_penalty": (torch.float32, "f32"),
    "rng_seed": (torch.int64, "u64"),
    "rng_counter": (torch.int64, "u64"),
    "sample_flags": (torch.int32, "u32"),
    "grammar_mask": (torch.int32, "u32"),
    "source_rows": (torch.int32, "i32"),
    "destination_rows": (torch.int32, "i32"),
    "expected_consumed": (torch.int32, "i32"),
    "checkpoint_epoch": (torch.int32, "i32"),
}
SAMPLING = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "rng_seed",
    "rng_counter",
    "sample_flags",
)


@dataclass
class GraphSpec:
    name: str
    kind: str  # decode | prefill | resume_sampling | state_maintenance | speculative
    method: str
    request_count: int
    token_capacity: int
    shapes: dict[str, tuple[int, ...]]
    maintenance_op: str | None = None
    # Speculative programs: proposals per request (W = depth + 1 lanes each, P = B * W lanes).
    proposal_depth: int = 0
    # Token words of each completion record (a speculative program reports up to W tokens).
    completion_tokens: int = COMPLETION_TOKENS
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    records: torch.Tensor | None = None
    fn: Any = None
    graph: Any = None
    pool: Any = None
    output: torch.Tensor | None = None


def catalog(
    geo: Geometry,
    decode_buckets: list[int],
    prefill_chunks: list[int],
    speculative: list[tuple[int, int]] | None = None,
) -> list[GraphSpec]:
    """Every graph of a core; `speculative`: (requests, depth) of its speculative programs."""
    p, w = geo.pages_per_request, geo.mask_words

    def sampling(b: int, lanes: int | None = None) -> dict[str, tuple[int, ...]]:
        return {**{k: (b,) for k in SAMPLING}, "grammar_mask": (lanes or b, w)}

    out = []
    for b in decode_buckets:
        out.append(
            GraphSpec(
                f"decode_b{b}",
                "decode",
                "decode",
                b,
                b,
                {"token_ids": (b,), "positions": (b,), "request_slots": (b,), "page_table": (b, p), **sampling(b)},
            )
        )
    for b, d in speculative or []:
        lanes = b * (d + 1)
        out.append(
            GraphSpec(
                f"verify_b{b}_d{d}",
                "speculative",
                "verify",
                b,
                lanes,
                {
                    "token_ids": (lanes,),
                    "positions": (lanes,),
                    "query_lengths": (b,),
                    "request_slots": (b,),
                    "page_table": (b, p),
                    **sampling(b, lanes),
                },
                proposal_depth=d,
                completion_tokens=d + 1,
            )
        )
    for t in prefill_chunks:
        out.append(
            GraphSpec(
                f"prefill_t{t}",
                "prefill",
                "prefill",
                1,
                t,
                {
                    "token_ids": (t,),
                    "positions": (t,),
                    "slot_mapping": (t,),
                    "page_table": (1, p),
                    "request_slots": (1,),
                    "query_lengths": (1,),
                    **sampling(1),
                },
            )
        )
    out.append(
        GraphSpec(
            "resume_b1",
            "resume_sampling",
            "resume",
            1,
            0,
            {"request_slots": (1,), "state_row_indices": (1,), "context_lengths": (1,), **sampling(1)},
        )
    )
    out.append(
        GraphSpec(
            "initialize",
            "state_maintenance",
            "initialize",
            1,
            0,
            {"destination_rows": (1,)},
            maintenance_op="initialize",
        )
    )
    t = max(prefill_chunks)
    out.append(
        GraphSpec(
            "admit_histogram",
            "state_maintenance",
            "admit_histogram",
            1,
            t,
            {"request_slots": (1,), "token_ids": (t,)},
            maintenance_op="admit_histogram",
        )
    )
    for op in ("restore", "snapshot"):
        out.append(
            GraphSpec(
                op,
                "state_maintenance",
                op,
                1,
                0,
                {"source_rows": (1,), "destination_rows": (1,), "expected_consumed": (1,), "checkpoint_epoch": (1,)},
                maintenance_op=op,
            )
        )
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Program:
    """State, staging and graphs of one core. Build it inside the arena's state pool."""

    def __init__(self, model: PagedLlama, graphs: list[GraphSpec]) -> None:
        self.model = model
        self.geo = g = model.geo
        self.graphs = graphs
        dev = model.head().device
        self.kv_all = torch.zeros(g.kv_shape(), dtype=torch.bfloat16, device=dev)
        self.kv = self.kv_all[: g.max_kv_pages]
        shape, dtype = model.row_storage()
        self.rows = torch.zeros(shape, dtype=dtype, device=dev)
        self.hist = torch.zeros(1 + g.request_slots, g.vocab, dtype=torch.int32, device=dev)
        self.pending = torch.zeros(1 + g.request_slots, dtype=torch.int32, device=dev)
        # One records buffer; each graph views its start as [B, HEADER_WORDS + its token words].
        tokens = max((spec.completion_tokens for spec in graphs), default=COMPLETION_TOKENS)
        self.records = torch.zeros(g.request_slots, HEADER_WORDS + tokens, dtype=torch.int32, device=dev)
        regions: dict[str, int] = {}
        for spec in graphs:
            for value, shape in spec.shapes.items():
                nbytes = _numel(shape) * VALUE_DTYPES[value][0].itemsize
                regions[value] = max(regions.get(value, 0), nbytes)
        self.offsets: dict[str, int] = {}
        at = 0
        for value in sorted(regions):
            self.offsets[value] = at
            at += -(-regions[value] // STAGING_ALIGN) * STAGING_ALIGN
        self.staging = torch.zeros(max(at, STAGING_ALIGN), dtype=torch.uint8, device=dev)
        for spec in graphs:
            for value, shape in spec.shapes.items():
                dt = VALUE_DTYPES[value][0]
                off = self.offsets[value]
                spec.inputs[value] = self.staging[off : off + _numel(shape) * dt.itemsize].view(dt).view(shape)
            width = HEADER_WORDS + spec.completion_tokens
            spec.records = self.records.view(-1)[: spec.request_count * width].view(spec.request_count, width)

    def state(self) -> dict[str, torch.Tensor]:
        return {
            "kv_pages": self.kv,
            "continuation_rows": self.rows,
            "penalty_histogram": self.hist,
            "pending_tokens": self.pending,
            "completion_records": self.records,
            "staging": self.staging,
        }

    def call(
        self, spec: GraphSpec, fn: Callable[..., torch.Tensor], state: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        s = state
        if not s:
            if spec.records is None:
                raise RuntimeError(f"graph {spec.name} has no completion-records view")
            s = {
                "kv": self.kv_all,
                "rows": self.rows,
                "hist": self.hist,
                "records": spec.records,
                "pending": self.pending,
            }
        return fn(spec.inputs, s["kv"], s["rows"], s["hist"], s["records"], s["pending"])

    def method(self, spec: GraphSpec) -> Any:
        return getattr(self.model, spec.method)

    # -- deterministic contents for replay checks ----------------------------------------------
    def set_inputs(self, spec: GraphSpec, seed: int) -> None:
        """Shuffled page tables, positions across page boundaries, live sampling parameters,
        random KV/rows/histograms/pending tokens, decode lanes both device-fed and host-fed: what a
        replay in another process must reproduce bitwise."""
        g = self.geo
        gen = torch.Generator(device="cpu").manual_seed(1000 + seed)
        # The large state is filled on its own device (a seeded generator there: fast at any size).
        dgen = torch.Generator(device=self.kv_all.device).manual_seed(2000 + seed)
        dev = self.kv_all.device
        self.kv_all.copy_((torch.randn(self.kv_all.shape, generator=dgen, device=dev) * 0.5).to(torch.bfloat16))
        self.model.randomize_rows(self.rows, dgen)
        self.hist.copy_(torch.randint(0, 3, self.hist.shape, generator=dgen, device=dev, dtype=torch.int32))
        # Entry 0 too: a step must leave it as it found it, whatever it holds.
        self.pending.copy_(torch.randint(0, g.vocab, self.pending.shape, generator=dgen, device=dev, dtype=torch.int32))
        self.records.zero_()
        self.staging.zero_()
        x = spec.inputs
        b = spec.request_count
        pages = torch.randperm(g.max_kv_pages, generator=gen)[: b * g.pages_per_request].view(b, -1).int()
        if "temperature" in x:
            x["temperature"].copy_(torch.linspace(0.5, 1.3, b))
            x["top_k"].copy_(torch.tensor([0, 40, 1, g.vocab + 5] * b)[:b].int())
            x["top_p"].copy_(torch.tensor([1.0, 0.9, 0.5, 0.95] * b)[:b])
            x["min_p"].copy_(torch.tensor([0.0, 0.05, 0.0, 0.1] * b)[:b])
            x["repetition_penalty"].copy_(torch.tensor([1.0, 1.1, 1.3, 0.9] * b)[:b])
            x["presence_penalty"].copy_(torch.tensor([0.0, 0.5, -0.5, 1.0] * b)[:b])
            x["frequency_penalty"].copy_(torch.tensor([0.0, 0.2, 0.0, -0.3] * b)[:b])
            x["rng_seed"].copy_(torch.randint(-(2**62), 2**62, (b,), generator=gen))
            x["rng_counter"].copy_(torch.randint(0, 1000, (b,), generator=gen))
            x["sample_flags"].fill_(1)
            x["grammar_mask"].fill_(-1)
            x["grammar_mask"][0, :2].zero_()  # row 0 may not sample the first 64 ids
        if spec.kind == "decode":
            x["token_ids"].copy_(torch.randint(0, g.vocab, (b,), generator=gen).int())
            x["token_ids"][0] = -1  # device-fed: lane 0 consumes its row's pending token
            ends = [5, g.page_tokens + 6, 2 * g.page_tokens - 1, g.context_limit - 1]
            x["positions"].copy_(torch.tensor([ends[i % 4] for i in range(b)]).int())
            x["request_slots"].copy_(torch.tensor([g.live_row(i % g.request_slots) for i in range(b)]).int())
            if b > 1:
                x["request_slots"][-1] = -1  # a padded lane, device-fed: it reads entry 0
                x["token_ids"][-1] = -1
            x["page_table"].copy_(pages)
        elif spec.kind == "speculative":
            w = spec.proposal_depth + 1
            ends = [5, g.page_tokens - 2, 2 * g.page_tokens + 3, g.context_limit - w]
            lanes = torch.randint(0, g.vocab, (b, w), generator=gen).int()
            lanes[0, 0] = -1  # request 0 device-fed
            used = [w, max(1, w // 2), 1, w][:b] + [w] * max(0, b - 4)
            for i in range(b):
                lanes[i, used[i] :] = -1
            x["token_ids"].copy_(lanes.view(-1))
            start = torch.tensor([ends[i % 4] for i in range(b)]).int()
            x["positions"].copy_((start[:, None] + torch.arange(w)[None, :]).int().view(-1))
            x["query_lengths"].copy_(torch.tensor(used).int())
            x["request_slots"].copy_(torch.tensor([g.live_row(i % g.request_slots) for i in range(b)]).int())
            if b > 1:
                x["request_slots"][-1] = -1  # a padded request
                x["query_lengths"][-1] = 0
            x["page_table"].copy_(pages)
        elif spec.kind == "prefill":
            t = spec.token_capacity
            real = max(1, t - 3)  # the last three lanes are padding
            pos = torch.arange(t) + (g.page_tokens - 7)
            x["token_ids"].copy_(torch.randint(0, g.vocab, (t,), generator=gen).int())
            x["positions"].copy_(pos.int())
            x["page_table"].copy_(pages)
            slot = pages[0].long()[(pos // g.page_tokens).clamp(max=g.pages_per_request - 1)] * g.page_tokens
            slot = slot + pos % g.page_tokens
            slot[real:] = -1
            x["slot_mapping"].copy_(slot)
            x["request_slots"].fill_(g.live_row(1 % g.request_slots))
            x["query_lengths"].fill_(real)
        elif spec.kind == "resume_sampling":
            x["request_slots"].fill_(g.live_row(2 % g.request_slots))
            x["state_row_indices"].fill_(g.snapshot_row(1 % max(1, g.snapshot_rows)))
            x["context_lengths"].fill_(77)
        elif spec.maintenance_op == "admit_histogram":
            t = spec.token_capacity
            x["request_slots"].fill_(g.live_row(1 % g.request_slots))
            x["token_ids"].copy_(torch.randint(0, g.vocab, (t,), generator=gen).int())
            x["token_ids"][t // 2 :] = -1  # a partial chunk
        else:
            live = g.live_row(1 % g.request_slots)
            snap = g.snapshot_row(2 % max(1, g.snapshot_rows))
            x["destination_rows"].fill_(live if spec.maintenance_op != "snapshot" else snap)
            if "source_rows" in x:
                src = g.snapshot_row(0) if spec.maintenance_op == "restore" else live
                x["source_rows"].fill_(src)
                # Restore checked and accepted (the source's own stamp); snapshot checked and
                # rejected (one token off): both outcomes replay in the checks.
                stamp = self.model.stamps(self.rows)[src]
                x["expected_consumed"].fill_(int(stamp[0]) if spec.maintenance_op == "restore" else int(stamp[0]) + 1)
                x["checkpoint_epoch"].fill_(int(stamp[1]))


def capacity_fields(capacities: Any) -> dict[str, int]:
    """The geometry's capacity fields from planned capacities (`ignition.prepare.Capacities`)."""
    return {
        "context_limit": capacities.context_limit,
        "request_slots": capacities.request_slots,
        "snapshot_rows": capacities.snapshot_rows,
        "max_kv_pages": capacities.max_kv_pages,
    }


@dataclass(frozen=True)
class ProgramPlan:
    """A recipe's prepared forward for one config and capacities (`ignition.recipes.ProgramPlan`):
    its geometry, what it will hold, and how its model is built over the streamed weights.
    `make_model(weights, device, options)` returns the forward (a `PagedLlama` or subclass)."""

    geo: Geometry
    capacities: Any
    make_model: Callable[[dict[str, torch.Tensor], Any, Any], PagedLlama]

    def geometry(self) -> dict[str, Any]:
        return self.geo.as_dict()

    def state_bytes(self) -> int:
        return self.geo.state_bytes()

    def pool_bytes(self) -> int:
        return self.geo.pool_bytes(self.capacities.prefill_chunks[-1])

    def build(self, weights: dict[str, torch.Tensor], device: Any, options: Any) -> Program:
        model = self.make_model(weights, device, options)
        caps = self.capacities
        speculative = list(getattr(caps, "speculative", []))
        return Program(model, catalog(self.geo, caps.decode_buckets, caps.prefill_chunks, speculative))
