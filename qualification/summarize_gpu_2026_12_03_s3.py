"""Summary of the third 2026-12-03 GPU session (one model, the ~1.07B random Llama, with RoPE
inside the attention kernels, the scheduler's lockstep, single-split prefill attention and the
8-bit radix sampler): writes qualification/gpu_2026-12-03-s3.json from qualification/raw/2026-12-03-s3/.

    python3 qualification/summarize_gpu_2026_12_03_s3.py
"""

import json
from pathlib import Path
from typing import Any

from gpu_summary import bench, floor

R = Path("qualification/raw/2026-12-03-s3/llama_1b_random")
S2 = json.loads(Path("qualification/gpu_2026-12-03-s2.json").read_text())["models"]["llama_1b_random"]


def load(p: str) -> Any:
    return json.loads((R / p).read_text())


fed = load("short/flare_vs_torch.json")
ir = load("short/ignition_replay.json")
p = load("prepare_report.json")
hf = load("extra/hf_generate_eager.json")
m: dict[str, Any] = {
    "tokens": {
        k: ir.get(k) for k in ("identical_to_reference", "identical_reversed_on_other_rows", "device_fed_identical")
    },
    "ready_s": fed["ready_s"],
    "python_floor": floor((R / "short/ignition_replay.log").read_text()),
    "bench_device_fed": bench(fed),
}
m["tokens"]["flare_device_fed_cold_and_prefix_hit_equal_torch_replay"] = (
    fed["all_cold_equal"] and fed["all_prefix_hit_equal"]
)
c1 = m["bench_device_fed"]["decode c=1"]["itl_ms_median"]
fl = m["python_floor"]["decode_b1"]
m["ratios"] = {
    "itl_c1_over_back_to_back_replay": round(c1 / (fl["replay_alone_us"] / 1000), 3),
    "itl_c1_over_python_floor_step": round(c1 / (fl["step_us"] / 1000), 3),
    "hf_generate_static_cache_eager_ms_per_token": round(hf["decode_ms_per_token"], 4),
    "hf_generate_over_flare_itl_c1": round(hf["decode_ms_per_token"] / c1, 3),
    "hbm_bound_ms_batch1": round(hf["hbm_bound_ms_per_token"], 4),
    "hbm_fraction_itl_c1": round(hf["hbm_bound_ms_per_token"] / c1, 3),
}
m["versus_session_2_device_fed"] = {
    k: {
        "itl_ms_median": (S2["bench_device_fed"][k]["itl_ms_median"], v["itl_ms_median"]),
        "ttft_ms_median": (S2["bench_device_fed"][k]["ttft_ms_median"], v["ttft_ms_median"]),
    }
    for k, v in m["bench_device_fed"].items()
    if k in S2["bench_device_fed"]
}
m["rust_core_replay_bitwise"] = {k: v.get("bitwise_equal") for k, v in load("native/rust_replay_io.json").items()}
m["core_workload_on_device"] = {
    "default_pages": load("native/core_workload.json"),
    "pages_96": load("native/core_workload_pressure.json"),
}
m["prepare"] = {
    "timings_s": p["timings"],
    "peak_memory": p["peak_memory"],
    "numerics": p.get("numerics"),
    "device_fed_identical": p.get("device_fed_identical"),
    "graph_nodes": {"decode_b1": [304, 244]},
}
kb = load("extra/kernel_breakdown.json")
m["decode_b1_kernels_launched_alone"] = {"kernels": kb.get("kernels"), "top": kb.get("top", [])[:10]}
out = {
    "what": "issues 6/7, third H200 session of 2026-12-03 (budget for one model): the seeded random ~1.07B Llama "
    "with RoPE inside the attention/KV-write kernels, the scheduler's lockstep (e32d2b8), single-split "
    "prefill attention (8f1c90c) and the 8-bit radix sampler (99278fb), all measured here for the first time",
    "device": "NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0",
    "commands": [
        "DUMP_IO=1 bash qualification/gpu_session.sh r1b-prepare OUT (carry .dev/b1); run twice: the machine "
        "went cold after the first (its log is prepare_run1/)",
        "RUST_IO_TIMEOUT=100 bash qualification/gpu_session.sh r1b-short OUT (carry .dev/b1 .dev/b2)",
        "RUST_IO_TIMEOUT=220 bash qualification/gpu_session.sh r1b-native OUT",
        "python3 qualification/hf_generate_baseline.py --model /tmp/r1b --out OUT/hf_generate_eager.json --tokens 256",
        "python3 qualification/kernel_breakdown.py /tmp/r1bcore decode_b1 OUT/kernel_breakdown.json",
    ],
    "not_measured": [
        "host-fed beside device-fed (budget)",
        "SmolLM2 real weights (budget)",
        "Transformers generate compiled (reduce-overhead): segfaulted (rc 139) after cudagraph warnings "
        "about cache_utils cumulative_length; see native/hf_generate_compile.log",
    ],
    "raw": str(R),
    "models": {"llama_1b_random": m},
}
Path("qualification/gpu_2026-12-03-s3.json").write_text(json.dumps(out, indent=1) + "\n")
print(
    json.dumps(
        {k: m[k] for k in ("tokens", "ratios", "versus_session_2_device_fed", "rust_core_replay_bitwise")}, indent=1
    )
)
