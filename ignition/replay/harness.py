"""`ignition replay CORE`: the minimal Python replay of a core's graphs, with no torch.

Per step it does what Helios' GraphExecutor does and nothing more: pack the rows into a host
mirror of the staging buffer (same values and padding, `ignition.core.stepping`), copy it up
through pinned memory, clear the completion records, launch the graph, copy the records back and
wait. So its tokens are the reference for the Rust replay of the same core and its step time is
the Python floor the native loop is compared with.
"""

from __future__ import annotations

import ctypes as C
import json
import math
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ignition.core.stepping import (
    Row,
    Sampling,
    StepError,
    admit,
    generate,
    histogram_chunks,
    pack_rows,
    sampled_token,
    smallest_holding,
)
from ignition.replay.core import CoreFiles, CoreReadError, GraphInfo, pack_graph
from ignition.replay.cuda import DeviceCore


class ReplayError(StepError):
    """A request or step outside what the core was prepared for."""


class CoreReplay:
    def __init__(self, core: CoreFiles, device: DeviceCore) -> None:
        self.core = core
        self.dev = device
        self.decode = core.by_kind("decode")
        self.prefill = core.by_kind("prefill")
        if not self.decode or not self.prefill:
            raise ReplayError("the core has no decode or no prefill graph")
        staging = core.buffers[core.staging]
        self.mirror = bytearray(staging.byte_size)
        self.staging_addr = core.address(device.base, core.staging)
        records = max(
            g.outputs["completion_records"].byte_len for g in core.graphs if "completion_records" in g.outputs
        )
        self.host = device.pinned(len(self.mirror) + records)
        self.steps = 0
        self.page_tokens, self.pages_per_request = core.page_tokens, core.pages_per_request
        self.context_limit, self.header_words = core.context_limit, core.header_words
        self.largest_chunk = self.prefill[-1].token_capacity

    # -- one step --------------------------------------------------------------------------------
    def _step(self, g: GraphInfo, values: dict[str, list[Any]]) -> list[list[int]]:
        pack_graph(self.core, g, values, self.mirror)
        C.memmove(self.host, bytes(self.mirror), len(self.mirror))
        self.dev.write_async(self.staging_addr, self.host, len(self.mirror))
        rec = g.outputs.get("completion_records")
        if rec is not None:
            self.dev.zero_async(self.core.address(self.dev.base, rec.buffer, rec.offset), rec.byte_len)
        self.dev.launch(g.id)
        if rec is None:
            self.dev.synchronize()
            self.steps += 1
            return []
        at = self.host + len(self.mirror)
        self.dev.read_async(at, self.core.address(self.dev.base, rec.buffer, rec.offset), rec.byte_len)
        self.dev.synchronize()
        self.steps += 1
        words = rec.unpack(C.string_at(at, rec.byte_len))
        width = rec.shape[-1]
        return [words[i : i + width] for i in range(0, len(words), width)]

    def rows_step(self, g: GraphInfo, rows: list[Row]) -> list[list[int]]:
        mask = g.inputs["grammar_mask"].count if "grammar_mask" in g.inputs else None
        return self._step(g, pack_rows(self.core.page_tokens, self.core.pages_per_request, rows, mask))

    def maintenance(self, op: str, destination: int, source: int | None = None) -> None:
        g = self.core.maintenance(op)
        if g is None:
            raise ReplayError(f"the core has no {op} graph")
        self._step(
            g,
            {
                "destination_rows": [destination],
                "source_rows": [] if source is None else [source],
                "expected_consumed": [-1],
            },
        )

    def prefill_graph(self, tokens: int) -> GraphInfo:
        return smallest_holding(self.prefill, lambda g: g.token_capacity, tokens, "prefill")

    def decode_graph(self, rows: int) -> GraphInfo:
        return smallest_holding(self.decode, lambda g: g.request_count, rows, "decode")

    def pages_for(self, request: int, tokens: int) -> list[int]:
        """Disjoint pages for request index `request` (0-based), enough for `tokens`."""
        n = math.ceil(tokens / self.core.page_tokens)
        if n > self.core.pages_per_request:
            raise ReplayError(f"{tokens} tokens exceed the context limit {self.core.context_limit}")
        first = request * self.core.pages_per_request
        if first + n > self.core.m.capacities.max_kv_pages:
            raise ReplayError(f"request {request} needs pages past max_kv_pages {self.core.m.capacities.max_kv_pages}")
        return list(range(first, first + n))

    # -- the Stepper protocol (ignition.core.stepping) ---------------------------------------
    def live_row(self, slot: int) -> int:
        """Request slot `slot`'s live row: slots own live rows x verification width rows each (a
        width of 0, in cores before ABI 2, reads as 1)."""
        scheme = self.core.m.cache_scheme
        return 1 + slot * max(1, int(scheme.live_rows_per_slot)) * max(1, int(scheme.verification_width))

    def initialize(self, live_row: int) -> None:
        self.maintenance("initialize", live_row)

    def admit_histogram(self, live_row: int, tokens: list[int]) -> None:
        g = self.core.maintenance("admit_histogram")
        if g is not None:
            for chunk in histogram_chunks(tokens, g.token_capacity):
                self._step(g, {"request_slots": [live_row], "token_ids": chunk})

    def prefill_step(self, rows: list[Row]) -> list[list[int]]:
        return self.rows_step(self.prefill_graph(sum(len(r.tokens) for r in rows)), rows)

    def decode_step(self, rows: list[Row]) -> list[list[int]]:
        return self.rows_step(self.decode_graph(len(rows)), rows)

    def generate(
        self,
        prompt: list[int],
        seed: int,
        params: Sampling,
        max_tokens: int,
        eos: tuple[int, ...] | None = None,
        live_row: int = 1,
        device_fed: bool = False,
    ) -> list[int]:
        """One request alone, exactly as `GraphRunner.generate` (the torch replay) runs it."""
        if device_fed and not self.core.device_fed:
            raise ReplayError("the core's decode graphs do not read pending tokens: no device-fed decode")
        eos = self.core.eos_token_ids if eos is None else eos
        return generate(self, prompt, seed, params, max_tokens, eos, live_row, device_fed=device_fed)

    # -- the floor -------------------------------------------------------------------------------
    def bench_decode(self, rows: int, tokens: int, prompt_len: int = 32) -> dict[str, Any]:
        """`rows` requests decoding `tokens` steps together in the smallest bucket that holds them:
        per-step wall time (pack + upload + replay + records + wait) and back-to-back replay time."""
        slots = self.core.m.capacities.request_slots
        if rows > slots:
            raise ReplayError(f"{rows} rows exceed {slots} request slots")
        g = self.decode_graph(rows)
        reqs: list[tuple[int, list[int], list[int]]] = []  # (row, pages, tokens so far)
        for j in range(rows):
            prompt = [(7 + 13 * j + 5 * i) % 1000 + 10 for i in range(prompt_len)]
            pages = self.pages_for(j, prompt_len + tokens + 1)
            row = self.live_row(j)
            first = admit(self, row, pages, prompt, 99 + j, Sampling())
            reqs.append((row, pages, [first]))
        step_us = []
        for _ in range(tokens):
            batch = [Row(r, p, prompt_len + len(t) - 1, [t[-1]], (99 + r, len(t))) for r, p, t in reqs]
            t0 = time.perf_counter()
            rec = self.rows_step(g, batch)
            step_us.append((time.perf_counter() - t0) * 1e6)
            for (_, _, t), r in zip(reqs, rec, strict=False):  # rec has a row per bucket slot
                t.append(sampled_token(r, self.header_words))
        n = 100
        t0 = time.perf_counter()
        for _ in range(n):
            self.dev.launch(g.id)
        self.dev.synchronize()
        replay_us = (time.perf_counter() - t0) / n * 1e6
        step_us.sort()
        return {
            "graph": g.name,
            "rows": rows,
            "steps": tokens,
            "step_us_median": round(statistics.median(step_us), 1),
            "step_us_p99": round(step_us[int(0.99 * (len(step_us) - 1))], 1),
            "tokens_per_s": round(rows * 1e6 / statistics.median(step_us), 1),
            "back_to_back_replay_us": round(replay_us, 1),
            "host_overhead_us": round(statistics.median(step_us) - replay_us, 1),
        }

    def bench_prefill(self, repeats: int = 5) -> dict[str, Any]:
        """One full chunk of the largest prefill graph per step, fresh request each time."""
        g = self.prefill[-1]
        cap = g.token_capacity
        times = []
        for i in range(repeats):
            prompt = [(11 * i + 3 * k) % 1000 + 10 for k in range(cap)]
            pages = self.pages_for(0, cap)
            self.initialize(1)
            t0 = time.perf_counter()
            self.rows_step(g, [Row(1, pages, 0, prompt, None)])
            times.append(time.perf_counter() - t0)
        best = min(times)
        return {
            "graph": g.name,
            "tokens": cap,
            "step_ms_min": round(best * 1e3, 3),
            "tokens_per_s": round(cap / best, 1),
        }


