"""Prefill attention on the device (issue 19 item 4): the block kernel (`tokens="prefill"`: each page
read once per ~64 query rows) against the per-token kernel it replaces for prefill chunks, at the
~1B Llama's, SmolLM2's and Qwen3.5-0.8B's attention geometries, for a 256-token chunk at the end of
4,096- and 1,024-token contexts; each as a CUDA-graph replay of all layers (the chunk's attention
over every layer, as a prefill graph runs it), with the relative error against each other.

Then decode (issue 19): pages per attention program (`pps`, `attention.PAGES_PER_SPLIT` today)
at 1, 2, 4, 8 and 16, for 1 and 4 requests at 256, 1,024 and 4,096 tokens over 72-page tables
(a 4,608-token context limit), each token's K/V written inside the attention as decode graphs
do; all layers as one graph, with the relative error against the current setting. (SmolLM2's
decode step took 88 us longer at 288 tokens of context than at a few: ~3 us per attention layer,
with 4 pages walked one after another by each program.)

    python3 qualification/attention_check.py OUT.json
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ignition.capture import attention, attention_tune
from ignition.capture.attention import _launch_attention
from ignition.capture.gemv import _time_ms

# The prefill kernel's (query rows per program, warps, stages) tried beside the rule's choice.
CONFIGS = ((64, 8, 2), (64, 8, 1), (32, 8, 2), (32, 4, 2), (64, 4, 2), (32, 8, 1), (16, 8, 1), (16, 4, 1))

# Pages per attention program timed for decode, over page tables this wide (a 4,608-token limit).
PPS = (1, 2, 4, 8, 16)
WIDTH = 72
# (name, layers with attention, heads, KV heads, head dim, RoPE in the kernel)
GEOMETRIES = (("llama_1b", 16, 32, 8, 64, True), ("smollm2", 30, 9, 3, 64, True), ("qwen3_5_0p8b", 6, 8, 2, 256, False))


def run(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor,
        cos: torch.Tensor | None, sin: torch.Tensor | None, layers: int, *, block: bool) -> torch.Tensor:  # fmt: skip
    out = q
    for layer in range(layers):
        out = _launch_attention(
            q, kv, table, req, pos, layer, q.shape[-1] ** -0.5, cos=cos, sin=sin, tokens="prefill" if block else "lanes"
        )
    return out


def sweep(args: tuple[Any, ...], reference: torch.Tensor, g: int, d: int) -> list[dict[str, Any]]:
    """Each of `CONFIGS` in place of `prefill_block_config`: time, error against the per-token
    kernel, or the reason it did not launch (shared memory beyond a block's)."""
    gp = 1 << (g - 1).bit_length()
    rule = attention.PREFILL_BLOCK_CONFIG
    results: list[dict[str, Any]] = [{"rule": list(rule(gp, d))}]
    for rows, warps, stages in CONFIGS:
        cfg = (max(1, rows // gp, 16 // gp), warps, stages)
        entry: dict[str, Any] = {"tokens_per_block": cfg[0], "warps": warps, "stages": stages}

        def fixed(_gp: int, _d: int, cfg: tuple[int, int, int] = cfg) -> tuple[int, int, int]:
            return cfg

        attention.PREFILL_BLOCK_CONFIG = fixed
        try:
            out = run(*args, block=True).float()
            entry["rel_l2"] = float((out - reference).norm() / reference.norm())
            entry["ms"] = round(_time_ms(functools.partial(run, *args, block=True), 20), 4)
        except Exception as e:  # a configuration that cannot launch is a result
            entry["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        finally:
            attention.PREFILL_BLOCK_CONFIG = rule
        results.append(entry)
    return results


def decode(name: str, layers: int, h: int, kvh: int, d: int, rope: bool, rows: int, context: int) -> dict[str, Any]:
    """One decode case as preparation's tuner times it (`attention_tune.time_decode`, 72-page
    tables): every `PPS` setting over all layers, with the relative error against the current one."""

    def timed(pps: int) -> tuple[float, torch.Tensor]:
        return attention_tune.time_decode(h, kvh, d, 64, WIDTH, layers, rows, context, pps, rope)

    want = timed(attention.PAGES_PER_SPLIT)[1].float()
    case: dict[str, Any] = {"geometry": name, "layers": layers, "rows": rows, "context": context, "pps": {}}
    for pps in PPS:
        ms, got = timed(pps)
        case["pps"][str(pps)] = {
            "us_per_layer": round(ms * 1e3 / layers, 2),
            "rel_l2": float((got.float() - want).norm() / want.norm()),
        }
    case["fastest"] = min(case["pps"], key=lambda key: case["pps"][key]["us_per_layer"])
    return case


def main() -> int:
    dev = torch.device("cuda")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "cases": [], "decode": []}
    worst = 0.0
    for name, layers, h, kvh, d, rope in GEOMETRIES:
        for context in (1024, 4096):
            chunk = 256
            pages = context // 64
            kv = torch.randn(pages + 1, layers, 2, 64, kvh, d, device=dev, dtype=torch.bfloat16)
            table = torch.randperm(pages + 1, device=dev)[:pages].int().view(1, pages)
            q = torch.randn(chunk, h, d, device=dev, dtype=torch.bfloat16)
            req = torch.zeros(chunk, dtype=torch.int32, device=dev)
            pos = torch.arange(context - chunk, context, dtype=torch.int32, device=dev)
            cos = sin = None
            if rope:
                ang = pos.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2, device=dev).float() / d))[None, :]
                cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
            args = (q, kv, table, req, pos, cos, sin, layers)
            a = run(*args, block=True).float()
            b = run(*args, block=False).float()
            err = float((a - b).norm() / b.norm())
            worst = max(worst, err)
            block_ms = _time_ms(functools.partial(run, *args, block=True), 20)
            token_ms = _time_ms(functools.partial(run, *args, block=False), 20)
            case = {
                "geometry": name, "layers": layers, "context": context, "chunk": chunk,
                "block_ms": round(block_ms, 4), "per_token_ms": round(token_ms, 4),
                "speedup": round(token_ms / block_ms, 2), "rel_l2_block_vs_per_token": err,
            }  # fmt: skip
            if context == 4096:  # the block kernel's configurations, same operands
                case["configs"] = sweep(args, b, h // kvh, d)
            report["cases"].append(case)
            print(json.dumps(case), flush=True)
    report["worst_rel_l2"] = worst
    for name, layers, h, kvh, d, rope in GEOMETRIES:
        for rows in (1, 4):
            for context in (256, 1024, 4096):
                timed = decode(name, layers, h, kvh, d, rope, rows, context)
                worst = max(worst, *(v["rel_l2"] for v in timed["pps"].values()))
                report["decode"].append(timed)
                print(json.dumps(timed), flush=True)
    report["worst_rel_l2"] = worst
    Path(sys.argv[1]).write_text(json.dumps(report, indent=1))
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
