"""A small Llama-like model over 64-token KV pages, written so Inductor emits Triton kernels only.

Seeded random weights, bf16. Attention is written as broadcast-multiply-reduce (no bmm), the
projections as plain matmuls (Triton GEMM templates under `max_autotune_gemm_backends="TRITON"`),
KV writes through a slot mapping (negative slots write nothing), reads through a page table.
Every step ends with a greedy completion record per request (the contract's record layout:
magic, slot, flags, count, consumed, counter, reserved..., tokens).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

RECORD_MAGIC = 0x464C_5243
HEADER_WORDS = 8
FLAG_SAMPLED = 1


@dataclass(frozen=True)
class TinyConfig:
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 512
    vocab: int = 2048
    page_tokens: int = 64
    context_limit: int = 256
    request_slots: int = 4
    rope_theta: float = 10000.0
    eps: float = 1e-5
    seed: int = 0

    @property
    def pages_per_request(self) -> int:
        return self.context_limit // self.page_tokens

    @property
    def max_kv_pages(self) -> int:
        return self.request_slots * self.pages_per_request

    @property
    def region_bytes(self) -> int:
        """One layer's K (or V) of one page, bf16."""
        return self.page_tokens * self.kv_heads * self.head_dim * 2

    def kv_shape(self) -> tuple[int, ...]:
        return (self.max_kv_pages, self.layers, 2, self.page_tokens, self.kv_heads, self.head_dim)

    def as_dict(self) -> dict:
        return asdict(self)


