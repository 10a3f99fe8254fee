"""Teacher-forced logits of every captured prefill capacity and decode bucket against a reference
forward (Transformers' model on the same weights): relative L2, top-10 overlap and KL per token.

Each check uses fresh, shuffled page tables and different live rows, and alternates prefill and
decode graphs, so it also shows that replays follow changed inputs and slot assignments.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ignition.capture.runner import GraphRunner, Row


def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    a, b = ours.float(), ref.float()
    rel = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-30)
    ta, tb = a.topk(10, -1).indices, b.topk(10, -1).indices
    overlap = torch.tensor([len(set(x.tolist()) & set(y.tolist())) / 10 for x, y in zip(ta, tb, strict=True)])
    lp, lq = torch.log_softmax(b, -1), torch.log_softmax(a, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (a.argmax(-1) == b.argmax(-1)).float()
    return {
        "tokens": int(a.shape[0]),
        "rel_l2_mean": rel.mean().item(),
        "rel_l2_max": rel.max().item(),
        "top10_overlap_mean": overlap.mean().item(),
        "top10_overlap_min": overlap.min().item(),
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1_agreement": top1.mean().item(),
    }


def teacher_forced(
    runner: GraphRunner, reference_logits: Any, prompt_len: int = 300, decode_steps: int = 6, seed: int = 0
) -> dict[str, Any]:
    """`reference_logits(ids) -> [len(ids), V]` (position i predicts token i + 1)."""
    geo = runner.p.geo
    rng = random.Random(seed)
    prompt_len = min(prompt_len, geo.context_limit - decode_steps)
    total = prompt_len + decode_steps
    ids = [rng.randrange(geo.vocab) for _ in range(total)]
    ref = reference_logits(ids).float().cpu()
    model = runner.p.model
    pages_needed = -(-total // geo.page_tokens)
    out: dict[str, Any] = {"prompt_len": prompt_len, "decode_steps": decode_steps}

    def fresh_pages() -> list[int]:
        return rng.sample(range(geo.max_kv_pages), pages_needed)

    for g in runner.prefill:
        pages = fresh_pages()
        row = geo.live_row(rng.randrange(geo.request_slots))
        runner.maintenance("initialize", row)
        hs = []
        at = 0
        while at < prompt_len:
            part = ids[at : min(prompt_len, at + g.token_capacity)]
            h, _ = runner.replay(g, [Row(row, pages, at, part)])
            hs.append(h[: len(part)])
            at += len(part)
        logits = model.logits(torch.cat(hs)).float().cpu()
        out[g.name] = compare_logits(logits, ref[:prompt_len])
    for g in runner.decode:
        b = g.request_count
        rows, starts = [], []
        lives = [geo.live_row(s) for s in rng.sample(range(geo.request_slots), b)]
        # Disjoint shuffled pages per row: rows of one batch never share a page.
        pool = rng.sample(range(geo.max_kv_pages), pages_needed * b)
        for i, live in enumerate(lives):
            pages = pool[i * pages_needed : (i + 1) * pages_needed]
            start = prompt_len - 3 * i
            runner.maintenance("initialize", live)
            pf = runner.prefill[-1]
            at = 0
            while at < start:
                part = ids[at : min(start, at + pf.token_capacity)]
                runner.replay(pf, [Row(live, pages, at, part)])
                at += len(part)
            rows.append(Row(live, pages, start, []))
            starts.append(start)
        got, want = [], []
        for step in range(decode_steps):
            batch = [Row(r.live_row, r.pages, s + step, [ids[s + step]]) for r, s in zip(rows, starts, strict=True)]
            h, _ = runner.replay(g, batch)
            got.append(model.logits(h[:b]).float().cpu())
            want.append(torch.stack([ref[s + step] for s in starts]))
        out[g.name] = compare_logits(torch.cat(got), torch.cat(want))
    worst = max((v for v in out.values() if isinstance(v, dict)), key=lambda v: v["rel_l2_max"])
    out["worst_rel_l2"] = worst["rel_l2_max"]
    out["min_top10_overlap"] = min(v["top10_overlap_min"] for v in out.values() if isinstance(v, dict))
    return out


def transformers_reference(model_dir: str, device: str = "cuda") -> Any:
    """The canonical forward of the checkpoint (bf16, sdpa), as a `reference_logits` callable."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    # PreTrainedModel.to is declared `@wraps(torch.nn.Module.to)`, which mypy does not bind as a method.
    model = model.to(device).eval()  # type: ignore[arg-type]

    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        out: torch.Tensor = model(torch.tensor([ids], device=device)).logits[0]
        return out

    return model, logits
