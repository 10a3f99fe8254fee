"""The CPU dry-run exporter over the recorded graph fixture, checked by the Rust loader."""

from __future__ import annotations

import copy
import json
import shutil
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ignition.core.checks import ManifestError, check_core
from ignition.core.manifest import (
    BufferRole,
    Direction,
    Dtype,
    EdgeDependency,
    KernelNode,
    MemcpyNode,
    MemsetNode,
    RuntimeCore,
    ValueKind,
    ZeroFill,
)
from ignition.export.errors import (
    ForeignPointerError,
    LibraryKernelError,
    MissingKernelImageError,
    RecordingError,
    UnresolvedAddressError,
    UnresolvedPointerError,
)
from ignition.export.exporter import RecordingExporter, export_recording
from tests.ignition.conftest import FIXTURES, flare_check, require_torch, with_pending_tokens

RECORDING = FIXTURES / "recorded_graph.json"


def load() -> dict[str, Any]:
    recording: dict[str, Any] = json.loads(RECORDING.read_text())
    return recording


def export(rec: dict[str, Any], out: Path) -> RuntimeCore:
    return RecordingExporter(rec, FIXTURES).export(out)


def node(rec: dict[str, Any], graph: str, nid: int) -> dict[str, Any]:
    g = next(g for g in rec["graphs"] if g["name"] == graph)
    return next(n for n in g["nodes"] if n["id"] == nid)


def set_word(n: dict[str, Any], at: int, value: int) -> None:
    raw = bytearray(bytes.fromhex(n["kernel"]["param_bytes"]))
    raw[at : at + 8] = struct.pack("<Q", value)
    n["kernel"]["param_bytes"] = raw.hex()


def test_fixture_is_current() -> None:
    script = FIXTURES / "make_recording.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_exported_core_loads_in_rust(tmp_path: Path, flare_bin: Path) -> None:
    out = tmp_path / "core"
    core = export_recording(RECORDING, out)
    proc = flare_check(flare_bin, out)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "is a valid runtime core" in proc.stdout
    assert "decode buckets     [1, 2]" in proc.stdout
    # Every kind of node made it, and every pointer word in the arena became a relocation.
    kinds = {type(n.op) for g in core.graphs for n in g.nodes}
    assert {KernelNode, MemcpyNode, MemsetNode} <= kinds
    decode = next(g for g in core.graphs if g.name == "decode_b1")
    relocs = [r for n in decode.nodes if isinstance(n.op, KernelNode) for r in n.op.relocations]
    embed = next(b for b in core.buffers if b.name == "model.embed_tokens.weight")
    # The sampling kernel's interior pointer (embed + 128) and the by-value struct's second word.
    assert any(r.buffer_id == embed.id and r.buffer_offset == 128 for r in relocs)
    assert any(r.param_index == 2 and r.byte_offset == 8 for r in relocs)
    # Triton's trailing NULL scratch pointers are not relocated.
    assert not any(r.param_index in (5, 6) for r in relocs)


def test_export_is_deterministic(tmp_path: Path) -> None:
    a, b = export(load(), tmp_path / "a"), export(load(), tmp_path / "b")
    assert (tmp_path / "a" / "manifest.pb").read_bytes() == (tmp_path / "b" / "manifest.pb").read_bytes()
    assert a.encode() == b.encode()


def test_rust_rejects_a_tampered_kernel_image(tmp_path: Path, flare_bin: Path) -> None:
    out = tmp_path / "core"
    core = export_recording(RECORDING, out)
    (out / core.kernels[0].file).write_bytes(b"not the recorded image")
    proc = flare_check(flare_bin, out)
    assert proc.returncode != 0
    assert "sha256" in proc.stderr + proc.stdout


