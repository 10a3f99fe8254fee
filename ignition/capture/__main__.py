"""Capture qualification: `ignition prepare` on a seeded random tiny Llama, then each graph's
I/O replayed in Rust (fresh process, at the recorded base and relocated) and compared bitwise.

    python -m ignition.capture --out DIR [--core-replay BIN]

Writes DIR/checkpoint/, DIR/core/ (the runtime core), DIR/core.work/ (recording, torch's I/O
bytes per graph, report.json) and DIR/core.report.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
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


TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 2048, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "eos_token_id": 1}  # fmt: skip
TOKENIZER = '{"version":"1.0","model":{"type":"WordLevel","vocab":{"<unk>":0,"<eos>":1},"unk_token":"<unk>"}}'


def main() -> int:
    """The capture qualification on a seeded random tiny Llama: `ignition prepare` with every
    check, and every graph's I/O replayed bitwise in Rust."""
    ap = argparse.ArgumentParser(prog="python -m ignition.capture", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--core-replay", type=Path, help="the Rust core_replay binary")
    args = ap.parse_args()
    from ignition.prepare import make_random_checkpoint, prepare

    tok = args.out / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    (tok / "tokenizer.json").write_text(TOKENIZER)
    (tok / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    ckpt = make_random_checkpoint(TINY, args.out / "checkpoint", 0, tok)
    report = prepare(ckpt, args.out / "core", decode_buckets="1,4", prefill_chunk=128, context_limit=256,
                     core_replay=args.core_replay, served_name="tiny-llama-paged")  # fmt: skip
    print(json.dumps({k: report.get(k) for k in ("timings", "export", "bitwise_equal_all")}, default=str))
    return 0 if report.get("bitwise_equal_all", args.core_replay is None) else 1


if __name__ == "__main__":
    sys.exit(main())
