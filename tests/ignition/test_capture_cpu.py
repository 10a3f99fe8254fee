"""CPU checks of the GPU capture path (ignition/capture): what runs without a device.

The capture itself (arena, torch.compile, CUDA graph walk, Rust replay) is qualified on the GPU
machine: qualification/ignition_capture_replay.json.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.ignition.conftest import require_torch


def test_gaps_cover_blocks_outside_named_tensors() -> None:
    from ignition.capture.recorder import _align_of, _gaps

    # A 4 KiB block holding one 100-byte tensor at 1024: fillers before it and after its
    # word-rounded end, never sharing a word with it.
    assert _gaps(0, 4096, [(1024, 1124)]) == [(0, 1024), (1128, 4096)]
    # A graph's 1,152-byte output at the start of a freed 3,072-byte block: the rest of the block
    # (where a view 1,152 bytes into the block's earlier tensor pointed) is covered from its end.
    assert _gaps(0, 3072, [(0, 1152)]) == [(1152, 3072)]
    assert _gaps(0, 4096, []) == [(0, 4096)]
    assert _gaps(0, 512, [(0, 512)]) == []
    assert _align_of(0) == 4096 and _align_of(1536) == 512 and _align_of(1 << 20) == 4096


def test_arena_segments_the_snapshot_misses_are_kept_as_scratch() -> None:
    """Segments in the arena's own log that torch's snapshot does not list become whole inactive
    blocks ("released" when freed), so a graph pointing into one still resolves; a logged segment
    overlapping a listed one is not added twice."""
    require_torch()
    from ignition.capture.arena import Segment
    from ignition.capture.recorder import unlisted_segments

    base = 1 << 40
    mib = 1 << 20
    listed = [{"address": base, "size": 2 * mib}, {"address": base + 8 * mib, "size": 2 * mib}]
    log = [
        Segment(0, 2 * mib, False),  # listed
        Segment(2 * mib, 2 * mib, True),  # freed by the caching allocator
        Segment(4 * mib, 4 * mib, False),  # live but unlisted
        Segment(9 * mib, mib, False),  # inside a listed one
        Segment(10 * mib, 2 * mib, True),
    ]
    got = unlisted_segments(listed, log, base)
    assert [(g["pool"], g["address"] - base, g["size"]) for g in got] == [
        ("released", 2 * mib, 2 * mib),
        ("unlisted", 4 * mib, 4 * mib),
        ("released", 10 * mib, 2 * mib),
    ]
    assert got[0]["blocks"] == [(base + 2 * mib, 2 * mib, "inactive")]
    assert unlisted_segments([], log[:1], base)[0]["pool"] == "unlisted"


def test_rows_copy_check_matches_only_the_block_a_copy_would_get() -> None:
    """The functionalized-copy check looks for blocks of the size the caching allocator gives a
    copy: exact for a small request (SmolLM2's 673,960-byte rows: the 2 MiB window matched 17
    activation blocks on the device), a window for a large one."""
    require_torch()
    from ignition.capture.recorder import copy_block_sizes

    assert copy_block_sizes(673_960) == (674_304, 674_304)
    assert copy_block_sizes(512) == (512, 512) and copy_block_sizes(1) == (512, 512)
    assert copy_block_sizes(1 << 20) == (1 << 20, 1 << 20)
    assert copy_block_sizes((1 << 20) + 1) == ((1 << 20) + 512, (1 << 20) + 512 + (2 << 20))


def test_allocator_source_exports_the_pluggable_entry_points() -> None:
    from ignition.capture.arena import SOURCE

    text = SOURCE.read_text()
    for symbol in (
        "flare_arena_init",
        "flare_arena_alloc",
        "flare_arena_free",
        "cuMemAddressReserve",
        "cuMemCreate",
        "cuMemMap",
        "cuMemSetAccess",
    ):
        assert symbol in text


def test_modules_import_without_a_device() -> None:
    require_torch()
    for m in (
        "ignition.capture.driver",
        "ignition.capture.arena",
        "ignition.capture.recorder",
        "ignition.capture.runner",
        "ignition.capture.numerics",
        "ignition.prepare",
    ):
        importlib.import_module(m)


def test_every_flare_op_has_its_lowering_where_it_is_defined() -> None:
    """Each `flare::` op registers its Inductor fallback lowering when it is defined, with the
    layout constraint its tags imply, so lowering a graph never takes Inductor's implicit-fallback
    path (which formatted deep argument IR for minutes on the device, torch 2.11). An op defined
    without `declare` is reported, and a compile that lowers it implicitly names it."""
    require_torch()
    import torch
    from torch._inductor.lowering import maybe_layout_constraints
    from torch.library import custom_op

    from ignition.capture import attention, gdn, gemv, rownorm, sampling
    from ignition.capture.fallback import declare, undeclared, watch_lowerings

    ops = [sampling.sample_op(), gemv.gemv_op(), *gdn.gdn_ops(), gdn.commit_op(), attention.write_attend_op()]
    ops.append(rownorm.rms_norm_op())
    assert undeclared() == []
    assert {op._qualname for op in ops} >= {"flare::sample", "flare::gemv", "flare::gdn_delta", "flare::write_attend"}

    def define(name: str) -> Any:
        @custom_op(f"flare_test::{name}", mutates_args=(), schema="(Tensor x) -> Tensor")
        def op(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @op.register_fake
        def _(x: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(x)

        return op

    implicit, declared = define("implicit"), define("declared")
    assert undeclared("flare_test") == ["flare_test::declared", "flare_test::implicit"]
    declare(declared)
    declare(declared)  # idempotent
    assert undeclared("flare_test") == ["flare_test::implicit"]
    # The constraint the implicit path would have chosen: none for a flexible-layout op, the
    # configured default for the others.
    assert maybe_layout_constraints(attention.write_attend_op()._opoverload) is None
    assert maybe_layout_constraints(declared._opoverload) is not None

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    # force_disable_caches: a cache hit (an earlier run of this test) lowers nothing.
    with watch_lowerings() as lowered, torch._inductor.config.patch(force_disable_caches=True):
        got = torch.compile(lambda t: declared(implicit(t.sin()).cos()), fullgraph=True)(x)
    assert lowered == ["flare_test.implicit.default"]
    # Absolute tolerance: Inductor's vectorized cos differs from eager by float32 rounding, which
    # is large relative to outputs near cos's zeros (a CI run failed allclose's 1e-8 there).
    torch.testing.assert_close(got, 2 * (2 * x.sin()).cos(), rtol=1e-5, atol=1e-6)


def test_bounded_operator_str_never_formats_argument_ir() -> None:
    """Inductor's description of an implicitly lowered call names each argument's type and size
    instead of printing it (an IR argument's text can take minutes), including inside lists."""
    require_torch()
    from torch._inductor import exc

    from ignition.capture.fallback import bound_operator_str

    class DeepIR:
        def get_size(self) -> list[int]:
            return [4, 8]

        def __str__(self) -> str:
            raise AssertionError("formatted the argument's IR")

    class Sizeless(DeepIR):
        def get_size(self) -> list[int]:
            raise NotImplementedError

    bound_operator_str()
    args = [DeepIR(), [DeepIR(), 3], 1e-6, Sizeless()]
    text = exc.OperatorIssue.operator_str("flare_test::probe", args, {"eps": None})
    assert "DeepIR(4, 8)" in text and "[DeepIR(4, 8), 3]" in text and "kwargs[eps]: None" in text, text
    assert "args[3]: Sizeless" in text, text


def test_template_fusion_setting_reaches_inductor() -> None:
    """`--template-fusion heuristic` turns Inductor's timing of fused GEMM templates off under
    whichever name this torch gives the setting; an unknown value is refused."""
    require_torch()
    import pytest
    import torch._inductor.config as ic

    from ignition.capture.recorder import configure_inductor

    saved = ic.save_config()
    try:
        out = configure_inductor("heuristic")
        names = [k for k in ("benchmark_template_fusion", "benchmark_epilogue_fusion") if k in out]
        assert len(names) == 1 and out[names[0]] is False and getattr(ic, names[0]) is False
        assert configure_inductor("benchmark")[names[0]] is True and getattr(ic, names[0]) is True
        with pytest.raises(ValueError, match="template_fusion"):
            configure_inductor("fast")
    finally:
        ic.load_config(saved)


def test_compile_breakdown_reads_torch_timers_and_names_disjoint_parts() -> None:
    """The per-graph compile breakdown: torch's timers advance across a compile (this torch still
    keeps them where the recorder reads them), and the brief names disjoint parts, autotuning
    summed over every timer that says so."""
    require_torch()
    import torch

    from ignition.capture.recorder import _compile_brief, _compile_metrics

    before = _compile_metrics()
    torch.compile(lambda x: (x * 2).sin().sum(), fullgraph=True)(torch.randn(8))
    after = _compile_metrics()
    assert after.get("_compile.compile_inner", 0.0) > before.get("_compile.compile_inner", 0.0)
    spent = {"bytecode_tracing": 1.0, "GraphLowering.run": 2.0, "async_compile.wait": 3.0}
    spent |= {"_compile.compile_inner": 9.0, "select_algorithm.autotune": 0.5, "AlgorithmSelectorCache.autotune": 0.25}
    assert _compile_brief(spent) == {"trace": 1.0, "lower": 2.0, "triton": 3.0, "autotune": 0.75}


def test_compile_cache_file_round_trips_and_tolerates_garbage(tmp_path: Path) -> None:
    """`--compile-cache`: nothing to load the first time, the artifacts this process compiled are
    written after, load back with their entry counts, and a corrupt file loads nothing instead
    of failing the preparation."""
    require_torch()
    import torch

    from ignition.prepare import _load_compile_cache, _save_compile_cache

    path = tmp_path / "compile.cache"
    assert _load_compile_cache(path) == {"loaded_bytes": 0}
    torch.compile(lambda x: (x * 3).cos().sum(), fullgraph=True)(torch.randn(8))
    saved = _save_compile_cache(path)
    assert saved["saved_bytes"] == path.stat().st_size > 0 and saved["saved_entries"].get("inductor", 0) >= 1
    loaded = _load_compile_cache(path)
    assert loaded["loaded_bytes"] == saved["saved_bytes"] and loaded["loaded_entries"] == saved["saved_entries"]
    path.write_bytes(b"not a cache")
    assert _load_compile_cache(path).get("loaded_entries", {}) == {}


def test_a_pointer_past_a_named_tensor_in_a_reused_block_resolves() -> None:
    """decode_b1 on the device (2026-12-05): the graph's 1,152-byte output reused the freed block
    where its layer's QKV projection had been, and the attention kernel's K pointer (1,152 bytes
    into that projection) must still resolve, to the filler after the output."""
    from ignition.capture.recorder import _gaps
    from ignition.core.manifest import Arena, Buffer, BufferRange, BufferRole, Dtype, Uninitialized
    from ignition.export.resolve import AddressMap

    base, block = 1 << 40, 0x600
    out = (base + block, base + block + 1152)
    spans = [out, *_gaps(base + block, base + block + 3072, [out])]
    buffers = [
        Buffer(i + 1, f"b{i}", BufferRole.GRAPH_POOL, lo - base, hi - lo, 8, Dtype.U8, Uninitialized())
        for i, (lo, hi) in enumerate(spans)
    ]
    amap = AddressMap(Arena(base, 1 << 20, 4096), buffers)
    assert amap.find(base + 0xA80) == BufferRange(2, 0)
    assert amap.find(base + block) == BufferRange(1, 0)


def test_the_gemv_tuner_streams_more_weights_than_l2_holds(monkeypatch: Any) -> None:
    """The tuner times a projection over its layers followed by copies of them (distinct memory,
    same values, biases and norms alongside) up to `COLD_BYTES`, so that no layer's weights are
    still in L2 when it is read again; a problem that already holds that much is timed as is."""
    require_torch()
    import torch

    from ignition.capture import gemv

    monkeypatch.setattr(gemv, "COLD_BYTES", 10_000)
    weights = [torch.full((8, 64), float(i)) for i in range(2)]  # 2 x 2,048 bytes
    norms = [torch.full((64,), float(i)) for i in range(2)]
    p = gemv.Problem("o_proj", weights, gemv.Variant(residual=True), norms=norms)
    cold = gemv._cold(p)
    assert len(cold.weights) == 6 and sum(w.numel() * w.element_size() for w in cold.weights) >= 10_000
    assert cold.norms is not None and len(cold.norms) == 6 and cold.biases is None
    assert len({w.data_ptr() for w in cold.weights}) == 6
    assert all(
        torch.equal(w, weights[i % 2]) and torch.equal(n, norms[i % 2])
        for i, (w, n) in enumerate(zip(cold.weights, cold.norms, strict=True))
    )
    monkeypatch.setattr(gemv, "COLD_BYTES", 4096)
    assert gemv._cold(p) is p


def test_the_gemv_tuner_picks_rows_per_program_per_bucket(monkeypatch: Any) -> None:
    """For each bucket of more than one row, the per-row kernel's rows per program is timed at the
    default (the whole bucket, up to `MAX_GROUP_ROWS`) and the smaller `GROUP_CANDIDATES`; the
    fastest that keeps the bucket's rows equal to the same rows alone is registered for that
    bucket only. The tensor-core kernel and one-row buckets have nothing to choose."""
    require_torch()
    import functools

    import torch

    from ignition.capture import gemv

    cost = {(4, 1): 9.0, (4, 2): 5.0, (4, 4): 7.0, (2, 1): 3.0, (2, 2): 4.0}

    def timed(fn: functools.partial[Any], reps: int) -> float:
        x, group = fn.args[1], fn.args[5]
        return cost[(x.shape[0], group)] / 1e3

    broken = {(4, 2), (4, 4)}  # these sizes' rows differ from the rows alone: passed over
    monkeypatch.setattr(gemv, "_time_ms", timed)
    monkeypatch.setattr(gemv, "_bucket_invariant", lambda p, x, r, cfg, g=None: (x.shape[0], g) not in broken)
    monkeypatch.setattr(gemv, "_GROUPS", {})
    p = gemv.Problem("down", [torch.zeros(8, 64)], gemv.Variant(glu=True, residual=True))
    xs = {m: torch.zeros(m, 128) for m in (1, 2, 4)}
    res = {m: torch.zeros(m, 8) for m in (1, 2, 4)}
    cfg = gemv.GemvConfig(8, 64, 4)
    out = gemv._tune_groups(p, p, xs, res, cfg, 1)
    assert set(out) == {"2", "4"}
    # At 4 rows the two fastest sizes (2, then the default 4) break the invariance: 1 is kept.
    assert out["4"] == {"rows_per_program": 1, "us_per_layer": {"1": 9.0, "2": 5.0, "4": 7.0}}
    assert out["2"]["rows_per_program"] == 1
    assert gemv.group_rows_for(8, 64, p.variant, 2) == 1 and gemv.group_rows_for(8, 64, p.variant, 4) == 1
    assert gemv.group_rows_for(8, 64, p.variant, 8) == 8  # untuned: the default
    assert gemv._tune_groups(p, p, xs, res, gemv.GemvConfig(16, 64, 4, dot=True), 1) == {}
    # No size keeping the rows: an error, never a silent choice.
    broken |= {(4, 1)}
    with pytest.raises(RuntimeError, match="no group size keeps 4 rows"):
        gemv._tune_groups(p, p, xs, res, cfg, 1)
    gemv.clear_group_rows()
    assert gemv.group_rows_for(8, 64, p.variant, 2) == 2


def test_the_launch_tuner_revisits_a_projection_once_its_successor_has_chosen(monkeypatch: Any) -> None:
    """`gemv.tune_launch` over a timing model where o_proj's early trigger (mode 3) pays only
    once gate_up prefetches (mode 3 with a prefetch): a single greedy pass keeps o_proj at mode
    1, a second finds the pair. The modes are registered per shape; a problem with one weight
    stays out of the chain and plain."""
    require_torch()
    import torch

    from ignition.capture import gemv

    def model(modes: dict[str, gemv.LaunchMode]) -> float:
        if all(m == gemv.PLAIN for m in modes.values()):
            return 10.0
        t = 9.0
        gate_up = modes.get("gate_up", gemv.PLAIN)
        if gate_up.pdl == 3 and gate_up.pf_k:
            t -= 1.0
            if modes.get("o_proj", gemv.PLAIN).pdl == 3:
                t -= 2.0
        if modes.get("o_proj", gemv.PLAIN).pdl == 3 and not (gate_up.pdl == 3 and gate_up.pf_k):
            t += 0.5  # an early trigger with nothing to prefetch behind it costs slots
        return t

    monkeypatch.setattr(gemv, "time_graphs", lambda steps, reps: model(steps[0].args[3]))
    monkeypatch.setattr(gemv, "launch", lambda *a, **k: None)
    monkeypatch.setattr(gemv, "_MODES", {})

    def problem(name: str, n: int, k: int, layers: int, variant: Any) -> Any:
        return gemv.Problem(name, [torch.zeros(n, k) for _ in range(layers)], variant)

    problems = [
        problem("o_proj", 8, 16, 2, gemv.Variant(residual=True)),
        problem("gate_up", 32, 16, 2, gemv.Variant()),
        problem("lm_head", 64, 16, 1, gemv.Variant()),
    ]
    candidates = (gemv.LaunchMode(1), gemv.LaunchMode(3), gemv.LaunchMode(3, 8192))
    monkeypatch.setattr(gemv, "LAUNCH_PASSES", 1)
    one = gemv.tune_launch(problems, 1, candidates)
    assert one["chosen"]["o_proj"]["pdl"] == 1 and one["chosen_ms"] == 8.0
    monkeypatch.setattr(gemv, "LAUNCH_PASSES", 3)
    full = gemv.tune_launch(problems, 1, candidates)
    assert full["chosen"] == {"o_proj": {"pdl": 3, "pf_k": 0}, "gate_up": {"pdl": 3, "pf_k": 8192}}
    assert full["chosen_ms"] == 6.0 and full["passes"] == 3 and full["kept"]
    assert gemv.launch_mode_for(8, 16, gemv.Variant(residual=True)) == gemv.LaunchMode(3)
    assert gemv.launch_mode_for(64, 16, gemv.Variant()) == gemv.PLAIN


@pytest.mark.parametrize(
    ("attention_gain", "mode_gain", "kept", "attention_pdl"),
    [(0.5, 2.0, True, True), (-0.5, 2.0, True, False), (0.0, 0.05, False, False)],
)
def test_prepare_times_launch_modes_on_the_compiled_step(
    monkeypatch: Any, attention_gain: float, mode_gain: float, kept: bool, attention_pdl: bool
) -> None:
    """`prepare._tune_launch` times the smallest decode graph (not the projections alone): the
    projections' modes with attention as programmatic dependents, then attention both ways; it
    keeps attention's flag only where the step is faster so, and every launch plain when the
    best step does not beat plain launches by `LAUNCH_MIN_GAIN`."""
    require_torch()
    import torch

    from ignition import prepare
    from ignition.capture import attention, gemv

    weights = [torch.zeros(8, 16) for _ in range(2)]
    problem = gemv.Problem("o_proj", weights, gemv.Variant(residual=True))

    class Rec:
        def __init__(self) -> None:
            self.timings: dict[str, float] = {}
            graph = ("decode", 2, "decode_b2"), ("decode", 1, "decode_b1"), ("prefill", 1, "prefill_t8")
            self.graphs = [SimpleNamespace(kind=k, request_count=b, name=n) for k, b, n in graph]
            self.program = SimpleNamespace(model=SimpleNamespace(projection_problems=lambda: [problem]))
            self.timed: list[str] = []

        def time_graph(self, name: str) -> float:
            self.timed.append(name)
            t = 10.0 - (mode_gain if gemv.launch_mode_for(8, 16, problem.variant).pdl == 3 else 0.0)
            return t - (attention_gain if attention.PDL else 0.0)

    monkeypatch.setattr(gemv, "_MODES", {})
    monkeypatch.setattr(gemv, "LAUNCH_CANDIDATES", (gemv.LaunchMode(3),))
    monkeypatch.setattr(attention, "PDL", False)
    rec = Rec()
    out = prepare._tune_launch(rec)
    assert set(rec.timed) == {"decode_b1"}
    assert out["kept"] is kept and attention.PDL is attention_pdl and out["attention_pdl"] is attention_pdl
    assert (gemv.launch_mode_for(8, 16, problem.variant) == gemv.LaunchMode(3)) is kept
    assert out["step_plain_ms"] == 10.0
    assert out["step_chosen_ms"] == (10.0 - mode_gain - max(attention_gain, 0.0) if kept else 10.0)


def test_projections_sharing_a_launch_mode_slot_are_tuned_as_one_unit(monkeypatch: Any) -> None:
    """Modes are registered per (shape, variant): two projections with the same key (Qwen3.5's
    out_proj and o_proj) are one unit, so no trial times a mode the other one overwrote."""
    require_torch()
    import torch

    from ignition.capture import gemv

    seen: list[dict[str, gemv.LaunchMode]] = []

    def model(modes: dict[str, gemv.LaunchMode]) -> float:
        seen.append(dict(modes))
        return 10.0 - (2.0 if modes.get("out_proj", gemv.PLAIN).pdl == 3 else 0.0)

    monkeypatch.setattr(gemv, "time_graphs", lambda steps, reps: model(steps[0].args[3]))
    monkeypatch.setattr(gemv, "launch", lambda *a, **k: None)
    monkeypatch.setattr(gemv, "_MODES", {})
    variant = gemv.Variant(residual=True)
    problems = [gemv.Problem(name, [torch.zeros(8, 16) for _ in range(2)], variant) for name in ("out_proj", "o_proj")]
    out = gemv.tune_launch(problems, 1, (gemv.LaunchMode(1), gemv.LaunchMode(3)))
    assert out["chosen"] == {"out_proj+o_proj": {"pdl": 3, "pf_k": 0}}
    assert all(m["out_proj"] == m["o_proj"] for m in seen)  # one mode for both in every trial
    assert gemv.launch_mode_for(8, 16, variant) == gemv.LaunchMode(3)
