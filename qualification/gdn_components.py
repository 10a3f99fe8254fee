"""Issue 18's component checks on the GPU: the Triton GDN kernels Ignition captures (short
convolution with explicit history, delta-rule decode step, delta-rule prefill) against
Transformers' `qwen3_5` torch functions on identical operands, at Qwen3.5-0.8B's GDN geometry
(16 key and 16 value heads of 128, kernel 4). Prints and writes one JSON report: max absolute
and relative errors, and each kernel's time beside the Transformers function it replaces.

    python3 qualification/gdn_components.py OUT.json [--tokens 512]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ignition.capture import gdn

HK, HV, DK, DV, K = 16, 16, 128, 128, 4


def err(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    d = (got.float() - want.float()).abs()
    scale = float(want.float().abs().max()) or 1.0
    return {"max_abs": float(d.max()), "max_rel_to_peak": float(d.max()) / scale}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(f: Callable[[], Any], reps: int = 20) -> float:
    f()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    sync()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1 (float32)")
    ap.add_argument("--small", action="store_true", help="a toy geometry (2/4 heads of 16), for a dry run")
    args = ap.parse_args()
    global HK, HV, DK, DV
    if args.small:
        HK, HV, DK, DV = 2, 4, 16, 16
    C = 2 * HK * DK + HV * DV
    dev = torch.device(args.device)
    act = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    t = args.tokens
    report: dict[str, Any] = {"geometry": {"hk": HK, "hv": HV, "dk": DK, "dv": DV, "kernel": K}, "tokens": t}

    # Convolution, bf16 as served: prefill from an empty history, then one decode step.
    w = torch.randn(C, K, generator=gen, device=dev).to(act)
    x = torch.randn(t, C, generator=gen, device=dev).to(act)
    hist = torch.zeros(2, C, K - 1, device=dev, dtype=act)
    row = torch.tensor([1], dtype=torch.int32, device=dev)
    y = gdn.conv_prefill(x, hist, row, torch.tensor([t], dtype=torch.int32, device=dev), w)
    # Transformers' names moved between releases; the torch fallbacks are what they run without
    # the causal-conv1d package (and without network access for hub kernels).
    conv_fn = getattr(hf, "torch_causal_conv1d_fn", None) or hf.causal_conv1d_fn
    conv_update = getattr(hf, "torch_causal_conv1d_update", None) or hf.causal_conv1d_update
    want = conv_fn(x.t()[None].contiguous(), w, None, activation="silu")[0].t()
    report["conv_prefill"] = err(y, want)
    nxt = torch.randn(1, C, generator=gen, device=dev).to(act)
    state = torch.cat([torch.zeros(C, 1, device=dev, dtype=act), hist[1].clone()], 1)[None].clone()
    y1 = gdn.conv_step(nxt, hist, row, w)
    want1 = conv_update(nxt.t()[None].contiguous(), state, w, None, "silu")[0].t()
    report["conv_step"] = err(y1, want1)

    # Delta rule, float32 state: a decode step and a prefill of `t` tokens.
    def operands(n: int) -> tuple[torch.Tensor, ...]:
        q = torch.randn(n, HK, DK, generator=gen, device=dev)
        k = torch.randn(n, HK, DK, generator=gen, device=dev)
        v = torch.randn(n, HV, DV, generator=gen, device=dev)
        g = -torch.rand(n, HV, generator=gen, device=dev) * 0.5
        beta = torch.rand(n, HV, generator=gen, device=dev)
        return q, k, v, g, beta

    s0 = torch.randn(HV, DK, DV, generator=gen, device=dev) * 0.1
    q, k, v, g, beta = operands(1)
    rows = torch.zeros(2, HV, DK, DV, device=dev)
    rows[1] = s0
    o = gdn.delta_rule_step(rows, row, q, k, v, g, beta)
    rec, rec_s = hf.torch_recurrent_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=s0[None].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    report["delta_step"] = {"output": err(o, rec[0]), "state": err(rows[1], rec_s[0])}

    q, k, v, g, beta = operands(t)
    rows = torch.zeros(2, HV, DK, DV, device=dev)
    rows[1] = s0
    length = torch.tensor([t], dtype=torch.int32, device=dev)
    o = gdn.delta_rule_prefill(rows, row, length, q, k, v, g, beta)
    args5 = (q[None], k[None], v[None], g[None], beta[None])
    chunk, chunk_s = hf.torch_chunk_gated_delta_rule(
        *args5, initial_state=s0[None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    report["delta_prefill_vs_chunked"] = {"output": err(o, chunk[0]), "state": err(rows[1], chunk_s[0])}
    # Ignition's chunked prefill kernel (`--gdn-prefill chunked`) against the same function.
    rows = torch.zeros(2, HV, DK, DV, device=dev)
    rows[1] = s0
    oc = gdn.delta_rule_prefill_chunked(rows, row, length, q, k, v, g, beta)
    report["delta_prefill_chunked_kernel_vs_chunked"] = {"output": err(oc, chunk[0]), "state": err(rows[1], chunk_s[0])}

    q1, k1, v1, g1, beta1 = operands(1)
    # Times: each Triton kernel beside the Transformers torch function it replaces (ms).
    scratch = torch.zeros(2, HV, DK, DV, device=dev)
    report["ms"] = {
        "conv_prefill_triton": timed(lambda: gdn.conv_prefill(x, hist.clone(), row, length, w)),
        "delta_prefill_triton": timed(lambda: gdn.delta_rule_prefill(scratch, row, length, q, k, v, g, beta)),
        "delta_prefill_chunked_triton": timed(
            lambda: gdn.delta_rule_prefill_chunked(scratch, row, length, q, k, v, g, beta)
        ),
        "delta_prefill_hf_chunked_torch": timed(
            lambda: hf.torch_chunk_gated_delta_rule(
                *args5, initial_state=s0[None].clone(), use_qk_l2norm_in_kernel=True
            ),
            reps=5,
        ),
        "delta_step_triton": timed(lambda: gdn.delta_rule_step(scratch, row, q1, k1, v1, g1, beta1)),
    }
    # The chunked prefill's value and key blocks (none spills registers when compiled for sm_90).
    for bv in (16, 32):
        for bk in (16, 32):
            report["ms"][f"delta_prefill_chunked_bv{bv}_bk{bk}"] = timed(
                functools.partial(
                    gdn.delta_rule_prefill_chunked, scratch, row, length, q, k, v, g, beta, block_v=bv, block_k=bk
                )
            )
    text = json.dumps(report, indent=1)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