def _params(p: dict[str, Any]) -> Sampling:
    known = set(Sampling.__dataclass_fields__)
    unknown = set(p) - known
    if unknown:
        raise ReplayError(f"unknown sampling parameters {sorted(unknown)}")
    return Sampling(**p)


def run(
    core_dir: Path,
    prompts: Path | None,
    reference: Path | None,
    out: Path | None,
    bench: bool,
    relocate: bool,
    decode_tokens: int,
    note: Any = print,
    edges: str = "after",
) -> dict[str, Any]:
    """Loads the core, replays the prompts (and the floor with `bench`), writes the report;
    `edges`: how programmatic edges are rebuilt (`DeviceCore`)."""
    t0 = time.perf_counter()
    core = CoreFiles(core_dir)
    dev = DeviceCore(core, relocate=relocate, progress=lambda m: note(f"load: {m}"), edges=edges)
    report: dict[str, Any] = {
        "core": str(core_dir),
        "load": {**asdict(dev.report), "fixed_address_honoured": dev.report.fixed_address_honoured},
        "load_s": round(time.perf_counter() - t0, 3),
        "edges": edges,
    }
    note(
        f"loaded in {report['load_s']} s: {dev.report.graphs} graphs, {dev.report.nodes} nodes, "
        f"{dev.report.kernels} kernels, base {dev.report.base:#x} (recorded {dev.report.recorded_base:#x})"
    )
    try:
        replay = CoreReplay(core, dev)
        if reference is not None and prompts is None:
            prompts = reference
        if prompts is not None:
            gens = []
            refs = json.loads(reference.read_text()) if reference is not None else None
            for i, p in enumerate(json.loads(prompts.read_text())):
                t = time.perf_counter()
                eos = tuple(p["eos"]) if "eos" in p else None
                toks = replay.generate(
                    p["prompt_ids"], p["seed"], _params(p.get("params", {})), p["max_tokens"], eos=eos
                )
                entry: dict[str, Any] = {
                    "seed": p["seed"],
                    "prompt_tokens": len(p["prompt_ids"]),
                    "tokens": toks,
                    "wall_s": round(time.perf_counter() - t, 4),
                }
                if refs is not None:
                    entry["identical_to_reference"] = toks == refs[i]["tokens"]
                gens.append(entry)
                note(
                    f"prompt {i}: {len(toks)} tokens"
                    + (f", identical: {entry['identical_to_reference']}" if refs is not None else "")
                )
            report["generations"] = gens
            if refs is not None:
                report["identical_to_reference"] = f"{sum(g['identical_to_reference'] for g in gens)}/{len(gens)}"
            # Again in reverse order on other live rows: the graph families alternate differently
            # and every request lands in another slot; a request's tokens must not change.
            slots = core.m.capacities.request_slots
            again = []
            for i, p in reversed(list(enumerate(json.loads(prompts.read_text())))):
                eos = tuple(p["eos"]) if "eos" in p else None
                row = replay.live_row(slots - 1 - i % slots)
                toks = replay.generate(
                    p["prompt_ids"], p["seed"], _params(p.get("params", {})), p["max_tokens"], eos=eos, live_row=row
                )
                again.append(toks == gens[i]["tokens"])
            report["identical_reversed_on_other_rows"] = f"{sum(again)}/{len(again)}"
            note(f"reversed order on other rows: identical {report['identical_reversed_on_other_rows']}")
            if core.device_fed:
                # Each decode's input from the pending token the previous step stored on the device.
                fed = []
                for i, p in enumerate(json.loads(prompts.read_text())):
                    eos = tuple(p["eos"]) if "eos" in p else None
                    toks = replay.generate(
                        p["prompt_ids"],
                        p["seed"],
                        _params(p.get("params", {})),
                        p["max_tokens"],
                        eos=eos,
                        device_fed=True,
                    )
                    fed.append(toks == gens[i]["tokens"])
                report["device_fed_identical"] = f"{sum(fed)}/{len(fed)}"
                note(f"device-fed decode: identical {report['device_fed_identical']}")
        if bench:
            report["decode"] = []
            for g in replay.decode:
                rows = g.request_count
                if rows > core.m.capacities.request_slots:
                    continue
                r = replay.bench_decode(rows, decode_tokens)
                note(
                    f"decode {r['graph']}: {r['step_us_median']} us/step (p99 {r['step_us_p99']}), "
                    f"replay alone {r['back_to_back_replay_us']} us"
                )
                report["decode"].append(r)
            report["prefill"] = replay.bench_prefill()
            note(f"prefill {report['prefill']['graph']}: {report['prefill']['tokens_per_s']} tok/s")
        report["steps"] = replay.steps
    finally:
        dev.close()
    if out is not None:
        out.write_text(json.dumps(report, indent=1) + "\n")
    return report


__all__ = ["CoreReadError", "CoreReplay", "ReplayError", "run"]
