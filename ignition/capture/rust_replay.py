"""Replays one graph of a core in a fresh process through the Rust `core_replay` example and
compares its output bytes with torch's (the I/O files `Recorder.reference` dumped)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any


def _compare(a: bytes, b: bytes, elem: int) -> dict[str, Any]:
    """Byte and element differences (numpy: the KV dumps are hundreds of MiB)."""
    import numpy as np

    n = min(len(a), len(b)) // elem * elem
    x = np.frombuffer(a, dtype=np.uint8, count=n)
    y = np.frombuffer(b, dtype=np.uint8, count=n)
    diff = x != y
    diff_elems = int(diff.reshape(-1, elem).any(1).sum()) if n else 0
    return {
        "bytes": len(a),
        "rust_bytes": len(b),
        "equal": a == b,
        "differing_bytes": int(diff.sum()),
        "elements": n // elem,
        "differing_elements": diff_elems,
    }


def replay_in_rust(
    binary: Path, core: Path, io: Path, out: Path, graph: str, repeat: int, relocate: bool
) -> dict[str, Any]:
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
    res: dict[str, Any] = {
        "command": " ".join(cmd[:4]) + " ... (" + str(len(cmd)) + " args)",
        "rc": p.returncode,
        "wall_s": round(time.time() - t0, 3),
        "stderr": p.stderr[-2000:],
    }
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
