"""The one summarizer (`qualification/summarize.py`) over a committed session's raw files agrees
with the summary that session recorded by hand-written script (`gpu_2026-12-04.json`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.ignition.conftest import REPO

sys.path.insert(0, str(REPO / "qualification"))

import hbm  # qualification/ is not a package: found through sys.path
import pytest
import summarize


def test_summary_of_the_2026_12_04_session_matches_what_it_recorded() -> None:
    recorded = json.loads((REPO / "qualification" / "gpu_2026-12-04.json").read_text())["models"]
    for key, raw in (("llama_1b_random", "llama_1b_random"), ("smollm2_135m_instruct", "smollm2")):
        entry = summarize.summarize(REPO / "qualification" / "raw" / "2026-12-04" / raw, None)
        old = recorded[key]
        bench = old["bench_device_fed"]
        for c in (1, 2, 4):
            assert entry["decode"][f"itl_ms_c{c}"]["median"] == bench[f"decode c={c}"]["itl_ms_median"]
        assert entry["ttft_ms"]["cold_4096"] == bench["cold 4096 tok"]["ttft_ms_median"]
        step_ms = entry["decode"]["python_floor_step_ms"]["decode_b1"]
        assert round(step_ms * 1000, 1) == old["python_floor"]["decode_b1"]["step_us"]
        assert entry["tokens"]["flare_cold_and_prefix_hit_equal_torch_replay"] is True
        assert all(Path(REPO / s).is_file() for s in entry["sources"])
        # The agent conversation resumed every later turn at the previous prompt's end.
        assert entry["agent"]["cached_at_message_endpoints"] is True
        assert [t["turn"] for t in entry["agent"]["turns"]] == [1, 2, 3, 4]
    # Without a bound in the raw files, none is reported (never guessed).
    smol = summarize.summarize(REPO / "qualification" / "raw" / "2026-12-04" / "smollm2", None)
    assert "hbm_bound_ms_b1" not in smol["decode"]


def test_tagged_files_win_over_untagged(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "prepare_report.json").write_text(json.dumps({"timings": {"compile_s": 1.0}}))
    (tmp_path / "a" / "prepare_report_gemv.json").write_text(json.dumps({"timings": {"compile_s": 2.0}}))
    assert summarize.summarize(tmp_path, "gemv")["prepare"]["compile_s"] == 2.0
    assert summarize.summarize(tmp_path, None)["prepare"]["compile_s"] == 1.0
    assert summarize.summarize(tmp_path, "other")["prepare"]["compile_s"] == 1.0


def test_the_attention_split_preparation_chose_is_reported() -> None:
    report = {"timings": {"attention_tune_s": 12.5}, "attention_split": {"pages_per_split": 2, "splits": 36}}
    out = summarize.prepare_section(report)
    assert out["attention_pages_per_split"] == 2 and out["attention_tune_s"] == 12.5
    assert "attention_pages_per_split" not in summarize.prepare_section({"timings": {}})


def test_an_agent_turn_cached_short_of_the_previous_prompt_is_reported() -> None:
    fed = {
        "bench": {
            "agent_turns": [
                {"turn": 1, "prompt_tokens": 460, "cached_tokens": 0, "ttft_ms": 9.0},
                {"turn": 2, "prompt_tokens": 487, "cached_tokens": 448, "ttft_ms": 6.0},
            ]
        }
    }
    assert summarize.agent_section(fed)["cached_at_message_endpoints"] is False


def test_the_hbm_bound_follows_the_device() -> None:
    """The bound's bandwidth comes from the device's name, never an H200 figure for an H100; an
    unknown device asks for the figure instead of guessing."""
    assert hbm.peak_gbps(name="NVIDIA H100 80GB HBM3") == (3350.0, "datasheet for NVIDIA H100 80GB HBM3")
    assert hbm.peak_gbps(name="NVIDIA H200")[0] == 4800.0
    assert hbm.peak_gbps(name="NVIDIA H100 NVL")[0] == 3900.0
    assert hbm.peak_gbps(1234.0, name="anything") == (1234.0, "--hbm-gbps")
    with pytest.raises(hbm.UnknownDevice):
        hbm.peak_gbps(name="NVIDIA A100-SXM4-80GB")


def test_speculation_figures_come_from_the_bench_files_and_counters(tmp_path: Path) -> None:
    """Each workload served with copy proposals against without (2026-12-06, SmolLM2 on the
    H200), and the server's counters; a bench that wrote nothing is left out, not zero."""
    raw = REPO / "qualification" / "raw" / "2026-12-06-s17" / "smollm2_spec"
    spec = summarize.summarize(raw, "spec")["speculation"]
    copy = spec["workloads"]["copy c=1"]
    assert spec["depth"] == 4 and copy["failed"] == 0
    ratio = copy["stream_tokens_per_s"]["speculative"] / copy["stream_tokens_per_s"]["off"]
    assert abs(copy["speedup"] - ratio) < 1e-3 and copy["speedup"] > 2
    totals = spec["server_totals"]
    assert totals["accepted_tokens_total"] <= totals["proposed_tokens_total"]
    assert totals["accepted_per_round"] == round(totals["accepted_tokens_total"] / totals["rounds_total"], 3)
    for name in ("bench_copy_d4.json", "bench_copy_d0.json"):
        (tmp_path / name).write_text((raw / name).read_text())
    (tmp_path / "bench_decode_d4.json").write_text("")
    assert set(summarize.speculation_section(tmp_path)["workloads"]) == {"copy c=1", "copy c=4"}
    assert summarize.speculation_section(tmp_path / "nothing") == {}


