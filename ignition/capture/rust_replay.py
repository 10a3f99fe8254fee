"""Replays one graph of a core in a fresh process through the Rust `core_replay` example and
compares its output bytes with torch's (the I/O files `Recorder.reference` dumped)."""

from __future__ import annotations

import json
import subprocess
import time
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
            elem = 2 if name.endswith(("output", "kv_pages", "continuation_rows")) else 4
            got = (rdir / f.name).read_bytes() if (rdir / f.name).is_file() else b""
            cmp[name] = _compare(f.read_bytes(), got, elem)
        res["compare"] = cmp
        res["bitwise_equal"] = all(c["equal"] for c in cmp.values())
    return res
