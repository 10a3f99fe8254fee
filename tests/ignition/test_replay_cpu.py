"""CPU checks of `ignition replay` (ignition/replay): reading an exported core back, binding
views, packing steps and patching kernel parameters. The device half is qualified on the GPU
machine (qualification/*.json, `ignition replay` against the torch replay and `flare run`)."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ignition.core.stepping import PAD, Row, Sampling, pack_rows
from ignition.export.exporter import RecordingExporter, export_recording
from ignition.replay.core import CoreFiles, CoreReadError, pack_graph, topological
from tests.ignition.conftest import FIXTURES, REPO, with_pending_tokens


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> CoreFiles:
    out = tmp_path_factory.mktemp("replay") / "core"
    export_recording(FIXTURES / "recorded_graph.json", out)
    return CoreFiles(out)


@pytest.fixture(scope="module")
def fed_core(tmp_path_factory: pytest.TempPathFactory) -> CoreFiles:
    """The fixture with pending tokens: decode graphs that can be device-fed."""
    import json

    out = tmp_path_factory.mktemp("replay_fed") / "core"
    rec = with_pending_tokens(json.loads((FIXTURES / "recorded_graph.json").read_text()))
    RecordingExporter(rec, FIXTURES).export(out)
    return CoreFiles(out)


def test_the_core_reads_back_with_bound_views(core: CoreFiles) -> None:
    names = {g.name: g for g in core.graphs}
    assert [g.request_count for g in core.by_kind("decode")] == [1, 2]
    assert [g.token_capacity for g in core.by_kind("prefill")] == [128]
    d2 = names["decode_b2"]
    assert d2.inputs["page_table"].shape == (2, core.pages_per_request)
    assert "completion_records" in d2.outputs
    staging = core.buffers[core.staging]
    for g in core.graphs:
        for v in g.inputs.values():
            assert v.buffer == core.staging and v.offset + v.byte_len <= staging.byte_size
        assert not g.state and not g.reads_pending_tokens
    assert not core.device_fed


def test_state_views_are_read_back_apart_and_never_packed(fed_core: CoreFiles) -> None:
    pending = next(b for b in fed_core.m.buffers if b.name == "pending_tokens")
    for g in fed_core.graphs:
        v = g.state["pending_tokens"]
        assert "pending_tokens" not in g.inputs and "pending_tokens" not in g.outputs
        assert (v.buffer, v.offset, v.shape) == (pending.id, 0, (5,))
        assert v.direction == ("state_read_write" if g.kind == "decode" else "state_write")
        assert g.reads_pending_tokens == (g.kind == "decode")
    assert fed_core.device_fed and fed_core.staging != pending.id
    # A device-fed lane packs its negative token id; the pending tokens are not in the mirror.
    g = next(g for g in fed_core.graphs if g.name == "decode_b2")
    mirror = bytearray(fed_core.buffers[fed_core.staging].byte_size)
    rows = [Row(3, [4, 9], 70, [-1], (5, 7))]
    pack_graph(fed_core, g, pack_rows(fed_core.page_tokens, fed_core.pages_per_request, rows), mirror)
    tokens = g.inputs["token_ids"]
    assert struct.unpack_from("<2i", mirror, tokens.offset) == (-1, PAD["token_ids"])


def test_packing_writes_values_then_padding_at_the_views(core: CoreFiles) -> None:
    g = next(g for g in core.graphs if g.name == "decode_b2")
    mirror = bytearray(b"\xaa" * core.buffers[core.staging].byte_size)
    rows = [Row(3, [4, 9], 70, [11], (2**64 - 5, 7), Sampling(temperature=0.5, top_k=40))]
    pack_graph(core, g, pack_rows(core.page_tokens, core.pages_per_request, rows), mirror)
    view = g.inputs["page_table"]
    table = struct.unpack_from(f"<{view.count}i", mirror, view.offset)
    ppr = core.pages_per_request
    assert list(table) == [4, 9] + [-1] * (ppr - 2) + [PAD["page_table"]] * ppr
    slots = g.inputs["request_slots"]
    assert struct.unpack_from("<2i", mirror, slots.offset) == (3, PAD["request_slots"])
    temp = g.inputs["temperature"]
    assert struct.unpack_from("<2f", mirror, temp.offset) == (0.5, PAD["temperature"])
    seed = g.inputs["rng_seed"]  # a u64 view: the i64 spelling of 2^64-5 is its two's complement
    assert struct.unpack_from(f"<2{seed.code}", mirror, seed.offset)[0] % 2**64 == 2**64 - 5
    # Bytes outside this graph's views are left alone.
    other = next(g for g in core.graphs if g.name == "prefill_t128").inputs["token_ids"]
    assert mirror[other.offset : other.offset + 4] == b"\xaa" * 4


def test_too_many_values_for_a_view_is_a_typed_error(core: CoreFiles) -> None:
    g = next(g for g in core.graphs if g.name == "decode_b1")
    mirror = bytearray(core.buffers[core.staging].byte_size)
    with pytest.raises(CoreReadError, match="view holds 1"):
        pack_graph(core, g, {"request_slots": [1, 2]}, mirror)
    with pytest.raises(ValueError, match="pages exceed"):
        pack_rows(core.page_tokens, 2, [Row(1, [0, 1, 2], 0, [5])])


def test_kernel_parameters_are_relocated_for_the_mapped_base(core: CoreFiles) -> None:
    base = 0x7F00_0000_0000
    checked = 0
    for g in core.graphs:
        for n in g.message.nodes:
            if n.WhichOneof("op") != "kernel":
                continue
            image = core.kernels[n.kernel.kernel_id]
            params = core.kernel_params(n, base)
            assert len(params) == len(n.kernel.param_bytes)
            for r in n.kernel.relocations:
                at = image.params[r.param_index].offset + r.byte_offset
                (word,) = struct.unpack_from("<Q", params, at)
                assert word == base + core.buffers[r.buffer_id].offset + r.buffer_offset
                checked += 1
            # At the recorded base the patched bytes are the recorded ones.
            assert core.kernel_params(n, core.m.arena.base_address) == n.kernel.param_bytes
    assert checked > 0


def test_topological_order_respects_every_edge(core: CoreFiles) -> None:
    for g in core.graphs:
        order = topological(g.message)
        at = {g.message.nodes[i].id: k for k, i in enumerate(order)}
        assert sorted(order) == list(range(len(g.message.nodes)))
        for e in g.message.edges:
            assert at[getattr(e, "from")] < at[e.to]
    broken = type(core.graphs[0].message)()
    broken.CopyFrom(core.graphs[0].message)
    e = broken.edges.add()
    setattr(e, "from", broken.nodes[-1].id)
    e.to = broken.nodes[0].id
    with pytest.raises(CoreReadError, match="cycle"):
        topological(broken)


def test_a_bad_manifest_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(CoreReadError, match="cannot read"):
        CoreFiles(tmp_path)
    (tmp_path / "manifest.pb").write_bytes(b"\xff\xff\xff")
    with pytest.raises(CoreReadError, match="does not decode"):
        CoreFiles(tmp_path)


def test_replay_imports_no_torch_and_fails_cleanly_without_a_driver(core: CoreFiles) -> None:
    code = "import sys, ignition.replay.harness; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    env = {**os.environ, "LD_LIBRARY_PATH": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "ignition", "replay", str(core.root)], cwd=REPO, env=env, capture_output=True, text=True
    )
    if proc.returncode == 0:
        pytest.skip("this machine has a CUDA device: the replay ran")
    assert proc.returncode == 2, proc.stderr
    assert "ignition replay:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


class _FakeStepper:
    """Records the calls `generate` makes; samples token 100 + counter, EOS at 103."""

    page_tokens, pages_per_request, context_limit, header_words, largest_chunk = 64, 8, 512, 8, 128

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def initialize(self, live_row: int) -> None:
        self.calls.append(("initialize", live_row))

    def admit_histogram(self, live_row: int, tokens: list[int]) -> None:
        self.calls.append(("histogram", live_row, len(tokens)))

    def _records(self, rows: list[Row]) -> list[list[int]]:
        return [[0, r.live_row, 1 if r.sample else 0] + [0] * 5 + [100 + (r.sample or (0, 0))[1]] for r in rows]

    def prefill_step(self, rows: list[Row]) -> list[list[int]]:
        self.calls.append(("prefill", rows[0].start, len(rows[0].tokens), rows[0].sample))
        return self._records(rows)

    def decode_step(self, rows: list[Row]) -> list[list[int]]:
        self.calls.append(("decode", rows[0].start, rows[0].tokens, rows[0].sample))
        return self._records(rows)


def test_generate_drives_admission_chunks_and_decode_like_the_executor() -> None:
    from ignition.core.stepping import StepError, generate, histogram_chunks

    s = _FakeStepper()
    out = generate(s, list(range(300)), 9, Sampling(), 10, eos=(103,), live_row=2)
    assert out == [100, 101, 102, 103]  # stops at EOS, the EOS token included
    assert s.calls[:2] == [("initialize", 2), ("histogram", 2, 300)]
    # 300 prompt tokens in 128-token chunks; only the last samples, with counter 0.
    assert s.calls[2:5] == [("prefill", 0, 128, None), ("prefill", 128, 128, None), ("prefill", 256, 44, (9, 0))]
    # Each decode step feeds the previous token at the next position with the next counter.
    assert s.calls[5:] == [
        ("decode", 300, [100], (9, 1)),
        ("decode", 301, [101], (9, 2)),
        ("decode", 302, [102], (9, 3)),
    ]
    assert generate(_FakeStepper(), [1, 2], 9, Sampling(), 2, eos=()) == [100, 101]
    # Device-fed: every decode packs -1 (its row's pending token) where it packed the last token.
    fed = _FakeStepper()
    assert generate(fed, list(range(300)), 9, Sampling(), 10, eos=(103,), live_row=2, device_fed=True) == out
    assert fed.calls[:5] == s.calls[:5]
    assert fed.calls[5:] == [
        ("decode", 300, [-1], (9, 1)),
        ("decode", 301, [-1], (9, 2)),
        ("decode", 302, [-1], (9, 3)),
    ]
    with pytest.raises(StepError, match="context limit"):
        generate(_FakeStepper(), list(range(500)), 9, Sampling(), 13, eos=())
    assert histogram_chunks([1, 2, 3], 2) == [[1, 2], [3, -1]]


class _FakeDriver:
    """Stands in for libcuda: answers every call with CUDA_SUCCESS, fills the out-parameters the
    loader reads and records what it was asked (the device half is qualified on the GPU)."""

    RELOCATED_BASE = 0x5000_0000_0000

    def __init__(self) -> None:
        import ctypes as C

        self.C = C
        self.calls: list[tuple[Any, ...]] = []
        self.next_handle = 0x1000
        self.nodes: dict[int, tuple[Any, ...]] = {}
        self.host: list[object] = []
        self.edges: list[tuple[int, int, bytes]] = []  # programmatic edges added after their nodes

    def _handle(self) -> int:
        self.next_handle += 1
        return self.next_handle

    def _out(self, ref: Any, value: int) -> None:
        """Writes `value` through `ref`, a ctypes byref() of an output scalar."""
        ref._obj.value = value

    def __getattr__(self, name: str) -> Callable[..., int]:
        C = self.C

        def call(*args: Any) -> int:  # ctypes arguments, as DeviceCore passes them
            self.calls.append((name, args))
            if name == "cuMemGetAllocationGranularity":
                self._out(args[0], 2 << 20)
            elif name == "cuMemAddressReserve":
                self._out(args[0], args[3].value or self.RELOCATED_BASE)
            elif name in ("cuDeviceGet",):
                self._out(args[0], 0)
            elif name in (
                "cuDevicePrimaryCtxRetain",
                "cuStreamCreate",
                "cuMemCreate",
                "cuModuleLoadData",
                "cuModuleGetFunction",
                "cuGraphCreate",
                "cuEventCreate",
                "cuGraphInstantiateWithFlags",
            ):
                self._out(args[0], self._handle())
            elif name == "cuMemAllocHost_v2":
                buf = C.create_string_buffer(args[1].value)
                self.host.append(buf)
                self._out(args[0], C.addressof(buf))
            elif name == "cuGraphAddDependencies_v2":  # (graph, from[], to[], edge data, count)
                data = bytes((C.c_ubyte * 8).from_buffer(args[3]))
                self.edges.append((int(args[1][0]), int(args[2][0]), data))
            elif name.startswith("cuGraphAdd"):
                h = self._handle()
                self._out(args[0], h)
                deps = [int(args[2][i] or 0) for i in range(args[3].value)]
                info: tuple[Any, ...] = (name, deps)
                if name == "cuGraphAddKernelNode_v2":
                    p = args[4]._obj
                    extra = (C.c_void_p * 5).from_address(p.extra)
                    size = C.c_size_t.from_address(extra[3]).value
                    info += (p.func, C.string_at(extra[1], size))
                self.nodes[h] = info
            return 0

        return call


def test_the_loader_rebuilds_every_graph_relocated(core: CoreFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    import ignition.replay.cuda as cuda

    fake = _FakeDriver()
    monkeypatch.setattr(cuda, "_driver", lambda: fake)
    dev = cuda.DeviceCore(core, relocate=True)
    assert dev.base == fake.RELOCATED_BASE and not dev.report.fixed_address_honoured
    names = [c[0] for c in fake.calls]
    # Whole-GiB reservation without a hint, then one physical allocation mapped over the arena.
    reserve = next(c for c in fake.calls if c[0] == "cuMemAddressReserve")
    assert reserve[1][1].value % (1 << 30) == 0 and reserve[1][3].value == 0
    assert names.index("cuMemMap") < names.index("cuMemcpyHtoD_v2")
    # Every safetensors payload lands at base + its buffer offset, with its bytes.
    uploads = {c[1][0].value: c[1][2].value for c in fake.calls if c[0] == "cuMemcpyHtoD_v2"}
    for b in core.m.buffers:
        if b.WhichOneof("payload") == "safetensors":
            assert uploads[dev.base + b.offset] == len(core.payload(b))
    fills = {c[1][0].value for c in fake.calls if c[0] == "cuMemsetD8_v2"}
    assert all(dev.base + b.offset in fills for b in core.m.buffers if b.WhichOneof("payload") == "zero_fill")
    # Each kernel by its recorded function name; every graph instantiated and uploaded.
    loaded = [c[1][2] for c in fake.calls if c[0] == "cuModuleGetFunction"]
    assert loaded == [k.function_name.encode() for k in core.m.kernels]
    assert names.count("cuGraphInstantiateWithFlags") == names.count("cuGraphUpload") == len(core.graphs)
    # Nodes: dependencies are exactly the recorded edges, parameters relocated to the new base.
    kernel_nodes = [v for v in fake.nodes.values() if v[0] == "cuGraphAddKernelNode_v2"]
    assert len(kernel_nodes) == sum(1 for g in core.graphs for n in g.message.nodes if n.WhichOneof("op") == "kernel")
    expected = {
        core.kernel_params(n, dev.base) for g in core.graphs for n in g.message.nodes if n.WhichOneof("op") == "kernel"
    }
    assert {v[3] for v in kernel_nodes} == expected
    assert sum(len(v[1]) for v in fake.nodes.values()) == sum(len(g.message.edges) for g in core.graphs)
    assert dev.report.relocated_words == sum(
        len(n.kernel.relocations) for g in core.graphs for n in g.message.nodes if n.WhichOneof("op") == "kernel"
    )
    start = len(fake.calls)
    dev.close()
    # Teardown drains first, then graphs, modules and memory, and releases the context last.
    down = [c[0] for c in fake.calls[start:]]
    order = [
        "cuStreamSynchronize",
        "cuGraphExecDestroy",
        "cuGraphDestroy",
        "cuModuleUnload",
        "cuMemUnmap",
        "cuMemRelease",
        "cuMemAddressFree",
        "cuDevicePrimaryCtxRelease_v2",
    ]
    assert [down.index(n) for n in order] == sorted(down.index(n) for n in order), down


def test_a_step_uploads_the_packed_mirror_and_rejects_an_unsampled_record(
    core: CoreFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ctypes as C

    import ignition.replay.cuda as cuda
    from ignition.core.stepping import StepError, sampled_token
    from ignition.replay.harness import CoreReplay

    fake = _FakeDriver()
    monkeypatch.setattr(cuda, "_driver", lambda: fake)
    dev = cuda.DeviceCore(core)
    assert dev.base == core.m.arena.base_address  # the recorded base was asked for and given
    rep = CoreReplay(core, dev)
    # The fake device writes no record, so the step's record has no sampled flag: a typed error.
    records = rep.decode_step([Row(1, [4, 2], 70, [7], (3, 1))])
    with pytest.raises(StepError, match="did not sample"):
        sampled_token(records[0], rep.header_words)
    upload = [c for c in fake.calls if c[0] == "cuMemcpyHtoDAsync_v2"][-1][1]
    assert upload[0].value == dev.base + core.buffers[core.staging].offset
    assert C.string_at(upload[1].value, upload[2].value) == bytes(rep.mirror)
    g = rep.decode_graph(1)
    table = g.inputs["page_table"]
    assert struct.unpack_from(f"<{table.count}i", rep.mirror, table.offset)[:3] == (4, 2, -1)
    launch = [c for c in fake.calls if c[0] == "cuGraphLaunch"][-1][1]
    assert launch[0].value == dev.execs[g.id]
    dev.close()


class _Sampling5(_FakeDriver):
    """Every record the "device" returns samples token 5 (flags word 2, token after the header)."""

    def __init__(self, core: CoreFiles) -> None:
        super().__init__()
        rec = next(g.outputs["completion_records"] for g in core.graphs if "completion_records" in g.outputs)
        self.width, self.header = rec.shape[-1], core.header_words

    def __getattr__(self, name: str) -> Callable[..., int]:
        if name != "cuMemcpyDtoHAsync_v2":
            return super().__getattr__(name)
        C, width, header = self.C, self.width, self.header

        def read(host: ctypes.c_void_p, src: ctypes.c_uint64, length: ctypes.c_size_t, stream: Any) -> int:
            words = (C.c_int32 * (length.value // 4)).from_address(host.value)
            for r in range(length.value // 4 // width):
                words[r * width + 2], words[r * width + header] = 1, 5
            return 0

        return read


def test_run_replays_references_reversed_and_benches_over_the_fake_driver(
    core: CoreFiles, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import json

    import ignition.replay.cuda as cuda
    from ignition.replay.harness import run

    monkeypatch.setattr(cuda, "_driver", lambda: _Sampling5(core))
    # The recorded fixture has no maintenance graphs (a real core's `initialize` clears the row).
    from ignition.replay.harness import CoreReplay

    monkeypatch.setattr(CoreReplay, "initialize", lambda self, live_row: None)
    refs = [
        {"prompt_ids": [3, 4, 5], "seed": 1, "max_tokens": 3, "params": {"temperature": 0.7}, "tokens": [5, 5, 5]},
        {"prompt_ids": list(range(10, 150)), "seed": 2, "max_tokens": 2, "tokens": [5, 6]},
    ]
    (tmp_path / "refs.json").write_text(json.dumps(refs))
    out = tmp_path / "report.json"
    report = run(core.root, None, tmp_path / "refs.json", out, True, False, 4, lambda _m: None)
    assert report["identical_to_reference"] == "1/2"  # the second reference was made up to differ
    assert report["identical_reversed_on_other_rows"] == "2/2"
    assert [d["rows"] for d in report["decode"]] == [1, 2] and report["prefill"]["tokens"] == 128
    assert json.loads(out.read_text())["steps"] == report["steps"] > 0
    assert "device_fed_identical" not in report  # its decode graphs do not read pending tokens


def test_run_compares_device_fed_decode_where_the_core_reads_pending_tokens(
    core: CoreFiles, fed_core: CoreFiles, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import json

    import ignition.replay.cuda as cuda
    from ignition.replay.harness import CoreReplay, ReplayError, run

    fake = _Sampling5(fed_core)
    monkeypatch.setattr(cuda, "_driver", lambda: fake)
    monkeypatch.setattr(CoreReplay, "initialize", lambda self, live_row: None)
    refs = [
        {"prompt_ids": [3, 4, 5], "seed": 1, "max_tokens": 3, "tokens": [5, 5, 5]},
        {"prompt_ids": list(range(10, 150)), "seed": 2, "max_tokens": 2, "tokens": [5, 5]},
    ]
    (tmp_path / "refs.json").write_text(json.dumps(refs))
    report = run(fed_core.root, None, tmp_path / "refs.json", None, False, False, 4, lambda _m: None)
    assert report["identical_to_reference"] == "2/2" and report["device_fed_identical"] == "2/2"
    # The host only ever uploads the staging mirror: the pending tokens stay on the device,
    # zero-filled at load.
    base = fed_core.m.arena.base_address
    pending = next(b for b in fed_core.m.buffers if b.name == "pending_tokens")
    uploads = {args[0].value for name, args in fake.calls if name == "cuMemcpyHtoDAsync_v2"}
    assert uploads == {base + fed_core.buffers[fed_core.staging].offset}
    assert any(name == "cuMemsetD8_v2" and args[0].value == base + pending.offset for name, args in fake.calls)
    # A core whose decode graphs do not read pending tokens refuses a device-fed generation.
    dev = cuda.DeviceCore(core)
    with pytest.raises(ReplayError, match="do not read pending tokens"):
        CoreReplay(core, dev).generate([3, 4], 1, Sampling(), 2, device_fed=True)
    dev.close()


@pytest.mark.parametrize("edges", ["after", "inline", "full", "serialized"])
def test_programmatic_edges_join_after_their_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edges: str) -> None:
    """A programmatic edge (ABI 4) is added with the driver's edge data (from the programmatic
    port, type programmatic), not as a node dependency: once every node of its graph exists, or
    with "inline" right after its dependent node; with "full" it is an ordinary dependency of its
    node instead; "serialized" adds it as "after" does, then sets programmatic stream
    serialization (launch attribute 6, value 1) on the dependent node."""
    import json

    import ignition.replay.cuda as cuda

    rec = json.loads((FIXTURES / "recorded_graph.json").read_text())
    decode = next(g for g in rec["graphs"] if g["name"] == "decode_b1")
    decode["edges"] = [[2, 3, "programmatic"] if e == [2, 3] else e for e in decode["edges"]]
    RecordingExporter(rec, FIXTURES).export(tmp_path / "core")
    fake = _FakeDriver()
    monkeypatch.setattr(cuda, "_driver", lambda: fake)
    dev = cuda.DeviceCore(CoreFiles(tmp_path / "core"), relocate=True, edges=edges)
    node_deps = sum(len(v[1]) for v in fake.nodes.values())
    total = sum(len(g["edges"]) for g in rec["graphs"])
    if edges == "full":
        assert fake.edges == [] and node_deps == total and dev.report.programmatic_edges == 0
    else:
        assert node_deps == total - 1 and dev.report.programmatic_edges == 1
        [(src, dst, data)] = fake.edges
        assert fake.nodes[src][0] == fake.nodes[dst][0] == "cuGraphAddKernelNode_v2"
        assert data == bytes([1, 0, 1, 0, 0, 0, 0, 0])
        # Inline: the call right after the dependent's creation; else right before instantiation.
        calls = [c[0] for c in fake.calls]
        at = calls.index("cuGraphAddDependencies_v2")
        if edges == "inline":
            assert calls[at - 1] == "cuGraphAddKernelNode_v2" and fake.calls[at - 1][1][0]._obj.value == dst
        elif edges == "serialized":
            name, (node, attr, value) = fake.calls[at + 1]
            assert name == "cuGraphKernelNodeSetAttribute" and node.value == dst
            assert attr.value == 6 and value[0] == 1
            assert calls[at + 2] == "cuGraphInstantiateWithFlags"
        else:
            assert calls[at + 1] == "cuGraphInstantiateWithFlags"
    dev.close()
