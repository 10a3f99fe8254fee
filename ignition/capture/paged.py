"""The prepared Llama-family step programs: decode, prefill, resume sampling and state maintenance,
over 64-token KV pages, continuation rows, per-slot penalty histograms and pending tokens.

The arithmetic follows Transformers' LlamaForCausalLM / Qwen3ForCausalLM (bf16 RMSNorm cast
before the weight, rotate-half RoPE from the checkpoint's rope parameters, GQA, SiLU MLP), so
teacher-forced logits can be compared with the canonical forward.

State and its invariants (row indices follow the cache scheme: row 0 is the null row; request slot
s owns the W = `verification_width` rows 1 + s*W .. 1 + (s+1)*W, its live row the first of them
and the others the speculative columns of a recipe with recurrent state; snapshot rows after
every slot's rows; W is 1 unless a recipe keeps columns):
- `kv` holds `max_kv_pages` pages plus one trash page at the end. Writes of padded rows
  (negative slot) go to the trash page, so they never race a real write.
- `rows[r]` is the final (normed) hidden vector of the last token consumed by row r: what resume
  sampling projects and samples from, what snapshot and restore copy. Row 0, the null row, is
  never written (padding lanes store its own bytes back). Every row ends in its stamp
  (`STAMP_BYTES`: consumed count, epoch; i32 each): a live row's consumed count is written by
  every step that consumes into it, its epoch by initialize (0) and restore; a snapshot row's
  stamp is its checkpoint's. Snapshot and restore check the source's stamp against the
  expected (consumed, epoch) before writing anything, and report the outcome in a record.
- `hist[e]` (entry e = s + 1 of slot s; entry 0 the null row's, read by padding) counts the
  live row's prompt (added once at admission by admit_histogram, after
  initialize or restore cleared the row) and every token sampled since (request state, outside
  every checkpoint). Penalties read it.
- `pending[e]` (entries as `hist`) is the token the slot's live row sampled last (request
  state, outside every checkpoint; entry 0, the null row's, is never written). Every sampling
  step stores its sampled tokens there; a decode lane whose packed token id is negative
  consumes its row's entry instead (device-fed generation). Padded lanes read entry 0.
- A row that does not sample (padding, a prefill chunk short of the prompt end, an exhausted
  grammar) changes no histogram and no pending token, and writes a record without the sampled flag.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ignition.capture.attention import attend_gather, rotate, write_attend_op
from ignition.capture.gemv import Problem, Projections, Variant
from ignition.capture.sampling import M32, Sampler
from ignition.core.stepping import FLAG_EOS, FLAG_GRAMMAR_EXHAUSTED, FLAG_SAMPLED

if TYPE_CHECKING:
    from ignition.recipes.llama import LlamaFamilyConfig

RECORD_MAGIC = 0x464C_5243
# A maintenance record's flag: the op's check failed and it wrote nothing (helios_contract::record).
FLAG_CHECKPOINT_REJECTED = 1 << 3
# A continuation row's stamp: consumed count and epoch, i32 each, at the end of the row.
STAMP_BYTES = 8
# Without the few-row projection kernel (`flare::gemv`), decode buckets and single-row projections
# run their GEMMs over at least this many rows (padding rows are inert). A GEMM tile holds 16 rows
# anyway, so it costs nothing on the GPU, and every bucket then shares one GEMM shape: one
# autotune for all of them, and a row's result does not depend on the bucket it was packed into.
# The kernel keeps that property by construction (see `ignition.capture.gemv`).
MIN_GEMM_ROWS = 16
# Largest decode bucket whose projections go through `flare::gemv` (its weight stream is read once
# per group of 8 rows); cores with larger buckets decode through GEMM templates at every bucket,
# so that all buckets of a core share one arithmetic.
GEMV_MAX_ROWS = 16
HEADER_WORDS = 8


@dataclass(frozen=True)
class Geometry:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    tie_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    page_tokens: int = 64
    context_limit: int = 2048
    request_slots: int = 8
    snapshot_rows: int = 64
    max_kv_pages: int = 512
    # Rows each request slot owns (the cache scheme's verification width): 1, or one column per
    # lane of the widest speculative program for a recipe whose state needs columns.
    verification_width: int = 1

    @property
    def pages_per_request(self) -> int:
        return self.context_limit // self.page_tokens

    @property
    def total_rows(self) -> int:
        return self.first_snapshot_row + self.snapshot_rows

    @property
    def first_snapshot_row(self) -> int:
        return 1 + self.request_slots * self.verification_width

    def live_row(self, slot: int) -> int:
        """The live row of request slot `slot` (0-based): the first of its W rows."""
        return 1 + slot * self.verification_width

    def live_rows(self) -> list[int]:
        return [self.live_row(s) for s in range(self.request_slots)]

    def snapshot_row(self, index: int) -> int:
        return self.first_snapshot_row + index

    def is_live_row(self, r: torch.Tensor) -> torch.Tensor:
        """Whether each row index is a slot's live row (not a column, snapshot or null row)."""
        return (r >= 1) & (r < self.first_snapshot_row) & ((r - 1) % self.verification_width == 0)

    def is_snapshot_row(self, r: torch.Tensor) -> torch.Tensor:
        return (r >= self.first_snapshot_row) & (r < self.total_rows)

    def slot_entry(self, r: torch.Tensor) -> torch.Tensor:
        """The histogram and pending-token entry of each live row (slot + 1); 0 for any other."""
        return torch.where(self.is_live_row(r), torch.div(r - 1, self.verification_width, rounding_mode="floor") + 1, 0)

    @property
    def region_bytes(self) -> int:
        """One layer's K (or V) of one page, bf16."""
        return self.page_tokens * self.kv_heads * self.head_dim * 2

    @property
    def kv_layers(self) -> int:
        """Layers that keep K/V in the pages (every layer of this recipe)."""
        return self.layers

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.kv_layers * self.region_bytes

    @property
    def row_bytes(self) -> int:
        """One continuation row: the final hidden vector (bf16), then the stamp."""
        return self.hidden * 2 + STAMP_BYTES

    def state_bytes(self) -> int:
        """KV pages (with the trash page), continuation rows, histograms and pending tokens."""
        rows = self.total_rows * self.row_bytes
        return (self.max_kv_pages + 1) * self.bytes_per_page + rows + (1 + self.request_slots) * (self.vocab + 1) * 4

    def pool_bytes(self, largest_chunk: int) -> int:
        """Upper bound of one graph's private pool: the largest chunk's float32 temporaries."""
        return (256 << 20) + largest_chunk * (self.ffn * 2 + self.vocab) * 4 * 4

    @property
    def mask_words(self) -> int:
        return -(-self.vocab // 32)

    def kv_shape(self) -> tuple[int, ...]:
        """With the trash page."""
        return (self.max_kv_pages + 1, self.kv_layers, 2, self.page_tokens, self.kv_heads, self.head_dim)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_recipe(cls, config: LlamaFamilyConfig, eos: tuple[int, ...], **capacity: int) -> Geometry:
        raw = config.raw
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            ffn=config.intermediate_size,
            vocab=config.vocab_size,
            eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=config.tie_word_embeddings,
            attention_bias=config.attention_bias,
            mlp_bias=config.mlp_bias,
            qk_norm=config.qk_norm,
            eos_token_ids=eos,
            **capacity,
        )


