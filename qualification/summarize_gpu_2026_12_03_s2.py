"""Summary of the second 2026-12-03 GPU session (device-fed decode, two steps in flight):
writes qualification/gpu_2026-12-03-s2.json from qualification/raw/2026-12-03-s2/.

    python3 qualification/summarize_gpu_2026_12_03_s2.py
"""

import json
from pathlib import Path
from typing import Any

from gpu_summary import bench, floor

R = Path("qualification/raw/2026-12-03-s2")


def load(p: str) -> Any:
    return json.loads((R / p).read_text())


out: dict[str, Any] = {
    "what": "issues 6/7, second H200 session of 2026-12-03: graphs with the device-side pending token and split-page "
    "attention, rows = pages; flare with records copied behind events and two decode steps in flight "
    "(device-fed), beside the same binary with --host-fed-decode",
    "device": "NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0",
    "measured_code": "graphs and binaries from 486144f (scripts from the next commit); the scheduler's lockstep fix "
    "(e32d2b8) came after this run and is NOT measured here: the c>=2 rows below show the batch-split "
    "pathology it fixes (device-fed and host-fed alike)",
    "commands": [
        "bash qualification/gpu_session.sh smol-fetch OUT (carry .dev/wa)",
        "CORE_REPLAY=1 bash qualification/gpu_session.sh smol-prepare OUT (carry .dev/wb .dev/b1): cold compile "
        "441 s, prepare timed out at 480 s in the torch-replay checks",
        "CORE_REPLAY=1 bash qualification/gpu_session.sh smol-reprepare OUT; SMOLCORE=/tmp/smolcore2 bash "
        "qualification/gpu_session.sh smol-measure OUT (carry .dev/b1 .dev/b2)",
        "bash qualification/gpu_session.sh r1b-prepare OUT (carry .dev/b1)",
        "bash qualification/gpu_session.sh r1b-measure-only OUT (carry .dev/b2)",
    ],
    "raw": str(R),
    "models": {},
}
for tag, d in (("smollm2_135m_instruct", "smollm2"), ("llama_1b_random", "llama_1b_random")):
    m: dict[str, Any] = {}
    ir = load(f"{d}/ignition_replay.json")
    m["tokens"] = {
        k: ir.get(k) for k in ("identical_to_reference", "identical_reversed_on_other_rows", "device_fed_identical")
    }
    fed, host = load(f"{d}/flare_vs_torch.json"), load(f"{d}/flare_vs_torch_host_fed.json")
    m["tokens"]["flare_device_fed_cold_and_prefix_hit_equal_torch_replay"] = (
        fed["all_cold_equal"] and fed["all_prefix_hit_equal"]
    )
    m["tokens"]["flare_host_fed_cold_and_prefix_hit_equal_torch_replay"] = (
        host["all_cold_equal"] and host["all_prefix_hit_equal"]
    )
    m["ready_s"] = {"device_fed": fed["ready_s"], "host_fed": host["ready_s"]}
    m["python_floor"] = floor((R / d / "ignition_replay.log").read_text())
    m["bench_device_fed"] = bench(fed)
    m["bench_host_fed"] = bench(host)
    c1 = m["bench_device_fed"]["decode c=1"]["itl_ms_median"]
    alone = m["python_floor"]["decode_b1"]["replay_alone_us"] / 1000
    m["itl_c1_device_fed_over_back_to_back_replay"] = round(c1 / alone, 3)
    m["itl_c1_host_fed_over_back_to_back_replay"] = round(m["bench_host_fed"]["decode c=1"]["itl_ms_median"] / alone, 3)
    m["itl_c1_device_fed_over_python_floor"] = round(c1 / (m["python_floor"]["decode_b1"]["step_us"] / 1000), 3)
    m["core_workload_on_device"] = {k: load(f"{d}/{k}.json") for k in ("core_workload", "core_workload_pressure")}
    if (R / d / "prepare_report.json").exists():
        p = load(f"{d}/prepare_report.json")
        m["prepare"] = {
            "timings_s": p["timings"],
            "peak_memory": p["peak_memory"],
            "memory_plan": p["memory_plan"],
            "numerics": p.get("numerics"),
            "device_fed_identical": p.get("device_fed_identical"),
            "kv_sized_graph_pool_blocks": p["recorder"].get("kv_sized_graph_pool_blocks"),
        }
    out["models"][tag] = m
out["models"]["llama_1b_random"]["hbm_bound_ms_batch1"] = 0.447
out["models"]["llama_1b_random"]["hbm_fraction_device_fed_c1"] = round(
    0.447 / out["models"]["llama_1b_random"]["bench_device_fed"]["decode c=1"]["itl_ms_median"], 3
)
out["models"]["smollm2_135m_instruct"]["rust_core_replay_bitwise"] = (
    "from the fetched output tail of smol-reprepare (prepare.log itself did not come back): decode_b1, decode_b2, "
    "decode_b4, resume_b1, initialize, admit_histogram, restore bitwise equal, each also relocated; the lines for "
    "the remaining graphs were not in the fetched tail"
)
Path("qualification/gpu_2026-12-03-s2.json").write_text(json.dumps(out, indent=1) + "\n")
print(
    json.dumps(
        {
            t: {
                k: v
                for k, v in m.items()
                if k
                in ("tokens", "itl_c1_device_fed_over_back_to_back_replay", "itl_c1_host_fed_over_back_to_back_replay")
            }
            for t, m in out["models"].items()
        },
        indent=1,
    )
)
