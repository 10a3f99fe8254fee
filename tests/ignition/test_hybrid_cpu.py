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
    tmp: Path,
    buckets: tuple[int, ...] = (1, 4),
    chunks: tuple[int, ...] = (128,),
    speculative: tuple[tuple[int, int], ...] = (),
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
    caps = Capacities(list(buckets), list(chunks), 256, 4, 4, 24, list(speculative))
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
    # Split where messages end (every 31 tokens here: below the smallest capacity, 32).
    unaligned = out["split_unaligned_vs_whole"]
    assert unaligned["step"] == 31 and unaligned["recurrent_rel_l2_max"] < 0.02, out


def test_compiled_graph_path_matches_the_reference_under_the_interpreter() -> None:
    """Decode and prefill compiled (fullgraph) with the GDN and row-store ops, against the
    eager reference: hidden vectors, every row region and the KV pages, padded lanes included;
    with the scan and with the chunked GDN prefill. A compiled speculative round (GDN columns,
    the commit op; two requests, one committing a column and one nothing) leaves both live rows
    and the KV bitwise as compiled decode steps do, also with every few-row kernel (`flare::gemv`,
    `flare::rms_norm`, `flare::sample`)."""
    from tests.ignition.test_paged_cpu import _interpreted

    report = _interpreted("hybrid_compiled.py", 1200)
    for r in (report, report["chunked"]):  # the GDN prefill as a scan, and chunked
        assert r["unnamed_rows_untouched"], report
        assert max(r["hidden_rel_l2_max"], r["rows_rel_l2_max"], r["kv_rel_l2"]) < 0.02, report
    for spec in (report["speculative"], report["speculative_kernels"]):
        assert spec["record"] == spec["expected_record"] and spec["differing_regions"] == [], spec
        assert spec["live_rows_bitwise"] and spec["lanes_bitwise"] and spec["kv_bitwise"], spec
        assert spec["other_rows_untouched"], spec


