"""CPU checks of the prepared step programs (ignition/capture/paged.py, sampling.py, program.py):
the eager forward over shuffled KV pages against Transformers' canonical forward on the same
seeded weights, the sampler's exactness and stream invariance, records, histograms, padding and
state maintenance. The captured graphs of the same programs are qualified on the GPU."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.ignition.conftest import require_torch

if TYPE_CHECKING:
    import torch
    import transformers

    from ignition.capture.paged import PagedLlama
    from ignition.capture.program import GraphSpec, Program
    from ignition.capture.runner import Row

TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "eos_token_id": 2,
}
QWEN3 = {
    **TINY,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
}
LLAMA3_ROPE = {
    **TINY,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}


def _checkpoint(tmp: Path, cfg: dict[str, Any], seed: int = 0) -> transformers.PreTrainedModel:
    require_torch()
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    model: transformers.PreTrainedModel = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    model.eval()
    with torch.no_grad():  # norms away from 1 so a misplaced weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(str(tmp))
    return model


def _paged(tmp: Path, cfg: dict[str, Any], **caps: int) -> PagedLlama:
    require_torch()
    import torch

    from ignition.capture.paged import Geometry, PagedLlama, rope_parameters
    from ignition.recipes.llama import Checkpoint, LlamaFamilyConfig, plan_weight_mapping, stream_execution_layout

    config = LlamaFamilyConfig.from_file(tmp / "config.json")
    ckpt = Checkpoint.open(tmp)
    mapping = plan_weight_mapping(config, ckpt.tensors, ckpt.files)
    weights = {}
    for name, tb in stream_execution_layout(mapping, ckpt):
        dt = {"BF16": torch.bfloat16, "F32": torch.float32}[tb.dtype.name]
        weights[name] = torch.frombuffer(bytearray(tb.data), dtype=dt).view(tb.shape).to(torch.bfloat16)
    geo = Geometry.from_recipe(
        config, (2,), **{"context_limit": 256, "request_slots": 4, "snapshot_rows": 4, "max_kv_pages": 24, **caps}
    )
    inv, scaling = rope_parameters(config.raw)
    return PagedLlama(geo, weights, inv, scaling, attention_kernel=False)


def _program(model: PagedLlama, buckets: tuple[int, ...] = (1, 4), chunks: tuple[int, ...] = (128,)) -> Program:
    from ignition.capture.program import Program, catalog

    return Program(model, catalog(model.geo, list(buckets), list(chunks)))


def _stats(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    from ignition.capture.numerics import compare_logits

    return compare_logits(ours, ref)


def _fill(prog: Program, spec: GraphSpec, rows: list[Row]) -> None:
    """Pack rows the way the executor does, into the graph's staging views."""
    from ignition.capture.runner import fill, pack_rows

    fill(spec, pack_rows(prog.geo, spec, rows))


def _records(spec: GraphSpec) -> torch.Tensor:
    """The graph's completion-records view (every graph of a built Program has one)."""
    assert spec.records is not None
    return spec.records


