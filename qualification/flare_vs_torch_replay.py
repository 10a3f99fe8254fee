"""GPU machine: `flare run CORE` (native replay) against the torch replay of the same graphs.

    python3 qualification/flare_vs_torch_replay.py --flare BIN --core CORE --reference GENS.json --out OUT.json

GENS.json is what `ignition prepare --reference-prompts` wrote: per prompt its text, token ids,
seed, sampling parameters and the tokens the in-process torch replay sampled. Each prompt is sent
to /v1/completions twice (cold, then as a full prefix hit, which resumes from the saved hidden
vector) and the returned text is compared with the reference tokens' decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flare", required=True)
    ap.add_argument("--core", required=True, type=Path)
    ap.add_argument("--reference", type=Path, help="without it: no token comparison, only the bench")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--bench", action="store_true", help="also run `flare bench` against the server")
    ap.add_argument("--bench-timeout", type=int, default=150)
    ap.add_argument("--agent-turns", type=int, default=4, help="turns of the bench's agent conversation")
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--log", type=Path, default=Path("/tmp/flare_run.log"))
    ap.add_argument("--run-arg", action="append", default=[], help="extra `flare run` argument (repeatable)")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.tokenizer or args.core / "tokenizer.json"))
    gens = json.loads(args.reference.read_text()) if args.reference else []
    t0 = time.time()
    log = args.log.open("w")
    cmd = [args.flare, "run", str(args.core), "--port", str(args.port), *args.run_arg]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{args.port}"
    report: dict[str, Any] = {"command": " ".join(cmd)}
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"flare run exited with {server.returncode}: {args.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
            if time.time() - t0 > 240:
                raise RuntimeError("flare run not ready within 240 s")
        report["ready_s"] = round(time.time() - t0, 2)
        model = json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["id"]
        results = []
        for g in gens:
            ids = post(base + "/tokenize", {"model": model, "prompt": g["text"], "add_special_tokens": False})["tokens"]
            body = {
                "model": model,
                "prompt": g["text"],
                "max_tokens": g["max_tokens"],
                "seed": g["seed"],
                **g.get("params", {}),
            }
            ref = [t for t in g["tokens"] if t not in g["eos"]]
            want = {tok.decode(ref, skip_special_tokens=False), tok.decode(ref, skip_special_tokens=True)}
            entry = {
                "text": g["text"][:60],
                "prompt_ids_equal": ids == g["prompt_ids"],
                "reference_tokens": len(g["tokens"]),
            }
            for attempt in ("cold", "prefix_hit"):
                t1 = time.time()
                r = post(base + "/v1/completions", body)
                text = r["choices"][0]["text"]
                entry[attempt] = {
                    "text_equal": text in want,
                    "completion_tokens": r["usage"]["completion_tokens"],
                    "cached_tokens": r["usage"].get("prompt_tokens_details", {}).get("cached_tokens"),
                    "finish_reason": r["choices"][0]["finish_reason"],
                    "wall_s": round(time.time() - t1, 4),
                }
                if text not in want:
                    entry[attempt]["got"] = text[:200]
                    entry[attempt]["want"] = sorted(want)[0][:200]
            results.append(entry)
        report["prompts"] = results
        report["all_cold_equal"] = all(e["cold"]["text_equal"] and e["prompt_ids_equal"] for e in results)
        report["all_prefix_hit_equal"] = all(e["prefix_hit"]["text_equal"] for e in results)
        if args.bench:
            t1 = time.time()
            try:
                p = subprocess.run(
                    [
                        args.flare,
                        "bench",
                        "--url",
                        base,
                        "--json",
                        "--cold-requests",
                        "2",
                        "--agent-turns",
                        str(args.agent_turns),
                        "--decode-rounds",
                        "1",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=args.bench_timeout,
                )
                report["bench_wall_s"] = round(time.time() - t1, 1)
                try:
                    report["bench"] = json.loads(p.stdout)
                except ValueError:
                    report["bench_stdout"] = p.stdout[-4000:]
                    report["bench_stderr"] = p.stderr[-4000:]
            except subprocess.TimeoutExpired:
                report["bench"] = f"timed out after {args.bench_timeout} s"
        report["metrics"] = urllib.request.urlopen(base + "/metrics").read().decode()[-6000:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        report["server_rc"] = server.returncode
        report["server_log_tail"] = args.log.read_text()[-4000:]
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report.get(k) for k in ("ready_s", "all_cold_equal", "all_prefix_hit_equal", "server_rc")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