def test_copy_outputs_compare_by_digest_across_depths(tmp_path: Path) -> None:
    """Seeded greedy copy runs at depth 4 and 0: equal digests, identical outputs; one differing
    record, not identical; records without digests (older benches), not judged."""
    raw = REPO / "qualification" / "raw" / "2026-12-06-s17" / "smollm2_spec"
    docs = {d: json.loads((raw / f"bench_copy_d{d}.json").read_text()) for d in (4, 0)}
    for d, doc in docs.items():
        for w in doc["workloads"]:
            for i, r in enumerate(w["records"]):
                r["output_digest"] = f"{i:016x}"
        (tmp_path / f"bench_copy_d{d}.json").write_text(json.dumps(doc))
    spec = summarize.speculation_section(tmp_path)
    assert all(w["outputs_identical"] for w in spec["workloads"].values())
    docs[0]["workloads"][1]["records"][2]["output_digest"] = "ff"
    (tmp_path / "bench_copy_d0.json").write_text(json.dumps(docs[0]))
    spec = summarize.speculation_section(tmp_path)
    assert spec["workloads"]["copy c=1"]["outputs_identical"] and not spec["workloads"]["copy c=4"]["outputs_identical"]
    assert "outputs_identical" not in summarize.speculation_section(raw)["workloads"]["copy c=1"]
    # With the texts kept (`--keep-outputs`): where each differing record first parts.
    for d, doc in docs.items():
        for w in doc["workloads"]:
            for i, r in enumerate(w["records"]):
                r["output"] = f"same prefix {i}" + ("" if d == 4 or r["output_digest"] != "ff" else " then more")
        (tmp_path / f"bench_copy_d{d}.json").write_text(json.dumps(doc))
    docs[0]["workloads"][1]["records"][1]["output"] = "same prefiX"
    (tmp_path / "bench_copy_d0.json").write_text(json.dumps(docs[0]))
    parts = summarize.speculation_section(tmp_path)["workloads"]
    assert parts["copy c=1"]["first_difference_chars"] == [None]
    assert parts["copy c=4"]["first_difference_chars"] == [None, 10, 13, None]


def test_headline_figures_carry_the_decode_bandwidth_issue_names() -> None:
    """`decode_itl_ms.c1.median`, `cold_ttft_ms.4096`, ... equal the sections they repeat."""
    raw = REPO / "qualification" / "raw" / "2026-12-04" / "llama_1b_random"
    entry = summarize.summarize(raw, None)
    assert entry["decode_itl_ms"]["c1"] == entry["decode"]["itl_ms_c1"]
    assert entry["cold_ttft_ms"]["4096"] == entry["ttft_ms"]["cold_4096"]
    assert entry["hbm_fraction_c1"] == entry["decode"]["fraction_of_hbm_bound_c1"]
    assert entry["prepare_s"] == entry["prepare"]["prepare_total_s"]
    assert entry["decode_tok_s"]["c4"] > 0 and entry["prefill_tok_s_4096"] > 0
    assert summarize.figures({}, None) == {}


def test_exposed_time_counts_overlap_once() -> None:
    """`kernel_breakdown.exposed`: kernels one after another keep their durations; a dependent
    that started early (a programmatic edge) counts only its time past its predecessors' ends,
    and one that ends inside a predecessor counts nothing; the sum is the busy time."""
    pytest.importorskip("torch")
    import kernel_breakdown

    serial = [("a", 0.0, 2.0), ("b", 3.0, 1.0), ("c", 4.5, 2.0)]
    assert kernel_breakdown.exposed(serial) == [2.0, 1.0, 2.0]
    overlapped = [("a", 0.0, 4.0), ("b", 1.0, 5.0), ("c", 2.0, 1.0), ("d", 5.5, 1.0)]
    assert kernel_breakdown.exposed(overlapped) == [4.0, 2.0, 0.0, 0.5]
    assert sum(kernel_breakdown.exposed(overlapped)) == 6.5  # the union [0, 6.5)