def attention_tokens(length: torch.Tensor | None, lanes: int, few_rows: bool) -> str:
    """How a step's tokens relate, for `flare::write_attend` (`attention.TOKENS`): a prefill
    chunk has a `length`; a decode step (few rows, one lane per request) has one token per
    request; anything else (speculative lanes) is "lanes"."""
    if length is not None:
        return "prefill"
    return "decode" if lanes == 1 and few_rows else "lanes"


def rope_parameters(raw_config: dict[str, Any], device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention scaling) exactly as Transformers computes them."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.AutoConfig.for_model(
        raw_config.get("model_type", "llama"),
        **{k: v for k, v in raw_config.items() if k not in ("model_type", "transformers_version")},
    )
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = str(params.get("rope_type", params.get("type", "default"))) if isinstance(params, dict) else "default"
    if kind == "default":
        base = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) if isinstance(params, dict) else 10000.0
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
        return inv.float(), 1.0
    inv, scaling = ROPE_INIT_FUNCTIONS[kind](cfg, device)
    return inv.float(), float(scaling)


class PagedLlama:
    """Holds execution-layout weights (names from `ignition.recipes.llama`) and the step programs.

    Every step method takes (inputs, kv, rows, hist, records, pending), mutates only those state
    tensors and returns the normed final hidden vectors of the tokens it consumed (decode: [B, H];
    prefill: [T, H]; resume: [1, H]).
    """

    # Whether `flare::write_attend` rotates q and k itself (cos/sin given), which the attention
    # tuner times the same way (`ignition.capture.attention_tune`).
    rope_in_attention = True

    def __init__(
        self,
        geo: Geometry,
        weights: dict[str, torch.Tensor],
        inv_freq: torch.Tensor,
        rope_scaling: float,
        attention_kernel: bool,
        gemv: bool = False,
        sampler_kernel: bool = False,
    ) -> None:
        """`gemv`: decode projections and the sampled rows' vocabulary projection through
        `flare::gemv` (needs the attention kernels' device; the caller checks the buckets fit
        `GEMV_MAX_ROWS`). `sampler_kernel`: sampling through `flare::sample` (same device)."""
        self.geo = geo
        self.w = weights
        self.inv_freq = inv_freq
        self.rope_scaling = rope_scaling
        self.kernel = attention_kernel
        # Created before tracing (Dynamo does not trace its creation); None: the gather reference.
        self.write_attend = write_attend_op() if attention_kernel else None
        self.trash_page = geo.max_kv_pages
        self.gemv = gemv and attention_kernel
        self.proj = Projections(self.gemv)
        self.sampler = Sampler(sampler_kernel and attention_kernel)

    def projection_problems(self) -> list[Problem]:
        """Each projection role with its per-layer weights, for `gemv.tune` (before capture)."""
        g, w = self.geo, self.w
        layers = range(g.layers)

        def each(name: str) -> list[torch.Tensor]:
            return [w[f"layers.{i}.{name}"] for i in layers]

        def biases(name: str) -> list[torch.Tensor] | None:
            return each(name) if f"layers.0.{name}" in w else None

        return [
            Problem(
                "qkv",
                each("qkv"),
                Variant(norm=True, bias=g.attention_bias),
                biases("qkv_bias"),
                each("input_norm"),
                g.eps,
            ),
            Problem("o_proj", each("o_proj"), Variant(bias=g.attention_bias, residual=True), biases("o_proj_bias")),
            Problem(
                "gate_up",
                each("gate_up"),
                Variant(norm=True, bias=g.mlp_bias),
                biases("gate_up_bias"),
                each("post_attention_norm"),
                g.eps,
            ),
            Problem("down", each("down"), Variant(glu=True, bias=g.mlp_bias, residual=True), biases("down_bias")),
            Problem("lm_head", [self.head()], Variant()),
        ]

    def head(self) -> torch.Tensor:
        return self.w["embed_tokens"] if self.geo.tie_embeddings else self.w["lm_head"]

    def _bias(self, name: str) -> torch.Tensor | None:
        return self.w.get(name)

    # -- the forward -----------------------------------------------------------------------
    def _embed(
        self, tok: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What every layer shares: the embedded tokens, RoPE cos/sin of the positions (over
        the rotary dims), and each token's KV page and offset (padding: the trash page)."""
        g = self.geo
        x = self.w["embed_tokens"][tok.long()]
        ang = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([ang, ang], -1)
        cos = (emb.cos() * self.rope_scaling).to(x.dtype)
        sin = (emb.sin() * self.rope_scaling).to(x.dtype)
        valid = slots >= 0
        page = torch.where(valid, slots // g.page_tokens, self.trash_page)
        off = torch.where(valid, slots % g.page_tokens, 0)
        return x, cos, sin, page, off

    def hidden(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        page_table: torch.Tensor,
        req: torch.Tensor,
        kv: torch.Tensor,
        few_rows: bool = False,
        live: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        length: torch.Tensor | None = None,
        lanes: int = 1,
    ) -> torch.Tensor:
        """tok/pos [N]; slots [N] int64 KV slot (negative: no write); page_table [R, P] int32;
        req [N] page-table row of each token. `few_rows`: a decode step (projections as GEMVs
        when the core has them). Recipes with state in the continuation rows also get `rows`,
        `live` (decode: each lane's live row; prefill: [1], the request's) with -1 for padding,
        and for prefill `length` [1], the real tokens of the chunk, and for a speculative program
        `lanes` (its lanes per request); this forward keeps no such state."""
        g, w, proj = self.geo, self.w, self.proj
        n = tok.shape[0]
        x, cos, sin, page, off = self._embed(tok, pos, slots)
        tables = page_table if self.kernel else page_table.long().clamp(min=0)
        hq, hk = g.heads * g.head_dim, g.kv_heads * g.head_dim
        scale = g.head_dim**-0.5
        tokens = attention_tokens(length, lanes, few_rows)
        for i in range(g.layers):
            p = f"layers.{i}."
            qkv = proj(
                x, w[p + "qkv"], self._bias(p + "qkv_bias"), norm=w[p + "input_norm"], eps=g.eps, few_rows=few_rows
            )
            q = qkv[:, :hq].reshape(n, g.heads, g.head_dim)
            k = qkv[:, hq : hq + hk].reshape(n, g.kv_heads, g.head_dim)
            v = qkv[:, hq + hk :].reshape(n, g.kv_heads, g.head_dim)
            if g.qk_norm:
                q = proj.norm(q, w[p + "q_norm"], g.eps, few_rows=few_rows)
                k = proj.norm(k, w[p + "k_norm"], g.eps, few_rows=few_rows)
            if self.write_attend is not None:
                # RoPE happens inside the op, on the projection's views.
                o = self.write_attend(q, k, v, cos, sin, kv, slots, tables, req, pos, i, scale, tokens).reshape(n, hq)
            else:
                q, k = rotate(q, cos, sin), rotate(k, cos, sin)
                kv[page, i, 0, off] = k
                kv[page, i, 1, off] = v
                o = attend_gather(q, kv, i, tables, req, pos, scale)
            x = proj(o, w[p + "o_proj"], self._bias(p + "o_proj_bias"), residual=x, few_rows=few_rows)
            post = w[p + "post_attention_norm"]
            gu = proj(x, w[p + "gate_up"], self._bias(p + "gate_up_bias"), norm=post, eps=g.eps, few_rows=few_rows)
            x = proj(gu, w[p + "down"], self._bias(p + "down_bias"), glu=True, residual=x, few_rows=few_rows)
        return proj.norm(x, w["final_norm"], g.eps, few_rows=few_rows)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection of the rows that sample (at most a decode bucket's)."""
        n = h.shape[0]
        if self.gemv:
            return self.proj(h, self.head(), few_rows=True)
        if n < MIN_GEMM_ROWS:
            return F.linear(F.pad(h, (0, 0, 0, MIN_GEMM_ROWS - n)), self.head())[:n]
        return F.linear(h, self.head())

    # -- sampling and records ----------------------------------------------------------------
    def _sample_and_record(
        self,
        h: torch.Tensor,
        slots: torch.Tensor,
        wants: torch.Tensor,
        consumed: torch.Tensor,
        s: dict[str, torch.Tensor],
        hist: torch.Tensor,
        records: torch.Tensor,
        pending: torch.Tensor,
    ) -> None:
        """h [B, H]; slots [B] live rows (negative: padding); wants [B] bool (the row samples)."""
        g = self.geo
        b = h.shape[0]
        live = (slots == 0) | g.is_live_row(slots)
        hrow = g.slot_entry(slots).long()
        tok, allowed = self.sampler(self.logits(h), hist, hrow, s, s["rng_counter"], s.get("grammar_mask"))
        sampled = wants & live & allowed
        eos = torch.zeros_like(sampled)
        for e in g.eos_token_ids:
            eos = eos | (tok == e)
        flags = (
            sampled.int() * FLAG_SAMPLED
            + (sampled & eos).int() * FLAG_EOS
            + (wants & live & ~allowed).int() * FLAG_GRAMMAR_EXHAUSTED
        )
        z = torch.zeros(b, dtype=torch.int32, device=h.device)
        counter_low = (s["rng_counter"].long() & M32).to(torch.int32)
        cols = [z + RECORD_MAGIC, slots.int(), flags.int(), sampled.int(), consumed.int(), counter_low, z, z]
        cols.append(torch.where(sampled, tok, 0).int())
        cols += [z] * (records.shape[1] - HEADER_WORDS - 1)
        records.copy_(torch.stack(cols, -1))
        hist.index_put_((torch.where(sampled, hrow, 0), tok), sampled.int(), accumulate=True)
        # Lanes that store nothing write entry 0 with its own value: every write to one index then
        # carries the same value, so the unordered scatter is deterministic and entry 0 unchanged.
        prow = torch.where(sampled, hrow, 0)
        pending.index_put_((prow,), torch.where(prow > 0, tok.to(pending.dtype), pending[0]))

    # -- continuation rows ---------------------------------------------------------------------
    def row_storage(self) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the continuation rows tensor (this recipe: the final hidden vector
        and the stamp, as bf16 words)."""
        return (self.geo.total_rows, self.geo.hidden + STAMP_BYTES // 2), torch.bfloat16

    def hidden_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The [R, hidden] view of the rows' saved final hidden vectors."""
        return rows[:, : self.geo.hidden]

    def hidden_offset(self) -> int:
        """Byte offset of the hidden vector in a row."""
        return 0

    def stamp_offset(self) -> int:
        """Byte offset of the stamp in a row: right after the hidden vector (`_store_rows`
        writes both at once)."""
        return self.hidden_offset() + self.geo.hidden * 2

    def stamps(self, rows: torch.Tensor) -> torch.Tensor:
        """The [R, 2] int32 view of the rows' stamps (consumed, epoch)."""
        raw = rows.view(torch.uint8).view(rows.shape[0], -1)
        at = self.stamp_offset()
        return raw[:, at : at + STAMP_BYTES].view(torch.int32)

    @staticmethod
    def row_bits(rows: torch.Tensor) -> torch.Tensor:
        """The rows as integers of their own width: copies through them keep every bit (a float
        select could quiet a NaN-shaped stamp)."""
        return rows.view({2: torch.int16, 4: torch.int32}.get(rows.element_size(), torch.uint8))

    def recurrent_states(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Views of the rows' recurrent state per layer that keeps one (none for this recipe)."""
        return []

    def randomize_rows(self, rows: torch.Tensor, generator: torch.Generator) -> None:
        """Finite random contents for every row (the replay checks' inputs)."""
        rows.copy_(torch.randn(rows.shape, generator=generator, device=rows.device).to(rows.dtype))

    def cache_scheme(self) -> dict[str, Any]:
        """The core's cache scheme: KV page regions and the continuation row layout."""
        g = self.geo
        return {
            "page_tokens": g.page_tokens,
            "page_regions": [
                {"name": f"layer{i}.{half}", "bytes_per_page": g.region_bytes}
                for i in range(g.kv_layers)
                for half in ("k", "v")
            ],
            "continuation_row_bytes": g.row_bytes,
            "row_layout": [
                {"name": "final_hidden", "kind": "hidden_vector", "offset": 0, "byte_size": g.hidden * 2},
                {"name": "stamp", "kind": "position_metadata", "offset": self.stamp_offset(), "byte_size": STAMP_BYTES},
            ],
            "live_rows_per_slot": 1,
            "verification_width": g.verification_width,
            "padding_slot": -1,
        }

    def _store_rows(
        self, rows: torch.Tensor, slots: torch.Tensor, h: torch.Tensor, consumed: torch.Tensor
    ) -> torch.Tensor:
        """Saves each live lane's hidden vector in its row and its consumed count in the row's
        stamp (the epoch kept); returns the vectors the step goes on with (here `h` itself; a
        recipe storing through an op returns the op's output)."""
        live = (slots >= 0) & (slots < rows.shape[0])
        idx = torch.where(live, slots, 0).long()
        # One write, as integers (exact bits), of the span from the hidden vector to the end of
        # the stamp that follows it: the vector, the new consumed count, the row's epoch.
        bits = self.row_bits(rows)
        size = bits.element_size()
        a, b = self.hidden_offset() // size, (self.stamp_offset() + STAMP_BYTES) // size
        stamp = torch.stack([consumed.to(torch.int32), self.stamps(rows)[idx, 1]], -1)
        vec = h.to(torch.bfloat16).view(bits.dtype)
        new = torch.cat([vec, stamp.view(bits.dtype).view(h.shape[0], -1)], -1)
        # Lanes that store nothing write the null row's own value back: every write to row 0 then
        # carries the same bytes, so the unordered scatter is deterministic and row 0 unchanged.
        span = bits[:, a:b]
        span[idx] = torch.where(live[:, None], new, span[0].expand_as(new))
        return h

    def _commit_columns(
        self, rows: torch.Tensor, live: torch.Tensor, accepted: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor:
        """After a speculative program: a recipe whose state keeps a column per lane makes each
        live request's accepted column its live state (live [B] rows, negative: none; accepted
        [B] its last consumed lane) and returns x for the step to go on with. This forward keeps
        no columns."""
        return x

    # -- step programs -----------------------------------------------------------------------
    def decode(
        self,
        v: dict[str, torch.Tensor],
        kv: torch.Tensor,
        rows: torch.Tensor,
        hist: torch.Tensor,
        records: torch.Tensor,
        pending: torch.Tensor,
    ) -> torch.Tensor:
        """One token per request row; its KV slot follows from its position and page table."""
        g = self.geo
        slots = v["request_slots"].long()
        pos = v["positions"].long()
        b = pos.shape[0]
        rowsel = torch.arange(b, device=pos.device)
        table = v["page_table"]
        pidx = (pos // g.page_tokens).clamp(0, g.pages_per_request - 1)
        slot = table.long()[rowsel, pidx] * g.page_tokens + pos % g.page_tokens
        valid = (slots >= 0) & (slot >= 0)
        slot = torch.where(valid, slot, -1)
        # A negative packed id: the lane consumes its row's pending token (padding reads entry 0).
        prow = g.slot_entry(slots)
        tok = torch.where(v["token_ids"] < 0, pending[prow], v["token_ids"])
        m = b if self.gemv else max(b, MIN_GEMM_ROWS)
        live = torch.where(valid, slots, -1)
        if m > b:  # inert rows: no KV write, page table -1 (reads page 0), position 0
            tok = F.pad(tok, (0, m - b))
            h = self.hidden(
                tok,
                F.pad(v["positions"], (0, m - b)),
                F.pad(slot, (0, m - b), value=-1),
                F.pad(table, (0, 0, 0, m - b), value=-1),
                torch.arange(m, device=pos.device),
                kv,
                live=F.pad(live, (0, m - b), value=-1),
                rows=rows,
            )[:b]
        else:
            h = self.hidden(tok, v["positions"], slot, table, rowsel, kv, few_rows=True, live=live, rows=rows)
        h = self._store_rows(rows, live, h, pos + 1)
        wants = (v["sample_flags"] & 1) != 0
        self._sample_and_record(h, torch.where(valid, slots, -1), wants, pos + 1, v, hist, records, pending)
        return h

    def verify(
        self,
        v: dict[str, torch.Tensor],
        kv: torch.Tensor,
        rows: torch.Tensor,
        hist: torch.Tensor,
        records: torch.Tensor,
        pending: torch.Tensor,
    ) -> torch.Tensor:
        """A speculative program: request i owns lanes i*W .. i*W+W; lane j consumes the pending
        token (j = 0; a negative packed id reads the row's pending token) or proposal j at position
        start + j and samples with counter + j, its histogram the row's plus the proposals before
        it (what ordinary decoding would have counted by then). The accepted prefix is the longest
        run of lanes whose sample equals the next lane's proposal (stopping at EOS or an exhausted
        grammar); the request emits those samples and the one after them, its row keeps the last
        accepted lane's hidden vector, its pending token and histogram advance over what it
        emitted. Rejected lanes wrote KV past the accepted length: garbage the scheduler
        overwrites before anything reads it. A recipe with recurrent state leaves each lane's in
        its request's column row + j and installs the last consumed lane's in the live row
        (`_commit_columns`). Returns the lanes' hidden vectors [P, H]."""
        g = self.geo
        slots = v["request_slots"].long()
        b = slots.shape[0]
        p = v["token_ids"].shape[0]
        w = p // b
        dev = slots.device
        lane = torch.arange(p, device=dev)
        req, j = lane // w, lane % w
        q = v["query_lengths"].long()
        live_req = g.is_live_row(slots) & (q > 0)
        prow = torch.where(live_req, g.slot_entry(slots), 0)  # [B]: padding reads and writes the null entry
        used = (j < q[req]) & live_req[req]
        pos = v["positions"].long()
        table = v["page_table"]
        pidx = (pos // g.page_tokens).clamp(0, g.pages_per_request - 1)
        slot = table.long()[req, pidx] * g.page_tokens + pos % g.page_tokens
        slot = torch.where(used & (slot >= 0), slot, -1)
        packed = v["token_ids"]
        tok = torch.where((packed < 0) & (j == 0), pending[prow][req], packed)
        tok = torch.where(used, tok, 0).to(packed.dtype)  # unused lanes: an inert in-vocabulary id
        live = torch.where(used, slots[req], -1)  # each lane's request's live row
        m = p if self.gemv else max(p, MIN_GEMM_ROWS)
        if m > p:  # inert rows past the lanes: no KV write, an all -1 page-table row, position 0
            h = self.hidden(
                F.pad(tok, (0, m - p)),
                F.pad(v["positions"], (0, m - p)),
                F.pad(slot, (0, m - p), value=-1),
                F.pad(table, (0, 0, 0, 1), value=-1),
                F.pad(req, (0, m - p), value=b),
                kv,
                live=F.pad(live, (0, m - p), value=-1),
                rows=rows,
                lanes=w,
            )[:p]
        else:
            h = self.hidden(tok, v["positions"], slot, table, req, kv, few_rows=True, live=live, rows=rows, lanes=w)
        # Each lane's histogram: the row's, plus the proposals of the lanes before it (1..j).
        lane_hist = hist[prow][req]
        k = torch.arange(w, device=dev)
        before = (k[None, :] >= 1) & (k[None, :] <= j[:, None]) & used[:, None]  # [P, W]
        ids = tok.long().view(b, w)[req]  # [P, W]: the tokens of the lane's request
        lane_hist.index_put_((lane[:, None].expand(p, w), ids), before.to(lane_hist.dtype), accumulate=True)
        # Each lane samples with its request's values; lane j's counter is j past lane 0's.
        names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty")
        s = {key: v[key][req] for key in (*names, "frequency_penalty", "rng_seed", "rng_counter")}
        y, allowed = self.sampler(self.logits(h), lane_hist, lane, s, s["rng_counter"] + j, v.get("grammar_mask"))
        eos = torch.zeros_like(allowed)
        for e in g.eos_token_ids:
            eos = eos | (y == e)
        y2, allowed2, eos2 = y.view(b, w), allowed.view(b, w), eos.view(b, w)
        # Lane c continues the run when its sample equals lane c+1's proposal.
        nxt = tok.long().view(b, w)[:, 1:]
        cont = (y2[:, :-1] == nxt) & allowed2[:, :-1] & ~eos2[:, :-1] & (k[None, 1:] < q[:, None])
        accepted = torch.where(cont, w - 1, k[None, :-1]).amin(-1)  # [B]: the first lane that stops
        fin = torch.arange(b, device=dev) * w + accepted  # each request's last consumed lane
        wants = ((v["sample_flags"] & 1) != 0) & live_req
        sampled = wants & allowed[fin]
        emitted = (k[None, :] <= accepted[:, None]) & sampled[:, None]  # [B, W]
        # The row keeps the last consumed lane's hidden vector (padding writes the null row back).
        start = pos.view(b, w)[:, 0]
        live_rows = torch.where(live_req, slots, -1)
        h_fin = self._commit_columns(rows, live_rows, accepted, h[fin])
        stored = self._store_rows(rows, live_rows, h_fin, start + 1 + accepted)
        # The output goes through the stores: a recipe storing through ops (undeclared writes)
        # keeps them in the graph only while something consumes what they return.
        h = h.index_put((fin,), stored)
        flags = (
            sampled.int() * FLAG_SAMPLED
            + (sampled & eos[fin]).int() * FLAG_EOS
            + (wants & ~allowed[fin]).int() * FLAG_GRAMMAR_EXHAUSTED
        )
        z = torch.zeros(b, dtype=torch.int32, device=dev)
        counter_low = (v["rng_counter"].long() & M32).to(torch.int32)
        count = torch.where(sampled, accepted + 1, 0)
        cols = [z + RECORD_MAGIC, torch.where(live_req, slots, -1).int(), flags.int(), count.int()]
        cols += [torch.where(live_req, start + 1 + accepted, 0).int(), counter_low, z, z]
        head = torch.stack(cols, -1)
        words = torch.where(emitted, y2, 0).int()
        records.copy_(torch.cat([head, words, z[:, None].expand(b, records.shape[1] - HEADER_WORDS - w)], -1))
        hist.index_put_((torch.where(emitted, prow[:, None], 0), y2), emitted.int(), accumulate=True)
        last = y2.gather(1, accepted[:, None])[:, 0]
        # Requests that store nothing write entry 0 with its own value (a deterministic scatter).
        target = torch.where(sampled, prow, 0)
        pending.index_put_((target,), torch.where(target > 0, last.to(pending.dtype), pending[0]))
        return h

    def prefill(
        self,
        v: dict[str, torch.Tensor],
        kv: torch.Tensor,
        rows: torch.Tensor,
        hist: torch.Tensor,
        records: torch.Tensor,
        pending: torch.Tensor,
    ) -> torch.Tensor:
        """One request's chunk; the row keeps the hidden vector of its last real token."""
        t = v["token_ids"].shape[0]
        req = torch.zeros(t, dtype=torch.int32, device=v["token_ids"].device)
        q = v["query_lengths"].long()
        live = torch.where(q > 0, v["request_slots"].long(), -1)
        h = self.hidden(
            v["token_ids"], v["positions"], v["slot_mapping"], v["page_table"], req, kv, live=live, rows=rows, length=q
        )
        last = (q - 1).clamp(0, t - 1)
        h_last = h[last]
        slots = torch.where(q > 0, v["request_slots"].long(), -1)
        consumed = v["positions"].long()[last] + 1
        h_last = self._store_rows(rows, slots, h_last, consumed)
        wants = (v["sample_flags"] & 1) != 0
        self._sample_and_record(h_last, slots, wants, consumed, v, hist, records, pending)
        return h

    def resume(
        self,
        v: dict[str, torch.Tensor],
        kv: torch.Tensor,
        rows: torch.Tensor,
        hist: torch.Tensor,
        records: torch.Tensor,
        pending: torch.Tensor,
    ) -> torch.Tensor:
        """Samples from a restored row's saved hidden vector; nothing is consumed."""
        src = v["state_row_indices"].long()
        h = self.hidden_rows(rows)[src.clamp(0, rows.shape[0] - 1)]
        slots = torch.where(src >= 0, v["request_slots"].long(), -1)
        wants = (v["sample_flags"] & 1) != 0
        self._sample_and_record(h, slots, wants, v["context_lengths"].long(), v, hist, records, pending)
        return h

    def initialize(
        self,
        v: dict[str, torch.Tensor],
        kv: torch.Tensor,
        rows: torch.Tensor,
        hist: torch.Tensor,
        records: torch.Tensor,
        pending: torch.Tensor,
    ) -> torch.Tensor:
        """Clears a live row (its stamp becomes (0, 0)) and its histogram."""
        dst = v["destination_rows"].long().clamp(0, rows.shape[0] - 1)
        rows[dst] = torch.zeros_like(rows[dst])
        hd = self.geo.slot_entry(dst)
        hist[hd] = torch.zeros_like(hist[hd])
        self._maintenance_record(records, dst, torch.zeros_like(dst, dtype=torch.bool), self.stamps(rows)[dst])
        return rows[dst]

    def restore(
        self,
        v: dict[str, torch.Tensor],
        kv: torch.Tensor,
        rows: torch.Tensor,
        hist: torch.Tensor,
        records: torch.Tensor,
        pending: torch.Tensor,
    ) -> torch.Tensor:
        """A snapshot row into a live row, stamp included, and the live row's histogram cleared;
        nothing written unless the snapshot's stamp is the expected (consumed, epoch)."""
        dst, ok = self._checked_copy(v, rows, records, restore=True)
        hd = self.geo.slot_entry(dst)
        hist[hd] = torch.where(ok[:, None], torch.zeros_like(hist[hd]), hist[hd])
        return rows[dst]

    def snapshot(
        self,
        v: dict[str, torch.Tensor],
        kv: torch.Tensor,
        rows: torch.Tensor,
        hist: torch.Tensor,
        records: torch.Tensor,
        pending: torch.Tensor,
    ) -> torch.Tensor:
        """A live row into a snapshot row, stamped with the checkpoint's epoch; nothing written
        unless the live row has consumed the expected count."""
        dst, _ = self._checked_copy(v, rows, records, restore=False)
        return rows[dst]

    def _checked_copy(
        self, v: dict[str, torch.Tensor], rows: torch.Tensor, records: torch.Tensor, restore: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Snapshot (live -> snapshot row) or restore (snapshot -> live row), checked before any
        write: the direction always; with an expected consumed count >= 0 also the source's
        stamp (restore: consumed and epoch; snapshot: consumed). Writes the outcome's record;
        returns (destination rows, accepted)."""
        g = self.geo
        n = rows.shape[0]
        src_in, dst_in = v["source_rows"].long(), v["destination_rows"].long()
        src, dst = src_in.clamp(0, n - 1), dst_in.clamp(0, n - 1)

        expected = v["expected_consumed"].long()
        epoch = v["checkpoint_epoch"].long() if "checkpoint_epoch" in v else torch.zeros_like(expected)
        found = self.stamps(rows)[src]
        match = found[:, 0].long() == expected
        if restore:
            direction = g.is_snapshot_row(src_in) & g.is_live_row(dst_in)
            match = match & (found[:, 1].long() == epoch)
        else:
            direction = g.is_live_row(src_in) & g.is_snapshot_row(dst_in)
        ok = direction & ((expected < 0) | match)
        bits = self.row_bits(rows)
        new = bits[src].clone()
        if not restore:  # the snapshot carries the checkpoint's epoch
            words = STAMP_BYTES // bits.element_size()
            at = self.stamp_offset() // bits.element_size()
            stamp = torch.stack([found[:, 0], epoch.to(torch.int32)], -1).view(bits.dtype).view(-1, words)
            new = torch.cat([new[:, :at], stamp, new[:, at + words :]], -1)
        bits[dst] = torch.where(ok[:, None], new, bits[dst])
        self._maintenance_record(records, dst, ~ok, found)
        return dst, ok

    def _maintenance_record(
        self, records: torch.Tensor, dst: torch.Tensor, rejected: torch.Tensor, found: torch.Tensor
    ) -> None:
        """A maintenance op's status record: its destination, whether it was rejected (nothing
        written), the source's stamp as it found it."""
        z = torch.zeros(dst.shape[0], dtype=torch.int32, device=dst.device)
        cols = [z + RECORD_MAGIC, dst.int(), rejected.int() * FLAG_CHECKPOINT_REJECTED, z]
        cols += [found[:, 0].int(), found[:, 1].int()] + [z] * (records.shape[1] - 6)
        records.copy_(torch.stack(cols, -1))

    def admit_histogram(
        self,
        v: dict[str, torch.Tensor],
        kv: torch.Tensor,
        rows: torch.Tensor,
        hist: torch.Tensor,
        records: torch.Tensor,
        pending: torch.Tensor,
    ) -> torch.Tensor:
        """Adds one chunk of a request's prompt to its live row's penalty histogram (negative ids
        are padding; the row was cleared by initialize or restore)."""
        g = self.geo
        row = v["request_slots"].long()[:1]
        ids = v["token_ids"].long()
        live = g.is_live_row(row)
        ok = (ids >= 0) & (ids < g.vocab) & live
        entry = g.slot_entry(row)
        target = torch.where(ok, entry.expand_as(ids), 0)
        hist.index_put_((target, ids.clamp(0, g.vocab - 1)), ok.int(), accumulate=True)
        return hist[entry]
