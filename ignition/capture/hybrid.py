"""The prepared Qwen3.5 forward: Gated DeltaNet layers over explicit state in the continuation
rows, gated full-attention layers over the paged KV, and everything else (sampling, records,
histograms, pending tokens, state maintenance) as the paged Llama forward runs it.

Continuation row layout (bytes, every region 16-byte aligned), per GDN layer in layer order:
`layer{i}.conv` the convolution history [C, K-1] (activation dtype) and `layer{i}.recurrent` the
delta-rule matrix [Hv, Dk, Dv] (float32); then `final_hidden` [hidden] (activation dtype).
Invariants (beside those of `ignition.capture.paged`):
- a live row's GDN regions hold the state after exactly the tokens its request consumed: a
  decode lane advances them by one token, a prefill chunk by its `query_lengths` tokens (the
  chunk's padding never enters them); a lane with a negative live row writes no row;
- initialize zeroes a row (every region), restore and snapshot copy whole rows, so a restored
  request continues from exactly the state its checkpoint saved;
- with speculative programs each slot owns W rows (the cache scheme's verification width, the
  widest program's lanes): lane j of a round leaves the GDN state after it in column row + j
  (column 0 is the live row), each lane's update the decode step's, and the round then copies
  its last consumed lane's column into the live row (`flare::commit_columns`). Columns are
  scratch: no other program reads them, and snapshot and restore see the live row only;
- KV pages hold only the attention layers (`kv_layers`), indexed by attention ordinal.

Arithmetic follows Transformers' `qwen3_5` (zero-centred RMSNorm `x * rsqrt(.) * (1 + w)` in
float32, the gated RMSNorm on the GDN output, the sigmoid output gate on attention, partial
rotary on the first `rotary_dim` dims of each head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ignition.capture import gdn
from ignition.capture.attention import attend_gather, rotate
from ignition.capture.gemv import Problem, Variant
from ignition.capture.paged import GEMV_MAX_ROWS, STAMP_BYTES, Geometry, PagedLlama, attention_tokens

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ignition.recipes.qwen3_5 import Qwen35Config

ALIGN = 16
# Tokens per chunk of the chunked GDN prefill (`--gdn-prefill chunked`).
GDN_PREFILL_CHUNK = 32


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class HybridGeometry(Geometry):
    layer_kinds: tuple[str, ...] = ()  # "linear_attention" | "full_attention" per layer
    rotary_dim: int = 0
    conv_channels: int = 0
    conv_kernel: int = 0
    gdn_key_heads: int = 0
    gdn_value_heads: int = 0
    gdn_key_dim: int = 0
    gdn_value_dim: int = 0

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "full_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "linear_attention"]

    @property
    def kv_layers(self) -> int:
        return len(self.attention_layers)

    def row_regions(self) -> list[dict[str, Any]]:
        """The continuation row layout: name, kind, offset, byte_size (see the module doc)."""
        out: list[dict[str, Any]] = []
        at = 0
        conv = self.conv_channels * (self.conv_kernel - 1) * 2
        recurrent = self.gdn_value_heads * self.gdn_key_dim * self.gdn_value_dim * 4
        for i in self.gdn_layers:
            out.append({"name": f"layer{i}.conv", "kind": "convolution_history", "offset": at, "byte_size": conv})
            at += _up(conv)
            out.append({"name": f"layer{i}.recurrent", "kind": "recurrent_state", "offset": at, "byte_size": recurrent})
            at += _up(recurrent)
        out.append({"name": "final_hidden", "kind": "hidden_vector", "offset": at, "byte_size": self.hidden * 2})
        # The stamp right after the hidden vector (4-byte aligned: the hidden size is even).
        at += self.hidden * 2
        out.append({"name": "stamp", "kind": "position_metadata", "offset": at, "byte_size": STAMP_BYTES})
        return out

    @property
    def row_bytes(self) -> int:
        last = self.row_regions()[-1]
        return _up(int(last["offset"]) + int(last["byte_size"]))

    @classmethod
    def from_qwen35(cls, config: Qwen35Config, eos: tuple[int, ...], **capacity: int) -> HybridGeometry:
        c = config
        factor = float((c.text.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25))
        return cls(
            layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            ffn=c.intermediate_size,
            vocab=c.vocab_size,
            eps=c.rms_norm_eps,
            tie_embeddings=c.tie_word_embeddings,
            attention_bias=c.attention_bias,
            mlp_bias=False,
            qk_norm=True,
            eos_token_ids=eos,
            layer_kinds=c.layer_types,
            rotary_dim=int(c.head_dim * factor),
            conv_channels=c.conv_channels,
            conv_kernel=c.conv_kernel,
            gdn_key_heads=c.linear_key_heads,
            gdn_value_heads=c.linear_value_heads,
            gdn_key_dim=c.linear_key_dim,
            gdn_value_dim=c.linear_value_dim,
            **capacity,
        )


def rope_inv_freq(config: Qwen35Config, rotary_dim: int) -> torch.Tensor:
    params = config.text.get("rope_parameters") or {}
    base = float(params.get("rope_theta", config.text.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} is not prepared for Qwen3.5 (default only)")
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


class PagedQwen35(PagedLlama):
    """Weights in the Qwen3.5 recipe's execution layout; the step programs of `PagedLlama`
    (decode, prefill, resume, maintenance) with this `hidden` and these continuation rows."""

    geo: HybridGeometry
    # q and k reach `flare::write_attend` rotated (partial rotary, after the gate split).
    rope_in_attention = False

    def __init__(
        self,
        geo: HybridGeometry,
        weights: dict[str, torch.Tensor],
        inv_freq: torch.Tensor,
        kernels: bool = False,
        attention_kernel: bool | None = None,
        gemv: bool = False,
        sampler_kernel: bool = False,
    ) -> None:
        """`kernels`: the Triton ops (`flare::gdn_conv`, `flare::gdn_delta`, `flare::store_row`,
        and `flare::write_attend` unless `attention_kernel` says otherwise) that the graphs run;
        otherwise the eager reference (CPU). `gemv`: decode projections through `flare::gemv`, as
        for the dense recipe (the caller checks the buckets fit); `sampler_kernel`: `flare::sample`."""
        attention = kernels if attention_kernel is None else attention_kernel
        super().__init__(
            geo,
            weights,
            inv_freq,
            1.0,
            attention_kernel=attention,
            gemv=gemv,
            sampler_kernel=sampler_kernel,
        )
        # Created before tracing (Dynamo does not trace their creation).
        self.gdn = gdn.gdn_ops() if kernels else None
        self.commit = gdn.commit_op() if kernels else None
        # Row regions by name (offset, byte_size): the views below and the ops' offsets.
        self.regions = {str(r["name"]): r for r in geo.row_regions()}

    def projection_problems(self) -> list[Problem]:
        """Each projection role of the hybrid with its per-layer weights, for `gemv.tune`: the
        attention layers' `qkv` and `o_proj`, the GDN layers' `in_proj` and `out_proj`, every
        layer's MLP, and the vocabulary projection. The input and post-attention norms are the
        prologues of `in_proj`/`qkv` and `gate_up` (zero-centred: x * rstd * (1 + w))."""
        g, w = self.geo, self.w

        def each(name: str, layers: Sequence[int]) -> list[torch.Tensor]:
            return [w[f"layers.{i}.{name}"] for i in layers]

        def normed(name: str, layers: Sequence[int], norm: str, biases: list[torch.Tensor] | None = None) -> Problem:
            variant = Variant(norm=True, bias=biases is not None)
            return Problem(name, each(name, layers), variant, biases, each(norm, layers), g.eps, "zero_centred")

        every = range(len(g.layer_kinds))
        attn, gdn_layers = list(g.attention_layers), list(g.gdn_layers)
        problems = [
            normed("in_proj", gdn_layers, "input_norm"),
            Problem("out_proj", each("out_proj", gdn_layers), Variant(residual=True)),
            normed("gate_up", every, "post_attention_norm"),
            Problem("down", each("down", every), Variant(glu=True, residual=True)),
            Problem("lm_head", [self.head()], Variant()),
        ]
        if attn:
            qkv_bias = each("qkv_bias", attn) if f"layers.{attn[0]}.qkv_bias" in w else None
            o_bias = each("o_proj_bias", attn) if f"layers.{attn[0]}.o_proj_bias" in w else None
            problems += [
                normed("qkv", attn, "input_norm", qkv_bias),
                Problem("o_proj", each("o_proj", attn), Variant(bias=o_bias is not None, residual=True), o_bias),
            ]
        return problems

    # -- continuation rows -----------------------------------------------------------------------
    def row_storage(self) -> tuple[tuple[int, ...], torch.dtype]:
        return (self.geo.total_rows, self.geo.row_bytes), torch.uint8

    def _region(self, rows: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        r = self.regions[name]
        raw = rows[:, r["offset"] : r["offset"] + r["byte_size"]]
        return raw.view(dtype).view(rows.shape[0], *shape)

    def hidden_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self._region(rows, "final_hidden", torch.bfloat16, (self.geo.hidden,))

    def recurrent_states(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return [self.recurrent_rows(rows, layer) for layer in self.geo.gdn_layers]

    def randomize_rows(self, rows: torch.Tensor, generator: torch.Generator) -> None:
        """Finite values in every region's own dtype (random bytes would read as NaN floats)."""
        rows.zero_()
        views = [self.hidden_rows(rows)]
        for layer in self.geo.gdn_layers:
            views += [self.conv_rows(rows, layer), self.recurrent_rows(rows, layer)]
        for v in views:
            scale = 0.1 if v.dtype == torch.float32 else 1.0
            v.copy_((torch.randn(v.shape, generator=generator, device=rows.device) * scale).to(v.dtype))

    def conv_rows(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        g = self.geo
        return self._region(rows, f"layer{layer}.conv", torch.bfloat16, (g.conv_channels, g.conv_kernel - 1))

    def recurrent_rows(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        g = self.geo
        shape = (g.gdn_value_heads, g.gdn_key_dim, g.gdn_value_dim)
        return self._region(rows, f"layer{layer}.recurrent", torch.float32, shape)

    def hidden_offset(self) -> int:
        return int(self.regions["final_hidden"]["offset"])

    def _store_rows(
        self, rows: torch.Tensor, slots: torch.Tensor, h: torch.Tensor, consumed: torch.Tensor
    ) -> torch.Tensor:
        if self.gdn is None:
            return super()._store_rows(rows, slots, h, consumed)
        live = torch.where((slots >= 0) & (slots < rows.shape[0]), slots, -1).int()
        out: torch.Tensor = self.gdn[2](
            h.to(torch.bfloat16),
            rows,
            live,
            self.regions["final_hidden"]["offset"],
            consumed.to(torch.int32),
            self.stamp_offset(),
        )
        return out

    def _commit_columns(
        self, rows: torch.Tensor, live: torch.Tensor, accepted: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor:
        """Each live request's GDN state (every region before the hidden vector) from the column
        of its last consumed lane into its live row; returns x (through the op on the device,
        which orders the copy before the step goes on)."""
        span = self.hidden_offset()
        if self.commit is not None:
            out: torch.Tensor = self.commit(x, rows, live.int(), accepted.int(), span)
            return out
        for r, a in zip(live.tolist(), accepted.tolist(), strict=True):
            if r >= 0 and a > 0:
                rows[r, :span] = rows[r + a, :span]
        return x

    def cache_scheme(self) -> dict[str, Any]:
        scheme = super().cache_scheme()
        scheme["continuation_row_bytes"] = self.geo.row_bytes
        scheme["row_layout"] = self.geo.row_regions()
        return scheme

    # -- the forward ---------------------------------------------------------------------------
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
        """As `PagedLlama.hidden`; `live` and `rows` are required (the GDN state), and `length`
        marks a prefill chunk (one request: `live` is [1]). `lanes` > 1: a speculative program's
        lanes, groups of `lanes` consecutive tokens of one request (`live`: the request's live
        row on each used lane), each lane's GDN state left in its column (row + lane index)."""
        if live is None or rows is None:
            raise ValueError("the hybrid forward needs the live rows and the continuation rows")
        g, w = self.geo, self.w
        n = tok.shape[0]
        x, cos, sin, page, off = self._embed(tok, pos, slots)
        tables = page_table.long().clamp(min=0)
        hd, rd = g.head_dim, g.rotary_dim
        attention = {layer: j for j, layer in enumerate(g.attention_layers)}
        tokens = attention_tokens(length, lanes, few_rows)
        proj = self.proj
        zc = "zero_centred"  # the input and post-attention norms: the next projection's prologue
        for i, kind in enumerate(g.layer_kinds):
            p = f"layers.{i}."
            if kind == "full_attention":
                qkv = proj(
                    x, w[p + "qkv"], self._bias(p + "qkv_bias"), norm=w[p + "input_norm"], eps=g.eps, norm_mode=zc,
                    few_rows=few_rows,
                )  # fmt: skip
                qg = qkv[:, : 2 * g.heads * hd].reshape(n, g.heads, 2 * hd)
                q, gate = qg[..., :hd], qg[..., hd:].reshape(n, g.heads * hd)
                k = qkv[:, 2 * g.heads * hd : (2 * g.heads + g.kv_heads) * hd].reshape(n, g.kv_heads, hd)
                v = qkv[:, (2 * g.heads + g.kv_heads) * hd :].reshape(n, g.kv_heads, hd)
                q = proj.norm(q, w[p + "q_norm"], g.eps, "zero_centred", few_rows=few_rows)
                k = proj.norm(k, w[p + "k_norm"], g.eps, "zero_centred", few_rows=few_rows)
                q = torch.cat([rotate(q[..., :rd], cos, sin), q[..., rd:]], -1)
                k = torch.cat([rotate(k[..., :rd], cos, sin), k[..., rd:]], -1)
                j = attention[i]
                if self.write_attend is not None:  # q and k arrive rotated: no rope in the op
                    o = self.write_attend(q, k, v, None, None, kv, slots, page_table, req, pos, j, hd**-0.5, tokens)
                    o = o.reshape(n, g.heads * hd)
                else:
                    kv[page, j, 0, off] = k
                    kv[page, j, 1, off] = v
                    o = attend_gather(q, kv, j, tables, req, pos, hd**-0.5)
                o = o * torch.sigmoid(gate)
                x = proj(o, w[p + "o_proj"], self._bias(p + "o_proj_bias"), residual=x, few_rows=few_rows)
            else:
                x = self._gdn(i, x, live, rows, length, residual=x, few_rows=few_rows, lanes=lanes)
            gu = proj(
                x, w[p + "gate_up"], norm=w[p + "post_attention_norm"], eps=g.eps, norm_mode=zc, few_rows=few_rows
            )
            # SiLU(gate) · up in the projection's prologue: [gate | up] halves, as packed.
            x = proj(gu, w[p + "down"], glu=True, residual=x, few_rows=few_rows)
        return proj.norm(x, w["final_norm"], g.eps, "zero_centred", few_rows=few_rows)

    def _gdn(
        self,
        layer: int,
        h: torch.Tensor,
        live: torch.Tensor,
        rows: torch.Tensor,
        length: torch.Tensor | None,
        residual: torch.Tensor,
        few_rows: bool = False,
        lanes: int = 1,
    ) -> torch.Tensor:
        """One GDN layer's token mixing over the rows' state (from the layer's input `h`, its
        input norm the projection's prologue), added to `residual` (eager
        reference: per lane / per request loops; the graphs run `ignition.capture.gdn`'s
        kernels). Decode and speculative lanes run the same per-token update: lane j of a
        group continues from the state lane j - 1 left (lane 0: the live row's) and leaves its
        own in column row + j, so with `lanes` 1 (decode) each lane updates its live row."""
        g, w = self.geo, self.w
        p = f"layers.{layer}."
        n = h.shape[0]
        c, vd, hv = g.conv_channels, g.gdn_value_heads * g.gdn_value_dim, g.gdn_value_heads
        kd = g.gdn_key_heads * g.gdn_key_dim
        projected = self.proj(
            h, w[p + "in_proj"], norm=w[p + "input_norm"], eps=g.eps, norm_mode="zero_centred", few_rows=few_rows
        )
        mixed, z = projected[:, :c], projected[:, c : c + vd]
        b, a = projected[:, c + vd : c + vd + hv], projected[:, c + vd + hv :]
        beta = torch.sigmoid(b)
        decay = -w[p + "a_log"].float().exp() * F.softplus(a.float() + w[p + "dt_bias"].float())
        conv_w = w[p + "conv"].reshape(c, g.conv_kernel)

        def split(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            t = y.shape[0]
            q = y[:, :kd].view(t, g.gdn_key_heads, g.gdn_key_dim)
            k = y[:, kd : 2 * kd].view(t, g.gdn_key_heads, g.gdn_key_dim)
            return q, k, y[:, 2 * kd :].view(t, g.gdn_value_heads, g.gdn_value_dim)

        if self.gdn is not None:
            conv_op, delta_op, _ = self.gdn
            lv = live.int()
            ln = None if length is None else length.int()
            conv_at = self.regions[f"layer{layer}.conv"]["offset"]
            y = conv_op(mixed, conv_w, rows, lv, ln, conv_at, g.conv_kernel, lanes)
            q, k, v = split(y)
            recurrent = self.regions[f"layer{layer}.recurrent"]["offset"]
            core = delta_op(q, k, v, decay.contiguous(), beta.float().contiguous(), rows, lv, ln, recurrent, lanes)
        elif length is None:  # decode (one token per lane on its own row) or speculative lanes
            hist, state = self.conv_rows(rows, layer), self.recurrent_rows(rows, layer)
            outs = []
            for lane in range(n):
                r, j = int(live[lane]), lane % lanes
                src = r + j - 1 if r >= 0 and j > 0 else max(r, 0)
                y, new_hist = gdn.conv_reference(mixed[lane : lane + 1], hist[src], conv_w)
                q, k, v = split(y)
                o, new_state = gdn.delta_rule_reference(
                    state[src], q, k, v, decay[lane : lane + 1], beta[lane : lane + 1]
                )
                if r >= 0:
                    hist[r + j] = new_hist
                    state[r + j] = new_state
                outs.append(o)
            core = torch.cat(outs)
        else:  # prefill: one request, the first `length` tokens real
            hist, state = self.conv_rows(rows, layer), self.recurrent_rows(rows, layer)
            r = int(live[0])
            src = max(r, 0)
            m = int(length[0])
            y, new_hist = gdn.conv_reference(mixed, hist[src], conv_w, m)
            q, k, v = split(y)
            core, new_state = gdn.delta_rule_reference(state[src], q, k, v, decay, beta, m)
            if r >= 0:
                hist[r] = new_hist
                state[r] = new_state
        o = self.proj.norm(
            core.reshape(n * hv, g.gdn_value_dim),
            w[p + "gdn_norm"],
            g.eps,
            "gated",
            z.reshape(n * hv, -1),
            few_rows=few_rows,
        )
        return self.proj(o.reshape(n, vd), w[p + "out_proj"], residual=residual, few_rows=few_rows)


def build_model(
    config: Qwen35Config,
    geo: HybridGeometry,
    largest_bucket: int,
    weights: dict[str, torch.Tensor],
    device: Any,
    options: Any,
) -> PagedQwen35:
    """The hybrid forward over the streamed weights; the Triton ops when preparing for the
    device (`options.attention_kernel`), the eager reference otherwise (or without options);
    decode projections through `flare::gemv` when asked and every bucket fits it; sampling
    through `flare::sample` when asked."""
    kernels = bool(options is not None and options.attention_kernel)
    gemv = kernels and options.decode_projections == "gemv" and largest_bucket <= GEMV_MAX_ROWS
    sampler = kernels and options.sampler == "kernel"
    gdn.PREFILL_CHUNK = GDN_PREFILL_CHUNK if kernels and options.gdn_prefill == "chunked" else None
    inv = rope_inv_freq(config, geo.rotary_dim).to(device)
    return PagedQwen35(geo, weights, inv, kernels, gemv=gemv, sampler_kernel=sampler)
