"""The Qwen3.5 forward's graph path on CPU: decode and prefill compiled with torch.compile
(fullgraph) with the GDN and row-store ops (`flare::gdn_conv`, `flare::gdn_delta`,
`flare::store_row`; Triton's interpreter runs the kernels, in bf16 as the graphs do) against the
eager reference on the same weights and state: hidden vectors, every row region and the KV
pages after a prefill chunk, a padded prefill chunk and decode steps in two buckets (lanes
padded). Attention stays the gather reference here: the interpreter computes the paged-attention
kernel wrongly in bf16 (right in float32, and on the GPU, where it is qualified). Prints one JSON
line; exit 1 on a mismatch. Needs TRITON_INTERPRET=1 before Triton is imported."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ignition.capture import gdn
from ignition.capture.gemv import Projections
from ignition.capture.hybrid import PagedQwen35
from ignition.capture.program import GraphSpec, Program
from ignition.capture.runner import Row, fill, pack_rows
from ignition.capture.sampling import Sampler
from ignition.prepare import Capacities, PrepareOptions
from ignition.recipes.mapping import Checkpoint, stream_execution_layout
from ignition.recipes.qwen3_5 import RECIPE, Qwen35Config, plan_weight_mapping
from tests.ignition.test_hybrid_cpu import CFG, _checkpoint

workdir = tempfile.TemporaryDirectory()  # removed when the script exits
root = Path(workdir.name)
_checkpoint(root)
config = Qwen35Config.from_dict(dict(CFG))
ckpt = Checkpoint.open(root)
weights = {
    name: torch.frombuffer(bytearray(tb.data), dtype=torch.bfloat16).view(tb.shape).clone()
    for name, tb in stream_execution_layout(plan_weight_mapping(config, ckpt.tensors, ckpt.files), ckpt)
}
caps = Capacities([1, 4], [64], 256, 4, 4, 24)
plan = RECIPE.plan_program(config, (2,), caps)
ref = plan.build(weights, torch.device("cpu"), PrepareOptions(attention_kernel=False))
ker = plan.build(weights, torch.device("cpu"), PrepareOptions(attention_kernel=True))
geo = ker.model.geo
ker.model = PagedQwen35(geo, weights, ker.model.inv_freq, kernels=True, attention_kernel=False)
compiled: dict[str, Any] = {}


def step(prog: Program, name: str, rows: list[Row], kernel: bool) -> torch.Tensor:
    spec: GraphSpec = next(g for g in prog.graphs if g.name == name)
    fill(spec, pack_rows(prog.geo, spec, rows))
    fn = prog.method(spec)
    if kernel:
        fn = compiled.setdefault(name, torch.compile(fn, fullgraph=True, dynamic=False))
    return prog.call(spec, fn).clone()


ids = list(range(10, 140))
pages = [3, 7, 5]
plan_steps = [
    ("prefill_t64", [Row(1, pages, 0, ids[:64])]),
    ("prefill_t64", [Row(1, pages, 64, ids[64:100])]),  # a padded chunk
    ("decode_b1", [Row(1, pages, 100, [ids[100]])]),
    ("prefill_t64", [Row(2, [9, 11], 0, ids[20:60])]),
    ("decode_b4", [Row(1, pages, 101, [ids[101]]), Row(2, [9, 11], 40, [ids[60]])]),  # two lanes padded
    ("decode_b4", [Row(2, [9, 11], 41, [ids[61]]), Row(1, pages, 102, [ids[102]])]),
]


def compare(ref: Program, ker: Program) -> dict[str, Any]:
    """The plan on both programs: hidden vectors, every row region, the KV pages."""
    worst = 0.0
    for name, rows in plan_steps:
        a, b = step(ref, name, rows, False), step(ker, name, rows, True)
        # The real rows: one per decode lane, one per prefill token.
        n = len(rows) if name.startswith("decode") else len(rows[0].tokens)
        a, b = a[:n].float(), b[:n].float()
        worst = max(worst, float((a - b).norm() / a.norm()))
    model = ref.model
    assert isinstance(model, PagedQwen35)
    region_err: dict[str, float] = {}
    for r in model.geo.row_regions():
        name = str(r["name"])
        if name.endswith(".recurrent"):
            layer = int(name.split(".")[0].removeprefix("layer"))
            x, y = model.recurrent_rows(ref.rows, layer), model.recurrent_rows(ker.rows, layer)
        elif name.endswith(".conv"):
            layer = int(name.split(".")[0].removeprefix("layer"))
            x, y = model.conv_rows(ref.rows, layer).float(), model.conv_rows(ker.rows, layer).float()
        else:
            x, y = model.hidden_rows(ref.rows).float(), model.hidden_rows(ker.rows).float()
        region_err[name] = float((x - y).norm() / x.norm().clamp(min=1e-30))
    kv_err = float((ref.kv_all.float() - ker.kv_all.float()).norm() / ref.kv_all.float().norm())
    untouched = bool(torch.equal(ker.rows[[0, 3, 4]], torch.zeros_like(ker.rows[[0, 3, 4]])))
    return {
        "hidden_rel_l2_max": worst,
        "rows_rel_l2_max": max(region_err.values()),
        "kv_rel_l2": kv_err,
        "unnamed_rows_untouched": untouched,
    }


def fresh() -> tuple[Program, Program]:
    ref = plan.build(weights, torch.device("cpu"), PrepareOptions(attention_kernel=False))
    ker = plan.build(weights, torch.device("cpu"), PrepareOptions(attention_kernel=True))
    ker.model = PagedQwen35(ker.model.geo, weights, ker.model.inv_freq, kernels=True, attention_kernel=False)
    return ref, ker


def ok(r: dict[str, Any]) -> bool:
    worst = max(r["hidden_rel_l2_max"], r["rows_rel_l2_max"], r["kv_rel_l2"])
    return bool(worst < 0.02 and r["unnamed_rows_untouched"])


def speculative(few_row_kernels: bool = False) -> dict[str, Any]:
    """A compiled two-request speculative program against compiled decode steps, all with the GDN
    kernels (`few_row_kernels`: and `flare::gemv`, `flare::rms_norm`, `flare::sample`, as the
    device runs them); slots own W = 4 rows. Request A's second proposal is wrong (the round consumes two
    tokens, the column of lane 1 committed), request B's first is (one token, nothing to commit);
    both live rows (every region, stamp included), the consumed positions' KV and the lanes'
    hidden vectors are bitwise what decode steps leave; rows outside both slots untouched."""
    from ignition.capture.paged import HEADER_WORDS
    from ignition.capture.runner import Sampling

    plan = RECIPE.plan_program(config, (2,), Capacities([1, 4], [64], 256, 4, 4, 24, [(2, 3)]))
    prog = plan.build(weights, torch.device("cpu"), PrepareOptions(attention_kernel=True))
    prog.model = PagedQwen35(prog.model.geo, weights, prog.model.inv_freq, kernels=True, attention_kernel=False)
    if few_row_kernels:
        prog.model.proj = Projections(kernel=True)
        prog.model.gemv = True  # as on the device: decode rows unpadded
        prog.model.sampler = Sampler(kernel=True)
    geo, greedy = prog.geo, Sampling(top_k=1)
    a, b = geo.live_row(1), geo.live_row(2)
    pages_b, start_a, start_b = [9, 11], 60, 40
    compiled.clear()

    def run(name: str, rows: list[Row]) -> tuple[torch.Tensor, list[list[int]]]:
        h = step(prog, name, rows, True)
        spec = next(g for g in prog.graphs if g.name == name)
        assert spec.records is not None
        return h, spec.records.tolist()

    _, rec = run("prefill_t64", [Row(a, pages, 0, ids[:start_a], (9, 0), greedy)])
    out_a = [rec[0][HEADER_WORDS]]
    _, rec = run("prefill_t64", [Row(b, pages_b, 0, ids[20 : 20 + start_b], (10, 0), greedy)])
    out_b = [rec[0][HEADER_WORDS]]
    state = [t.clone() for t in (prog.rows, prog.kv_all, prog.hist, prog.pending)]
    hs = []
    for n in range(2):
        h, rec = run("decode_b1", [Row(a, pages, start_a + n, [out_a[-1]], (9, 1 + n), greedy)])
        out_a.append(rec[0][HEADER_WORDS])
        hs.append(h[:1])
    h, rec = run("decode_b1", [Row(b, pages_b, start_b, [out_b[-1]], (10, 1), greedy)])
    out_b.append(rec[0][HEADER_WORDS])
    hs.append(h[:1])
    after_rows, after_kv = prog.rows.clone(), prog.kv_all.clone()
    for t, saved in zip((prog.rows, prog.kv_all, prog.hist, prog.pending), state, strict=True):
        t.copy_(saved)
    rows = [
        Row(a, pages, start_a, [out_a[0], out_a[1], (out_a[2] + 1) % geo.vocab], (9, 1), greedy),
        Row(b, pages_b, start_b, [out_b[0], (out_b[1] + 1) % geo.vocab], (10, 1), greedy),
    ]
    h, rec = run("verify_b2_d3", rows)
    w = geo.verification_width
    slots = set(range(a, a + w)) | set(range(b, b + w))
    others = [r for r in range(prog.rows.shape[0]) if r not in slots]
    consumed = [(pages, p) for p in (start_a, start_a + 1)] + [(pages_b, start_b)]
    kv_equal = all(
        torch.equal(prog.kv_all[pp[p // 64], :, :, p % 64], after_kv[pp[p // 64], :, :, p % 64]) for pp, p in consumed
    )
    differing = set()
    for live in (a, b):
        diff = (prog.rows[live] != after_rows[live]).nonzero().flatten().tolist()
        differing |= {str(r["name"]) for r in geo.row_regions() for i in diff if 0 <= i - r["offset"] < r["byte_size"]}
    return {
        "differing_regions": sorted(differing),
        "record": [
            rec[0][3:5] + rec[0][HEADER_WORDS : HEADER_WORDS + 2],
            rec[1][3:5] + rec[1][HEADER_WORDS : HEADER_WORDS + 1],
        ],
        "expected_record": [[2, start_a + 2, *out_a[1:3]], [1, start_b + 1, out_b[1]]],
        "live_rows_bitwise": bool(torch.equal(prog.rows[[a, b]], after_rows[[a, b]])),
        "lanes_bitwise": bool(torch.equal(torch.cat([h[:2], h[w : w + 1]]), torch.cat(hs))),
        "kv_bitwise": kv_equal,
        "other_rows_untouched": bool(torch.equal(prog.rows[others], state[0][others])),
    }


report = compare(ref, ker)
report["speculative"] = speculative()
report["speculative_kernels"] = speculative(few_row_kernels=True)
# The same with the chunked GDN prefill (`--gdn-prefill chunked`, chunks of 16 here).
gdn.PREFILL_CHUNK = 16
report["chunked"] = compare(*fresh())
gdn.PREFILL_CHUNK = None
print(json.dumps(report))
spec_ok = all(
    r["record"] == r["expected_record"]
    and all(v for k, v in r.items() if k not in ("record", "expected_record", "differing_regions"))
    for r in (report["speculative"], report["speculative_kernels"])
)
sys.exit(0 if ok(report) and ok(report["chunked"]) and spec_ok else 1)
