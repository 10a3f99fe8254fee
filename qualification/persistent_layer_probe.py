"""GPU machine, issue 19: a decode step as one persistent kernel (`persistent_kernels`) at a
model's real geometry, against the decode graphs' kernels. `persistent_probe.py` measured a
square chain: a grid barrier cost ~0.6 us less than a kernel boundary per link at SmolLM2's
width and ~1.4 us less at the ~1B's (H100, 2026-12-06). This probe measured the whole step
slower at every configuration (H100, 2026-12-06, session 22), so no core carries the kernel.
- First every layer's four projections as `pdl_probe.layer` runs them (qkv with its RMSNorm,
  o_proj over the query part with the residual, gate_up with its RMSNorm, down with the SiLU gate
  and the residual; random bf16 weights, no attention), as tuned `flare::gemv` kernels and as one
  kernel of the projection stages with a grid barrier after each (`_step_kernel`).
- Then the whole decode step, attention included (qkv, the token's K/V write and the page
  groups as work items, the combine, o_proj, gate_up, down), against the six kernels per layer
  the decode graphs run (`flare::gemv` and `flare::write_attend`'s decode launch), at 288 and
  4,096 tokens over 72-page tables; the combine as its own stage or done by each (row, KV
  head)'s last page group, barriers polling with RMWs or with loads (`DECODE_VARIANTS`).
One program per SM; the barrier's 64-bit ticket counter is never reset, so the graphs hold no
memset. Reports per row count both graphs' time per layer and the relative error between them.

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
from persistent_kernels import PAGES_PER_GROUP, SPIN_LIMIT, grid_barrier, projection_stage
from persistent_kernels import launch as persistent_launch

from ignition.capture.attention import _launch_attention
from ignition.capture.gemv import CANDIDATES, launch, precompile, tune


@triton.jit
def _step_kernel(X, X2, QKV, GU, WQKV, WO, WGU, WD, NQ, NP, CNT, FAIL, eps, L, B: tl.constexpr, H: tl.constexpr,
                 HQ: tl.constexpr, NQKV: tl.constexpr, F: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 P: tl.constexpr, LIMIT: tl.constexpr, POLL: tl.constexpr):  # fmt: skip
    """`pdl_probe.layer`'s four projections for every layer, from `persistent_kernels`' stages:
    X [B, H] in (and out), scratch X2 [B, H], QKV [B, NQKV], GU [B, 2F]; weights stacked per layer."""
    for i in range(L):
        li = i + tl.zeros([], tl.int64)  # 64-bit offsets (a loop index is i32)
        projection_stage(X, H, WQKV + li * NQKV * H, NQ + li * H, X, QKV, B, eps, NQKV, H, BN, BK, P, True, False,
                         False)  # fmt: skip
        grid_barrier(CNT, FAIL, P, LIMIT, POLL)
        projection_stage(QKV, NQKV, WO + li * H * HQ, NQ, X, X2, B, eps, H, HQ, BN, BK, P, False, False, True)
        grid_barrier(CNT, FAIL, P, LIMIT, POLL)
        projection_stage(X2, H, WGU + li * 2 * F * H, NP + li * H, X2, GU, B, eps, 2 * F, H, BN, BK, P, True, False,
                         False)  # fmt: skip
        grid_barrier(CNT, FAIL, P, LIMIT, POLL)
        projection_stage(GU, 2 * F, WD + li * H * F, NQ, X2, X, B, eps, H, F, BN, BK, P, False, True, True)
        grid_barrier(CNT, FAIL, P, LIMIT, POLL)


def persistent_step(cfg: dict[str, Any], stacked: dict[str, torch.Tensor], x: torch.Tensor, scratch: dict[str, Any],
                    programs: int, bn: int, bk: int, warps: int, poll: bool = False) -> torch.Tensor:  # fmt: skip
    """The projections of every layer as one launch of `_step_kernel` (x updated in place)."""
    b, h = x.shape
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    cnt = scratch["counter"]
    _step_kernel[(programs,)](
        x, scratch["x2"], scratch["qkv"], scratch["gu"], stacked["qkv"], stacked["o_proj"], stacked["gate_up"],
        stacked["down"], stacked["qkv_norm"], stacked["gate_up_norm"], cnt, cnt[1:],
        float(cfg.get("rms_norm_eps", 1e-6)), stacked["qkv"].shape[0], B=b, H=h, HQ=heads * d,
        NQKV=stacked["qkv"].shape[1], F=cfg["intermediate_size"], BN=bn, BK=bk, P=programs, LIMIT=SPIN_LIMIT,
        POLL=poll, num_warps=warps,
    )  # fmt: skip
    return x


def persistent_decode(cfg: dict[str, Any], stacked: dict[str, torch.Tensor], x: torch.Tensor,
                      att: dict[str, Any], scratch: dict[str, Any], programs: int, bn: int, bk: int,
                      warps: int, fused: bool, poll: bool = False) -> torch.Tensor:  # fmt: skip
    """A whole decode step's layers as `persistent_kernels.launch` runs them (a new tensor); `fused`:
    the combine inside the attention stage (five barriers per layer), else its own stage; `poll`:
    barriers wait on volatile loads."""
    heads, kvh = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    roles = ("qkv", "o_proj", "gate_up", "down", "qkv_norm", "gate_up_norm")
    weights = [stacked[r][0] for r in roles]
    strides = [stacked[r][0].numel() for r in roles[:5]]
    req = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    dims = (stacked["qkv"].shape[0], heads, kvh, d, cfg["intermediate_size"])
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    return persistent_launch(x, att["cos"], att["sin"], att["kv"], att["slots"], att["table"], req, att["pos"],
                             weights, strides, scratch["counter"], dims, eps, (bn, bk, warps), programs, fused,
                             poll)  # fmt: skip


def decode_chain(cfg: dict[str, Any], probs: dict[str, Any], x: torch.Tensor, att: dict[str, Any]) -> torch.Tensor:
    """The same step as the decode graphs run it: per layer `flare::gemv` qkv (norm),
    `flare::write_attend`'s decode launch (K/V write inside, page groups, combine), o_proj
    (residual), gate_up (norm), down (SiLU gate, residual)."""
    heads, kvh = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    b = x.shape[0]
    req = torch.arange(b, dtype=torch.int32, device=x.device)
    for i in range(cfg["num_hidden_layers"]):
        qkv = launch(x, probs["qkv"].weights[i], norm=probs["qkv"].norms[i], eps=eps)
        q = qkv[:, : heads * d].view(b, heads, d)
        k = qkv[:, heads * d : (heads + kvh) * d].view(b, kvh, d)
        v = qkv[:, (heads + kvh) * d :].view(b, kvh, d)
        o = _launch_attention(q, att["kv"], att["table"], req, att["pos"], i, d**-0.5, att["pps"], cos=att["cos"],
                              sin=att["sin"], tokens="decode", write=(k, v, att["slots"]))  # fmt: skip
        x2 = launch(o.reshape(b, heads * d), probs["o_proj"].weights[i], residual=x)
        gu = launch(x2, probs["gate_up"].weights[i], norm=probs["gate_up"].norms[i], eps=eps)
        x = launch(gu, probs["down"].weights[i], residual=x2, glu=True)
    return x


def attention_operands(cfg: dict[str, Any], rows: int, context: int, pps: int, gen: torch.Generator) -> dict[str, Any]:
    """Each row its own request at position `context - 1` of a 72-page table (a 4,608-token
    limit, as the harness prepares), K/V of every layer random, RoPE at the positions."""
    heads, kvh = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    width, t, dev = 72, 64, torch.device("cuda")
    used = -(-context // t)
    kv = torch.randn(rows * used + 1, cfg["num_hidden_layers"], 2, t, kvh, d, generator=gen, device=dev)
    table = torch.full((rows, width), -1, dtype=torch.int32, device=dev)
    table[:, :used] = torch.randperm(rows * used + 1, generator=gen, device=dev)[: rows * used].int().view(rows, used)
    pos = torch.full((rows,), context - 1, dtype=torch.int32, device=dev)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=dev).float() / d)
    ang = pos.float()[:, None] * inv[None, :]
    return {
        "kv": kv.bfloat16(), "table": table, "pos": pos, "pps": pps,
        "slots": (table[:, used - 1].long() * t + (context - 1) % t).contiguous(),
        "cos": torch.cat([ang, ang], -1).cos(), "sin": torch.cat([ang, ang], -1).sin(),
    }  # fmt: skip


# (rows per program block, columns per tile, warps) of the persistent kernels.
CONFIGS = ((8, 128, 4), (16, 256, 8), (32, 256, 8), (32, 512, 8))
# The whole step's variants: a configuration, the combine fused into the attention stage, and
# barriers polling with volatile loads (a compile each, per row count).
DECODE_VARIANTS = (
    (CONFIGS[0], True, False), (CONFIGS[1], True, False), (CONFIGS[1], True, True), (CONFIGS[1], False, False),
)  # fmt: skip
# Pages per attention group and contexts of the whole-step variant (with attention).
DECODE_PPS = PAGES_PER_GROUP
DECODE_CONTEXTS = (288, 4096)


def _scratch(cfg: dict[str, Any], stacked: dict[str, torch.Tensor], m: int) -> dict[str, Any]:
    dev, bf = torch.device("cuda"), torch.bfloat16
    kvh = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return {
        "x2": torch.empty(m, cfg["hidden_size"], dtype=bf, device=dev),
        "qkv": torch.empty(m, stacked["qkv"].shape[1], dtype=bf, device=dev),
        "gu": torch.empty(m, 2 * cfg["intermediate_size"], dtype=bf, device=dev),
        # Barrier tickets, the failure word, arrivals per (row, KV head).
        "counter": torch.zeros(2 + m * kvh, dtype=torch.int64, device=dev),
    }


def _timed(run: Any, want: torch.Tensor, base_us: float, layers: int, hbm_bound_us: float, reps: int,
           scratch: dict[str, Any], programs: int) -> dict[str, Any]:  # fmt: skip
    """One persistent variant: captured, replayed, compared with the per-kernel output."""
    try:
        graph, got = captured(run)
        us = replay_ms(graph, reps) * 1e3
    except Exception as e:  # a configuration that cannot compile or launch is a result
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {
        "us_per_layer": round(us / layers, 2),
        "over_per_kernel": round(us / base_us, 3),
        "fraction_of_hbm_bound": round(hbm_bound_us / us, 3),
        "rel_l2_vs_per_kernel": float((got.float() - want.float()).norm() / want.float().norm()),
        "barrier_gave_up": bool(scratch["counter"][1].item()),
        "counter_multiple_of_programs": int(scratch["counter"][0].item()) % programs == 0,
    }


def _good(entry: dict[str, Any]) -> bool:
    return all(
        "error" not in v and v["rel_l2_vs_per_kernel"] < 0.05 and not v["barrier_gave_up"]
        for v in entry.values()
        if isinstance(v, dict)
    )


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
    bound = round(weight_bytes / (gbps * 1e3), 1)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "config": str(args.config), "programs": sms, "hbm_bound_us": bound,
        "hbm_source": hbm_source, "projections": {}, "decode_step": {},
    }  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    for m in rows:  # the projections alone (`pdl_probe.chain`)
        x0 = torch.randn(m, cfg["hidden_size"], generator=gen, device="cuda").bfloat16()
        graph, want = captured(functools.partial(chain, cfg, probs, x0.clone(), {}))
        base_us = replay_ms(graph, args.reps) * 1e3
        entry: dict[str, Any] = {"per_kernel_us_per_layer": round(base_us / layers, 2)}
        for (bn, bk, warps), poll in [*((c, False) for c in CONFIGS), (CONFIGS[1], True)]:
            scratch, x = _scratch(cfg, stacked, m), x0.clone()
            # Each replay starts from x0: the graph copies it in, then runs the step.
            run = functools.partial(
                lambda x, x0, s, bn, bk, w, p: persistent_step(cfg, stacked, x.copy_(x0), s, sms, bn, bk, w, p),
                x, x0, scratch, bn, bk, warps, poll,
            )  # fmt: skip
            key = f"bn{bn}_bk{bk}_w{warps}" + ("_poll_load" if poll else "")
            entry[key] = _timed(run, want, base_us, layers, bound, args.reps, scratch, sms)
        ok &= _good(entry)
        report["projections"][str(m)] = entry
        print("projections", m, json.dumps(entry), flush=True)
    for m in rows:  # the whole step with attention, against the decode graphs' kernels
        for context in DECODE_CONTEXTS:
            x0 = torch.randn(m, cfg["hidden_size"], generator=gen, device="cuda").bfloat16()
            att = attention_operands(cfg, m, context, DECODE_PPS, gen)
            graph, want = captured(lambda: decode_chain(cfg, probs, x0.clone(), att))  # noqa: B023
            base_us = replay_ms(graph, args.reps) * 1e3
            entry = {"per_kernel_us_per_layer": round(base_us / layers, 2), "pps": DECODE_PPS}
            for (bn, bk, warps), fused, poll in DECODE_VARIANTS:
                scratch, x = _scratch(cfg, stacked, m), x0.clone()
                run = functools.partial(
                    lambda x, x0, a, s, bn, bk, w, f, p: persistent_decode(cfg, stacked, x.copy_(x0), a, s, sms, bn,
                                                                           bk, w, f, p),
                    x, x0, att, scratch, bn, bk, warps, fused, poll,
                )  # fmt: skip
                key = f"bn{bn}_bk{bk}_w{warps}" + ("" if fused else "_combine_stage") + ("_poll_load" if poll else "")
                entry[key] = _timed(run, want, base_us, layers, bound, args.reps, scratch, sms)
                entry[key]["arrivals_zero"] = not bool(scratch["counter"][2:].any().item())
            ok &= _good(entry)
            report["decode_step"][f"rows{m}_ctx{context}"] = entry
            print("decode_step", m, context, json.dumps(entry), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
