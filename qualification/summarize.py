"""One summarizer for every device session: the files a `gpu_session.sh` stage wrote for one model
→ that model's entry in `qualification/latest.json` (replaced whole, other models kept).

    python3 qualification/summarize.py KEY RAW_DIR [--tag TAG]... [--commit SHA] [--date YYYY-MM-DD]
        [--command "what was run"] [--latest qualification/latest.json]

RAW_DIR is searched recursively for the stage outputs; with `--tag gemv` a file `NAME_gemv.json` is
preferred over `NAME.json` (stages that prepare one model twice tag their files; several tags
are tried in order). Every figure
is read from a file, and the entry lists the files it came from; what no file provides is
absent, never guessed. Ratios are computed against baselines measured in the same run (the
Python replay floor, the batch-1 HBM bound of the graph's weights).

Entry fields (all optional but `sources`): `tokens` (identity with the torch replay), `decode`
(ITL median/p99 per concurrency, the floor, the bound, the fractions), `ttft_ms` (cold 512 and
4,096 tokens, prefix hit, agent turns), `prefill_tokens_per_s`, `lifecycle`, `prepare` (times,
peak memory, numerics), `kernels` (per graph from kernel_breakdown), and free-form
`exactness`/`agent` flags a stage may write as `exactness.json`; the headline figures again under
the decode-bandwidth issue's names (`figures`); and `speculation` (issue 21: each
bench workload served with and without copy proposals, and the server's acceptance counters).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpu_summary import bench, floor


def find(raw: Path, name: str, tags: Sequence[str]) -> Path | None:
    """RAW/**/NAME_TAG.ext for the first tag present, else RAW/**/NAME.ext."""
    stem, ext = name.rsplit(".", 1)
    for candidate in [f"{stem}_{tag}.{ext}" for tag in tags] + [name]:
        hits = sorted(raw.rglob(candidate))
        if hits:
            return hits[0]
    return None


REPO = Path(__file__).resolve().parent.parent


def _rel(path: Path) -> str:
    """Repository-relative where possible (the entry names files, not this machine's paths)."""
    full = path.resolve()
    return str(full.relative_to(REPO)) if full.is_relative_to(REPO) else str(path)


def load(path: Path | None) -> Any:
    return None if path is None else json.loads(path.read_text())


def decode_section(fed: Any, floor_log: str | None, breakdown: Any, hf: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if fed is not None and "bench" in fed and isinstance(fed["bench"], dict):
        workloads = bench(fed)
        for c in (1, 2, 4):
            w = workloads.get(f"decode c={c}")
            if w and w["itl_ms_median"] is not None:
                out[f"itl_ms_c{c}"] = {"median": w["itl_ms_median"], "p99": w["itl_ms_p99"]}
    if floor_log is not None:
        fl = floor(floor_log)
        out["python_floor_step_ms"] = {k: round(v["step_us"] / 1000, 4) for k, v in fl.items()}
        out["back_to_back_replay_ms"] = {k: round(v["replay_alone_us"] / 1000, 4) for k, v in fl.items()}
    bound = None
    if breakdown is not None:
        b1 = next((g for g in breakdown["graphs"] if g["graph"] == "decode_b1"), None)
        if b1 is not None:
            bound = b1["hbm_bound_us"] / 1000
            out["hbm_bound_source"] = "kernel_breakdown decode_b1 weight bytes"
    if bound is None and hf is not None and "hbm_bound_ms_per_token" in hf:
        bound = hf["hbm_bound_ms_per_token"]
        out["hbm_bound_source"] = "hf_generate weight bytes"
    if bound is not None:
        out["hbm_bound_ms_b1"] = round(bound, 4)
    c1 = out.get("itl_ms_c1", {}).get("median")
    if c1:
        if bound is not None:
            out["fraction_of_hbm_bound_c1"] = round(bound / c1, 3)
        step = out.get("python_floor_step_ms", {}).get("decode_b1")
        if step:
            out["itl_c1_over_python_floor_step"] = round(c1 / step, 3)
    return out


def ttft_section(fed: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    if fed is None or not isinstance(fed.get("bench"), dict):
        return {}, {}
    workloads = {w["name"]: w for w in fed["bench"]["workloads"]}
    ttft: dict[str, Any] = {}
    rate: dict[str, Any] = {}
    for name, key in (("cold 512 tok", "cold_512"), ("cold 4096 tok", "cold_4096"), ("prefix 4096+tail", "prefix_hit")):
        w = workloads.get(name)
        if w and w["ttft"]["count"]:
            ttft[key] = round(w["ttft"]["median_ms"], 3)
    if "agent" in workloads and workloads["agent"]["ttft"]["count"]:
        ttft["agent_turn"] = round(workloads["agent"]["ttft"]["median_ms"], 3)
    cold = workloads.get("cold 4096 tok")
    if "cold_4096" in ttft and cold and cold.get("requests"):
        per_request = cold["prompt_tokens"] / cold["requests"]  # the rendered prompt, template included
        rate["cold_4096"] = round(per_request / (ttft["cold_4096"] / 1000), 1)
    return ttft, rate


def agent_section(fed: Any) -> dict[str, Any]:
    """The agent conversation's turns (a tool call and its result appended per turn): what each
    turn found cached against where the previous turn's prompt ended. With a ChatML-style
    template the whole previous prompt is a prefix of the next one, so a turn that resumed at the
    previous conversation's endpoint caches at least all of it (not a block-rounded part); it may
    cache more where the previous turn's output matched the next rendering (its terminal
    capture)."""
    turns = (fed or {}).get("bench", {}).get("agent_turns") if isinstance(fed, dict) else None
    if not turns:
        return {}
    rows = [{k: t.get(k) for k in ("turn", "prompt_tokens", "cached_tokens", "ttft_ms")} for t in turns]
    later = list(itertools.pairwise(rows))
    out: dict[str, Any] = {"turns": rows}
    if later:
        out["cached_at_message_endpoints"] = all(
            a["prompt_tokens"] <= b["cached_tokens"] <= b["prompt_tokens"] for a, b in later
        )
        out["turns_cached_past_the_previous_prompt"] = sum(b["cached_tokens"] > a["prompt_tokens"] for a, b in later)
        ttfts = [b["ttft_ms"] for _, b in later if b["ttft_ms"] is not None]
        if ttfts and rows[0]["ttft_ms"]:
            out["later_turn_ttft_ms_median"] = round(sorted(ttfts)[len(ttfts) // 2], 3)
            out["first_turn_ttft_ms"] = round(rows[0]["ttft_ms"], 3)
    return out


def prepare_section(report: Any) -> dict[str, Any]:
    if report is None:
        return {}
    t = report.get("timings", {})
    timers = ("compile_s", "prepare_total_s", "gemv_tune_s", "attention_tune_s", "timing_lock_wait_s")
    out: dict[str, Any] = {k: t[k] for k in timers if k in t}
    peak = report.get("peak_memory", {})
    if "torch_max_reserved_bytes" in peak:
        out["peak_torch_reserved_gb"] = round(peak["torch_max_reserved_bytes"] / 1e9, 2)
    n = report.get("numerics")
    if n:
        graphs = {k: v for k, v in n.items() if isinstance(v, dict)}
        out["numerics"] = {
            "worst_rel_l2": n.get("worst_rel_l2"),
            "min_top10_overlap": n.get("min_top10_overlap"),
            "max_kl": max((v["kl_max"] for v in graphs.values()), default=None),
        }
    for key in ("decode_projections", "device_fed_identical", "exactness", "failed_stage", "error"):
        if key in report:
            out[key] = report[key]
    split = report.get("attention_split")
    if isinstance(split, dict):  # the pages per decode attention program preparation chose
        out["attention_pages_per_split"] = split.get("pages_per_split")
    spec = report.get("speculative")
    if isinstance(spec, dict):  # speculative generation against decoding through the torch replay
        out["speculative_identical_to_decoding"] = spec.get("identical")
    return out


def speculation_section(raw: Path) -> dict[str, Any]:
    """`spec_bench`'s files: each `flare bench` workload (bench_W_dD.json) served with
    `--speculative-depth D` and with 0, the tokens/s ratio, whether the copy workload's outputs
    are identical (where its records carry digests), and the server's speculation counters
    at depth D (metrics_dD.txt: totals over every workload that server ran). A run whose bench
    wrote nothing (the server never came up) is left out, not counted as zero."""
    runs: dict[str, dict[int, Any]] = {}
    for path in sorted(raw.rglob("bench_*_d*.json")):
        text = path.read_text().strip()
        if not text:
            continue
        depth = int(path.stem.rsplit("_d", 1)[1])
        for w in json.loads(text)["workloads"]:
            runs.setdefault(w["name"], {})[depth] = w
    depths = {d for by in runs.values() for d in by if d > 0}
    if not depths:
        return {}
    depth = max(depths)
    workloads = {}
    for name, by in sorted(runs.items()):
        if depth in by and 0 in by:
            on, off = by[depth], by[0]
            workloads[name] = {
                "stream_tokens_per_s": {"speculative": round(on["stream_tokens_per_sec"], 1),
                                        "off": round(off["stream_tokens_per_sec"], 1)},
                "speedup": round(on["stream_tokens_per_sec"] / off["stream_tokens_per_sec"], 3),
                "itl_ms_median": {"speculative": round(on["itl"]["median_ms"], 4),
                                  "off": round(off["itl"]["median_ms"], 4)},
                "failed": on["failed"] + off["failed"],
            }  # fmt: skip
            digests = [[r.get("output_digest") for r in w["records"]] for w in (on, off)]
            if on["kind"] == "copy" and None not in digests[0] + digests[1]:
                # Greedy and seeded (`--copy-seed`): speculation must not change one token.
                workloads[name]["outputs_identical"] = digests[0] == digests[1]
                texts = [[r.get("output") for r in w["records"]] for w in (on, off)]
                if None not in texts[0] + texts[1]:  # `flare bench --keep-outputs`
                    workloads[name]["first_difference_chars"] = [
                        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
                        if x != y
                        else None
                        for x, y in zip(texts[0], texts[1], strict=False)
                    ]
    out: dict[str, Any] = {"depth": depth, "workloads": workloads}
    metrics = find(raw, f"metrics_d{depth}.txt", ())
    if metrics is not None:
        counters = {}
        for line in metrics.read_text().splitlines():
            if line.startswith("flare_speculative_"):
                key, value = line.split()[:2]
                counters[key.removeprefix("flare_speculative_")] = float(value)
        rounds = counters.get("rounds_total")
        out["server_totals"] = {k: round(v, 4) if k.endswith("ratio") else int(v) for k, v in counters.items()}
        if rounds:
            out["server_totals"]["accepted_per_round"] = round(counters.get("accepted_tokens_total", 0) / rounds, 3)
    return out


def kernels_section(breakdown: Any) -> dict[str, Any]:
    if breakdown is None:
        return {}
    keys = ("kernels", "kernels_per_layer", "graph_us", "sum_of_kernels_us", "gaps_us", "hbm_bound_us")
    out = {}
    for g in breakdown["graphs"]:
        entry = {k: g[k] for k in (*keys, "fraction_of_hbm_bound", "timing_source")}
        entry["top_ops"] = g["by_op"][:6]
        out[g["graph"]] = entry
    return out


def figures(entry: dict[str, Any], fed: Any) -> dict[str, Any]:
    """The headline figures under the names the decode-bandwidth issue gives them
    (`decode_itl_ms.c1.median`, `cold_ttft_ms.4096`, `hbm_fraction_c1`, ...), taken from the
    entry's sections (and `decode c=4`'s throughput from the bench); absent where they are."""
    out: dict[str, Any] = {}
    dec, ttft = entry.get("decode", {}), entry.get("ttft_ms", {})
    itl = {f"c{c}": dec[f"itl_ms_c{c}"] for c in (1, 2, 4) if f"itl_ms_c{c}" in dec}
    if itl:
        out["decode_itl_ms"] = itl
    if fed is not None and isinstance(fed.get("bench"), dict):
        c4 = bench(fed).get("decode c=4")
        if c4:
            out["decode_tok_s"] = {"c4": c4["output_tokens_per_s"]}
    cold = {n: ttft[f"cold_{n}"] for n in ("512", "4096") if f"cold_{n}" in ttft}
    if cold:
        out["cold_ttft_ms"] = cold
    pairs = (
        ("prefix_hit_ttft_ms", ttft.get("prefix_hit")),
        ("native_over_floor", dec.get("itl_c1_over_python_floor_step")),
        ("hbm_bound_ms", dec.get("hbm_bound_ms_b1")),
        ("hbm_fraction_c1", dec.get("fraction_of_hbm_bound_c1")),
        ("prefill_tok_s_4096", entry.get("prefill_tokens_per_s", {}).get("cold_4096")),
        ("prepare_s", entry.get("prepare", {}).get("prepare_total_s")),
    )
    out.update({k: v for k, v in pairs if v is not None})
    return out


def summarize(raw: Path, tags: str | Sequence[str] | None) -> dict[str, Any]:
    """RAW's stage files → one model's entry; `tags` say which tagged files win, first first."""
    tags = [tags] if isinstance(tags, str) else list(tags or ())
    paths = {
        name: find(raw, name, tags)
        for name in (
            "prepare_report.json",
            "flare_vs_torch.json",
            "ignition_replay.json",
            "ignition_replay.log",
            "kernel_breakdown.json",
            "core_workload.json",
            "core_workload_pressure.json",
            "core_workload_preempt.json",
            "core_workload_preempt_host.json",
            "hf_generate.json",
            "exactness.json",
        )
    }
    fed = load(paths["flare_vs_torch.json"])
    replay = load(paths["ignition_replay.json"])
    floor_log = paths["ignition_replay.log"].read_text() if paths["ignition_replay.log"] else None
    breakdown = load(paths["kernel_breakdown.json"])
    entry: dict[str, Any] = {"sources": sorted(_rel(p) for p in paths.values() if p is not None)}
    tokens: dict[str, Any] = {}
    if replay is not None:
        tokens.update({k: replay[k] for k in ("identical_to_reference", "device_fed_identical") if k in replay})
    if fed is not None and "all_cold_equal" in fed and fed.get("prompts"):
        equal = bool(fed["all_cold_equal"] and fed["all_prefix_hit_equal"])
        tokens["flare_cold_and_prefix_hit_equal_torch_replay"] = equal
    if tokens:
        entry["tokens"] = tokens
    if fed is not None and "ready_s" in fed:
        entry["ready_s"] = fed["ready_s"]
    decode = decode_section(fed, floor_log, breakdown, load(paths["hf_generate.json"]))
    if decode:
        entry["decode"] = decode
    ttft, rate = ttft_section(fed)
    if ttft:
        entry["ttft_ms"] = ttft
    if rate:
        entry["prefill_tokens_per_s"] = rate
    agent = agent_section(fed)
    if agent:
        entry["agent"] = agent
    work = load(paths["core_workload.json"])
    if work is not None:
        keys = ("compared", "identical_to_solo_run", "prefix_hit_tokens")
        entry["lifecycle"] = {k: work[k] for k in keys if k in work}
        # The small-pool runs: checkpoint eviction, then preemption (long outputs).
        runs = (
            ("core_workload_pressure.json", "pressure"),
            ("core_workload_preempt.json", "preemption"),
            ("core_workload_preempt_host.json", "preemption_host_tier"),
        )
        for name, key in runs:
            run = load(paths[name])
            if run is not None:
                more = (
                    "pages",
                    "max_output",
                    "preemptions",
                    "evictions",
                    "compared",
                    "identical_to_solo_run",
                    "differing_without_prefix_hit_or_recompute",
                    "restored_whole_after_preemption",
                )
                entry["lifecycle"][key] = {k: run[k] for k in more if k in run}
    prep = prepare_section(load(paths["prepare_report.json"]))
    log = find(raw, "prepare.log", tags)
    if prep and "timing_lock_wait_s" not in prep and log is not None:  # reports before the field
        waits = re.findall(r"timing lock \S+ held after ([0-9.]+) s", log.read_text(errors="replace"))
        if waits:
            prep["timing_lock_wait_s"] = round(sum(float(w) for w in waits), 1)
            entry["sources"].append(_rel(log))
    if prep:
        entry["prepare"] = prep
    kern = kernels_section(breakdown)
    if kern:
        entry["kernels"] = kern
    if "exactness" in prep:  # prepare's check over the captured graphs
        entry["exactness"] = prep.pop("exactness")
    spec = speculation_section(raw)
    if spec:
        entry["speculation"] = spec
    entry.update(figures(entry, fed))
    extra = load(paths["exactness.json"])
    if isinstance(extra, dict):
        entry.update({k: v for k, v in extra.items() if k in ("exactness", "agent")})
    return entry


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("key", help="the model entry, e.g. llama_1b_random or qwen3_5_0p8b_random (+variant)")
    ap.add_argument("raw", type=Path)
    ap.add_argument(
        "--tag", action="append", help="prefer files NAME_TAG.json (a stage that prepared the model twice); repeatable"
    )
    ap.add_argument("--commit")
    ap.add_argument("--date")
    ap.add_argument("--command", help="what ran on the device, recorded with the entry")
    ap.add_argument(
        "--device", help="the card the entry was measured on, where it is not the file's (e.g. NVIDIA H100 80GB HBM3)"
    )
    ap.add_argument("--latest", type=Path, default=Path(__file__).parent / "latest.json")
    args = ap.parse_args()
    entry = summarize(args.raw, args.tag)
    given = (("commit", args.commit), ("date", args.date), ("command", args.command), ("device", args.device))
    entry.update({k: v for k, v in given if v})
    doc: dict[str, Any] = (
        json.loads(args.latest.read_text()) if args.latest.exists() else {"device": "NVIDIA H200", "models": {}}
    )
    models: dict[str, Any] = doc["models"]
    models[args.key] = entry
    doc["models"] = dict(sorted(models.items()))
    args.latest.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({args.key: {k: entry[k] for k in ("decode", "ttft_ms") if k in entry}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
