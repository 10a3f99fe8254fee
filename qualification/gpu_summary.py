"""Readers shared by the GPU-session summaries: `flare bench` workloads from flare_vs_torch
JSON, and the Python floor from `ignition replay --bench` logs."""

from pathlib import Path
from typing import Any


def bench(f: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for w in f["bench"]["workloads"]:
        out[w["name"]] = {
            "concurrency": w["concurrency"],
            "failed": w["failed"],
            "ttft_ms_median": round(w["ttft"]["median_ms"], 3),
            "itl_ms_median": round(w["itl"]["median_ms"], 4) if w["itl"]["count"] else None,
            "itl_ms_p99": round(w["itl"]["p99_ms"], 4) if w["itl"]["count"] else None,
            "output_tokens_per_s": round(w["output_tokens_per_sec"], 1),
            "prompt_tokens": w["prompt_tokens"],
            "cached_tokens": w["cached_tokens"],
        }
    return out


def floor(log: str) -> dict[str, Any]:
    """`ignition replay --bench` lines: decode us/step and back-to-back replay us."""
    out = {}
    for line in log.splitlines():
        if "us/step" in line:
            name = line.split("decode ")[-1].split(":")[0]
            step = float(line.split(": ")[1].split(" us/step")[0])
            alone = float(line.split("replay alone ")[1].split(" us")[0])
            out[name] = {"step_us": step, "replay_alone_us": alone}
    return out


def serving(measure: Path) -> dict[str, Any]:
    """One model's serving summary from a measure directory (a pathlib.Path): token identity,
    readiness, the Python floor, the bench workloads and the c=1 ratios against the floor."""
    import json

    fed = json.loads((measure / "flare_vs_torch.json").read_text())
    ir = json.loads((measure / "ignition_replay.json").read_text())
    m: dict[str, Any] = {
        "tokens": {
            k: ir.get(k) for k in ("identical_to_reference", "identical_reversed_on_other_rows", "device_fed_identical")
        },
        "ready_s": fed["ready_s"],
        "python_floor": floor((measure / "ignition_replay.log").read_text()),
        "bench_device_fed": bench(fed),
    }
    m["tokens"]["flare_device_fed_cold_and_prefix_hit_equal_torch_replay"] = (
        fed["all_cold_equal"] and fed["all_prefix_hit_equal"]
    )
    c1, fl = m["bench_device_fed"]["decode c=1"]["itl_ms_median"], m["python_floor"]["decode_b1"]
    m["ratios"] = {
        "itl_c1_over_back_to_back_replay": round(c1 / (fl["replay_alone_us"] / 1000), 3),
        "itl_c1_over_python_floor_step": round(c1 / (fl["step_us"] / 1000), 3),
        # What the host adds per decode step beyond the device's back-to-back replays.
        "host_gap_us_per_step_c1": round(c1 * 1000 - fl["replay_alone_us"], 1),
    }
    return m
