"""`ignition prepare`: a Llama-family checkpoint -> a runtime core, with its qualification report.

Stages (each printed with its duration): validate the checkpoint, the capacities and the device;
stream the weights into their execution layouts on the fixed-address arena; compile and capture
every graph (decode per request bucket, prefill per chunk capacity, resume sampling, initialize/
restore/snapshot); record and export; then, unless --no-check, teacher-forced logits against
Transformers, torch replay determinism, and (with --core-replay) bitwise replay in a fresh
process. Capacities that do not fit fail with a typed error; nothing is silently shrunk.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ignition.progress import note, phase
from ignition.recipes import RecipeConfig, recipe_for
from ignition.recipes.mapping import Checkpoint, stream_execution_layout

if TYPE_CHECKING:
    from ignition.core.manifest import SamplingDefaults


@dataclass(eq=False)
class CapacityError(Exception):
    option: str
    reason: str

    def __str__(self) -> str:
        return f"{self.option}: {self.reason}"


@dataclass(eq=False)
class DeviceError(Exception):
    reason: str

    def __str__(self) -> str:
        return f"device: {self.reason}"


@dataclass(frozen=True)
class Capacities:
    decode_buckets: list[int]
    prefill_chunks: list[int]
    context_limit: int
    request_slots: int
    snapshot_rows: int
    max_kv_pages: int
    # (requests, depth) of the speculative programs (`speculative_programs`).
    speculative: list[tuple[int, int]] = field(default_factory=list)


MAX_SPECULATIVE_DEPTH = 15
# Lanes of a speculative program, at most: they then share the decode buckets' projection shapes
# (`ignition.capture.paged.MIN_GEMM_ROWS` padded GEMMs, or `GEMV_MAX_ROWS` few-row kernels), so
# a lane's logits are bitwise a decode row's and verification emits what ordinary decoding would.
MAX_VERIFY_LANES = 16


def speculative_programs(decode_buckets: list[int], depth: int) -> list[tuple[int, int]]:
    """(requests, depth) of the speculative programs for these buckets: each bucket verifies up
    to `depth` proposals per request, fewer where its lanes would exceed `MAX_VERIFY_LANES`
    (none where not even one proposal fits)."""
    out = []
    for b in decode_buckets:
        d = min(depth, MAX_VERIFY_LANES // b - 1)
        if d >= 1:
            out.append((b, d))
    return out


def plan_capacities(
    config: RecipeConfig,
    decode_buckets: str,
    prefill_chunk: int | None,
    context_limit: int | None,
    kv_pages: int | None,
    page_tokens: int = 64,
    speculative_depth: int = 0,
) -> Capacities:
    try:
        buckets = [int(x) for x in decode_buckets.split(",") if x.strip()]
    except ValueError as e:
        raise CapacityError("--decode-buckets", f"not a comma-separated list of integers: {e}") from None
    if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
        raise CapacityError("--decode-buckets", f"{buckets} must be positive and strictly ascending")
    if buckets[-1] > 64:
        raise CapacityError("--decode-buckets", f"{buckets[-1]} rows exceed the 64 request slots a core may hold")
    max_pos = int(config.raw.get("max_position_embeddings") or 0)
    limit = context_limit or min(max_pos or 8192, 8192)
    if limit % page_tokens or limit <= 0:
        raise CapacityError("--context-limit", f"{limit} is not a positive multiple of the {page_tokens}-token page")
    if max_pos and limit > max_pos:
        raise CapacityError("--context-limit", f"{limit} exceeds the checkpoint's max_position_embeddings {max_pos}")
    chunk = prefill_chunk or min(512, limit)
    if chunk < 128 or chunk & (chunk - 1) or chunk > limit:
        raise CapacityError("--prefill-chunk-size", f"{chunk} must be a power of two in 128..={limit}")
    chunks = [1 << i for i in range(7, chunk.bit_length())]
    pages_per_request = limit // page_tokens
    slots = buckets[-1]
    pages = kv_pages or slots * pages_per_request * 2
    if pages < pages_per_request:
        raise CapacityError("--kv-pages", f"{pages} pages cannot hold one {limit}-token request ({pages_per_request})")
    # A snapshot row of this recipe is one hidden vector (a few KiB), so rows are sized to the
    # pages: every checkpoint holds at least a tail page or a segment anyway, and with far fewer
    # rows than pages, snapshot pressure thins each new chain to its endpoint before page
    # pressure can retire stale checkpoints, losing shared prefixes (measured on the GPU with
    # 32 rows for 576 pages; tests/ lifecycle `a_shared_prefix_survives_page_pressure...`).
    if not 0 <= speculative_depth <= MAX_SPECULATIVE_DEPTH:
        raise CapacityError("--speculative-depth", f"{speculative_depth} outside 0..={MAX_SPECULATIVE_DEPTH}")
    speculative = speculative_programs(buckets, speculative_depth)
    return Capacities(buckets, chunks, limit, slots, max(8 * slots, pages), pages, speculative)


def _eos_ids(model: Path, config: RecipeConfig) -> list[int]:
    ids: set[int] = set()
    raw = config.raw.get("eos_token_id")
    for v in raw if isinstance(raw, list) else [raw]:
        if isinstance(v, int):
            ids.add(v)
    special = model / "special_tokens.json"
    if special.is_file():
        v = json.loads(special.read_text()).get("eos_token_id")
        if isinstance(v, int):
            ids.add(v)
    if not ids:
        raise CapacityError("--model", "the checkpoint declares no eos_token_id (config.json or special_tokens.json)")
    return sorted(ids)


def _chat_template(model: Path) -> str:
    p = model / "chat_template.jinja"
    if p.is_file():
        return p.read_text()
    cfg = model / "tokenizer_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(t, str):
            return t
    raise CapacityError("--model", "no chat template (chat_template.jinja or tokenizer_config.json)")


def _sampling(d: SamplingDefaults, vocab: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        p = getattr(d, name)
        entry: dict[str, Any] = {"default": p.default}
        if p.range is not None:
            hi = min(p.range.max, float(vocab)) if name == "top_k" else p.range.max
            entry["range"] = [p.range.min, hi]
        out[name] = entry
    out["max_output_tokens"] = d.max_output_tokens
    return out


def check_device() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise DeviceError("CUDA is not available to torch")
    p = torch.cuda.get_device_properties(0)
    if (p.major, p.minor) < (8, 0):
        raise DeviceError(f"{p.name} (sm_{p.major}{p.minor}) lacks bf16 tensor cores; sm_80 or newer is needed")
    free, total = torch.cuda.mem_get_info()
    return {"name": p.name, "compute_capability": f"{p.major}.{p.minor}", "free_bytes": free, "total_bytes": total}


@dataclass(frozen=True)
class PrepareOptions:
    """Everything `prepare` takes besides the checkpoint and the output path (CLI flags map 1:1)."""

    decode_buckets: str = "1,2,4,8"
    prefill_chunk: int | None = None
    context_limit: int | None = None
    kv_pages: int | None = None
    compile_graphs: bool = True
    check: bool = True
    # The Rust core_replay binary for the fresh-process bitwise check.
    core_replay: Path | None = None
    card: str = "auto"
    # Paged attention as the Triton kernels (False: gather + reduce, for comparisons).
    attention_kernel: bool = True
    # Decode projections: "gemv" (`flare::gemv`, tuned here) or "gemm" (Inductor's templates).
    # GEMM stays the default until a whole core with gemv has been qualified on the device.
    decode_projections: str = "gemm"
    # Hybrid recipes' Gated DeltaNet prefill: "scan" (token by token) or "chunked" (matrix
    # products per chunk). The scan stays the default until chunked is qualified on the device.
    gdn_prefill: str = "scan"
    # Sampling: "kernel" (`flare::sample`, one fused kernel per sampling step) or "torch" (the
    # definition in `ignition.capture.sampling`, ~19 Inductor kernels). Torch stays the default
    # until a core with the kernel has been qualified on the device.
    sampler: str = "torch"
    # Programmatic dependent launch (Hopper) in the decode graphs: "auto" picks each gemv
    # projection's launch mode and whether the decode attention kernels launch as dependents by
    # timing the compiled decode step between compile and capture (`_tune_launch`); "off"
    # launches plainly. Off until a core with it has been qualified against a plain one on the
    # device (it needs ABI 4's programmatic edges in Helios).
    pdl: str = "off"
    served_name: str | None = None
    reference_prompts: Path | None = None
    dump_io: bool = False
    # Proposals per request the speculative programs verify at most (0: no speculative programs);
    # larger buckets verify fewer (their lanes stay within `MAX_VERIFY_LANES`). Off by default
    # until the programs are qualified on the device (2026-12-05: their lanes did not yet sample
    # what decode samples there; see qualification/device_2026-12-05_s10.md).
    speculative_depth: int = 0
    # torch.compile's portable cache (Mega-Cache) in one file: loaded before compiling when it
    # exists, written after capture. Entries are keyed on the traced code, torch, Triton and
    # the GPU, so a stale or foreign file only costs the compile it cannot save.
    compile_cache: Path | None = None
    # GEMM template epilogue fusion: "benchmark" (Inductor's default: each candidate compiled and
    # timed) or "heuristic" (fused untimed; see `configure_inductor`).
    template_fusion: str = "benchmark"


def prepare(model: Path, out: Path, options: PrepareOptions | None = None) -> dict[str, Any]:
    o = options or PrepareOptions()
    compile_graphs, check, core_replay = o.compile_graphs, o.check, o.core_replay
    served_name, reference_prompts, dump_io = o.served_name, o.reference_prompts, o.dump_io
    if o.decode_projections not in ("gemv", "gemm"):
        raise CapacityError("--decode-projections", f"{o.decode_projections!r} is neither gemv nor gemm")
    if o.sampler not in ("kernel", "torch"):
        raise CapacityError("--sampler", f"{o.sampler!r} is neither kernel nor torch")
    if o.pdl not in ("auto", "off"):
        raise CapacityError("--pdl", f"{o.pdl!r} is neither auto nor off")
    if o.gdn_prefill not in ("scan", "chunked"):
        raise CapacityError("--gdn-prefill", f"{o.gdn_prefill!r} is neither scan nor chunked")
    if not compile_graphs:
        raise CapacityError(
            "--no-compile",
            "graphs without torch.compile would launch library kernels (cuBLAS), which a core cannot carry; refusing",
        )
    t_all = time.time()
    report: dict[str, Any] = {"command": " ".join(sys.argv), "model": str(model)}
    work = out.parent / (out.name + ".work")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(os.environ.get("IGNITION_CACHE", work)) / "triton"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(os.environ.get("IGNITION_CACHE", work)) / "inductor"))
    with phase(f"validate {model}"):
        if not (model / "config.json").is_file():
            raise CapacityError("--model", f"{model} holds no config.json (a Transformers checkpoint directory)")
        raw = json.loads((model / "config.json").read_text())
        recipe = recipe_for(raw)
        config = recipe.parse_config(raw)
        ckpt = Checkpoint.open(model)
        mapping = recipe.plan_weight_mapping(config, ckpt.tensors, ckpt.files)
        caps = plan_capacities(
            config,
            o.decode_buckets,
            o.prefill_chunk,
            o.context_limit,
            o.kv_pages,
            speculative_depth=o.speculative_depth,
        )
        eos = _eos_ids(model, config)
        template = _chat_template(model)
        tokenizer = (model / "tokenizer.json").read_bytes()
        card = recipe.sampling_card(config, o.card)
        note(f"{config.architecture} ({recipe.name} recipe): {len(ckpt.tensors)} tensors, {mapping.summary()}")
        plan = recipe.plan_program(config, tuple(eos), caps)
        caps = plan.capacities  # the recipe may size its snapshot rows to its row bytes
        note(f"capacities {caps}")
        device = check_device()
        note(f"device {device['name']} ({device['free_bytes'] / 2**30:.1f} GiB free)")
    import torch

    from ignition.capture.recorder import CoreDescription, Recorder
    from ignition.export.exporter import export_recording

    # One code object (decode, prefill) is compiled once per captured shape.
    for key, value in (("cache_size_limit", 256), ("recompile_limit", 256), ("accumulated_recompile_limit", 4096)):
        with contextlib.suppress(AttributeError):
            setattr(torch._dynamo.config, key, value)
    weight_bytes = sum(math.prod(d.shape) * 2 for d in mapping.destinations.values())
    state_bytes = plan.state_bytes()
    # One pool per graph: decode buckets, speculative programs, prefill chunks, resume and four
    # maintenance graphs.
    graphs = len(caps.decode_buckets) + len(caps.speculative) + len(caps.prefill_chunks) + 5
    arena_bytes = weight_bytes + state_bytes + plan.pool_bytes() * graphs
    if arena_bytes > device["free_bytes"] - (2 << 30):
        raise CapacityError(
            "--kv-pages",
            f"the arena needs {arena_bytes / 2**30:.1f} GiB; {device['free_bytes'] / 2**30:.1f} GiB are free",
        )
    report["capacities"] = vars(caps)
    report["memory_plan"] = {"weights": weight_bytes, "state": state_bytes, "arena_mapped": arena_bytes}

    def build(dev: Any) -> Any:
        weights = {}
        for name, tb in stream_execution_layout(mapping, ckpt):
            t = torch.frombuffer(bytearray(tb.data), dtype=_torch_dtype(tb.dtype.name)).view(tb.shape)
            weights[name] = t.to(device=dev, dtype=torch.bfloat16)
        return plan.build(weights, dev, o)

    describe = CoreDescription(
        model_config={k: v for k, v in config.raw.items() if isinstance(v, (int, float, str, bool, list))},
        served_model_name=served_name or model.name,
        tokenizer_json=tokenizer,
        chat_template=template,
        eos_token_ids=eos,
        sampling=_sampling(card, config.vocab_size),
        decode_buckets=caps.decode_buckets,
        prefill_chunks=caps.prefill_chunks,
    )
    rec = Recorder(work, build, describe, arena_bytes, template_fusion=o.template_fusion)
    stage = "prepare"
    try:
        with phase("stream weights onto the fixed-address arena"):
            rec.prepare()
            note(f"arena at {rec.report['arena']['base']} ({rec.arena.mapped / 2**30:.2f} GiB mapped)")
        gemv = bool(rec.program.model.gemv)
        _reset_launch_settings()
        report["decode_projections"] = "gemv" if gemv else "gemm"
        report["gdn_prefill"] = o.gdn_prefill
        report["sampler"] = "kernel" if rec.program.model.sampler.op is not None else "torch"
        if o.sampler == "kernel" and rec.program.model.sampler.op is None:
            note("sampling as torch ops: the fused sampler needs the kernels' device")
        if o.decode_projections == "gemv" and not gemv:
            note("decode projections as GEMM templates: a bucket exceeds the few-row kernel or attention is gathered")
        if gemv:
            stage = "tune"
            with phase("tune the few-row projections"):
                lanes = max((b * (d + 1) for b, d in caps.speculative), default=0)
                report["gemv"] = _tune_projections(rec, caps.decode_buckets, lanes)
        if rec.program.model.write_attend is not None:
            stage = "tune"
            with phase("tune the decode attention split"):
                report["attention_split"] = _tune_attention(rec, caps.decode_buckets)
        stage = "compile_and_capture"
        if o.compile_cache is not None:
            report["compile_cache"] = _load_compile_cache(o.compile_cache)
        tune_launch = None
        if o.pdl == "auto" and not gemv:
            note("launches stay plain: --pdl auto tunes the gemv decode projections, and this core has none")
        if gemv and o.pdl == "auto":

            def tune_launch() -> None:
                with phase("tune the launch modes on the compiled decode step"):
                    report["pdl"] = _tune_launch(rec)

        with phase(f"compile and capture {len(rec.graphs)} graphs"):
            rec.compile_and_capture(progress=note, before_capture=tune_launch)
        if o.compile_cache is not None:
            report["compile_cache"] |= _save_compile_cache(o.compile_cache)
        stage = "record"
        with phase("walk the graphs and record kernels, parameters and memory"):
            recording = rec.record()
            unlisted = rec.report["memory_map"]["unlisted"]
            if unlisted:
                note(f"WARNING: {len(unlisted)} arena segments torch does not list, kept as scratch: {unlisted[:4]}")
        stage = "export"
        with phase(f"export the core to {out}"):
            if out.exists():
                shutil.rmtree(out)
            t0 = time.time()
            core = export_recording(recording, out, note)
            rec.timings["export_s"] = round(time.time() - t0, 3)
            report["export"] = {"graphs": len(core.graphs), "kernels": len(core.kernels), "buffers": len(core.buffers)}
        report["peak_memory"] = {
            "torch_max_allocated_bytes": torch.cuda.max_memory_allocated(),
            "torch_max_reserved_bytes": torch.cuda.max_memory_reserved(),
            "arena_used_bytes": rec.arena.used,
            "device_used_bytes": (lambda f: f[1] - f[0])(torch.cuda.mem_get_info()),
        }
        rec.timings["prepare_total_s"] = round(time.time() - t_all, 3)
        if check:
            stage = "check"
            _check(rec, model, out, work, core_replay, report, reference_prompts, dump_io)
    except Exception as e:
        report["failed_stage"] = stage
        report["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        report["recorder"] = rec.report
        report["timings"] = rec.timings
        (work / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        if out.is_dir():
            (out.parent / (out.name + ".report.json")).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


def _load_compile_cache(path: Path) -> dict[str, Any]:
    """Hot-loads torch.compile's cache artifacts from `path` (if it exists) into the local caches."""
    import torch

    if not path.is_file():
        note(f"compile cache {path}: none yet (written after capture)")
        return {"loaded_bytes": 0}
    blob = path.read_bytes()
    try:
        info = torch.compiler.load_cache_artifacts(blob)
    except Exception as e:  # a cache from another torch: compile from scratch
        note(f"compile cache {path}: not loaded ({type(e).__name__}: {e})")
        return {"loaded_bytes": 0, "load_error": f"{type(e).__name__}: {e}"}
    entries = _cache_entries(info)
    note(f"compile cache {path}: {len(blob) / 2**20:.1f} MiB loaded, {sum(entries.values())} entries {entries}")
    return {"loaded_bytes": len(blob), "loaded_entries": entries}


