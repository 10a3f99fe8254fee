"""CPU checks of the GPU capture path (ignition/capture): what runs without a device.

The capture itself (arena, torch.compile, CUDA graph walk, Rust replay) is qualified on the GPU
machine: qualification/ignition_capture_replay.json.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from tests.ignition.conftest import require_torch


def test_gaps_cover_blocks_outside_named_tensors() -> None:
    from ignition.capture.recorder import _align_of, _gaps

    # A 4 KiB block holding one 100-byte tensor at 1024: fillers before it and after its
    # 512-rounded end, never sharing a word with it.
    assert _gaps(0, 4096, [(1024, 1124)]) == [(0, 1024), (1536, 4096)]
    assert _gaps(0, 4096, []) == [(0, 4096)]
    assert _gaps(0, 512, [(0, 512)]) == []
    assert _align_of(0) == 4096 and _align_of(1536) == 512 and _align_of(1 << 20) == 4096


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
