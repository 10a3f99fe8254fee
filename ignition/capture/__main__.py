"""Capture → record → export → (optionally) replay in Rust and compare bitwise.

    python -m ignition.capture --out DIR [--core-replay BIN] [--repeat N]

Writes DIR/recording/ (the recorded-graph JSON, weights, kernel images), DIR/core/ (the runtime
core), DIR/io/<graph>/ (torch's input and output bytes) and DIR/report.json. With --core-replay,
each graph is replayed by that binary in a fresh process (at the recorded base, then forced to
relocate) and its output bytes are compared with torch's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _compare(a: bytes, b: bytes, elem: int) -> dict[str, Any]:
    n = min(len(a), len(b))
    diff_bytes = sum(1 for x, y in zip(a[:n], b[:n], strict=True) if x != y)
    diff_elems = sum(1 for i in range(0, n, elem) if a[i : i + elem] != b[i : i + elem])
    return {"bytes": len(a), "rust_bytes": len(b), "equal": a == b, "differing_bytes": diff_bytes,
            "elements": n // elem, "differing_elements": diff_elems}  # fmt: skip


def replay_in_rust(binary: Path, core: Path, io: Path, out: Path, graph: str, repeat: int, relocate: bool) -> dict[str, Any]:
    gdir = io / graph
    rdir = out / ("rust_reloc" if relocate else "rust") / graph
    rdir.mkdir(parents=True, exist_ok=True)
    cmd = [str(binary), str(core), "--graph", graph, "--repeat", str(repeat)]
    for f in sorted(gdir.glob("in.*.bin")):
        cmd += ["--write", f"{f.name[3:-4]}={f}"]
    outs = sorted(gdir.glob("out.*.bin"))
    for f in outs:
        cmd += ["--read", f"{f.name[4:-4]}={rdir / f.name}"]
    if relocate:
        cmd.append("--relocate")
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    res: dict[str, Any] = {"command": " ".join(cmd[:4]) + " ... (" + str(len(cmd)) + " args)", "rc": p.returncode,
                           "wall_s": round(time.time() - t0, 3), "stderr": p.stderr[-2000:]}  # fmt: skip
    try:
        res["report"] = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        res["stdout"] = p.stdout[-2000:]
    if p.returncode == 0:
        cmp = {}
        for f in outs:
            name = f.name[4:-4]
            elem = 2 if name.endswith(("logits", "kv_pages")) else 4
            got = (rdir / f.name).read_bytes() if (rdir / f.name).is_file() else b""
            cmp[name] = _compare(f.read_bytes(), got, elem)
        res["compare"] = cmp
        res["bitwise_equal"] = all(c["equal"] for c in cmp.values())
    return res


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m ignition.capture", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--core-replay", type=Path, help="the Rust core_replay binary")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--base", type=lambda s: int(s, 0), default=None)
    ap.add_argument("--diagnose", action="store_true",
                    help="also replay in Rust with every graph-pool/scratch buffer preloaded as torch had it")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(args.out / "triton_cache"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(args.out / "inductor_cache"))

    import torch

    from ignition.capture.arena import DEFAULT_BASE
    from ignition.capture.model import TinyConfig
    from ignition.capture.recorder import Recorder
    from ignition.export.errors import ExportError
    from ignition.export.exporter import export_recording

    rec = Recorder(args.out, TinyConfig(), base=args.base or DEFAULT_BASE)
    report = rec.report
    report["commands"] = {"capture": " ".join(sys.argv)}
    path = args.out / "report.json"

    def save() -> None:
        report["timings"] = rec.timings
        path.write_text(json.dumps(report, indent=1, default=str) + "\n")

    t_all = time.time()
    stage = "prepare"
    try:
        rec.prepare()
        stage = "compile_and_capture"
        rec.compile_and_capture()
        stage = "record"
        recording = rec.record()
        stage = "reference"
        rec.reference(args.out / "io", timed=args.repeat, full_io_dir=args.out / "io_full" if args.diagnose else None)
        report["peak_gpu_memory"] = {
            "torch_max_allocated_bytes": torch.cuda.max_memory_allocated(),
            "torch_max_reserved_bytes": torch.cuda.max_memory_reserved(),
            "arena_used_bytes": rec.arena.used,
            "device_used_bytes_now": (lambda f: f[1] - f[0])(torch.cuda.mem_get_info()),
        }
        stage = "export"
        t0 = time.time()
        msgs: list[str] = []
        core = export_recording(recording, args.out / "core", progress=lambda m: (msgs.append(m), print(m)))
        rec.timings["export_s"] = round(time.time() - t0, 3)
        relocs = {g.name: sum(len(getattr(n.op, "relocations", ())) for n in g.nodes) for g in core.graphs}
        report["export"] = {"ok": True, "kernels": len(core.kernels), "buffers": len(core.buffers),
                            "pointer_words_relocated": relocs, "progress": msgs}  # fmt: skip
    except ExportError as e:
        report["export"] = {"ok": False, "error_type": type(e).__name__, "error": str(e)}
        save()
        print(f"export failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    except Exception as e:  # noqa: BLE001 - the report must say where it broke
        report["failed_stage"] = stage
        report["error"] = repr(e)
        report["traceback"] = traceback.format_exc()[-4000:]
        save()
        traceback.print_exc()
        return 1
    rec.timings["prepare_total_s"] = round(time.time() - t_all, 3)
    save()
    if args.core_replay:
        # Each replay is a fresh process with its own address space: it can map the recorded base
        # while this process still holds it.
        report["rust_replay"] = {}
        for g in rec.graphs:
            for relocate in (False, True):
                key = g.name + (" relocated" if relocate else "")
                report["rust_replay"][key] = replay_in_rust(args.core_replay, args.out / "core", args.out / "io",
                                                            args.out, g.name, args.repeat, relocate)  # fmt: skip
        if args.diagnose:
            for g in rec.graphs:
                report["rust_replay"][g.name + " again"] = replay_in_rust(
                    args.core_replay, args.out / "core", args.out / "io", args.out / "again", g.name, 0, False)
                report["rust_replay"][g.name + " preloaded pool"] = replay_in_rust(
                    args.core_replay, args.out / "core", args.out / "io_full", args.out / "full", g.name, 0, False)
        report["bitwise_equal_all"] = all(r.get("bitwise_equal", False) for r in report["rust_replay"].values())
        save()
    print(json.dumps({k: report.get(k) for k in ("timings", "graphs", "kernels", "export", "bitwise_equal_all")},
                     default=str)[:4000])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
