"""CPU checks of the prepared Qwen3.5 forward (`ignition/capture/hybrid.py`): teacher-forced
logits against Transformers' `Qwen3_5ForCausalLM` on the same seeded weights through prefill
chunks and decode buckets, exact snapshot/restore continuation, split against whole prefill,
padding lanes and other rows untouched. The eager reference path (the GPU graphs will run the
GDN kernels of `ignition.capture.gdn`, checked against the same references)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.ignition.conftest import require_torch
from tests.ignition.test_paged_cpu import _EagerGraph, _run, _stats

if TYPE_CHECKING:
    import transformers

    from ignition.capture.hybrid import PagedQwen35
    from ignition.capture.program import Program

CFG: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 96,
    "vocab_size": 300,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def _checkpoint(tmp: Path, seed: int = 0) -> transformers.PreTrainedModel:
    require_torch()
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.AutoConfig.for_model(CFG["model_type"], **{k: v for k, v in CFG.items() if k != "model_type"})
    model: transformers.PreTrainedModel = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    model.eval()
    with torch.no_grad():  # norms away from their identity so a misplaced weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.2 * torch.randn_like(p))
    model.save_pretrained(str(tmp))
    return model


def _program(
    tmp: Path, buckets: tuple[int, ...] = (1, 4), chunks: tuple[int, ...] = (128,)
) -> tuple[PagedQwen35, Program]:
    import torch

    from ignition.capture.hybrid import PagedQwen35
    from ignition.prepare import Capacities
    from ignition.recipes.mapping import Checkpoint, stream_execution_layout
    from ignition.recipes.qwen3_5 import RECIPE, Qwen35Config, plan_weight_mapping

    config = Qwen35Config.from_dict({**CFG})
    ckpt = Checkpoint.open(tmp)
    weights = {}
    for name, tb in stream_execution_layout(plan_weight_mapping(config, ckpt.tensors, ckpt.files), ckpt):
        dt = {"BF16": torch.bfloat16, "F32": torch.float32}[tb.dtype.name]
        weights[name] = torch.frombuffer(bytearray(tb.data), dtype=dt).view(tb.shape).to(torch.bfloat16)
    caps = Capacities(list(buckets), list(chunks), 256, 4, 4, 24)
    prog: Program = RECIPE.plan_program(config, (2,), caps).build(weights, torch.device("cpu"), None)
    assert isinstance(prog.model, PagedQwen35)
    return prog.model, prog


def test_prefill_and_decode_match_transformers(tmp_path: Path) -> None:
    require_torch()
    import torch

    from ignition.capture.runner import Row

    hf = _checkpoint(tmp_path)
    model, prog = _program(tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocab_size"], (150,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    pages = torch.randperm(24, generator=g)[:4].tolist()
    _run(prog, "initialize", [])  # destination row 0 by default: harmless
    h1, _ = _run(prog, "prefill_t128", [Row(2, pages, 0, ids[:128])])
    h2, _ = _run(prog, "prefill_t128", [Row(2, pages, 128, ids[128:140])])  # a padded chunk
    s = _stats(model.logits(torch.cat([h1, h2[:12]])).float(), ref[:140])
    assert s["rel_l2_max"] < 0.03 and s["top10_overlap_min"] >= 0.8, s
    dec = []
    for p in range(140, 150):
        h, _ = _run(prog, "decode_b1", [Row(2, pages, p, [ids[p]])])
        dec.append(model.logits(h).float())
    s = _stats(torch.cat(dec), ref[140:150])
    assert s["rel_l2_max"] < 0.03 and s["top10_overlap_min"] >= 0.8, s


def test_snapshot_restore_continues_bitwise_and_padding_writes_nothing(tmp_path: Path) -> None:
    """A request snapshotted after its prefill and restored into another live row continues
    with the same hidden vectors and states, bitwise, as the uninterrupted one; a padded decode
    lane and the rows nobody named are left untouched."""
    require_torch()
    import torch

    from ignition.capture.runner import GraphRunner, Row

    _checkpoint(tmp_path)
    _, prog = _program(tmp_path)
    for spec in prog.graphs:
        spec.graph = _EagerGraph(prog, spec)
    runner = GraphRunner(prog)
    ids = list(range(7, 107))
    pages = [5, 9]
    runner.initialize(1)
    runner.replay(runner.by_name["prefill_t128"], [Row(1, pages, 0, ids[:90])])
    snap = prog.geo.request_slots + 2
    runner.maintenance("snapshot", snap, 1)
    kv = prog.kv_all.clone()
    straight = [runner.replay(runner.by_name["decode_b1"], [Row(1, pages, 90 + i, [ids[90 + i]])])[0] for i in range(5)]
    state_after = prog.rows[1].clone()
    prog.kv_all.copy_(kv)  # the same pages again: the restored request rewrites the same slots
    runner.maintenance("restore", 3, snap)
    before = prog.rows.clone()
    resumed = []
    for i in range(5):
        h, _ = runner.replay(runner.by_name["decode_b4"], [Row(3, pages, 90 + i, [ids[90 + i]])])
        resumed.append(h[:1])
    assert all(torch.equal(a[:1], b) for a, b in zip(straight, resumed, strict=True))
    assert torch.equal(prog.rows[3], state_after)
    # Both rows' stamps count what they consumed (the hybrid row carries its stamp like any other).
    assert prog.model.stamps(prog.rows)[[1, 3, snap], 0].tolist() == [95, 95, 90]
    untouched = [r for r in range(prog.rows.shape[0]) if r != 3]
    assert torch.equal(prog.rows[untouched], before[untouched])  # padding lanes wrote no row


def test_split_prefill_is_close_to_whole(tmp_path: Path) -> None:
    """The same 100 tokens as one chunk or as 60 + 40: the GDN states agree up to the
    projections' rounding (GEMMs over different row counts); measured, asserted loosely."""
    require_torch()
    from ignition.capture.runner import Row

    _checkpoint(tmp_path)
    model, prog = _program(tmp_path)
    ids = list(range(11, 111))
    _run(prog, "prefill_t128", [Row(1, [2, 3], 0, ids)])
    _run(prog, "prefill_t128", [Row(2, [4, 6], 0, ids[:60])])
    _run(prog, "prefill_t128", [Row(2, [4, 6], 60, ids[60:])])
    worst = 0.0
    for layer in model.geo.gdn_layers:
        whole, split = model.recurrent_rows(prog.rows, layer)[1], model.recurrent_rows(prog.rows, layer)[2]
        worst = max(worst, float((whole - split).norm() / whole.norm()))
    hw, hs = model.hidden_rows(prog.rows)[1].float(), model.hidden_rows(prog.rows)[2].float()
    assert worst < 0.02 and float((hw - hs).norm() / hw.norm()) < 0.02, worst


