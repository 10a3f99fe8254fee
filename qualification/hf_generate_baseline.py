"""Transformers `generate` with a static cache on a checkpoint: the decode baseline Flare's ITL is
compared with (issue 7), plus the batch-1 HBM bound of the weights.

    python3 qualification/hf_generate_baseline.py --model DIR --out OUT.json [--tokens 256] [--compile]

Reports per-token decode time (generate of N tokens minus a 1-token generate, over N - 1), the
bytes of weights read per token, and the fraction of the device's bandwidth that implies.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from hbm import peak_gbps  # a sibling: the script directory is on the path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="torch.compile the static-cache forward")
    ap.add_argument("--hbm-gbps", type=float, help="GB/s for the HBM bound (default: the device's datasheet figure)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    # PreTrainedModel.to is declared `@wraps(torch.nn.Module.to)`, which mypy does not bind as a method.
    model = model.to(dev).eval()  # type: ignore[arg-type]
    if args.compile:
        # reduce-overhead replays CUDA graphs whose outputs the next replay overwrites; the static
        # cache's counters are such outputs, so each forward starts a new cudagraph step (without
        # this, transformers 5.17 failed on the H200: "cumulative_length ... overwritten").
        compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

        def forward(*a: Any, **k: Any) -> Any:
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*a, **k)

        model.forward = forward
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(dev)
    kw = {"do_sample": False, "cache_implementation": "static", "pad_token_id": 0}

    def run(n: int) -> float:
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t0

    run(args.tokens)  # warm-up (and compile)
    full = min(run(args.tokens) for _ in range(args.repeat))
    one = min(run(1) for _ in range(args.repeat))
    per_token = (full - one) / max(args.tokens - 1, 1)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gbps, hbm_source = peak_gbps(args.hbm_gbps) if dev == "cuda" else (float(args.hbm_gbps or 0.0), "cpu run")
    bound = weight_bytes / (gbps * 1e9) if gbps > 0 else 0.0
    report = {
        "model": args.model,
        "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "compile": args.compile,
        "tokens": args.tokens,
        "generate_s": full,
        "first_token_s": one,
        "decode_ms_per_token": per_token * 1e3,
        "weight_bytes": weight_bytes,
        "hbm_gbps": gbps,
        "hbm_source": hbm_source,
        "hbm_bound_ms_per_token": bound * 1e3,
        "fraction_of_hbm_bound": bound / per_token if per_token > 0 and bound > 0 else None,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