def _run(prog: Program, name: str, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    spec = next(g for g in prog.graphs if g.name == name)
    _fill(prog, spec, rows)
    _records(spec).zero_()
    h = prog.call(spec, prog.method(spec))
    return h, _records(spec).clone()


@pytest.mark.parametrize("cfg", [TINY, QWEN3, LLAMA3_ROPE], ids=["llama", "qwen3", "llama3-rope"])
def test_prefill_and_decode_match_transformers(tmp_path: Path, cfg: dict[str, Any]) -> None:
    require_torch()
    import torch

    from ignition.capture.runner import Row

    hf = _checkpoint(tmp_path, cfg)
    model = _paged(tmp_path, cfg)
    prog = _program(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (150,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    pages = torch.randperm(24, generator=g)[:4].tolist()  # shuffled, non-contiguous pages
    # Prefill 140 tokens in two chunks (the second padded), then decode 10 teacher-forced steps.
    h1, _ = _run(prog, "prefill_t128", [Row(2, pages, 0, ids[:128])])
    h2, _ = _run(prog, "prefill_t128", [Row(2, pages, 128, ids[128:140])])
    ours = model.logits(torch.cat([h1, h2[:12]])).float()
    s = _stats(ours, ref[:140])
    assert s["rel_l2_max"] < 0.02 and s["top10_overlap_min"] >= 0.8, s
    dec = []
    for p in range(140, 150):
        h, _ = _run(prog, "decode_b1", [Row(2, pages, p, [ids[p]])])
        dec.append(model.logits(h).float())
    s = _stats(torch.cat(dec), ref[140:150])
    assert s["rel_l2_max"] < 0.02 and s["top10_overlap_min"] >= 0.8, s


def test_batched_decode_rows_and_padding_are_independent(tmp_path: Path) -> None:
    require_torch()
    import torch

    from ignition.capture.runner import Row

    _checkpoint(tmp_path, TINY)
    model = _paged(tmp_path, TINY)
    prog = _program(model)
    ids = list(range(3, 80))
    a, b = [0, 5], [7, 9]
    for row, pages in ((1, a), (3, b)):
        _run(prog, "prefill_t128", [Row(row, pages, 0, ids[:70])])
    kv_before = prog.kv.clone()
    rows_before = prog.rows.clone()
    # Bucket 4 with two real rows (order swapped between runs) and two padded lanes.
    h, rec = _run(prog, "decode_b4", [Row(1, a, 70, [ids[70]], (11, 0)), Row(3, b, 70, [ids[70]], (12, 0))])
    kv_1 = prog.kv.clone()
    prog.kv.copy_(kv_before)
    prog.rows.copy_(rows_before)
    prog.hist.zero_()
    h_swapped, rec_swapped = _run(
        prog, "decode_b4", [Row(3, b, 70, [ids[70]], (12, 0)), Row(1, a, 70, [ids[70]], (11, 0))]
    )
    assert torch.equal(h[0], h_swapped[1]) and torch.equal(h[1], h_swapped[0])
    assert rec[0, 8] == rec_swapped[1, 8] and rec[1, 8] == rec_swapped[0, 8]
    # Padded lanes write no page and no row, and their records are not sampled.
    assert torch.equal(prog.kv, kv_1)
    changed = [int(p) for p in range(24) if not torch.equal(kv_1[p], kv_before[p])]
    assert changed == [a[1], b[1]], changed
    assert rec[2, 2] == 0 and rec[3, 2] == 0
    # Padded lanes store into the null row (row 0) only; other rows keep their contents.
    assert torch.equal(prog.rows[[2, 4]], rows_before[[2, 4]])


def test_records_histograms_and_maintenance(tmp_path: Path) -> None:
    require_torch()
    import torch

    from ignition.capture.paged import FLAG_SAMPLED, RECORD_MAGIC
    from ignition.capture.runner import Row

    _checkpoint(tmp_path, TINY)
    model = _paged(tmp_path, TINY)
    prog = _program(model)
    pages = [4, 2]
    _, rec = _run(prog, "initialize", [])  # no sampling graph: records untouched
    spec = next(g for g in prog.graphs if g.name == "initialize")
    spec.inputs["destination_rows"].fill_(2)
    prog.rows[2] = 5
    prog.hist[2] = 7
    prog.call(spec, prog.method(spec))
    assert prog.rows[2].abs().sum() == 0 and prog.hist[2].sum() == 0
    _, rec = _run(prog, "prefill_t128", [Row(2, pages, 0, list(range(10, 60)), (5, 0))])
    r = rec[0].tolist()
    assert r[0] == RECORD_MAGIC and r[1] == 2 and r[2] & FLAG_SAMPLED and r[3] == 1 and r[4] == 50 and r[5] == 0
    tok = r[8]
    assert prog.hist[2].sum() == 1 and prog.hist[2, tok] == 1
    saved = prog.rows[2].clone()
    assert saved.abs().sum() > 0
    # A chunk short of the prompt end does not sample and counts nothing.
    _, rec = _run(prog, "prefill_t128", [Row(2, pages, 50, list(range(60, 70)))])
    assert rec[0, 2] == 0 and prog.hist[2].sum() == 1
    snap = prog.geo.request_slots + 2
    assert prog.model.stamps(prog.rows)[2].tolist() == [60, 0]  # consumed by the prefills, epoch 0
    spec = next(g for g in prog.graphs if g.name == "snapshot")
    spec.inputs["source_rows"].fill_(2)
    spec.inputs["destination_rows"].fill_(snap)
    spec.inputs["expected_consumed"].fill_(60)
    spec.inputs["checkpoint_epoch"].fill_(9)
    prog.call(spec, prog.method(spec))
    hidden = prog.model.hidden_rows(prog.rows)
    assert torch.equal(hidden[snap], hidden[2]) and prog.model.stamps(prog.rows)[snap].tolist() == [60, 9]
    spec = next(g for g in prog.graphs if g.name == "restore")
    spec.inputs["source_rows"].fill_(snap)
    spec.inputs["destination_rows"].fill_(4)
    spec.inputs["expected_consumed"].fill_(60)
    spec.inputs["checkpoint_epoch"].fill_(9)
    prog.call(spec, prog.method(spec))
    assert torch.equal(prog.rows[4], prog.rows[snap]) and prog.hist[4].sum() == 0
    # Resume sampling from the restored row equals sampling after the prefill that wrote it.
    spec = next(g for g in prog.graphs if g.name == "resume_b1")
    _fill(prog, spec, [Row(4, pages, 60, [], (9, 3))])
    _records(spec).zero_()
    h = prog.call(spec, prog.method(spec))
    assert torch.equal(h[0], hidden[snap]) and _records(spec)[0, 4] == 60 and _records(spec)[0, 5] == 3


def _state(prog: Program) -> list[torch.Tensor]:
    return [t.clone() for t in (prog.kv_all, prog.rows, prog.hist, prog.pending)]


def _set_state(prog: Program, state: list[torch.Tensor]) -> None:
    for t, saved in zip((prog.kv_all, prog.rows, prog.hist, prog.pending), state, strict=True):
        t.copy_(saved)


def test_a_device_fed_decode_equals_the_host_fed_one(tmp_path: Path) -> None:
    """A decode lane packed with token id -1 consumes the token its row's last sampling step
    stored: bitwise the same step as packing that token, in every lane and every state tensor."""
    require_torch()
    import torch

    from ignition.capture.runner import Row

    _checkpoint(tmp_path, TINY)
    prog = _program(_paged(tmp_path, TINY))
    ids = list(range(3, 80))
    a, b = [0, 5], [7, 9]
    prog.pending[0] = 77  # not the invariant (0), so that a write to the null row's entry shows
    _, ra = _run(prog, "prefill_t128", [Row(1, a, 0, ids[:70], (11, 0))])
    _, rb = _run(prog, "prefill_t128", [Row(3, b, 0, ids[:60], (12, 0))])
    ta, tb = int(ra[0, 8]), int(rb[0, 8])
    assert prog.pending.tolist() == [77, ta, 0, tb, 0]
    before = _state(prog)
    # Bucket 4: row 1 host-fed, row 3 as packed below, two padded lanes.
    host = [Row(1, a, 70, [ta], (11, 1)), Row(3, b, 60, [tb], (12, 1))]
    h_host, rec_host = _run(prog, "decode_b4", host)
    after_host = _state(prog)
    _set_state(prog, before)
    h_fed, rec_fed = _run(prog, "decode_b4", [host[0], Row(3, b, 60, [-1], (12, 1))])
    assert torch.equal(h_host, h_fed) and torch.equal(rec_host, rec_fed)
    assert all(torch.equal(x, y) for x, y in zip(after_host, _state(prog), strict=True))
    # The decode stored what it sampled; the padded lanes left entry 0 as it was.
    assert prog.pending.tolist() == [77, int(rec_fed[0, 8]), 0, int(rec_fed[1, 8]), 0]
    # Every lane device-fed, the padded ones too (they read entry 0): still the same step.
    _set_state(prog, before)
    spec = next(g for g in prog.graphs if g.name == "decode_b4")
    _fill(prog, spec, [Row(1, a, 70, [-1], (11, 1)), Row(3, b, 60, [-1], (12, 1))])
    spec.inputs["token_ids"].fill_(-1)
    _records(spec).zero_()
    h_all = prog.call(spec, prog.method(spec))
    assert torch.equal(h_all[:2], h_host[:2]) and torch.equal(_records(spec), rec_host)
    kv, rows, hist, pending = _state(prog)
    assert torch.equal(kv, after_host[0]) and torch.equal(hist, after_host[2]) and torch.equal(pending, after_host[3])
    assert torch.equal(rows[1:], after_host[1][1:])  # row 0 holds padding's hidden vectors either way


def test_pending_tokens_are_written_only_by_sampling_rows(tmp_path: Path) -> None:
    require_torch()
    import torch

    from ignition.capture.runner import Row

    _checkpoint(tmp_path, TINY)
    prog = _program(_paged(tmp_path, TINY))
    pages = [4, 2]
    prog.pending.copy_(torch.tensor([0, 11, 22, 33, 44], dtype=torch.int32))
    # A chunk short of the prompt end samples nothing and stores nothing.
    _, rec = _run(prog, "prefill_t128", [Row(2, pages, 0, list(range(10, 60)))])
    assert rec[0, 2] == 0 and prog.pending.tolist() == [0, 11, 22, 33, 44]
    # An exhausted grammar (no id allowed) reports, stores nothing.
    spec = next(g for g in prog.graphs if g.name == "prefill_t128")
    _fill(prog, spec, [Row(2, pages, 50, list(range(60, 70)), (5, 0))])
    spec.inputs["grammar_mask"].zero_()
    _records(spec).zero_()
    prog.call(spec, prog.method(spec))
    assert _records(spec)[0, 2] == 4 and prog.pending.tolist() == [0, 11, 22, 33, 44]
    _, rec = _run(prog, "prefill_t128", [Row(2, pages, 50, list(range(60, 70)), (5, 0))])
    tok = int(rec[0, 8])
    assert prog.pending.tolist() == [0, 11, tok, 33, 44]
    # Maintenance leaves pending tokens alone; resume stores its sample at its live row.
    for name, src, dst in (
        ("snapshot", 2, prog.geo.request_slots + 2),
        ("restore", prog.geo.request_slots + 2, 4),
        ("initialize", None, 3),
    ):
        spec = next(g for g in prog.graphs if g.name == name)
        spec.inputs["destination_rows"].fill_(dst)
        if src is not None:
            spec.inputs["source_rows"].fill_(src)
        prog.call(spec, prog.method(spec))
    assert prog.pending.tolist() == [0, 11, tok, 33, 44]
    spec = next(g for g in prog.graphs if g.name == "resume_b1")
    _fill(prog, spec, [Row(4, pages, 60, [], (9, 3))])
    _records(spec).zero_()
    prog.call(spec, prog.method(spec))
    resumed = int(_records(spec)[0, 8])
    assert prog.pending.tolist() == [0, 11, tok, 33, resumed]
    # A decode bucket of padded lanes only (device-fed: they read entry 0) stores nothing.
    spec = next(g for g in prog.graphs if g.name == "decode_b4")
    _fill(prog, spec, [])
    spec.inputs["token_ids"].fill_(-1)
    _records(spec).zero_()
    prog.call(spec, prog.method(spec))
    assert _records(spec)[:, 2].sum() == 0 and prog.pending.tolist() == [0, 11, tok, 33, resumed]


def _sampler_inputs(b: int, v: int, **over: torch.Tensor) -> dict[str, torch.Tensor]:
    import torch

    base = {
        "temperature": torch.full((b,), 1.0),
        "top_k": torch.zeros(b, dtype=torch.int32),
        "top_p": torch.ones(b),
        "min_p": torch.zeros(b),
        "repetition": torch.ones(b),
        "presence": torch.zeros(b),
        "frequency": torch.zeros(b),
        "seed": torch.arange(b, dtype=torch.int64) + 7,
        "counter": torch.zeros(b, dtype=torch.int64),
    }
    base.update(over)
    return base


def _sample(
    logits: torch.Tensor, hist: torch.Tensor | None = None, grammar: torch.Tensor | None = None, **kw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    from ignition.capture.sampling import sample

    b, v = logits.shape
    a = _sampler_inputs(b, v, **kw)
    hist = hist if hist is not None else torch.zeros(b, v, dtype=torch.int32)
    return sample(
        logits,
        hist,
        a["temperature"],
        a["top_k"],
        a["top_p"],
        a["min_p"],
        a["repetition"],
        a["presence"],
        a["frequency"],
        a["seed"],
        a["counter"],
        grammar,
    )


def test_sampler_thresholds_are_exact_against_a_sort() -> None:
    require_torch()
    import torch

    from ignition.capture.sampling import _largest_threshold

    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        v = 257
        p = torch.softmax(torch.randn(3, v, generator=g) * (1 + trial % 4), -1)
        p[0, :40] = p[0, 0]  # a block of ties
        key = p.view(torch.int32).long()
        k = torch.tensor([1, 17, 40])
        tk = _largest_threshold(key, None, k)
        for r in range(3):
            kth = torch.sort(key[r], descending=True).values[k[r] - 1]
            assert tk[r] == kth  # the k-th largest value itself: ties at it are kept
        top_p = torch.tensor([0.5, 0.9, 0.99])
        tp = _largest_threshold(key, p, top_p * p.sum(-1))
        for r in range(3):
            s = torch.sort(key[r], descending=True).values
            mass = torch.stack([p[r][key[r] >= t].sum() for t in s])
            want = s[(mass >= top_p[r] * p[r].sum()).nonzero()[0, 0]]
            assert tp[r] == want
        # Every radix finds the same thresholds (the graphs use RADIX_BITS).
        for bits in (4, 16):
            assert torch.equal(_largest_threshold(key, None, k, bits), tk)
            assert torch.equal(_largest_threshold(key, p, top_p * p.sum(-1), bits), tp)


def test_sampler_filters_masks_penalties_and_stream_invariance() -> None:
    require_torch()
    import torch

    from ignition.capture.sampling import uniform

    g = torch.Generator().manual_seed(4)
    v = 300
    logits = torch.randn(4, v, generator=g) * 3
    top1 = logits.argmax(-1)
    tok, ok = _sample(logits, top_k=torch.ones(4, dtype=torch.int32))
    assert torch.equal(tok, top1) and ok.all()
    tok, _ = _sample(logits, top_p=torch.full((4,), 1e-6))
    assert torch.equal(tok, top1)
    tok, _ = _sample(logits, min_p=torch.full((4,), 1.0))
    assert torch.equal(tok, top1)
    # Grammar: only ids 33 and 290 allowed; an all-zero mask is reported, not sampled.
    words = torch.zeros(4, (v + 31) // 32, dtype=torch.int32)
    words[:3, 1] = 1 << 1
    words[:3, 9] = 1 << 2
    tok, ok = _sample(logits, grammar=words)
    assert all(t in (33, 290) for t in tok[:3].tolist()) and ok.tolist() == [True, True, True, False]
    # A huge frequency penalty on the argmax moves the sample off it.
    hist = torch.zeros(4, v, dtype=torch.int32)
    hist[torch.arange(4), top1] = 3
    tok, _ = _sample(logits, hist=hist, top_k=torch.ones(4, dtype=torch.int32), frequency=torch.full((4,), 100.0))
    assert not (tok == top1).any()
    # Streams depend on (seed, counter) only: same row content in another batch row, same draw.
    u = uniform(torch.tensor([5, 9, 5]), torch.tensor([2, 2, 3]), v)
    u2 = uniform(torch.tensor([9, 5]), torch.tensor([2, 2]), v)
    assert torch.equal(u[0], u2[1]) and torch.equal(u[1], u2[0]) and not torch.equal(u[0], u[2])
    assert (u > 0).all() and (u < 1).all()


def test_sampler_draws_follow_the_distribution() -> None:
    require_torch()
    import torch

    v = 5
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits = torch.log(p).clamp(min=-1e9).repeat(4000, 1)
    n = logits.shape[0]
    tok, _ = _sample(logits, seed=torch.full((n,), 42, dtype=torch.int64), counter=torch.arange(n, dtype=torch.int64))
    freq = torch.bincount(tok, minlength=v).float() / n
    assert (freq - p).abs().max() < 0.03, freq
    # top_p 0.7 keeps {0.5, 0.25} (the smallest set reaching 0.7), renormalized to 2/3, 1/3.
    tok, _ = _sample(
        logits,
        top_p=torch.full((n,), 0.7),
        seed=torch.full((n,), 1, dtype=torch.int64),
        counter=torch.arange(n, dtype=torch.int64),
    )
    freq = torch.bincount(tok, minlength=v).float() / n
    assert freq[2:].sum() == 0 and abs(freq[0] - 2 / 3) < 0.03, freq


def test_program_staging_is_one_buffer_with_a_region_per_value(tmp_path: Path) -> None:
    require_torch()
    _checkpoint(tmp_path, TINY)
    prog = _program(_paged(tmp_path, TINY), buckets=(1, 2, 4), chunks=(128, 256))
    base = prog.staging.data_ptr()
    spans: dict[str, tuple[int, int]] = {}
    for g in prog.graphs:
        for value, t in g.inputs.items():
            lo = t.data_ptr() - base
            assert (
                lo == prog.offsets[value]
                and t.untyped_storage().data_ptr() == prog.staging.untyped_storage().data_ptr()
            )
            spans[value] = (lo, max(spans.get(value, (lo, lo))[1], lo + t.numel() * t.element_size()))
    ordered = sorted(spans.values())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))
    names = [g.name for g in prog.graphs]
    assert names == [
        "decode_b1",
        "decode_b2",
        "decode_b4",
        "prefill_t128",
        "prefill_t256",
        "resume_b1",
        "initialize",
        "admit_histogram",
        "restore",
        "snapshot",
    ]


def test_capacity_plan_refuses_what_does_not_fit() -> None:
    from ignition.prepare import CapacityError, plan_capacities
    from ignition.recipes.llama import LlamaFamilyConfig

    cfg = LlamaFamilyConfig.from_dict(TINY)
    caps = plan_capacities(cfg, "1,2,4,8", 512, 512, None)
    assert caps.prefill_chunks == [128, 256, 512] and caps.request_slots == 8 and caps.max_kv_pages == 8 * 8 * 2
    assert caps.snapshot_rows == caps.max_kv_pages  # rows are a hidden vector each: as many as pages
    refusals: list[tuple[tuple[str, int | None, int | None, int | None], str]] = [
        (("4,2", None, None, None), "--decode-buckets"),
        (("1", None, 1024, None), "--context-limit"),
        (("1", None, 500, None), "--context-limit"),
        (("1", 300, 512, None), "--prefill-chunk-size"),
        (("1", 64, 512, None), "--prefill-chunk-size"),
        (("1", None, 512, 3), "--kv-pages"),
        (("x", None, None, None), "--decode-buckets"),
    ]
    for args, option in refusals:
        with pytest.raises(CapacityError) as e:
            plan_capacities(cfg, *args)
        assert e.value.option == option
    json.dumps(vars(caps))


def test_every_graph_runs_on_its_replay_check_inputs(tmp_path: Path) -> None:
    """The contents `Program.set_inputs` gives each graph (the GPU replay checks) are valid
    steps: each eager step runs, samples where it should, and writes records for real rows."""
    require_torch()
    import torch

    from ignition.capture.paged import FLAG_SAMPLED

    _checkpoint(tmp_path, TINY)
    prog = _program(_paged(tmp_path, TINY), buckets=(1, 4), chunks=(128,))
    for i, spec in enumerate(prog.graphs):
        prog.set_inputs(spec, i)
        pending = prog.pending.clone()
        out = prog.call(spec, prog.method(spec))
        assert torch.isfinite(out.float()).all(), spec.name
        if spec.kind in ("decode", "prefill", "resume_sampling"):
            rec = _records(spec)
            real = [r for r in range(spec.request_count) if int(spec.inputs["request_slots"][r]) >= 0]
            assert real and all(int(rec[r, 2]) & FLAG_SAMPLED for r in real), (spec.name, rec)
            for r in real:
                pending[int(rec[r, 1])] = rec[r, 8]
        assert torch.equal(prog.pending, pending), spec.name  # sampled rows only, entry 0 untouched
        if spec.kind == "decode" and spec.request_count >= 3:
            # The replay checks cover both input paths: device-fed and host-fed real lanes.
            fed = spec.inputs["token_ids"][: len(real)]
            assert (fed < 0).any() and (fed >= 0).any(), fed


def test_prepare_refuses_without_a_gpu_or_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_torch()
    import torch

    from ignition.__main__ import main

    assert main(["prepare", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "core")]) == 2
    assert "--model" in capsys.readouterr().err
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the device refusal cannot be observed")
    _checkpoint(tmp_path / "ckpt", TINY)
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    (tmp_path / "ckpt" / "chat_template.jinja").write_text("x")
    assert main(["prepare", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "core")]) == 2
    assert "device: CUDA is not available" in capsys.readouterr().err


class _EagerGraph:
    """Stands in for a captured CUDA graph on CPU: replay runs the eager step into the output."""

    def __init__(self, prog: Program, spec: GraphSpec) -> None:
        self.prog, self.spec = prog, spec

    def replay(self) -> None:
        out = self.prog.call(self.spec, self.prog.method(self.spec))
        if self.spec.output is None or self.spec.output.shape != out.shape:
            self.spec.output = out.clone()
        else:
            self.spec.output.copy_(out)


def test_runner_numerics_and_generation_on_cpu(tmp_path: Path) -> None:
    """The qualification harness (GraphRunner packing, teacher-forced numerics, generation) over
    eager steps: what the GPU run does with captured graphs."""
    require_torch()
    import torch

    from ignition.capture.numerics import teacher_forced
    from ignition.capture.runner import GraphRunner, Sampling

    hf = _checkpoint(tmp_path, TINY)
    prog = _program(_paged(tmp_path, TINY), buckets=(1, 4), chunks=(128,))
    for spec in prog.graphs:
        spec.graph = _EagerGraph(prog, spec)
    runner = GraphRunner(prog)

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits: torch.Tensor = hf(torch.tensor([ids])).logits[0]
        return logits

    out = teacher_forced(runner, ref, prompt_len=200, decode_steps=4)
    assert set(out) >= {"prefill_t128", "decode_b1", "decode_b4"}
    assert out["worst_rel_l2"] < 0.02 and out["min_top10_overlap"] >= 0.8, json.dumps(out)
    params = Sampling(temperature=0.8, top_k=20, top_p=0.9)
    a = runner.generate(list(range(3, 140)), 77, params, 12)
    b = runner.generate(list(range(3, 140)), 77, params, 12, live_row=3)
    assert a == b and len(a) >= 1  # the stream depends on (seed, counter), not the row
    # Each decode's input from the pending token the previous step stored: the same tokens.
    assert runner.generate(list(range(3, 140)), 77, params, 12, live_row=2, device_fed=True) == a
    hot = Sampling(temperature=1.5)
    outs = {tuple(runner.generate(list(range(3, 140)), seed, hot, 6)) for seed in range(5)}
    assert len(outs) > 1  # and on the seed it does depend


def test_prepare_exactness_check_on_eager_steps(tmp_path: Path) -> None:
    """prepare's exactness check (`ignition.capture.exactness`) on the dense recipe: its rows are
    one hidden vector, and a restore still continues bitwise."""
    require_torch()
    from ignition.capture.exactness import check
    from ignition.capture.runner import GraphRunner

    _checkpoint(tmp_path, TINY)
    prog = _program(_paged(tmp_path, TINY), buckets=(1, 4), chunks=(32, 128))
    for spec in prog.graphs:
        spec.graph = _EagerGraph(prog, spec)
    out = check(GraphRunner(prog), prompt_len=150, steps=4)
    assert out["restore_bitwise"] and out["restore_into_reused_row_bitwise"], out
    assert out["split_vs_whole"]["hidden_rel_l2"] < 0.02, out
    assert out["split_unaligned_vs_whole"]["hidden_rel_l2"] < 0.02, out


def test_a_decode_row_is_bitwise_the_same_in_every_bucket(tmp_path: Path) -> None:
    """Buckets share one GEMM shape (MIN_GEMM_ROWS), so a row's hidden vector and token do not
    depend on the bucket or the neighbours it was packed with."""
    require_torch()
    import torch

    from ignition.capture.runner import Row

    _checkpoint(tmp_path, TINY)
    prog = _program(_paged(tmp_path, TINY), buckets=(1, 4), chunks=(128,))
    ids = list(range(5, 90))
    pages, other = [3, 8], [1, 6]
    _run(prog, "prefill_t128", [Row(1, pages, 0, ids[:80])])
    _run(prog, "prefill_t128", [Row(2, other, 0, ids[5:85])])
    state = (prog.kv_all.clone(), prog.rows.clone(), prog.hist.clone())
    h1, r1 = _run(prog, "decode_b1", [Row(1, pages, 80, [ids[80]], (4, 0))])
    prog.kv_all.copy_(state[0])
    prog.rows.copy_(state[1])
    prog.hist.copy_(state[2])
    h4, r4 = _run(prog, "decode_b4", [Row(2, other, 80, [ids[84]], (5, 0)), Row(1, pages, 80, [ids[80]], (4, 0))])
    assert torch.equal(h1[0], h4[1]) and r1[0, 8] == r4[1, 8]


def test_admission_counts_the_prompt_once_and_sampling_adds_to_it(tmp_path: Path) -> None:
    require_torch()
    import torch

    from ignition.capture.runner import Row

    _checkpoint(tmp_path, TINY)
    prog = _program(_paged(tmp_path, TINY), buckets=(1,), chunks=(128,))
    prompt = [5, 9, 9, 300 - 1] + [7] * 150  # longer than one admission chunk (128)
    spec = next(g for g in prog.graphs if g.name == "admit_histogram")
    assert spec.token_capacity == 128
    for at in range(0, len(prompt), 128):
        part = prompt[at : at + 128]
        spec.inputs["request_slots"].fill_(3)
        spec.inputs["token_ids"].copy_(torch.tensor(part + [-1] * (128 - len(part))))
        prog.call(spec, prog.method(spec))
    want = torch.bincount(torch.tensor(prompt), minlength=300).int()
    assert torch.equal(prog.hist[3], want) and prog.hist[[0, 1, 2, 4]].sum() == 0
    _, rec = _run(prog, "prefill_t128", [Row(3, [0, 1, 2], 26, prompt[26:154], (1, 0))])
    want[int(rec[0, 8])] += 1
    assert torch.equal(prog.hist[3], want)
    # Padding rows of an admission chunk (-1) and a padded request slot count nothing.
    spec.inputs["request_slots"].fill_(-1)
    spec.inputs["token_ids"].fill_(4)
    prog.call(spec, prog.method(spec))
    assert prog.hist[0].sum() == 0 and torch.equal(prog.hist[3], want)


def _interpreted(script: str, timeout: int) -> dict[str, Any]:
    """Runs tests/ignition/scripts/SCRIPT under Triton's CPU interpreter in a fresh process (the
    interpreter switch is read when kernels are defined); returns its last JSON line."""
    require_torch()
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    p = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "scripts" / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    report: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return report


def test_triton_kernels_match_the_reference_under_the_interpreter() -> None:
    """The paged-attention and KV-write kernels (what the GPU graphs run) against the gather
    reference, on CPU through Triton's interpreter; the prefill block kernel also against the
    per-token kernel, a row's result independent of the block that holds it; and over a recycled
    page holding NaN past the positions read, the same bits as over a clean one; and page groups
    past a token's last page neither written nor read."""
    report = _interpreted("triton_kernels_interpreted.py", 300)
    assert report["poisoned_pages_bitwise"], report
    assert report["kv_write_exact"] and report["attention_max_abs_err"] < 1e-5, report
    assert report["prefill_block_max_abs_err"] < 1e-5 and report["prefill_block_invariant"], report
    assert report["decode_fused_write_bitwise"], report
    assert report["idle_groups_unread"], report


def test_persistent_layer_probe_kernel_matches_torch_under_the_interpreter() -> None:
    """The persistent kernels that `qualification/persistent_layer_probe.py` times on the device:
    every layer's projections, and the whole decode step with attention and its K/V writes,
    against torch (with the combine inside the attention stage, and as its own stage); one
    barrier arrival per stage."""
    report = _interpreted("persistent_layer_interpreted.py", 120)
    for fused, tickets in ((True, 10), (False, 12)):
        step = report.pop(f"decode_step_fused_{fused}")
        assert step["max_abs_err"] < 1e-4 and step["kv_max_abs_err"] < 1e-5 and step["tickets"] == tickets, step
    assert all(r["max_abs_err"] < 1e-4 and r["arrivals"] == 8 for r in report.values()), report


def test_write_attend_compiles_without_copying_the_cache() -> None:
    """`flare::write_attend` inside a compiled layer loop (CPU, Triton's interpreter): the cache is
    written in place, nothing reorders the write and the read, and Inductor allocates no
    KV-shaped buffer (the op declares no mutation so that the cache is never functionalized)."""
    report = _interpreted("write_attend_compiled.py", 600)
    assert report["kv_shaped_buffers"] == 0 and report["compiled_untouched_kv_bitwise_equal"], report


def test_gemv_kernel_matches_the_reference_under_the_interpreter() -> None:
    """`flare::gemv`'s kernel (decode projections with the norm, SiLU-gate, bias and residual
    folded in) against the eager reference on CPU, including a row's bitwise independence from
    the rows launched with it (decode buckets agree with solo runs)."""
    report = _interpreted("gemv_interpreted.py", 300)
    assert report["max_rel_err"] < 1e-5 and report["row_invariant"] and report["pdl_modes_bitwise"], report
    assert report["addr64_bitwise"], report


def test_gemv_addresses_weights_past_int32_in_int64() -> None:
    """Tiles are offset in int64 from 2**31 weight elements on (a margin: the last element's
    offset at exactly 2**31 still fits int32): a 262144-token vocabulary of width 8192 is the
    first, Qwen3.5's 248320 x 8192 is not."""
    from ignition.capture.gemv import needs_addr64

    assert not needs_addr64(262144, 8191) and not needs_addr64(248320, 8192)
    assert needs_addr64(262144, 8192) and needs_addr64(2, 1 << 30)


def test_gemv_precompile_groups_specializations_and_runs_them_in_a_pool() -> None:
    """The tuner's candidates compiled ahead in spawned workers: one task per specialization as
    Triton keys it (shapes alike in 16-divisibility share one; a split's reduction block, the
    norm variant and an odd shape do not), every task launched without failure. Then, for the
    tiles `tune` registers, the smaller group sizes of each bucket past one row that no bucket's
    default compiled: buckets 1, 3, 4 and 16 leave 1 and 2 rows per program at 3 rows, and 1, 2
    and 4 at 16 (a multiple of 16: its own specialization), once per tile and shape class (a
    problem alike to another adds none), none for a tensor-core tile."""
    report = _interpreted("gemv_precompile_interpreted.py", 120)
    assert report["per_problem"] == {"a": 6, "b": 2, "c": 6, "d": 6}, report
    assert report["precompile"] == {"tasks": 20, "workers": 2, "failed": 0}, report
    shapes = [(32, 64), (48, 64), (37, 300), (32, 128)]
    want = [[n, k, m, g] for n, k in shapes for m, g in ((3, 1), (3, 2), (16, 1), (16, 2), (16, 4))]
    assert report["group_tasks"] == want, report
    assert report["precompile_groups"] == {"tasks": 20, "workers": 2, "failed": 0}, report


def test_gemv_compiles_as_an_opaque_op() -> None:
    """The projections inside a compiled decode-style loop call `flare::gemv` (no graph break,
    not traced through) and match the eager reference."""
    report = _interpreted("gemv_compiled.py", 300)
    assert report["gemv_calls_in_compiled_code"] >= 8 and report["max_abs_err"] < 1e-4, report


def test_row_norm_kernel_is_row_invariant_under_the_interpreter() -> None:
    """`flare::rms_norm` (every few-row norm when kernels are on) against the eager reference in
    each mode, a row's result bitwise independent of the rows launched with it, strided rows,
    and the op called from compiled code."""
    report = _interpreted("rownorm_interpreted.py", 300)
    assert report["row_invariant"] and report["op_calls_in_compiled_code"] >= 2, report
    assert report["worst_ulps"]["float32"] < 8 and report["worst_ulps"]["float16"] <= 1, report


def test_row_norm_reads_fused_projection_heads_without_an_aten_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ATen copy inside `flare::rms_norm` is a library kernel in the graph, which export
    rejects (2026-12-06, the H200: Qwen3.5's decode_b2 failed on a `direct_copy_kernel` from
    reshaping q heads [2, H, D], sliced out of the fused projection, to [2H, D]). The launch
    must pass such views by their strides, at every row count, with the kernel stubbed out."""
    require_torch()
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from ignition.capture import rownorm

    launches: list[tuple[Any, ...]] = []

    class Kernel:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            return lambda *args, **kw: launches.append((grid, *args))

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.overloadpacket in (torch.ops.aten.copy_, torch.ops.aten.clone, torch.ops.aten._to_copy):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(rownorm, "_kernel", lambda: Kernel())
    heads, d = 4, 32
    w = torch.ones(d)
    for n in (1, 2, 4):
        qkv = torch.randn(n, 2 * heads * 2 * d + 2 * 2 * d)
        q = qkv[:, : 2 * heads * d].reshape(n, heads, 2 * d)[..., :d]  # Qwen3.5: [query | gate] per head
        k = qkv[:, 2 * heads * d : 2 * heads * d + 2 * d].reshape(n, 2, d)
        gate = qkv[:, : heads * d].reshape(n * heads, d)
        with Copies() as copies:
            for x, g, mode in ((q, None, "zero_centred"), (k, None, "rms"), (q, gate, "gated")):
                rownorm.launch(x, w, 1e-6, mode, g)
        assert copies.seen == [], (n, copies.seen)
    grid, x3 = launches[-3][0], launches[-3][1]  # q at n = 4: its heads, read in place
    assert grid == (4 * heads,) and x3.stride() == q.stride() and x3.data_ptr() == q.data_ptr()
    with pytest.raises(ValueError, match="gate"):
        rownorm.launch(q, w, 1e-6, "gated", gate[:3])


def test_fused_sampler_matches_the_torch_sampler_under_the_interpreter() -> None:
    """`flare::sample`'s kernel against the torch definition it replaces: every filter, penalty
    and grammar mix, ties at thresholds, fully masked rows, the top-p climb and bisection; a
    row's token independent of its batch, the block size and the climb limit; and the op called
    from compiled code."""
    report = _interpreted("sampler_interpreted.py", 600)
    assert report["mismatches"] == [] and report["cases"] >= 100, report
    assert report["rows_outside_the_first_draw"] > 0 and report["op_calls"] >= 1, report


def test_snapshot_and_restore_check_the_stamp_before_writing(tmp_path: Path) -> None:
    """A maintenance op writes nothing unless the source's stamp is what the executor expects
    (snapshot: the consumed count; restore: consumed count and epoch) and the rows go the right
    way (live -> snapshot, snapshot -> live); its record says which, with the stamp it found.
    An expected count below zero leaves the stamp unchecked (older executors)."""
    require_torch()
    import torch

    from ignition.capture.paged import FLAG_CHECKPOINT_REJECTED, RECORD_MAGIC
    from ignition.capture.runner import Row

    _checkpoint(tmp_path, TINY)
    prog = _program(_paged(tmp_path, TINY))
    _run(prog, "prefill_t128", [Row(1, [0, 1], 0, list(range(10, 50)), (5, 0))])
    snap, other = prog.geo.request_slots + 1, prog.geo.request_slots + 2

    def op(name: str, src: int, dst: int, consumed: int, epoch: int) -> list[int]:
        spec = next(g for g in prog.graphs if g.name == name)
        x = spec.inputs
        x["source_rows"].fill_(src)
        x["destination_rows"].fill_(dst)
        x["expected_consumed"].fill_(consumed)
        x["checkpoint_epoch"].fill_(epoch)
        _records(spec).zero_()
        prog.call(spec, prog.method(spec))
        record: list[int] = _records(spec)[0].tolist()
        return record

    before = prog.rows.clone()
    for src, dst, consumed in ((1, snap, 39), (1, snap, 41), (snap, 1, 40), (1, 2, 40)):
        r = op("snapshot", src, dst, consumed, 7)  # a wrong count, or the wrong direction
        assert r[0] == RECORD_MAGIC and r[2] == FLAG_CHECKPOINT_REJECTED and r[1] == dst, r
        assert torch.equal(prog.rows, before)
    r = op("snapshot", 1, snap, 40, 7)
    assert r[2] == 0 and r[4:6] == [40, 0] and prog.model.stamps(prog.rows)[snap].tolist() == [40, 7]
    hidden = prog.model.hidden_rows(prog.rows)
    assert torch.equal(hidden[snap], hidden[1])
    prog.hist[3] = 2
    before = prog.rows.clone()
    for src, dst, consumed, epoch in ((snap, 3, 40, 8), (snap, 3, 41, 7), (other, 3, 40, 7), (snap, other, 40, 7)):
        r = op("restore", src, dst, consumed, epoch)
        assert r[2] == FLAG_CHECKPOINT_REJECTED, (src, dst, consumed, epoch, r)
        assert torch.equal(prog.rows, before) and int(prog.hist[3].sum()) == 2 * prog.geo.vocab
    assert op("restore", snap, 3, 40, 7)[2] == 0 and torch.equal(prog.rows[3], prog.rows[snap])
    assert prog.hist[3].sum() == 0
    # Unchecked: the stamp is not compared, the direction still is.
    assert op("restore", other, 2, -1, 0)[2] == 0 and prog.model.stamps(prog.rows)[2].tolist() == [0, 0]
    assert op("restore", 1, 2, -1, 0)[2] == FLAG_CHECKPOINT_REJECTED
    # Initialize stamps (0, 0); a decode after the restore advances the consumed count only.
    _run(prog, "decode_b1", [Row(3, [0, 1], 40, [7], (5, 1))])
    assert prog.model.stamps(prog.rows)[3].tolist() == [41, 7]


def test_decode_projections_name_their_choices(tmp_path: Path) -> None:
    """An unknown `--decode-projections` value is a typed error before any weight is read,
    naming the two it accepts (the persistent kernel measured slower and is none of them)."""
    require_torch()
    from ignition.prepare import CapacityError, PrepareOptions, prepare

    for value in ("fused", "persistent"):
        with pytest.raises(CapacityError, match="neither gemv nor gemm"):
            prepare(tmp_path, tmp_path / "core", PrepareOptions(decode_projections=value))