def test_prepare_exactness_check_on_eager_steps(tmp_path: Path) -> None:
    """The check prepare runs over the captured graphs (`ignition.capture.exactness`), here over
    eager steps: restore bitwise, into a reused row bitwise, split prefill measured."""
    require_torch()
    from ignition.capture.exactness import check
    from ignition.capture.runner import GraphRunner

    _checkpoint(tmp_path)
    _, prog = _program(tmp_path, chunks=(32, 128))
    for spec in prog.graphs:
        spec.graph = _EagerGraph(prog, spec)
    out = check(GraphRunner(prog), prompt_len=150, steps=4)
    assert out["split_vs_whole"]["chunks"] == [32, 128]
    assert out["restore_bitwise"] and out["restore_into_reused_row_bitwise"], out
    assert out["split_vs_whole"]["hidden_rel_l2"] < 0.02 and out["split_vs_whole"]["recurrent_rel_l2_max"] < 0.02, out


def test_compiled_graph_path_matches_the_reference_under_the_interpreter() -> None:
    """Decode and prefill compiled (fullgraph) with the GDN and row-store ops, against the
    eager reference: hidden vectors, every row region and the KV pages, padded lanes included;
    with the scan and with the chunked GDN prefill."""
    from tests.ignition.test_paged_cpu import _interpreted

    report = _interpreted("hybrid_compiled.py", 900)
    for r in (report, report["chunked"]):  # the GDN prefill as a scan, and chunked
        assert r["unnamed_rows_untouched"], report
        assert max(r["hidden_rel_l2_max"], r["rows_rel_l2_max"], r["kv_rel_l2"]) < 0.02, report


def test_every_graph_runs_on_its_replay_check_inputs(tmp_path: Path) -> None:
    """`Program.set_inputs` (the GPU replay checks' contents) gives the hybrid rows finite values
    in each region's dtype, and every graph's eager step runs on them with finite outputs and
    finite state."""
    require_torch()
    import torch

    _checkpoint(tmp_path)
    model, prog = _program(tmp_path)
    for i, spec in enumerate(prog.graphs):
        prog.set_inputs(spec, i)
        out = prog.call(spec, prog.method(spec))
        assert torch.isfinite(out.float()).all(), spec.name
        for layer in model.geo.gdn_layers:
            assert torch.isfinite(model.recurrent_rows(prog.rows, layer)).all(), (spec.name, layer)
            assert torch.isfinite(model.conv_rows(prog.rows, layer).float()).all(), (spec.name, layer)
        assert torch.isfinite(model.hidden_rows(prog.rows).float()).all(), spec.name


def test_decode_projections_are_the_tuned_problems(tmp_path: Path) -> None:
    """Every projection a decode step makes is a few-row call (`flare::gemv` when kernels are on)
    of a shape and variant `projection_problems` lists, so preparation tunes each one; prefill
    makes none but the sampled row's vocabulary projection."""
    require_torch()
    import torch

    from ignition.capture.gemv import Projections, Variant
    from ignition.capture.runner import Row

    _checkpoint(tmp_path)
    model, prog = _program(tmp_path)
    calls: list[tuple[tuple[int, ...], str, bool]] = []
    real = Projections(kernel=False)

    def recording(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        glu: bool = False,
        residual: torch.Tensor | None = None,
        few_rows: bool = False,
    ) -> torch.Tensor:
        v = Variant(norm=norm is not None, glu=glu, bias=bias is not None, residual=residual is not None)
        calls.append((tuple(weight.shape), v.key(), few_rows))
        return real(x, weight, bias, norm=norm, eps=eps, glu=glu, residual=residual, few_rows=few_rows)

    model.proj = recording  # type: ignore[assignment]
    model.gemv = True  # as on the device: decode rows unpadded, projections few-row (references here)
    ids = list(range(3, 40))
    pages = [0, 1]
    _run(prog, "initialize", [])
    _run(prog, "prefill_t128", [Row(2, pages, 0, ids)])
    head = tuple(model.head().shape)
    assert calls and all(shape == head for shape, _, few in calls if few), "prefill projects as GEMMs but the sample"
    calls.clear()
    _run(prog, "decode_b4", [Row(2, pages, len(ids), [7])])
    tuned = {(tuple(w.shape), p.variant.key()) for p in model.projection_problems() for w in p.weights}
    layers = len(model.geo.layer_kinds)
    assert len(calls) >= 4 * layers, calls
    for shape, key, few in calls:
        assert few, (shape, key)
        assert (shape, key) in tuned, (shape, key, sorted(tuned))
