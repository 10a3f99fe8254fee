"""GPU machine: `flare run CORE` with a reserve that leaves room for only about half of the core's
KV pages, so the load-time memory plan must cut them; one completion must still be served.

    python3 qualification/partial_kv_check.py --flare BIN --core CORE --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ignition.replay.core import CoreFiles


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flare", required=True)
    ap.add_argument("--core", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--port", type=int, default=8124)
    args = ap.parse_args()
    core = CoreFiles(args.core)
    kv = next(b for b in core.m.buffers if b.name == "kv_pages" or b.role == 5)
    free_mib = int(
        subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[0]
    )
    # Usable after the reserve: the arena without half of the KV buffer (plus pinned staging slack).
    usable = core.m.arena.byte_size - kv.byte_size // 2 + (64 << 20) + (256 << 20)
    reserve_gib = max(0.0, (free_mib * 2**20 - usable) / 2**30)
    log = Path("/tmp/partial_kv_flare.log")  # its tail goes into the report
    server = subprocess.Popen(
        [args.flare, "run", str(args.core), "--port", str(args.port), "--gpu-reserve-gib", f"{reserve_gib:.3f}"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    report: dict[str, Any] = {"reserve_gib": round(reserve_gib, 3), "prepared_pages": core.m.capacities.max_kv_pages}
    try:
        base = f"http://127.0.0.1:{args.port}"
        t0 = time.time()
        while time.time() - t0 < 60:
            if server.poll() is not None:
                break
            try:
                with urllib.request.urlopen(base + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        text = log.read_text()
        m = re.search(r"kv_pages=(\d+) kv_pages_prepared=(\d+)", text)
        report["served_pages"] = int(m.group(1)) if m else None
        report["startup_rc"] = server.poll()
        if server.poll() is None:
            # The API requires the served model's name (the 2026-12-03 run sent none: 400).
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                model = json.loads(r.read())["data"][0]["id"]
            body = json.dumps(
                {"model": model, "prompt": "The three primary colors are", "max_tokens": 16, "seed": 1}
            ).encode()
            req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    out = json.loads(r.read())
                report["completion_tokens"] = out["usage"]["completion_tokens"]
            except urllib.error.HTTPError as e:
                report["completion_error"] = {"status": e.code, "body": e.read().decode(errors="replace")[:1000]}
            with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
                metrics = r.read().decode()
            report["pages_total_metric"] = next(
                (ln for ln in metrics.splitlines() if ln.startswith("flare_pages_total")), None
            )
        report["log_tail"] = text[-1500:]
    finally:
        server.terminate()
        server.wait(timeout=30)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "log_tail"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
