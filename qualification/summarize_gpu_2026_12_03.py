import json
from pathlib import Path
from typing import Any

R = Path("qualification/raw/2026-12-03")


def load(p: str) -> Any:
    return json.loads((R / p).read_text())


def wl(f: dict[str, Any], name: str) -> dict[str, Any]:
    return next(w for w in f["bench"]["workloads"] if w["name"] == name)


out: dict[str, Any] = {
    "what": "issues 6/7 on one H200: SmolLM2-135M-Instruct (real weights, fetch-default) and a seeded random-weight "
    "~1.07B Llama (qualification/configs/llama_1b_random.json) prepared by `ignition prepare`, replayed by the "
    "torch-free `ignition replay CORE` (Python floor, reference tokens) and served by `flare run CORE` (native "
    "CUDA replay) with `flare bench`; Transformers generate (static cache) on the same shapes; HBM bound at batch 1",
    "date": "2026-12-03",
    "device": "NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0",
    "commands": {
        "build_here": [
            "cargo build --release -p flare",
            "cargo build --release -p helios-replay --features cuda --example core_replay",
        ],
        "device": [
            "bash qualification/gpu_session.sh smol-fetch OUT  (carry .dev/wa)",
            "CORE_REPLAY=1 bash qualification/gpu_session.sh smol-prepare OUT  (carry .dev/wb .dev/b1; prepare timed "
            "out in its Rust check, core and references were written)",
            "bash qualification/gpu_session.sh smol-measure OUT  (carry .dev/b2)",
            "bash qualification/gpu_session.sh r1b-prepare OUT  (carry .dev/b1)",
            "bash qualification/gpu_session.sh r1b-measure OUT  (carry .dev/b2)",
            "bash qualification/gpu_session.sh smol-reprepare OUT  (the prepare report with numerics, warm Inductor "
            "cache)",
            "python3 -m ignition replay /tmp/smolcore --reference ... --relocate",
            "python3 qualification/kernel_breakdown.py CORE decode_b1 OUT.json",
            "python3 qualification/rust_replay_io.py /tmp/smolcore /tmp/core_replay OUT.json  (Rust core_replay over "
            "prepare's dumped I/O of every graph)",
            "bash qualification/gpu_session.sh hf-baselines OUT",
        ],
    },
    "raw": str(R),
    "measured_code": "commit dac4417 (graphs, ignition replay) with bbfc817's scripts; flare and core_replay built "
    "from it. "
    "Later changes to the graphs (e.g. split-page attention) are not measured here; "
    "the capacities are prepare's before bbfc817 (32 snapshot rows)",
}
for tag, d, hf in (
    ("smollm2_135m_instruct", "smollm2", "hf_smollm2_135m_eager.json"),
    ("llama_1b_random", "llama_1b_random", "hf_llama_1b_eager.json"),
):
    prep = load(f"{d}/prepare_report.json")
    fv = load(f"{d}/flare_vs_torch.json")
    ir = load(f"{d}/ignition_replay.json")
    h = load(f"{d}/{hf}")
    m = {}
    n = prep["numerics"]
    m["numerics_vs_transformers"] = {
        k: {
            x: round(v[x], 4)
            for x in ("rel_l2_mean", "rel_l2_max", "top10_overlap_min", "kl_mean", "kl_max", "top1_agreement")
        }
        for k, v in n.items()
        if isinstance(v, dict)
    }
    m["prepare"] = {
        "timings_s": prep["timings"],
        "peak_memory": prep["peak_memory"],
        "memory_plan": prep["memory_plan"],
        "capacities": prep["capacities"],
        "export": prep["export"],
        "kv_sized_graph_pool_blocks": prep["recorder"].get("kv_sized_graph_pool_blocks"),
        "arena": {
            k: prep["recorder"]["arena"][k] for k in ("base", "at_requested_base", "used_bytes", "failed_allocs")
        },
    }
    m["torch_replay_us"] = {k: v["replay_us"] for k, v in prep["torch_replay"].items()}
    m["torch_replay_checks"] = {
        k: {
            c: v.get(c)
            for c in ("second_replay_bitwise_equal", "poisoned_pool_replay_bitwise_equal", "records_equal_eager")
        }
        for k, v in prep["torch_replay"].items()
    }
    m["tokens"] = {
        "ignition_replay_vs_torch_replay": ir["identical_to_reference"],
        "flare_cold_equal_torch_replay": fv["all_cold_equal"],
        "flare_prefix_hit_equal_torch_replay": fv["all_prefix_hit_equal"],
    }
    m["ignition_replay_floor"] = {"load_s": ir["load_s"], "decode": ir["decode"], "prefill": ir["prefill"]}
    bench = {}
    for w in fv["bench"]["workloads"]:
        bench[w["name"]] = {
            "concurrency": w["concurrency"],
            "requests": w["requests"],
            "failed": w["failed"],
            "ttft_ms_median": round(w["ttft"]["median_ms"], 3),
            "itl_ms_median": round(w["itl"]["median_ms"], 4) if w["itl"]["count"] else None,
            "itl_ms_p99": round(w["itl"]["p99_ms"], 4) if w["itl"]["count"] else None,
            "output_tokens_per_s": round(w["output_tokens_per_sec"], 1),
            "prompt_tokens": w["prompt_tokens"],
            "cached_tokens": w["cached_tokens"],
        }
    m["flare_bench"] = bench
    m["flare_ready_s"] = fv["ready_s"]
    itl1 = wl(fv, "decode c=1")["itl"]["median_ms"]
    floor = ir["decode"][0]
    cold4k = wl(fv, "cold 4096 tok")
    m["ratios"] = {
        "flare_itl_c1_ms": round(itl1, 4),
        "python_floor_step_ms_b1": round(floor["step_us_median"] / 1e3, 4),
        "back_to_back_replay_ms_b1": round(floor["back_to_back_replay_us"] / 1e3, 4),
        "flare_itl_over_python_floor": round(itl1 / (floor["step_us_median"] / 1e3), 3),
        "flare_itl_over_back_to_back_replay": round(itl1 / (floor["back_to_back_replay_us"] / 1e3), 3),
        "hf_generate_static_cache_ms_per_token": round(h["decode_ms_per_token"], 4),
        "hf_generate_over_flare_itl": round(h["decode_ms_per_token"] / itl1, 3),
        "hbm_bound_ms_per_token": round(h["hbm_bound_ms_per_token"], 4),
        "flare_fraction_of_hbm_bound_b1": round(h["hbm_bound_ms_per_token"] / itl1, 3),
        "cold_4096_prefill_tokens_per_s": round(
            cold4k["prompt_tokens"] / cold4k["requests"] / (cold4k["ttft"]["median_ms"] / 1e3), 1
        ),
    }
    out[tag] = m