def _save_compile_cache(path: Path) -> dict[str, Any]:
    """Writes the cache artifacts this process created or used (torch keeps them) to `path`."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return {"saved_bytes": 0}
    blob, info = saved
    entries = _cache_entries(info)
    if path.is_file() and path.stat().st_size > len(blob):
        # Hits are saved again with what was compiled, so a smaller set means this run used a
        # part of the file (other options, another model): keep the larger one.
        note(f"compile cache {path}: kept ({len(blob) / 2**20:.1f} MiB from this run is smaller)")
        return {"saved_bytes": 0, "kept_bytes": path.stat().st_size}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(blob)
    tmp.replace(path)
    note(f"compile cache {path}: {len(blob) / 2**20:.1f} MiB written, {sum(entries.values())} entries {entries}")
    return {"saved_bytes": len(blob), "saved_entries": entries}


def _cache_entries(info: Any) -> dict[str, int]:
    """Artifacts per cache kind in a `CacheInfo` (`artifacts`: kind -> keys)."""
    artifacts = getattr(info, "artifacts", None) or {}
    return {str(kind): len(keys) for kind, keys in artifacts.items() if keys}


@contextlib.contextmanager
def _timing_lock(timings: dict[str, float]) -> Iterator[None]:
    """Holds the file lock named by `IGNITION_TIMING_LOCK` (if set) while tuning: the
    qualification harness runs one model's prepare beside another's measurements, and a
    tile chosen under a neighbour's load is the wrong tile. The wait adds to
    `timings["timing_lock_wait_s"]` (preparation time spent on the neighbour, not on this core)."""
    path = os.environ.get("IGNITION_TIMING_LOCK")
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as lock:
        t0 = time.time()
        fcntl.flock(lock, fcntl.LOCK_EX)
        waited = time.time() - t0
        timings["timing_lock_wait_s"] = round(timings.get("timing_lock_wait_s", 0.0) + waited, 3)
        note(f"timing lock {path} held after {waited:.1f} s")
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _tune_projections(rec: Any, buckets: list[int], lanes: int) -> dict[str, Any]:
    """Picks each projection shape's `flare::gemv` tile on this device (outside the arena: the
    temporaries are freed before capture) and prints what each reaches. Timed at the decode
    buckets; the bucket invariance is checked up to `lanes` rows as well (a speculative
    program's lanes must be bitwise what decode computes)."""
    import torch

    from ignition.capture.gemv import precompile, precompile_groups, tune, tune_groups

    problems = rec.program.model.projection_problems()
    t0 = time.time()
    pre = precompile(problems, buckets)
    rec.timings["gemv_precompile_s"] = round(time.time() - t0, 3)
    error = f", {pre['pool_error']}" if "pool_error" in pre else ""
    note(
        f"{pre['tasks']} kernel specializations compiled in {rec.timings['gemv_precompile_s']} s "
        f"by {pre['workers']} processes ({pre['failed']} failed{error})"
    )
    rec.report["gemv_precompile"] = pre
    with _timing_lock(rec.timings):
        out = tune(problems, buckets, invariant_rows=lanes)
        torch.cuda.synchronize()
    # Rows per program per bucket, for the tiles just chosen: their compiles in a pool first
    # (the tuner's cold weight copies freed before the workers' contexts start).
    torch.cuda.empty_cache()
    t1 = time.time()
    pre_groups = precompile_groups(problems, buckets)
    rec.timings["gemv_precompile_groups_s"] = round(time.time() - t1, 3)
    rec.report["gemv_precompile_groups"] = pre_groups
    error = f", {pre_groups['pool_error']}" if "pool_error" in pre_groups else ""
    note(
        f"{pre_groups['tasks']} group-size specializations compiled in "
        f"{rec.timings['gemv_precompile_groups_s']} s by {pre_groups['workers']} processes "
        f"({pre_groups['failed']} failed{error})"
    )
    with _timing_lock(rec.timings):
        for name, groups in tune_groups(problems, buckets).items():
            out[name]["group_rows"] = groups
        torch.cuda.synchronize()
    torch.cuda.empty_cache()
    rec.timings["gemv_tune_s"] = round(time.time() - t0, 3)
    for name, r in out.items():
        note(f"gemv {name} {r['shape']}: {r['config']}, {r['weight_gb_per_s']} GB/s at {r['rows']} row(s)")
        for m, g in r.get("group_rows", {}).items():
            note(f"gemv {name} at {m} rows: {g['rows_per_program']} per program (us per layer {g['us_per_layer']})")
    return out


def _reset_launch_settings() -> None:
    """Plain launches everywhere (module state a previous prepare in this process may have
    set): only `--pdl auto`'s tuning changes them."""
    from ignition.capture import attention
    from ignition.capture.gemv import clear_launch_modes

    clear_launch_modes()
    attention.PDL = False


def _tune_launch(rec: Any) -> dict[str, Any]:
    """Picks each projection's launch mode (`gemv.tune_launch`) by timing the compiled decode
    step of the smallest bucket (`Recorder.time_graph`) with the decode attention kernels as
    programmatic dependents (their wait and early trigger let the next projection prefetch).
    Then keeps attention so only if the step is faster so, and keeps any of it only if the step
    beats plain launches by `LAUNCH_MIN_GAIN`."""
    import torch

    from ignition.capture import attention
    from ignition.capture.gemv import LAUNCH_MIN_GAIN, tune_launch

    step = min((g for g in rec.graphs if g.kind == "decode"), key=lambda g: g.request_count)
    t0 = time.time()
    with _timing_lock(rec.timings):
        _reset_launch_settings()
        plain_ms = rec.time_graph(step.name)
        attention.PDL = True
        problems = rec.program.model.projection_problems()
        out = tune_launch(problems, step.request_count, step_ms=lambda: rec.time_graph(step.name))
        with_attention = rec.time_graph(step.name)  # the modes it chose stay registered
        attention.PDL = False
        without = rec.time_graph(step.name)
        attention.PDL = with_attention < without
        best = min(with_attention, without)
        if best >= plain_ms * (1 - LAUNCH_MIN_GAIN):  # nothing pays: every launch plain
            _reset_launch_settings()
            out["chosen"], best = {}, plain_ms
        out["kept"] = bool(out["chosen"]) or attention.PDL
    torch.cuda.empty_cache()  # the trial graphs' pools (`time_graph` synchronized each)
    out |= {"graph": step.name, "step_plain_ms": round(plain_ms, 4), "step_chosen_ms": round(best, 4)}
    out |= {"attention_pdl": attention.PDL, "step_with_attention_pdl_ms": round(with_attention, 4)}
    out["step_without_attention_pdl_ms"] = round(without, 4)
    rec.timings["pdl_tune_s"] = round(time.time() - t0, 3)
    chosen = ", ".join(f"{k} {v['pdl']}/{v['pf_k']}" for k, v in out["chosen"].items()) or "plain launches"
    note(
        f"launch modes: {chosen}, attention PDL {attention.PDL} ({step.name}: {best:.4f} ms against "
        f"{plain_ms:.4f} ms plain, {len(out.get('trials', []))} trials)"
    )
    return out


def _tune_attention(rec: Any, buckets: list[int]) -> dict[str, Any]:
    """Picks the pages each decode attention program walks (`attention_tune`) on this device,
    before capture, and prints the choice."""
    from ignition.capture import attention_tune

    model = rec.program.model
    g = model.geo
    t0 = time.time()
    with _timing_lock(rec.timings):
        out = attention_tune.tune(
            g.heads, g.kv_heads, g.head_dim, g.page_tokens, g.pages_per_request, g.kv_layers, buckets,
            model.rope_in_attention,
        )  # fmt: skip
    rec.timings["attention_tune_s"] = round(time.time() - t0, 3)
    note(f"attention: {out['pages_per_split']} page(s) per decode program ({out['splits']} groups per table)")
    return out


def _speculative_check(runner: Any, gens: list[dict[str, Any]]) -> dict[str, Any]:
    """Each reference generation again through the speculative programs, proposing its own
    continuation (every proposal right) and with every third position wrong (device-fed): the
    tokens must be the same; the rounds taken show what verification saves when proposals are."""
    from ignition.capture.runner import Sampling
    from ignition.core.stepping import replaying

    vocab = runner.p.geo.vocab
    same, rounds = [], {"tokens": 0, "right": 0, "one_in_three_wrong": 0}
    per_prompt = []
    for g in gens:
        s, toks = Sampling(**g.get("params", {})), g["tokens"]
        args = (g["prompt_ids"], g["seed"], s, g["max_tokens"])
        right, n_right = runner.generate_speculative(*args, replaying(toks))
        wrong, n_wrong = runner.generate_speculative(*args, replaying(toks, 3, vocab), device_fed=True)
        same.append(right == toks and wrong == toks)
        rounds["tokens"] += len(toks) - 1
        rounds["right"] += n_right
        rounds["one_in_three_wrong"] += n_wrong
        first = next((i for i, (a, b) in enumerate(zip(right, toks, strict=False)) if a != b), None)
        per_prompt.append({"identical": same[-1], "right_rounds": n_right, "right_first_difference": first})
    out = {
        "identical": f"{sum(same)}/{len(same)}",
        "depth": runner.verify_depth(1),
        "decode_rounds": rounds,
        "per_prompt": per_prompt,
        "lanes_against_decode": _lanes_against_decode(runner, gens[0]),
    }
    note(
        f"speculative generation identical to decoding: {out['identical']}; {rounds['tokens']} decoded tokens in "
        f"{rounds['right']} rounds (proposals right), {rounds['one_in_three_wrong']} (one in three wrong)"
    )
    return out


def _state_restorer(p: Any) -> Callable[[], None]:
    """Copies the program's request state (KV, rows, histograms, pending tokens) now; the
    returned function puts it back, so the lane checks replay several graphs from one state."""
    state = (p.kv_all, p.rows, p.hist, p.pending)
    saved = [t.clone() for t in state]

    def restore() -> None:
        for t, v in zip(state, saved, strict=True):
            t.copy_(v)

    return restore


def _lanes_against_decode(runner: Any, gen: dict[str, Any]) -> dict[str, Any]:
    """From one state, two decode steps of a generation's next tokens, then one speculative
    round consuming the same two tokens: each lane's hidden vector against the decode step's at
    that position (bitwise, and the largest difference), the tokens each sampled, and whether
    the live row (a hybrid's recurrent state committed from its column included) is bitwise
    what the decode steps left."""
    import torch

    from ignition.capture.runner import Row, Sampling
    from ignition.core.stepping import admit

    p = runner.p
    prompt, toks, seed = gen["prompt_ids"], gen["tokens"], gen["seed"]
    s = Sampling(**gen.get("params", {}))
    pages = list(range(-(-(len(prompt) + 16) // runner.page_tokens)))
    admit(runner, 1, pages, prompt, seed, s)
    restore = _state_restorer(p)
    start = len(prompt)
    decoded = []
    for i in range(2):
        g = runner.decode_graph(1)
        h, rec = runner.replay(g, [Row(1, pages, start + i, [toks[i]], (seed, 1 + i), s)])
        decoded.append((h[0].float(), rec[0][runner.header_words]))
    row_after = p.rows[1].clone()
    restore()
    g = runner.verify_graph([Row(1, pages, start, [toks[0], toks[1]], (seed, 1), s)])
    h, rec = runner.replay(g, [Row(1, pages, start, [toks[0], toks[1]], (seed, 1), s)])
    lanes = []
    for i, (hd, td) in enumerate(decoded):
        hv = h[i].float()
        lanes.append({"bitwise": bool(torch.equal(hv, hd)), "max_abs_diff": float((hv - hd).abs().max())})
        lanes[-1]["decode_token"] = td
    live_row = bool(torch.equal(p.rows[1], row_after))
    return {"graph": g.name, "lanes": lanes, "record": rec[0][: runner.header_words + 2], "live_row_bitwise": live_row}


def _batched_against_alone(runner: Any, gen: dict[str, Any]) -> dict[str, Any]:
    """One request's step in every decode bucket and speculative program, batched behind other
    requests (other prompts, other states, the earlier slots), against the same step alone in
    the smallest decode bucket: its hidden vector bitwise (and the largest difference), per
    graph. The serving loop batches whatever requests are running, so a request's tokens equal
    its solo run, and speculation's with top_k = 1 equal decoding's, only where this holds."""
    import torch

    from ignition.capture.runner import Row, Sampling
    from ignition.core.stepping import admit

    p = runner.p
    geo = p.geo
    prompt, toks, seed = gen["prompt_ids"], gen["tokens"], gen["seed"]
    s = Sampling(**gen.get("params", {}))
    most = max(g.request_count for g in [*runner.decode, *runner.verify])
    per = -(-(len(prompt) + 16) // runner.page_tokens)
    requests = []  # (live row, pages, start, first token); the checked request last
    for k in range(most):
        # The neighbours' prompts: the request's rotated (same length, other tokens and states).
        own = prompt if k == most - 1 else prompt[k + 1 :] + prompt[: k + 1]
        live, pages = geo.live_row(k), list(range(k * per, (k + 1) * per))
        first = admit(runner, live, pages, own, seed + k, s)
        requests.append((live, pages, len(own), toks[0] if k == most - 1 else first))
    restore = _state_restorer(p)

    def row(k: int, lanes: int) -> Row:
        live, pages, start, first = requests[k]
        tokens = toks[:lanes] if k == most - 1 else [first] * lanes
        return Row(live, pages, start, tokens, (seed + k, 1), s)

    alone = []
    for i in range(2):  # the request's next two steps alone (the speculative lanes' references)
        h, _ = runner.replay(
            runner.decode_graph(1),
            [Row(*requests[-1][:2], requests[-1][2] + i, [toks[i]], (seed + most - 1, 1 + i), s)],
        )
        alone.append(h[0].float())
    restore()
    out: dict[str, Any] = {}
    for g in runner.decode[1:]:
        b = g.request_count
        h, _ = runner.replay(g, [row(k, 1) for k in range(most - b, most)])
        hv = h[b - 1].float()
        out[g.name] = {"bitwise": bool(torch.equal(hv, alone[0])), "max_abs_diff": float((hv - alone[0]).abs().max())}
        restore()
    for g in runner.verify:
        b, w = g.request_count, g.proposal_depth + 1
        h, _ = runner.replay(g, [row(k, 2) for k in range(most - b, most)])
        lanes = [h[(b - 1) * w + i].float() for i in range(2)]
        out[g.name] = {
            "bitwise": all(bool(torch.equal(a, c)) for a, c in zip(lanes, alone, strict=True)),
            "max_abs_diff": max(float((a - c).abs().max()) for a, c in zip(lanes, alone, strict=True)),
        }
        restore()
    return {"graphs": out, "all_bitwise": all(v["bitwise"] for v in out.values())}


def _torch_dtype(name: str) -> Any:
    import torch

    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[name]


def _check(
    rec: Any,
    model: Path,
    core: Path,
    work: Path,
    core_replay: Path | None,
    report: dict[str, Any],
    reference_prompts: Path | None,
    dump_io: bool = False,
) -> None:
    import torch

    from ignition.capture.numerics import teacher_forced, transformers_reference
    from ignition.capture.runner import GraphRunner, Sampling

    runner = GraphRunner(rec.program)
    with phase("teacher-forced logits against Transformers"):
        hf, ref = transformers_reference(str(model))
        report["numerics"] = teacher_forced(runner, ref)
        note(
            f"worst rel L2 {report['numerics']['worst_rel_l2']:.4f}, "
            f"min top-10 overlap {report['numerics']['min_top10_overlap']:.2f}"
        )
        del hf
        torch.cuda.empty_cache()
    if reference_prompts is not None:
        with phase("reference generations through the torch replay"):
            gens, fed = [], []
            for p in json.loads(reference_prompts.read_text()):
                s = Sampling(**p.get("params", {}))
                t0 = time.time()
                toks = runner.generate(p["prompt_ids"], p["seed"], s, p["max_tokens"])
                gens.append({**p, "tokens": toks, "wall_s": round(time.time() - t0, 4)})
                # Again with every decode input taken from the pending token on the device.
                fed.append(runner.generate(p["prompt_ids"], p["seed"], s, p["max_tokens"], device_fed=True) == toks)
            report["reference_generations"] = gens
            report["device_fed_identical"] = f"{sum(fed)}/{len(fed)}"
            note(f"device-fed decode identical to host-fed: {report['device_fed_identical']}")
            if runner.verify:
                report["speculative"] = _speculative_check(runner, gens)
            two = next((g for g in gens if len(g["tokens"]) >= 2), None)  # two steps to compare
            if two is not None and (len(runner.decode) > 1 or runner.verify):
                report["batched_against_alone"] = _batched_against_alone(runner, two)
                note(f"a request batched behind others, bitwise its step alone: {report['batched_against_alone']}")
            (work / "reference_generations.json").write_text(json.dumps(gens) + "\n")
    with phase("exactness: snapshot and restore, a reused row, split against whole prefill"):
        from ignition.capture.exactness import check as exactness

        report["exactness"] = exactness(runner)
        note(
            f"restore bitwise {report['exactness'].get('restore_bitwise')}, into a reused row "
            f"{report['exactness'].get('restore_into_reused_row_bitwise')}"
        )
    with phase("torch replay: determinism, poisoned pool, graph vs eager, replay time"):
        # The I/O of these graphs is dumped for the fresh-process replay (every state buffer, twice).
        # `dump_io` alone dumps for a later run (qualification/rust_replay_io.py), not timed here.
        wanted = core_replay is not None or dump_io
        dump = [g.name for g in rec.graphs if g.kind != "prefill"] + [runner.prefill[0].name] if wanted else []
        rec.reference(work / "io", timed=50, graphs=dump)
        report["torch_replay"] = rec.report.pop("torch_replay")
    if core_replay is not None:
        with phase("bitwise replay of each dumped graph in a fresh process (Rust core_replay)"):
            from ignition.capture.rust_replay import replay_in_rust

            report["rust_replay"] = {}
            for name in dump:
                for relocate in (False, True):
                    key = name + (" relocated" if relocate else "")
                    r = replay_in_rust(core_replay, core, work / "io", work, name, 20, relocate)
                    report["rust_replay"][key] = r
                    note(f"{key}: bitwise_equal={r.get('bitwise_equal')}")
            report["bitwise_equal_all"] = all(r.get("bitwise_equal", False) for r in report["rust_replay"].values())


def _model_type(config: dict[str, Any]) -> str:
    """The model_type of the first architecture a recipe claims (config.json may omit it)."""
    recipe = recipe_for(config)
    arch = next(a for a in config.get("architectures") or () if a in recipe.architectures)
    return recipe.architectures[arch]


def make_random_checkpoint(config: dict[str, Any], out: Path, seed: int, tokenizer_from: Path) -> Path:
    """A seeded random-weight checkpoint of `config` (Transformers' own initialization), with the
    tokenizer and template of `tokenizer_from`; for numerics and timing at sizes we cannot ship."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    cfg = transformers.AutoConfig.for_model(
        config.get("model_type") or _model_type(config), **{k: v for k, v in config.items() if k != "model_type"}
    )
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.save_pretrained(str(out))
    for f in ("tokenizer.json", "chat_template.jinja", "special_tokens.json", "tokenizer_config.json"):
        if (tokenizer_from / f).is_file():
            shutil.copy(tokenizer_from / f, out / f)
    del m
    return out