def test_pointer_into_an_arena_gap_names_kernel_and_offset(tmp_path: Path) -> None:
    rec = load()
    base = int(rec["arena"]["base_address"], 16)
    gap = base + rec["arena"]["byte_size"] - 64  # past the last allocation, inside the arena
    set_word(node(rec, "decode_b2", 3), 24, gap)  # param 2 (by-value struct), byte offset 8
    with pytest.raises(UnresolvedPointerError) as e:
        export(rec, tmp_path / "core")
    err = e.value
    assert (err.graph, err.node, err.kernel) == ("decode_b2", 3, "triton_paged_attention_64")
    assert (err.param_index, err.byte_offset, err.word) == (2, 8, gap)
    assert "triton_paged_attention_64" in str(err) and "byte offset 8" in str(err)
    assert not (tmp_path / "core" / "manifest.pb").exists()


def test_pointer_one_past_a_buffer_is_unresolved(tmp_path: Path) -> None:
    rec = load()
    base = int(rec["arena"]["base_address"], 16)
    pool = next(a for a in rec["allocations"] if a["name"] == "graph_pool")
    set_word(node(rec, "prefill_t128", 2), 24, base + pool["offset"] + pool["byte_size"])
    with pytest.raises(UnresolvedPointerError) as e:
        export(rec, tmp_path / "core")
    assert (e.value.param_index, e.value.byte_offset) == (3, 0)
    # The message names what the address fell between.
    end = pool["offset"] + pool["byte_size"]
    assert f"arena offset {end:#x}, after graph_pool [{pool['offset']:#x}, {end:#x})" in str(e.value)


def test_pointer_into_a_foreign_allocator_is_rejected(tmp_path: Path) -> None:
    rec = load()
    set_word(node(rec, "decode_b1", 5), 0, 0x7F00_0000_1000)
    with pytest.raises(ForeignPointerError) as e:
        export(rec, tmp_path / "core")
    assert e.value.kernel == "triton_sample_tokens_0"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"origin": "library"}, "origin 'library'"),
        ({"function_name": "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8"}, "'cutlass'"),
        ({"function_name": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"}, "'sm90_'"),
        ({"function_name": "_ZN2at6native18elementwise_kernelILi128ELi4EEEviT1_"}, "'_ZN'"),
    ],
)
def test_library_kernels_are_rejected_by_name(tmp_path: Path, change: dict[str, str], needle: str) -> None:
    rec = load()
    k = next(k for k in rec["kernels"] if k["key"] == "paged_attention")
    k.update(change)
    with pytest.raises(LibraryKernelError) as e:
        export(rec, tmp_path / "core")
    assert e.value.kernel == k["function_name"]
    assert needle in e.value.reason
    assert k["function_name"] in str(e.value)


def test_missing_kernel_image_is_an_error(tmp_path: Path) -> None:
    rec = load()
    rec["kernels"][0]["image"] = "kernels/absent.cubin"
    with pytest.raises(MissingKernelImageError):
        export(rec, tmp_path / "core")


def test_memcpy_crossing_a_buffer_end_is_unresolved(tmp_path: Path) -> None:
    rec = load()
    node(rec, "decode_b1", 4)["memcpy"]["byte_count"] = 1 << 20
    with pytest.raises(UnresolvedAddressError) as e:
        export(rec, tmp_path / "core")
    assert "memcpy" in e.value.where


def test_python_checks_catch_an_out_of_range_default(tmp_path: Path) -> None:
    rec = load()
    rec["frontend"]["sampling"]["top_p"] = {"default": 1.5, "range": [0.01, 1.0]}
    with pytest.raises(ManifestError) as e:
        export(rec, tmp_path / "core")
    assert e.value.field == "frontend.sampling.top_p.default"


def test_python_checks_catch_a_missing_decode_bucket(tmp_path: Path) -> None:
    rec = copy.deepcopy(load())
    rec["capacities"]["decode_request_buckets"] = [1, 2, 4]
    with pytest.raises(ManifestError) as e:
        export(rec, tmp_path / "core")
    assert "bucket 4" in e.value.reason


