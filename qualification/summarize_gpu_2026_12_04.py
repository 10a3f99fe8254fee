"""Summary of the 2026-12-04 GPU session (the ~1.07B random Llama at 518c5b5: flexible-layout
attention inputs, staged payload upload on the copy stream; the fixture lifecycle with paced
reads): writes qualification/gpu_2026-12-04.json from qualification/raw/2026-12-04/.

    python3 qualification/summarize_gpu_2026_12_04.py
"""

import json
from pathlib import Path
from typing import Any

from gpu_summary import serving

RAW = Path("qualification/raw/2026-12-04")
R = RAW / "llama_1b_random"
S3 = json.loads(Path("qualification/gpu_2026-12-03-s3.json").read_text())["models"]["llama_1b_random"]


def load(p: str) -> Any:
    return json.loads((R / p).read_text())


p = load("prepare/prepare_report.json")
hf = load("measure/hf_generate.json")
m = serving(R / "measure")
c1 = m["bench_device_fed"]["decode c=1"]["itl_ms_median"]
cold = m["bench_device_fed"]["cold 4096 tok"]
m["ratios"].update(
    {
        "hf_generate_static_cache_eager_ms_per_token": round(hf["decode_ms_per_token"], 4),
        "hf_generate_over_flare_itl_c1": round(hf["decode_ms_per_token"] / c1, 3),
        "hbm_bound_ms_batch1": round(hf["hbm_bound_ms_per_token"], 4),
        "hbm_fraction_itl_c1": round(hf["hbm_bound_ms_per_token"] / c1, 3),
        "prefill_tok_per_s_cold_4096_ttft": round(cold["prompt_tokens"] / 2 / (cold["ttft_ms_median"] / 1000)),
    }
)
m["versus_session_3_device_fed"] = {
    k: {
        "itl_ms_median": (S3["bench_device_fed"][k]["itl_ms_median"], v["itl_ms_median"]),
        "ttft_ms_median": (S3["bench_device_fed"][k]["ttft_ms_median"], v["ttft_ms_median"]),
    }
    for k, v in m["bench_device_fed"].items()
    if k in S3["bench_device_fed"]
}
m["rust_core_replay_bitwise"] = {k: v.get("bitwise_equal") for k, v in load("measure/rust_replay_io.json").items()}
m["core_workload_on_device"] = load("measure/core_workload.json")
m["payload_upload_staged_vs_direct"] = load("measure/core_load.json")
m["prepare"] = {
    "timings_s": p["timings"],
    "peak_memory": p["peak_memory"],
    "numerics": p.get("numerics"),
    "device_fed_identical": p.get("device_fed_identical"),
    "graph_nodes": {g: v["nodes"] for g, v in p["recorder"]["graphs"].items()}
    if isinstance(p.get("recorder", {}).get("graphs"), dict)
    else None,
}
fixture = json.loads((RAW / "fixture/cuda_replay_check.json").read_text())
# SmolLM2-135M-Instruct (real weights), the smol-prepare/smol-all chain after the 1B one.
SR = RAW / "smollm2"


def sload(q: str) -> Any:
    return json.loads((SR / q).read_text())


sp = sload("prepare/prepare_report.json")
smol = serving(SR / "measure")
smol.update(
    {
        "core_workload_on_device": sload("measure/core_workload.json"),
        "payload_upload_staged_vs_direct": sload("measure/core_load.json"),
        "rust_core_replay_bitwise": "timed out at RUST_IO_TIMEOUT=100 s before writing its report; the 8 graphs it "
        "printed "
        "were bitwise equal (measure/rust_replay_io.partial.txt)",
        "prepare": {"timings_s": sp["timings"], "peak_memory": sp["peak_memory"], "numerics": sp.get("numerics")},
    }
)
out = {
    "what": "issue 7, H200 session of 2026-12-04: the seeded random ~1.07B Llama prepared and served at 518c5b5 "
    "(flexible-layout attention inputs, 8675905; staged payload upload on the copy stream, 2c960f3), "
    "and the fixture lifecycle compared step for step with paced records reads",
    "device": "NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0",
    "commands": [
        "DUMP_IO=1 bash qualification/gpu_session.sh bg OUT r1b-prepare r1b-all (carry .dev/b1 .dev/b2)",
        "bash qualification/gpu_session.sh fixture OUT; WAIT_S=540 bash qualification/gpu_session.sh wait OUT "
        "r1b-prepare",
        "WAIT_S=570 bash qualification/gpu_session.sh wait OUT r1b-all",
        "bash qualification/gpu_session.sh smol-fetch OUT (carry .dev/wa)",
        "DUMP_IO=1 PREPARE_TIMEOUT=700 RUST_IO_TIMEOUT=100 bash qualification/gpu_session.sh bg OUT smol-prepare "
        "smol-all "
        "(carry .dev/wb .dev/b1), then wait OUT smol-prepare and wait OUT smol-all (carry .dev/b1 .dev/b2)",
    ],
    "not_measured": [
        "host-fed beside device-fed, page-pressure lifecycle run, partial KV backing (SHORT stage, budget)",
        "Transformers generate compiled (segfaulted in session 3; not retried)",
    ],
    "raw": str(RAW),
    "fixture": {
        "all_graphs_bitwise_equal": [
            fixture["fixed_base"]["all_graphs_bitwise_equal"],
            fixture["relocated"]["all_graphs_bitwise_equal"],
        ],
        "lifecycle": fixture["lifecycle"],
    },
    "models": {"llama_1b_random": m, "smollm2_135m_instruct": smol},
}
Path("qualification/gpu_2026-12-04.json").write_text(json.dumps(out, indent=1) + "\n")
print(
    json.dumps(
        {k: m[k] for k in ("tokens", "ratios", "versus_session_3_device_fed", "rust_core_replay_bitwise")}, indent=1
    )
)
print(json.dumps(out["fixture"]))
print(json.dumps({k: smol[k] for k in ("tokens", "ratios")}), json.dumps(smol["bench_device_fed"]["decode c=1"]))
