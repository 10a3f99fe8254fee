"""GPU machine: `flare::gemv` on a model's projection shapes, before any core is prepared.

Random bf16 weights at the geometry of a config.json (every layer, so the stream leaves L2), the
tuner run as prepare runs it (tiles, then rows per program per bucket), then for each projection:
the kernel against the eager reference (max relative error, bf16), the chosen tile's time per
layer and achieved GB/s at each row count, and torch's own `F.linear` (cuBLAS, what a core may
not carry) on the same weights as a yardstick measured in the same run.

    python3 qualification/gemv_check.py CONFIG.json OUT.json [--rows 1,2,4]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hbm import peak_gbps  # a sibling: the script directory is on the path

from ignition.capture.gemv import (
    Problem,
    Variant,
    _run,
    _time_ms,
    config_for,
    precompile,
    precompile_groups,
    reference,
    tune,
    tune_groups,
)


def problems(cfg: dict[str, Any], layers: int) -> list[Problem]:
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    gen = torch.Generator(device="cuda").manual_seed(0)

    def ws(n: int, k: int, count: int = layers) -> list[torch.Tensor]:
        return [(torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16() for _ in range(count)]

    norms = [(torch.rand(h, generator=gen, device="cuda") + 0.5).bfloat16() for _ in range(layers)]
    return [
        Problem("qkv", ws((heads + 2 * kvh) * d, h), Variant(norm=True), None, norms),
        Problem("o_proj", ws(h, heads * d), Variant(residual=True)),
        Problem("gate_up", ws(2 * f, h), Variant(norm=True), None, norms),
        Problem("down", ws(h, f), Variant(glu=True, residual=True)),
        Problem("lm_head", ws(v, h, 1), Variant()),
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--hbm-gbps", type=float, help="GB/s for the HBM bound (default: the device's datasheet figure)")
    args = ap.parse_args()
    args.hbm_gbps, hbm_source = peak_gbps(args.hbm_gbps)
    cfg = json.loads(args.config.read_text())
    rows = [int(x) for x in args.rows.split(",")]
    probs = problems(cfg, cfg["num_hidden_layers"])
    t0 = time.time()
    precompile(probs, rows)  # the candidates compiled in a process pool first, as prepare does
    t1 = time.time()
    tuned = tune(probs, rows)
    t2 = time.time()
    pre_groups = precompile_groups(probs, rows)  # then the rows per program, as prepare does
    t3 = time.time()
    for name, groups in tune_groups(probs, rows).items():
        tuned[name]["group_rows"] = groups
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "precompile_s": round(t1 - t0, 1),
        "tune_s": round(t2 - t1, 1),
        "precompile_groups": pre_groups | {"s": round(t3 - t2, 1)},
        "tune_groups_s": round(time.time() - t3, 1),
        "hbm_gbps": args.hbm_gbps,
        "hbm_source": hbm_source,
        "rows": rows,
        "tuned": tuned,
        "projections": {},
    }
    gen = torch.Generator(device="cuda").manual_seed(1)
    for p in probs:
        n, k = p.weights[0].shape
        kin = 2 * k if p.variant.glu else k
        entry: dict[str, Any] = {"config": vars(config_for(n, k, p.variant))}
        for m in rows:
            x = torch.randn(m, kin, generator=gen, device="cuda").bfloat16()
            r = torch.randn(m, n, generator=gen, device="cuda").bfloat16()
            norm = None if p.norms is None else p.norms[0]
            res = r if p.variant.residual else None
            want = reference(x, p.weights[0], None, norm, res, p.eps, p.variant.glu).float()
            got = _run(p, x, r, config_for(n, k, p.variant), 1).float()
            err = ((got - want).norm() / want.norm()).item()
            ms = _time_ms(functools.partial(_run, p, x, r, config_for(n, k, p.variant)), 5) / len(p.weights)
            xin = x if not p.variant.glu else x[:, :k].contiguous()

            def cublas(xin: torch.Tensor = xin, p: Problem = p) -> None:
                for w in p.weights:
                    F.linear(xin, w)

            torch_ms = _time_ms(cublas, 5) / len(p.weights)
            nbytes = n * k * 2
            entry[f"rows_{m}"] = {
                "rel_l2_vs_reference": round(err, 6),
                "gemv_us": round(ms * 1e3, 2),
                "gemv_gb_per_s": round(nbytes / ms / 1e6, 1),
                "torch_linear_us": round(torch_ms * 1e3, 2),
                "torch_linear_gb_per_s": round(nbytes / torch_ms / 1e6, 1),
                "hbm_bound_us": round(nbytes / (args.hbm_gbps * 1e3), 2),
            }
        report["projections"][p.name] = entry
        print(p.name, json.dumps(entry))
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    worst = max(v["rel_l2_vs_reference"] for e in report["projections"].values() for k, v in e.items() if k != "config")
    print(json.dumps({"worst_rel_l2": worst}))
    return 0 if worst < 0.02 else 1


if __name__ == "__main__":
    raise SystemExit(main())
