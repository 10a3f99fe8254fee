"""GPU machine, issue 19: a decode step's projections as one persistent kernel, at a model's real
geometry. `persistent_probe.py` measured a square chain: a grid barrier cost ~0.6 us less than a
kernel boundary per link at SmolLM2's width and ~1.4 us less at the ~1B's (H100, 2026-12-06).
This measures the case a recipe would build: every layer's four projections as `pdl_probe.layer`
runs them (qkv with its RMSNorm, o_proj over the query part with the residual, gate_up with its
RMSNorm, down with the SiLU gate and the residual; random bf16 weights, no attention), once as
tuned `flare::gemv` kernels and once as one kernel for the whole step:
- one program per SM, each owning a strided set of row blocks of every projection;
- four grid barriers per layer, on a 64-bit ticket counter that is never reset: a program's
  arrival returns a ticket t, and it waits until the counter reaches (t // P + 1) * P. Every
  program arrives once at every barrier, so each barrier's P arrivals end on a multiple of P
  and a graph replays the kernel with no memset node before it (a core can carry it as is);
- activations read past L1 (`.cg`) after each barrier, weights read plainly.
Reports per row count both graphs' time per layer and the relative error between them.

    python3 qualification/persistent_layer_probe.py CONFIG.json OUT.json [--rows 1,4]
"""

# mypy: disable-error-code="no-untyped-def"
# Triton reads a kernel's parameter annotations to specialize it, so the kernel's pointer and
# scalar parameters stay unannotated (as in ignition's kernel modules).
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemv_check import problems  # siblings: the script directory is on the path
from hbm import peak_gbps
from pdl_probe import captured, chain, replay_ms

from ignition.capture.gemv import CANDIDATES, precompile, tune

# Spins at one barrier before a program gives up and flags the run (programs that are not all
# resident would wait for each other forever).
SPIN_LIMIT = 1 << 20