class TinyLlama(nn.Module):
    def __init__(self, cfg: TinyConfig, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.cfg = c = cfg
        g = torch.Generator(device="cpu").manual_seed(cfg.seed)
        dt = torch.bfloat16

        def rand(*shape: int, scale: float = 0.05) -> nn.Parameter:
            t = (torch.randn(*shape, generator=g) * scale).to(dt)
            return nn.Parameter(t.to(device), requires_grad=False)

        def ones(n: int) -> nn.Parameter:
            t = (1.0 + 0.1 * torch.randn(n, generator=g)).to(dt)
            return nn.Parameter(t.to(device), requires_grad=False)

        qkv = (c.heads + 2 * c.kv_heads) * c.head_dim
        self.embed = rand(c.vocab, c.hidden, scale=1.0)
        self.attn_norm = nn.ParameterList([ones(c.hidden) for _ in range(c.layers)])
        self.wqkv = nn.ParameterList([rand(c.hidden, qkv) for _ in range(c.layers)])
        self.wo = nn.ParameterList([rand(c.heads * c.head_dim, c.hidden) for _ in range(c.layers)])
        self.mlp_norm = nn.ParameterList([ones(c.hidden) for _ in range(c.layers)])
        self.wgu = nn.ParameterList([rand(c.hidden, 2 * c.ffn) for _ in range(c.layers)])
        self.wd = nn.ParameterList([rand(c.ffn, c.hidden) for _ in range(c.layers)])
        self.norm = ones(c.hidden)
        self.head = rand(c.hidden, c.vocab)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Checkpoint-style names (execution layouts: projections stored [in, out], q|k|v fused)."""
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm, "lm_head.weight": self.head}
        for i in range(self.cfg.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = self.attn_norm[i]
            out[p + "self_attn.qkv_proj.weight"] = self.wqkv[i]
            out[p + "self_attn.o_proj.weight"] = self.wo[i]
            out[p + "post_attention_layernorm.weight"] = self.mlp_norm[i]
            out[p + "mlp.gate_up_proj.weight"] = self.wgu[i]
            out[p + "mlp.down_proj.weight"] = self.wd[i]
        return out

    # -- the step ----------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.eps) * w.float()).to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., ::2], xf[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2).to(x.dtype)

    def _forward(self, tok: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, req: torch.Tensor,
                 page_table: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """tok/pos [N] int32, slots [N] int64 (negative: no write), req [N] request row of each token."""
        c = self.cfg
        n = tok.shape[0]
        grp, ctx = c.heads // c.kv_heads, c.pages_per_request * c.page_tokens
        x = self.embed[tok.long()]
        pos64 = pos.long()
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=tok.device, dtype=torch.float32) / c.head_dim))
        ang = pos64[:, None].float() * inv[None, :]
        cos, sin = ang.cos(), ang.sin()
        valid = slots >= 0
        page = torch.where(valid, slots // c.page_tokens, 0)
        off = torch.where(valid, slots % c.page_tokens, 0)
        pages = page_table.long()[req.long()]  # [N, P]
        mask = torch.arange(ctx, device=tok.device)[None, :] <= pos64[:, None]  # [N, C]
        hq, hk = c.heads * c.head_dim, c.kv_heads * c.head_dim
        for i in range(c.layers):
            h = self._rms(x, self.attn_norm[i])
            qkv = h @ self.wqkv[i]
            q = self._rope(qkv[:, :hq].reshape(n, c.heads, c.head_dim), cos, sin)
            k = self._rope(qkv[:, hq : hq + hk].reshape(n, c.kv_heads, c.head_dim), cos, sin)
            v = qkv[:, hq + hk :].reshape(n, c.kv_heads, c.head_dim)
            w = valid[:, None, None]
            kv[page, i, 0, off] = torch.where(w, k, kv[page, i, 0, off])
            kv[page, i, 1, off] = torch.where(w, v, kv[page, i, 1, off])
            keys = kv[pages, i, 0].reshape(n, ctx, c.kv_heads, 1, c.head_dim).float()
            vals = kv[pages, i, 1].reshape(n, ctx, c.kv_heads, 1, c.head_dim).float()
            qf = q.float().reshape(n, 1, c.kv_heads, grp, c.head_dim)
            scores = (qf * keys).sum(-1) * (c.head_dim**-0.5)  # [N, C, KVH, G]
            scores = scores.masked_fill(~mask[:, :, None, None], float("-inf"))
            p = scores.softmax(1)
            o = (p[..., None] * vals).sum(1).to(x.dtype).reshape(n, hq)
            x = x + o @ self.wo[i]
            gu = self._rms(x, self.mlp_norm[i]) @ self.wgu[i]
            gate, up = gu[:, : c.ffn], gu[:, c.ffn :]
            x = x + (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype) @ self.wd[i]
        return self._rms(x, self.norm) @ self.head  # [N, V] bf16

    @staticmethod
    def _records(logits_rows: torch.Tensor, request_slots: torch.Tensor, consumed: torch.Tensor,
                 records: torch.Tensor) -> None:  # fmt: skip
        r = request_slots.shape[0]
        tok = logits_rows.float().argmax(-1).to(torch.int32)
        z = torch.zeros(r, dtype=torch.int32, device=tok.device)
        cols = [z + RECORD_MAGIC, request_slots.to(torch.int32), z + FLAG_SAMPLED, z + 1, consumed.to(torch.int32),
                z, z, z]  # fmt: skip
        cols += [tok] + [z] * (records.shape[1] - HEADER_WORDS - 1)
        records.copy_(torch.stack(cols, -1))

    def decode(self, token_ids, positions, request_slots, page_table, kv, records):  # type: ignore[no-untyped-def]
        """One token per request row; its KV slot follows from its position and page table."""
        c = self.cfg
        b = token_ids.shape[0]
        rows = torch.arange(b, device=token_ids.device)
        pos64 = positions.long()
        slot = page_table.long()[rows, pos64 // c.page_tokens] * c.page_tokens + pos64 % c.page_tokens
        slot = torch.where(request_slots >= 0, slot, -1)
        logits = self._forward(token_ids, positions, slot, rows, page_table, kv)
        self._records(logits, request_slots, positions + 1, records)
        return logits

    def prefill(self, token_ids, positions, slot_mapping, page_table, request_slots, query_lengths, kv, records):  # type: ignore[no-untyped-def]
        """One request's chunk of tokens; the record samples after its last real token."""
        req = torch.zeros_like(token_ids)
        logits = self._forward(token_ids, positions, slot_mapping, req, page_table, kv)
        last = (query_lengths.long() - 1).clamp(min=0)
        self._records(logits[last], request_slots, positions.long()[last] + 1, records)
        return logits
