"""Diagnosis of the speculative programs on the GPU (issue 21): on a tiny seeded random Llama,
generation through `PagedLlama.verify` against ordinary decoding, eager and compiled, with the
attention kernels and the gather reference, GEMM templates and `flare::gemv`, with and without
Inductor's emulated precision casts and its split reductions; then the tiny hybrid (GDN state
columns, the commit op), compiled with the kernels, with GEMM templates and `flare::gemv`.
Prints one JSON line per case: whether the tokens are identical, the rounds taken with right
proposals, and each lane's hidden vector (and the live row) against the decode step's
(`ignition.prepare._lanes_against_decode`), and the same step batched behind other requests in
every bucket and program against it alone (`_batched_against_alone`).

    python3 qualification/speculative_diag.py [--device cpu] [--cases all|llama|hybrid]

2026-12-05: prepare's check on SmolLM2 found speculative generation equal to decoding in 1 of 4
prompts on the H200 while every CPU run agrees; these cases tell the kernels, the compiler's
fusions and the projections apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if TYPE_CHECKING:
    from ignition.capture.program import GraphSpec, Program

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 4096,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "eos_token_id": 2,
}


class _Replay:
    """Stands in for a captured graph: replay runs the step (eager or compiled) into the output."""

    def __init__(self, prog: Program, spec: GraphSpec, fn: Any) -> None:
        self.prog, self.spec, self.fn = prog, spec, fn

    def replay(self) -> None:
        self.spec.output = self.prog.call(self.spec, self.fn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", choices=("all", "llama", "hybrid"), default="all")
    args = ap.parse_args()
    import torch
    import torch._inductor.config as icfg
    import transformers

    from ignition.capture.paged import Geometry, PagedLlama, rope_parameters
    from ignition.capture.program import Program, catalog
    from ignition.capture.recorder import configure_inductor
    from ignition.recipes.llama import Checkpoint, LlamaFamilyConfig, plan_weight_mapping, stream_execution_layout

    dev = args.device
    tmp = Path(tempfile.mkdtemp(prefix="speculative-diag-"))
    torch.manual_seed(0)
    hf_cfg = transformers.AutoConfig.for_model("llama", **{k: v for k, v in CONFIG.items() if k != "model_type"})
    transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).save_pretrained(str(tmp))
    config = LlamaFamilyConfig.from_file(tmp / "config.json")
    ckpt = Checkpoint.open(tmp)
    mapping = plan_weight_mapping(config, ckpt.tensors, ckpt.files)
    weights = {}
    for name, tb in stream_execution_layout(mapping, ckpt):
        dt = {"BF16": torch.bfloat16, "F32": torch.float32}[tb.dtype.name]
        weights[name] = torch.frombuffer(bytearray(tb.data), dtype=dt).view(tb.shape).to(dev, torch.bfloat16)
    geo = Geometry.from_recipe(config, (2,), context_limit=512, request_slots=4, snapshot_rows=4, max_kv_pages=24)
    inv, scaling = rope_parameters(config.raw, dev)
    if dev != "cpu":  # Triton GEMM templates, as prepare compiles them (none on CPU)
        configure_inductor()
    gpu = dev != "cpu"
    # (attention kernels, compiled, emulated precision casts, flare::gemv, Inductor's split
    # reductions: a reduction split over programs for few rows sums in another order than the
    # same reduction over more rows, so a verify lane's sampler could differ from decode's;
    # flare::sample: one program per row, so a lane samples as a decode row by construction;
    # flare::rms_norm with gemv (off: the norms as Inductor reductions, whose blocks follow the
    # row count)
    cases = [
        (gpu, False, False, False, True, False, False),
        (gpu, True, False, False, True, False, False),
        (gpu, True, True, False, True, False, False),
        (gpu, True, False, False, False, False, False),
        (False, True, False, False, True, False, False),
    ]
    if gpu:
        cases += [
            (True, True, False, True, True, False, False),
            (True, True, False, True, True, False, True),
            (True, True, False, False, True, True, False),
            (True, True, False, True, True, True, True),
        ]
    for kernel, compiled, emulate, gemv, split, sampler, norms in cases if args.cases != "hybrid" else []:
        icfg.emulate_precision_casts = emulate
        icfg.split_reductions = split
        torch._dynamo.reset()
        model = PagedLlama(geo, weights, inv, scaling, attention_kernel=kernel, gemv=gemv, sampler_kernel=sampler)
        if not norms:
            model.proj.norm_op = None
        prog = Program(model, catalog(geo, [1, 2], [128], [(1, 7), (2, 7)]))

        res: dict[str, Any] = {"kernel": kernel, "compiled": compiled, "emulate_precision_casts": emulate, "gemv": gemv}
        res["split_reductions"] = split
        res["sampler_kernel"] = sampler
        res["norm_kernel"] = norms and gemv
        _case(prog, compiled, res)
    icfg.emulate_precision_casts = False
    icfg.split_reductions = True
    if args.cases == "llama":
        return
    # The hybrid (tiny Qwen3.5): GDN state columns and the commit op, compiled, with the kernels.
    from ignition.capture.hybrid import PagedQwen35
    from ignition.prepare import Capacities, PrepareOptions
    from ignition.recipes.qwen3_5 import RECIPE, Qwen35Config
    from ignition.recipes.qwen3_5 import plan_weight_mapping as q35_mapping
    from tests.ignition.test_hybrid_cpu import CFG as Q35_CFG
    from tests.ignition.test_hybrid_cpu import _checkpoint as q35_checkpoint

    q35_dir = tmp / "q35"
    q35_checkpoint(q35_dir)
    q35_config = Qwen35Config.from_dict(dict(Q35_CFG))
    q35_ckpt = Checkpoint.open(q35_dir)
    q35_weights = {}
    for name, tb in stream_execution_layout(q35_mapping(q35_config, q35_ckpt.tensors, q35_ckpt.files), q35_ckpt):
        q35_weights[name] = torch.frombuffer(bytearray(tb.data), dtype=torch.bfloat16).view(tb.shape).to(dev)
    for gemv, sampler, norms in (
        ((False, False, False), (True, False, False), (True, True, True)) if gpu else ((False, False, False),)
    ):
        torch._dynamo.reset()
        caps = Capacities([1, 2], [128], 512, 4, 4, 24, [(1, 3), (2, 3)])
        options = PrepareOptions(
            attention_kernel=gpu,
            decode_projections="gemv" if gemv else "gemm",
            sampler="kernel" if sampler else "torch",
        )
        prog = RECIPE.plan_program(q35_config, (2,), caps).build(q35_weights, torch.device(dev), options)
        assert isinstance(prog.model, PagedQwen35)
        if not norms:
            prog.model.proj.norm_op = None
        # On CPU the reference GDN loops over lanes in Python: eager only.
        res = {"hybrid": True, "kernel": gpu, "compiled": gpu, "gemv": gemv, "sampler_kernel": sampler}
        _case(prog, gpu, {**res, "norm_kernel": norms})


def _case(prog: Program, compiled: bool, res: dict[str, Any]) -> None:
    """Generation through the speculative programs against decoding (sampled and greedy, every
    proposal right) and one round's lanes and live row against two decode steps; prints `res`."""
    import torch

    from ignition.capture.runner import GraphRunner, Sampling
    from ignition.core.stepping import replaying
    from ignition.prepare import _batched_against_alone, _lanes_against_decode

    for spec in prog.graphs:
        fn = prog.method(spec)
        spec.graph = _Replay(prog, spec, torch.compile(fn, fullgraph=True, dynamic=False) if compiled else fn)
    runner = GraphRunner(prog)
    prompt = list(range(3, 120))
    t0 = time.time()
    want: list[int] = []
    for name, params in (
        ("sampled", Sampling(temperature=0.7, top_k=40, top_p=0.9)),
        ("greedy", Sampling(top_k=1)),
    ):
        want = runner.generate(prompt, 21, params, 40)
        got, steps = runner.generate_speculative(prompt, 21, params, 40, replaying(want))
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        res[name] = {"identical": got == want, "rounds": steps, "first_difference": first}
    gen = {"prompt_ids": prompt, "tokens": want, "seed": 21, "params": vars(Sampling(top_k=1))}
    res["lanes"] = _lanes_against_decode(runner, gen)
    res["batched"] = _batched_against_alone(runner, gen)
    res["s"] = round(time.time() - t0, 1)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