def test_every_graph_runs_on_its_replay_check_inputs(tmp_path: Path) -> None:
    """`Program.set_inputs` (the GPU replay checks' contents) gives the hybrid rows finite values
    in each region's dtype, and every graph's eager step runs on them with finite outputs and
    finite state."""
    require_torch()
    import torch

    _checkpoint(tmp_path)
    model, prog = _program(tmp_path, speculative=((1, 3), (4, 3)))
    assert {g.name for g in prog.graphs} >= {"verify_b1_d3", "verify_b4_d3"}
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
    makes none but the sampled row's vocabulary projection. Every norm of a decode step is a
    few-row call too: a projection's prologue (input and post-attention norms) or
    `flare::rms_norm` (a row's norm independent of the rows beside it)."""
    require_torch()
    import torch

    from ignition.capture.gemv import Projections, Variant
    from ignition.capture.runner import Row

    _checkpoint(tmp_path)
    model, prog = _program(tmp_path)
    calls: list[tuple[tuple[int, ...], str, bool]] = []
    norms: list[tuple[str, bool]] = []

    class Recording(Projections):
        def __call__(self, x: torch.Tensor, weight: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
            bias = a[0] if a else kw.get("bias")
            v = Variant(
                norm=kw.get("norm") is not None,
                glu=bool(kw.get("glu")),
                bias=bias is not None,
                residual=kw.get("residual") is not None,
            )
            calls.append((tuple(weight.shape), v.key(), bool(kw.get("few_rows"))))
            return super().__call__(x, weight, *a, **kw)

        def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, *a: Any, **kw: Any) -> torch.Tensor:
            norms.append((a[0] if a else kw.get("mode", "rms"), bool(kw.get("few_rows"))))
            return super().norm(x, w, eps, *a, **kw)

    model.proj = Recording(kernel=False)
    model.gemv = True  # as on the device: decode rows unpadded, projections few-row (references here)
    ids = list(range(3, 40))
    pages = [0, 1]
    _run(prog, "initialize", [])
    _run(prog, "prefill_t128", [Row(2, pages, 0, ids)])
    head = tuple(model.head().shape)
    assert calls and all(shape == head for shape, _, few in calls if few), "prefill projects as GEMMs but the sample"
    calls.clear()
    norms.clear()
    _run(prog, "decode_b4", [Row(2, pages, len(ids), [7])])
    tuned = {(tuple(w.shape), p.variant.key()) for p in model.projection_problems() for w in p.weights}
    layers = len(model.geo.layer_kinds)
    assert len(calls) >= 4 * layers, calls
    for shape, key, few in calls:
        assert few, (shape, key)
        assert (shape, key) in tuned, (shape, key, sorted(tuned))
    # Input and post-attention norms: the next projection's prologue (in_proj or qkv, gate_up).
    assert sum("norm" in key for _, key, _ in calls) == 2 * layers, calls
    # The final norm, q/k norms and the GDN output norms: few-row norm calls.
    assert len(norms) >= layers + 1 and all(few for _, few in norms), norms
    assert {mode for mode, _ in norms} == {"zero_centred", "gated"}, norms


def test_speculative_generation_equals_ordinary_generation(tmp_path: Path) -> None:
    """The hybrid's speculative programs (eager): each slot owns one row per lane (W = 4), and
    generation through them equals ordinary generation whether the proposals are right, one in
    three wrong, empty or garbage, host-fed or device-fed, on any slot; prepare's speculative
    check passes (lanes and the committed live row bitwise the decode steps'), and a request
    batched behind others (their own GDN rows) is bitwise its step alone."""
    require_torch()
    from ignition.capture.runner import GraphRunner, Sampling
    from ignition.core.stepping import replaying
    from ignition.prepare import _batched_against_alone, _speculative_check

    _checkpoint(tmp_path)
    _, prog = _program(tmp_path, speculative=((1, 3), (4, 3)))
    geo = prog.geo
    assert geo.verification_width == 4 and geo.live_rows() == [1, 5, 9, 13] and geo.first_snapshot_row == 17
    assert prog.model.cache_scheme()["verification_width"] == 4
    for spec in prog.graphs:
        spec.graph = _EagerGraph(prog, spec)
    runner = GraphRunner(prog)
    prompt = list(range(3, 90))
    params = Sampling(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.4)
    for p in (params, Sampling(top_k=1)):
        want = runner.generate(prompt, 21, p, 14, live_row=geo.live_row(1))
        assert len(want) == 14, want
        got, steps = runner.generate_speculative(prompt, 21, p, 14, replaying(want), live_row=geo.live_row(2))
        assert got == want and steps == 4, (got, steps)  # 13 decoded tokens, 4 per round
        got, steps = runner.generate_speculative(
            prompt, 21, p, 14, replaying(want, 3, 300), live_row=geo.live_row(3), device_fed=True
        )
        assert got == want and 4 < steps < 13, steps
        assert runner.generate_speculative(prompt, 21, p, 14, lambda out: [])[0] == want
        assert runner.generate_speculative(prompt, 21, p, 14, lambda out: [7, 7, 7])[0] == want
    gens = [{"prompt_ids": prompt, "seed": 5, "params": vars(params), "max_tokens": 9}]
    gens[0]["tokens"] = runner.generate(prompt, 5, params, 9)
    report = _speculative_check(runner, gens)
    assert report["identical"] == "1/1" and report["depth"] == 3, report
    lanes = report["lanes_against_decode"]
    assert all(lane["bitwise"] for lane in lanes["lanes"]) and lanes["live_row_bitwise"], report
    batched = _batched_against_alone(runner, gens[0])
    assert batched["all_bitwise"] and len(batched["graphs"]) >= 2, batched


def test_a_round_leaves_the_state_two_decode_steps_leave(tmp_path: Path) -> None:
    """Two proposals, the first right and the second wrong: the round consumes two tokens, and
    the live row (every GDN layer's convolution history and recurrent matrix, the hidden vector,
    the stamp) is bitwise what two decode steps leave; the KV of the consumed positions too. Only
    the slot's own columns hold anything else; every other row is untouched."""
    require_torch()
    import torch

    from ignition.capture.paged import HEADER_WORDS
    from ignition.capture.runner import GraphRunner, Row, Sampling

    _checkpoint(tmp_path)
    _, prog = _program(tmp_path, speculative=((1, 3), (4, 3)))
    for spec in prog.graphs:
        spec.graph = _EagerGraph(prog, spec)
    runner = GraphRunner(prog)
    geo, params = prog.geo, Sampling(top_k=1)
    live = geo.live_row(1)
    pages, ids = [3, 8], list(range(5, 80))
    runner.initialize(live)
    _, rec = runner.replay(runner.by_name["prefill_t128"], [Row(live, pages, 0, ids, (9, 0), params)])
    first = rec[0][HEADER_WORDS]
    rows0, kv0 = prog.rows.clone(), prog.kv_all.clone()
    out, start = [first], len(ids)
    for n in range(2):
        row = Row(live, pages, start + n, [out[-1]], (9, 1 + n), params)
        _, rec = runner.replay(runner.by_name["decode_b1"], [row])
        out.append(rec[0][HEADER_WORDS])
    after_rows, after_kv = prog.rows.clone(), prog.kv_all.clone()
    prog.rows.copy_(rows0)
    prog.kv_all.copy_(kv0)
    wrong = (out[2] + 1) % geo.vocab
    row = Row(live, pages, start, [first, out[1], wrong], (9, 1), params)
    _, rec = runner.replay(runner.by_name["verify_b1_d3"], [row])
    assert rec[0][3:5] == [2, start + 2] and rec[0][HEADER_WORDS : HEADER_WORDS + 2] == out[1:3], rec[0]
    assert torch.equal(prog.rows[live], after_rows[live])
    columns = list(range(live + 1, live + geo.verification_width))
    others = [r for r in range(prog.rows.shape[0]) if r != live and r not in columns]
    assert torch.equal(prog.rows[others], rows0[others])
    pt = geo.page_tokens
    for pos in range(start, start + 2):
        page, off = pages[pos // pt], pos % pt
        assert torch.equal(prog.kv_all[page, :, :, off], after_kv[page, :, :, off]), pos
