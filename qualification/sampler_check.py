"""`flare::sample` on the device (issue 19): the fused sampler against the torch definition it
replaces, tokens and time. For each vocabulary (SmolLM2/Qwen3.5's 49,152 and Llama 3's 128,256),
batch 1 and 4, and each request mix (plain temperature, greedy, chat top-k/top-p, top-k alone,
nucleus only, penalties with min-p, a grammar mask), over peaked and flat logits:
- tokens: the kernel's against eager `sample` over many draws (same seeds and counters);
- time: each replayed as a CUDA graph (as a core runs it), the kernel against `torch.compile` of
  `sample` (what a core prepared with `--sampler torch` runs), in microseconds per step.

    python3 qualification/sampler_check.py OUT.json
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ignition.capture.gemv import _time_ms
from ignition.capture.sampling import launch, parameters, sample

# (block, warps) of `flare_sample`'s one program per row, timed beside the default.
FINAL_WIDTHS = ((2048, 8), (4096, 8), (8192, 16), (8192, 8))
MIXES: dict[str, dict[str, float]] = {
    "plain": {"temperature": 0.8},
    "greedy": {"top_k": 1},
    "chat": {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
    "topk": {"temperature": 0.7, "top_k": 20},  # chat's radix select without its top-p climb
    "nucleus": {"top_p": 0.9},
    "penalties": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "min_p": 0.05},
    "grammar": {"top_p": 0.95},
}


def inputs(b: int, v: int, mix: str, draw: int, dev: torch.device) -> dict[str, Any]:
    m = MIXES[mix]

    def full(name: str, default: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((b,), m.get(name, default), dtype=dtype, device=dev)

    grammar = None
    if mix == "grammar":  # about one id in eight allowed
        g = torch.Generator(device=dev).manual_seed(draw)
        words = torch.randint(0, 2**31, (b, (v + 31) // 32), generator=g, device=dev, dtype=torch.int64)
        grammar = (words & (words >> 3) & (words >> 7)).to(torch.int32)
    return {
        "temperature": full("temperature", 1.0),
        "top_k": full("top_k", 0, torch.int32),
        "top_p": full("top_p", 1.0),
        "min_p": full("min_p", 0.0),
        "repetition": full("repetition_penalty", 1.0),
        "presence": full("presence_penalty", 0.0),
        "frequency": full("frequency_penalty", 0.0),
        "seed": torch.arange(b, device=dev, dtype=torch.int64) + 7,
        "counter": torch.full((b,), draw, dtype=torch.int64, device=dev),
        "grammar": grammar,
    }


def logits_for(b: int, v: int, shape: str, seed: int, dev: torch.device) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(b, v, generator=g, device=dev) * 2.0
    if shape == "peaked":  # a few likely ids, as a language model's next-token logits mostly are
        top = torch.randint(0, v, (b, 8), generator=g, device=dev)
        x.scatter_add_(1, top, torch.rand(b, 8, generator=g, device=dev) * 8 + 8)
    return x.to(torch.bfloat16)


def main() -> int:
    out = Path(sys.argv[1])
    dev = torch.device("cuda")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "cases": []}
    compiled = torch.compile(sample, fullgraph=True, dynamic=False)
    worst_agreement = 1.0
    for v in (49152, 128256):
        for b in (1, 4):
            hist = torch.zeros(b + 1, v, dtype=torch.int32, device=dev)
            hist[1:, : v // 50] = 1  # some seen ids, for the penalties
            rows = torch.arange(1, b + 1, device=dev)
            for shape in ("peaked", "flat"):
                for mix in MIXES:
                    same = total = 0
                    for draw in range(32):
                        x = logits_for(b, v, shape, draw, dev)
                        a = inputs(b, v, mix, draw, dev)
                        args = (*parameters(a), a["grammar"])
                        got, _ = launch(x, hist, rows, *args)
                        want, _ = sample(x, hist[rows], *args)
                        same += int((got == want).sum())
                        total += b
                    agreement = same / total
                    worst_agreement = min(worst_agreement, agreement)
                    x = logits_for(b, v, shape, 0, dev)
                    a = inputs(b, v, mix, 0, dev)
                    args = (*parameters(a), a["grammar"])
                    kernel_us = 1000 * _time_ms(functools.partial(launch, x, hist, rows, *args), 50)
                    # The one program per row at other widths (the default is FINAL_BLOCK/WARPS).
                    widths = {}
                    for fb, fw in FINAL_WIDTHS:
                        run = functools.partial(launch, x, hist, rows, *args, final_block=fb, final_warps=fw)
                        widths[f"{fb}/{fw}"] = round(1000 * _time_ms(run, 20), 2)
                    gathered = hist[rows]
                    # One compile per shape: the grammar mix (another graph) is timed by the kernel only.
                    torch_us = kernel_us
                    if a["grammar"] is None:
                        torch_us = 1000 * _time_ms(functools.partial(compiled, x, gathered, *args), 50)
                    case = {
                        "vocab": v,
                        "rows": b,
                        "logits": shape,
                        "mix": mix,
                        "tokens_equal_to_torch": agreement,
                        "kernel_us": round(kernel_us, 2),
                        "torch_compiled_us": round(torch_us, 2) if a["grammar"] is None else None,
                        "speedup": round(torch_us / kernel_us, 2) if a["grammar"] is None else None,
                        "kernel_us_by_final_width": widths,
                    }
                    report["cases"].append(case)
                    print(json.dumps(case), flush=True)
    report["worst_token_agreement"] = worst_agreement
    out.write_text(json.dumps(report, indent=1))
    # Equal tokens up to float-sum order at a threshold: anything below 0.98 is a bug.
    return 0 if worst_agreement >= 0.98 else 1


if __name__ == "__main__":
    sys.exit(main())