@triton.jit
def _barrier(CNT, FAIL, P: tl.constexpr, LIMIT: tl.constexpr):
    tl.debug_barrier()  # every thread's stores issued before the arrival's release
    ticket = tl.atomic_add(CNT, 1, sem="acq_rel")
    target = (ticket // P + 1) * P
    spins = 0
    while (tl.atomic_add(CNT, 0, sem="acquire") < target) & (spins < LIMIT):
        spins += 1
    if spins >= LIMIT:
        tl.store(FAIL, 1)


@triton.jit
def _chunk(X, x_stride, NORM, inv, k0, eps, K: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, B: tl.constexpr,
           IS_NORM: tl.constexpr, GLU: tl.constexpr):  # fmt: skip
    """Columns k0..k0+BK of the stage's input rows as fp32 [BP, BK]: RMS-normed (cast to bf16,
    then scaled by the norm weight, as Transformers' LlamaRMSNorm), or SiLU(gate) * up from
    [gate | up] halves (each product rounded to bf16 as the eager MLP does), or as stored."""
    bs = tl.arange(0, BP)
    ks = k0 + tl.arange(0, BK)
    m = (bs < B)[:, None] & (ks < K)[None, :]
    at = bs[:, None] * x_stride + ks[None, :]
    x = tl.load(X + at, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    if GLU:
        u = tl.load(X + at + K, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        g = (x / (1.0 + tl.exp(-x))).to(X.dtype.element_ty).to(tl.float32)
        x = (g * u).to(X.dtype.element_ty).to(tl.float32)
    if IS_NORM:
        w = tl.load(NORM + ks, mask=ks < K, other=0.0).to(tl.float32)
        x = (x * inv[:, None]).to(X.dtype.element_ty).to(tl.float32) * w[None, :]
        x = x.to(X.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _stage(X, x_stride, W, NORM, RES, Y, B: tl.constexpr, eps, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr, BP: tl.constexpr, P: tl.constexpr, IS_NORM: tl.constexpr, GLU: tl.constexpr,
           HAS_RES: tl.constexpr):  # fmt: skip
    """Y[b, n] = (RES[b, n] +) W[n, :] . input(b) for this program's row blocks n (every P-th
    block from the program's own), all B rows at once so each weight tile is read once."""
    pid = tl.program_id(0)
    bs = tl.arange(0, BP)
    inv = tl.zeros([BP], tl.float32)
    if IS_NORM:  # each row's 1 / rms over all K first (from L2: the rows were just written)
        sq = tl.zeros([BP], tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            m = (bs < B)[:, None] & (ks < K)[None, :]
            x = tl.load(X + bs[:, None] * x_stride + ks[None, :], mask=m, other=0.0, cache_modifier=".cg")
            sq += tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
        inv = 1.0 / tl.sqrt(sq / K + eps)
    for n0 in range(pid * BN, N, P * BN):
        ns = n0 + tl.arange(0, BN)
        nm = ns < N
        acc = tl.zeros([BN, BP], tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            w = tl.load(W + ns[:, None].to(tl.int64) * K + ks[None, :], mask=nm[:, None] & (ks < K)[None, :], other=0.0)
            x = _chunk(X, x_stride, NORM, inv, k0, eps, K, BP, BK, B, IS_NORM, GLU)
            acc += tl.sum(w.to(tl.float32)[:, None, :] * x[None, :, :], 2)
        out_at = bs[None, :] * N + ns[:, None]
        om = nm[:, None] & (bs < B)[None, :]
        if HAS_RES:
            acc += tl.load(RES + out_at, mask=om, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(Y + out_at, acc.to(Y.dtype.element_ty), mask=om)


@triton.jit
def _step_kernel(X, X2, QKV, GU, WQKV, WO, WGU, WD, NQ, NP, CNT, FAIL, eps, L, B: tl.constexpr, BP: tl.constexpr,
                 H: tl.constexpr, HQ: tl.constexpr, NQKV: tl.constexpr, F: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, P: tl.constexpr, LIMIT: tl.constexpr):  # fmt: skip
    """Every layer of `pdl_probe.layer` for B rows: X [B, H] in (and out), scratch X2 [B, H],
    QKV [B, NQKV], GU [B, 2F]; weights stacked per layer."""
    for i in range(L):
        li = i + tl.zeros([], tl.int64)  # 64-bit offsets (a loop index is i32)
        _stage(X, H, WQKV + li * NQKV * H, NQ + li * H, X, QKV, B, eps, NQKV, H, BN, BK, BP, P, True, False, False)
        _barrier(CNT, FAIL, P, LIMIT)
        _stage(QKV, NQKV, WO + li * H * HQ, NQ, X, X2, B, eps, H, HQ, BN, BK, BP, P, False, False, True)
        _barrier(CNT, FAIL, P, LIMIT)
        _stage(X2, H, WGU + li * 2 * F * H, NP + li * H, X2, GU, B, eps, 2 * F, H, BN, BK, BP, P, True, False, False)
        _barrier(CNT, FAIL, P, LIMIT)
        _stage(GU, 2 * F, WD + li * H * F, NQ, X2, X, B, eps, H, F, BN, BK, BP, P, False, True, True)
        _barrier(CNT, FAIL, P, LIMIT)


def persistent_step(cfg: dict[str, Any], stacked: dict[str, torch.Tensor], x: torch.Tensor, scratch: dict[str, Any],
                    programs: int, bn: int, bk: int, warps: int) -> torch.Tensor:  # fmt: skip
    """The whole step as one launch of `_step_kernel` (x is updated in place and returned)."""
    b, h = x.shape
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    nqkv, f = stacked["qkv"].shape[1], cfg["intermediate_size"]
    _step_kernel[(programs,)](
        x, scratch["x2"], scratch["qkv"], scratch["gu"], stacked["qkv"], stacked["o_proj"], stacked["gate_up"],
        stacked["down"], stacked["qkv_norm"], stacked["gate_up_norm"], scratch["cnt"], scratch["fail"],
        float(cfg.get("rms_norm_eps", 1e-6)), stacked["qkv"].shape[0],
        B=b, BP=triton.next_power_of_2(b), H=h, HQ=heads * d, NQKV=nqkv, F=f, BN=bn, BK=bk, P=programs,
        LIMIT=SPIN_LIMIT, num_warps=warps,
    )  # fmt: skip
    return x


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    cfg = json.loads(args.config.read_text())
    gbps, hbm_source = peak_gbps(None)
    layers = cfg["num_hidden_layers"]
    probs = {p.name: p for p in problems(cfg, layers) if p.name != "lm_head"}
    rows = [int(r) for r in args.rows.split(",")]
    plain = [c for c in CANDIDATES if c.split == 1]
    precompile(list(probs.values()), rows, plain)
    tune(list(probs.values()), rows, plain)
    stacked = {name: torch.stack(list(p.weights)) for name, p in probs.items()}
    for name in ("qkv", "gate_up"):
        stacked[f"{name}_norm"] = torch.stack(list(probs[name].norms or ()))
    weight_bytes = sum(w.numel() * w.element_size() for p in probs.values() for w in p.weights)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "config": str(args.config), "programs": sms,
        "hbm_bound_us": round(weight_bytes / (gbps * 1e3), 1), "hbm_source": hbm_source, "rows": {},
    }  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    for m in rows:
        x0 = torch.randn(m, cfg["hidden_size"], generator=gen, device="cuda").bfloat16()
        graph, want = captured(functools.partial(chain, cfg, probs, x0.clone(), 0))
        per_kernel_us = replay_ms(graph, args.reps) * 1e3
        entry: dict[str, Any] = {"per_kernel_us_per_layer": round(per_kernel_us / layers, 2)}
        for bn, bk, warps in ((8, 128, 4), (16, 256, 8), (32, 256, 8), (32, 512, 8)):
            key = f"persistent_bn{bn}_bk{bk}_w{warps}"
            h = cfg["hidden_size"]
            scratch = {
                "x2": torch.empty(m, h, dtype=torch.bfloat16, device="cuda"),
                "qkv": torch.empty(m, stacked["qkv"].shape[1], dtype=torch.bfloat16, device="cuda"),
                "gu": torch.empty(m, 2 * cfg["intermediate_size"], dtype=torch.bfloat16, device="cuda"),
                "cnt": torch.zeros(1, dtype=torch.int64, device="cuda"),
                "fail": torch.zeros(1, dtype=torch.int32, device="cuda"),
            }
            x = x0.clone()
            try:
                # Each replay starts from x0: the graph copies it in, then runs the step.
                graph, got = captured(lambda: persistent_step(cfg, stacked, x.copy_(x0), scratch, sms, bn, bk, warps))  # noqa: B023
                us = replay_ms(graph, args.reps) * 1e3
                err = float((got.float() - want.float()).norm() / want.float().norm())
                entry[key] = {
                    "us_per_layer": round(us / layers, 2),
                    "over_per_kernel": round(us / per_kernel_us, 3),
                    "fraction_of_hbm_bound": round(report["hbm_bound_us"] / us, 3),
                    "rel_l2_vs_per_kernel": err,
                    "barrier_gave_up": bool(scratch["fail"].item()),
                    "counter_multiple_of_programs": int(scratch["cnt"].item()) % sms == 0,
                }
                ok &= err < 0.05 and not scratch["fail"].item()
            except Exception as e:  # a configuration that cannot compile or launch is a result
                entry[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                ok = False
        report["rows"][str(m)] = entry
        print(m, json.dumps(entry), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