s = load("smollm2/smol_rust_replay.json")
out["smollm2_135m_instruct"]["rust_fresh_process_bitwise"] = {k: v.get("bitwise_equal") for k, v in s.items()}
rel = load("smollm2/ignition_replay_relocated.json")
out["smollm2_135m_instruct"]["ignition_replay_relocated"] = {
    "base": hex(rel["load"]["base"]),
    "recorded_base": hex(rel["load"]["recorded_base"]),
    "identical_to_reference": rel["identical_to_reference"],
}
out["llama_1b_random"]["hf_generate_earlier_run_ms_per_token"] = round(
    load("llama_1b_random/hf_generate.json")["decode_ms_per_token"], 4
)
for tag, f in (
    ("smollm2_135m_instruct", "smollm2/smol_decode_b1_kernels.json"),
    ("llama_1b_random", "llama_1b_random/r1b_decode_b1_kernels.json"),
):
    k = load(f)
    out[tag]["decode_b1_kernels_launched_alone"] = {
        "kernels": k["kernels"],
        "note": "each kernel launched alone between events (adds ~5 us each); shares, not absolute times",
        "top": [
            {"function": x["function"][:90], "count": x["count"], "share": x["share"]} for x in k["by_function"][:8]
        ],
    }
Path("qualification/gpu_2026-12-03.json").write_text(json.dumps(out, indent=1) + "\n")
for tag in ("smollm2_135m_instruct", "llama_1b_random"):
    print(tag, json.dumps(out[tag]["ratios"]), json.dumps(out[tag]["tokens"]))
    print(
        "  prefix",
        out[tag]["flare_bench"]["prefix 4096+tail"],
        "cold512",
        out[tag]["flare_bench"]["cold 512 tok"]["ttft_ms_median"],
    )
