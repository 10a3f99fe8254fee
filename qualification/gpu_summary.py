"""Readers shared by the GPU-session summaries: `flare bench` workloads from flare_vs_torch
JSON, and the Python floor from `ignition replay --bench` logs."""


def bench(f: dict) -> dict:
    out = {}
    for w in f["bench"]["workloads"]:
        out[w["name"]] = {"concurrency": w["concurrency"], "failed": w["failed"],
                          "ttft_ms_median": round(w["ttft"]["median_ms"], 3),
                          "itl_ms_median": round(w["itl"]["median_ms"], 4) if w["itl"]["count"] else None,
                          "itl_ms_p99": round(w["itl"]["p99_ms"], 4) if w["itl"]["count"] else None,
                          "output_tokens_per_s": round(w["output_tokens_per_sec"], 1),
                          "prompt_tokens": w["prompt_tokens"], "cached_tokens": w["cached_tokens"]}  # fmt: skip
    return out


def floor(log: str) -> dict:
    """`ignition replay --bench` lines: decode us/step and back-to-back replay us."""
    out = {}
    for line in log.splitlines():
        if "us/step" in line:
            name = line.split("decode ")[-1].split(":")[0]
            step = float(line.split(": ")[1].split(" us/step")[0])
            alone = float(line.split("replay alone ")[1].split(" us")[0])
            out[name] = {"step_us": step, "replay_alone_us": alone}
    return out