def test_cli_export_recording(tmp_path: Path, flare_bin: Path) -> None:
    out = tmp_path / "core"
    proc = subprocess.run(
        [sys.executable, "-m", "ignition", "export-recording", "--recording", str(RECORDING), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=FIXTURES.parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    assert "pointer words relocated" in proc.stderr
    assert flare_check(flare_bin, out).returncode == 0
    shutil.rmtree(out)


def test_pending_tokens_are_bound_as_request_state_with_each_graph_kinds_direction(tmp_path: Path) -> None:
    core = export(with_pending_tokens(load()), tmp_path / "core")
    buf = next(b for b in core.buffers if b.name == "pending_tokens")
    assert buf.role is BufferRole.REQUEST_STATE and buf.dtype is Dtype.I32 and isinstance(buf.payload, ZeroFill)
    want = {
        "decode_b1": Direction.STATE_READ_WRITE,
        "decode_b2": Direction.STATE_READ_WRITE,
        "prefill_t128": Direction.STATE_WRITE,
        "resume_b1": Direction.STATE_WRITE,
    }
    got = {}
    for g in core.graphs:
        (b,) = [b for b in g.bindings if b.value is ValueKind.PENDING_TOKENS]
        assert b.view.buffer_id == buf.id and b.view.offset == 0 and b.shape == (5,) and b.dtype is Dtype.I32
        got[g.name] = b.direction
        # Every other binding keeps the direction its value kind implies.
        for o in g.bindings:
            if o.value is not ValueKind.PENDING_TOKENS:
                assert o.direction is (Direction.OUTPUT if o.value is ValueKind.COMPLETION_RECORDS else Direction.INPUT)
    assert got == want
    assert core.encode() == export(with_pending_tokens(load()), tmp_path / "again").encode()


def _binding(rec: dict[str, Any], graph: str, value: str) -> dict[str, Any]:
    g = next(g for g in rec["graphs"] if g["name"] == graph)
    return next(b for b in g["bindings"] if b["value"] == value)


@pytest.mark.parametrize(
    ("change", "field", "needle"),
    [
        # Only decode reads pending tokens, and decode also stores them.
        (
            lambda r: _binding(r, "prefill_t128", "pending_tokens").update(direction="state_read_write"),
            "graphs[prefill_t128].bindings[PENDING_TOKENS]",
            "STATE_READ_WRITE",
        ),
        (
            lambda r: _binding(r, "decode_b1", "pending_tokens").update(direction="state_write"),
            "graphs[decode_b1].bindings[PENDING_TOKENS]",
            "STATE_WRITE",
        ),
        # Inferred (no direction): an input, which request state never is.
        (
            lambda r: _binding(r, "resume_b1", "pending_tokens").pop("direction"),
            "graphs[resume_b1].bindings[PENDING_TOKENS]",
            "INPUT",
        ),
        # A sampling graph that does not store its sample would leave a stale pending token.
        (
            lambda r: next(g for g in r["graphs"] if g["name"] == "resume_b1")["bindings"].pop(),
            "graphs[resume_b1].bindings",
            "missing PENDING_TOKENS",
        ),
        # State lives in its own zero-filled request-state buffer, never in staging.
        (
            lambda r: _binding(r, "decode_b2", "pending_tokens").update(
                address=_binding(r, "decode_b2", "top_k")["address"]
            ),
            "graphs[decode_b2].bindings[PENDING_TOKENS].view",
            "STAGING_INPUTS",
        ),
        (
            lambda r: next(a for a in r["allocations"] if a["name"] == "pending_tokens").update(init="uninitialized"),
            "graphs[decode_b1].bindings[PENDING_TOKENS].view",
            "zero-filled",
        ),
    ],
)
def test_python_checks_reject_misbound_pending_tokens(tmp_path: Path, change: Any, field: str, needle: str) -> None:
    rec = with_pending_tokens(load())
    change(rec)
    with pytest.raises(ManifestError) as e:
        export(rec, tmp_path / "core")
    assert e.value.field == field and needle in str(e.value), str(e.value)
    assert not (tmp_path / "core" / "manifest.pb").exists()


def test_an_unknown_binding_direction_is_a_recording_error(tmp_path: Path) -> None:
    rec = with_pending_tokens(load())
    _binding(rec, "decode_b1", "pending_tokens")["direction"] = "sideways"
    with pytest.raises(RecordingError, match="unknown Direction 'sideways'"):
        export(rec, tmp_path / "core")


def test_a_hybrid_row_layout_exports_and_loads_in_rust(tmp_path: Path, flare_bin: Path) -> None:
    """The continuation row layout the Qwen3.5 forward declares (per GDN layer a convolution
    history and a recurrent matrix, then the final hidden vector) exported into the fixture core
    in place of its one-region layout, within the fixture's row size: `flare check` accepts it."""
    require_torch()
    from ignition.capture.hybrid import HybridGeometry

    rec = load()
    geo = HybridGeometry(
        layers=2,
        hidden=8,
        heads=1,
        kv_heads=1,
        head_dim=8,
        ffn=16,
        vocab=64,
        eps=1e-6,
        tie_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        qk_norm=True,
        eos_token_ids=(2,),
        layer_kinds=("linear_attention", "full_attention"),
        conv_channels=16,
        conv_kernel=4,
        gdn_key_heads=1,
        gdn_value_heads=2,
        gdn_key_dim=4,
        gdn_value_dim=4,
    )
    assert geo.row_bytes <= rec["cache_scheme"]["continuation_row_bytes"]  # the regions fit the fixture's row
    rec["cache_scheme"]["row_layout"] = geo.row_regions()
    out = tmp_path / "core"
    core = export(rec, out)
    kinds = [r.kind.name for r in core.cache_scheme.row_layout]
    assert kinds == ["CONVOLUTION_HISTORY", "RECURRENT_STATE", "HIDDEN_VECTOR", "POSITION_METADATA"]
    proc = flare_check(flare_bin, out)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def _decode_edges(rec: dict[str, Any]) -> list[list[Any]]:
    edges: list[list[Any]] = next(g for g in rec["graphs"] if g["name"] == "decode_b1")["edges"]
    return edges


def test_programmatic_edges_export_and_load_in_rust(tmp_path: Path, flare_bin: Path) -> None:
    """A recorded programmatic edge (a PDL launch, ABI 4) between two kernel nodes reaches the
    manifest with its kind, and the Rust loader accepts it."""
    rec = copy.deepcopy(load())
    edges = _decode_edges(rec)
    edges[edges.index([2, 3])] = [2, 3, "programmatic"]
    out = tmp_path / "core"
    core = RecordingExporter(rec, FIXTURES).export(out)
    decode = next(g for g in core.graphs if g.name == "decode_b1")
    kinds = {(e.src, e.dst): e.dependency for e in decode.edges}
    assert kinds[(2, 3)] is EdgeDependency.PROGRAMMATIC and kinds[(3, 4)] is EdgeDependency.FULL
    proc = flare_check(flare_bin, out)
    assert proc.returncode == 0, proc.stderr + proc.stdout


@pytest.mark.parametrize(
    ("edge", "error", "needle"),
    [
        ([3, 4, "programmatic"], ManifestError, "joins kernel nodes only"),  # kernel -> memcpy
        ([2, 3, "sideways"], RecordingError, "unknown EdgeDependency 'sideways'"),
        ([2, 3, "programmatic", 1], RecordingError, "an edge is [from, to]"),
    ],
)
def test_bad_programmatic_edges_are_rejected(tmp_path: Path, edge: list[Any], error: type, needle: str) -> None:
    rec = copy.deepcopy(load())
    edges = _decode_edges(rec)
    edges[edges.index(edge[:2])] = edge
    with pytest.raises(error) as e:
        export(rec, tmp_path / "core")
    assert needle in str(e.value)


def test_programmatic_edges_need_abi_4(tmp_path: Path) -> None:
    """The exporter writes the current ABI; a core that says it is older may not carry them."""
    built = export_recording(RECORDING, tmp_path / "core")
    decode = next(g for g in built.graphs if g.name == "decode_b1")
    edges = tuple(
        replace(e, dependency=EdgeDependency.PROGRAMMATIC) if (e.src, e.dst) == (2, 3) else e for e in decode.edges
    )
    graphs = tuple(replace(g, edges=edges) if g is decode else g for g in built.graphs)
    check_core(replace(built, graphs=graphs))
    with pytest.raises(ManifestError, match="need ABI 4"):
        check_core(replace(built, identity=replace(built.identity, abi_version=3), graphs=graphs))
