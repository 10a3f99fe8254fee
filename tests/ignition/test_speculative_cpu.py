"""CPU checks of the speculative programs (`PagedLlama.verify`, issue 21): generation through them
equals ordinary generation whatever the proposals (right, wrong, none, device-fed), and a round
commits exactly what ordinary decoding of its emitted tokens would: the row's hidden vector, its
pending token, its penalty histogram, the KV of every consumed position."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.ignition.conftest import require_torch
from tests.ignition.test_paged_cpu import TINY, _checkpoint, _paged, _run, _set_state, _state

if TYPE_CHECKING:
    import torch

    from ignition.capture.program import GraphSpec, Program
    from ignition.capture.runner import Sampling


def _program(tmp: Path, speculative: list[tuple[int, int]]) -> Program:
    from ignition.capture.program import Program, catalog

    model = _paged(tmp, TINY)
    return Program(model, catalog(model.geo, [1, 4], [128], speculative))


def _eager(prog: Program) -> None:
    from tests.ignition.test_paged_cpu import _EagerGraph

    for spec in prog.graphs:
        spec.graph = _EagerGraph(prog, spec)


def _params() -> Sampling:
    """Penalties and filters on, so a histogram or counter off by one token changes the stream."""
    from ignition.capture.runner import Sampling

    return Sampling(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.4)


def test_speculative_generation_equals_ordinary_generation(tmp_path: Path) -> None:
    require_torch()
    from ignition.capture.runner import GraphRunner, Sampling
    from ignition.core.stepping import replaying

    _checkpoint(tmp_path, TINY)
    prog = _program(tmp_path, [(1, 3), (4, 3)])
    _eager(prog)
    runner = GraphRunner(prog)
    assert runner.verify_depth(1) == 3 and [g.name for g in runner.verify] == ["verify_b1_d3", "verify_b4_d3"]
    prompt = list(range(3, 120))
    for params in (_params(), Sampling(top_k=1)):
        want = runner.generate(prompt, 21, params, 14)
        assert len(want) == 14, want  # the tiny model does not sample EOS here: every round counts

        got, steps = runner.generate_speculative(prompt, 21, params, 14, replaying(want))
        assert got == want and steps == 4, (got, steps)  # 13 decoded tokens, 4 per round
        got, steps = runner.generate_speculative(
            prompt, 21, params, 14, replaying(want, 3, 300), live_row=3, device_fed=True
        )
        assert got == want and 4 < steps < 13, steps
        got, steps = runner.generate_speculative(prompt, 21, params, 14, lambda out: [])
        assert got == want and steps == 13
        garbage = runner.generate_speculative(prompt, 21, params, 14, lambda out: [7, 7, 7], live_row=2)
        assert garbage[0] == want


def test_a_round_commits_exactly_what_ordinary_decoding_does(tmp_path: Path) -> None:
    """Two proposals, the first right and the second wrong: the round emits two tokens and leaves
    the row's state as two decode steps of those tokens leave it (KV of the consumed positions,
    hidden vector, pending token, histogram); the record says two tokens, consumed start + 2."""
    require_torch()
    import torch

    from ignition.capture.paged import FLAG_SAMPLED, HEADER_WORDS, RECORD_MAGIC
    from ignition.capture.runner import Row

    _checkpoint(tmp_path, TINY)
    prog = _program(tmp_path, [(1, 3), (4, 3)])
    params = _params()
    pages, ids = [3, 8, 1], list(range(5, 90))
    _, rec = _run(prog, "prefill_t128", [Row(2, pages, 0, ids, (9, 0), params)])
    first = int(rec[0, HEADER_WORDS])
    before = _state(prog)
    # Ordinary decoding: three steps from the prefill's token.
    out, start = [first], len(ids)
    for n in range(3):
        _, rec = _run(prog, "decode_b1", [Row(2, pages, start + n, [out[-1]], (9, 1 + n), params)])
        out.append(int(rec[0, HEADER_WORDS]))
    _set_state(prog, before)
    for n in range(2):
        _run(prog, "decode_b1", [Row(2, pages, start + n, [out[n]], (9, 1 + n), params)])
    after_two = _state(prog)
    _set_state(prog, before)
    wrong = (out[2] + 1) % 300
    h, rec = _run(prog, "verify_b4_d3", [Row(2, pages, start, [-1, out[1], wrong], (9, 1), params)])
    r = rec[0].tolist()
    assert r[:6] == [RECORD_MAGIC, 2, FLAG_SAMPLED, 2, start + 2, 1] and r[HEADER_WORDS : HEADER_WORDS + 2] == out[1:3]
    assert all(int(x[2]) == 0 for x in rec[1:])  # padded requests sample nothing
    kv, rows, hist, pending = _state(prog)
    assert torch.equal(rows[2], after_two[1][2]) and torch.equal(hist[2], after_two[2][2])
    # The pending token is the last emitted one (two decode steps leave the second's sample).
    assert int(pending[2]) == out[2] and torch.equal(pending[[0, 1, 3, 4]], before[3][[0, 1, 3, 4]])
    # KV: the consumed positions are what decoding wrote; the rejected lane wrote one position
    # past them (garbage, overwritten before anything reads it); nothing else changed.
    pt = prog.geo.page_tokens
    for pos in range(start + 3):
        page, off = pages[pos // pt], pos % pt
        same = torch.equal(kv[page, :, :, off], after_two[0][page, :, :, off])
        assert same == (pos < start + 2), pos
    changed = {p for p in range(kv.shape[0]) if not torch.equal(kv[p], before[0][p])}
    trash = prog.geo.max_kv_pages  # unused lanes write there
    assert changed <= {pages[start // pt], pages[(start + 2) // pt], trash}
    assert h.shape[0] == 16  # every lane's hidden vector, padded lanes included


def test_a_record_stops_at_eos_and_at_an_exhausted_grammar(tmp_path: Path) -> None:
    require_torch()
    from ignition.capture.paged import FLAG_EOS, FLAG_GRAMMAR_EXHAUSTED, FLAG_SAMPLED, HEADER_WORDS
    from ignition.capture.runner import Row, Sampling, fill, pack_rows

    _checkpoint(tmp_path, TINY)
    prog = _program(tmp_path, [(1, 3)])
    spec = next(g for g in prog.graphs if g.name == "verify_b1_d3")
    pages, ids = [0, 1, 2], list(range(5, 90))
    _run(prog, "prefill_t128", [Row(1, pages, 0, ids, (4, 0))])
    base = _state(prog)
    # Only EOS (id 2) allowed from lane 1 on: lane 1 samples EOS, so the proposal after it is not
    # consumed even though it is EOS too.
    fill(spec, pack_rows(prog.geo, spec, [Row(1, pages, len(ids), [-1, 2, 2, 2], (4, 1), Sampling(top_k=1))]))
    mask = spec.inputs["grammar_mask"]
    mask[1:].zero_()
    mask[1:, 0] = 1 << 2
    _, rec = _run_filled(prog, spec)
    lane0 = int(rec[0, HEADER_WORDS])
    if lane0 == 2:
        assert int(rec[0, 3]) == 1 and int(rec[0, 2]) == FLAG_SAMPLED | FLAG_EOS
    else:
        assert int(rec[0, 3]) == 1 and int(rec[0, 2]) == FLAG_SAMPLED  # lane 0 did not match
    # Lane 0 may not sample anything: no token, grammar exhausted, nothing committed.
    _set_state(prog, base)
    fill(spec, pack_rows(prog.geo, spec, [Row(1, pages, len(ids), [-1, 5], (4, 1))]))
    spec.inputs["grammar_mask"].zero_()
    _, rec = _run_filled(prog, spec)
    assert int(rec[0, 2]) == FLAG_GRAMMAR_EXHAUSTED and int(rec[0, 3]) == 0
    assert int(prog.pending[1]) == int(base[3][1]) and prog.hist[1].sum() == base[2][1].sum()


def _run_filled(prog: Program, spec: GraphSpec) -> tuple[torch.Tensor, torch.Tensor]:
    assert spec.records is not None
    spec.records.zero_()
    h = prog.call(spec, prog.method(spec))
    return h, spec.records.clone()


def test_speculative_programs_are_planned_within_the_lane_limit() -> None:
    from ignition.prepare import MAX_VERIFY_LANES, speculative_programs

    assert speculative_programs([1, 2, 4, 8], 7) == [(1, 7), (2, 7), (4, 3), (8, 1)]
    assert speculative_programs([1, 16], 4) == [(1, 4)]
    assert speculative_programs([1, 2], 0) == []
    assert all(b * (d + 1) <= MAX_VERIFY_LANES for b, d in speculative_programs([1, 2, 4, 8, 16], 15))


@pytest.mark.parametrize("depth", [-1, 16])
def test_a_speculative_depth_outside_the_plan_is_refused(depth: int) -> None:
    from ignition.prepare import CapacityError, plan_capacities
    from ignition.recipes import recipe_for

    recipe = recipe_for(TINY)
    config = recipe.parse_config(TINY)
    with pytest.raises(CapacityError, match="--speculative-depth"):
        plan_capacities(config, "1,4", 128, 256, None, speculative_depth=depth)


def test_the_replay_check_inputs_and_the_prepare_check_run_the_programs(tmp_path: Path) -> None:
    """`Program.set_inputs` (the GPU replay checks' inputs) gives each speculative program a valid
    round: real requests sample and store their pending token, the padded one does not;
    prepare's speculative check passes over eager steps; and a request batched behind others in
    every decode bucket and program is bitwise its step alone."""
    require_torch()
    import torch

    from ignition.capture.paged import FLAG_SAMPLED, HEADER_WORDS
    from ignition.capture.runner import GraphRunner
    from ignition.prepare import _batched_against_alone, _speculative_check

    _checkpoint(tmp_path, TINY)
    prog = _program(tmp_path, [(1, 3), (4, 3)])
    for i, spec in enumerate(g for g in prog.graphs if g.kind == "speculative"):
        prog.set_inputs(spec, i)
        pending = prog.pending.clone()
        out = prog.call(spec, prog.method(spec))
        assert torch.isfinite(out.float()).all() and spec.records is not None
        rec = spec.records
        real = [r for r in range(spec.request_count) if int(spec.inputs["request_slots"][r]) >= 0]
        assert real and all(int(rec[r, 2]) & FLAG_SAMPLED for r in real), (spec.name, rec)
        for r in real:
            count = int(rec[r, 3])
            assert 1 <= count <= int(spec.inputs["query_lengths"][r])
            pending[int(rec[r, 1])] = rec[r, HEADER_WORDS + count - 1]
        assert torch.equal(prog.pending, pending), spec.name
    _eager(prog)
    runner = GraphRunner(prog)
    prompt, params = list(range(3, 100)), _params()
    gens = [{"prompt_ids": prompt, "seed": 5, "params": vars(params), "max_tokens": 9}]
    gens[0]["tokens"] = runner.generate(prompt, 5, params, 9)
    report = _speculative_check(runner, gens)
    assert report["identical"] == "1/1" and report["depth"] == 3, report
    assert all(lane["bitwise"] for lane in report["lanes_against_decode"]["lanes"]), report
    assert report["lanes_against_decode"]["live_row_bitwise"], report
    assert report["decode_rounds"]["right"] < report["decode_rounds"]["one_in_three_wrong"] <= 8, report
    batched = _batched_against_alone(runner, gens[0])
    assert batched["all_bitwise"] and {"verify_b1_d3", "verify_b4_d3"} <= batched["graphs"].keys(), batched


def test_speculative_lanes_with_the_device_kernels_equal_decoding() -> None:
    """With the few-row kernels a core runs (`flare::gemv`, `flare::rms_norm`, `flare::sample`
    under Triton's interpreter), speculative generation still equals ordinary generation, and
    both equal generation through the torch sampler and norms."""
    from tests.ignition.test_paged_cpu import _interpreted

    report = _interpreted("speculative_kernels_interpreted.py", 600)
    for case in ("sampled", "greedy"):
        assert report[case] == {"speculative_equal": True, "rounds": 2, "torch_equal": True}, report
