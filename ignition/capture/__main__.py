"""Capture qualification: `ignition prepare` on a seeded random tiny Llama, then each graph's
I/O replayed in Rust (fresh process, at the recorded base and relocated) and compared bitwise.

    python -m ignition.capture --out DIR [--core-replay BIN]

Writes DIR/checkpoint/, DIR/core/ (the runtime core), DIR/core.work/ (recording, torch's I/O
bytes per graph, report.json) and DIR/core.report.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "eos_token_id": 1,
}
TOKENIZER = '{"version":"1.0","model":{"type":"WordLevel","vocab":{"<unk>":0,"<eos>":1},"unk_token":"<unk>"}}'


def main() -> int:
    """The capture qualification on a seeded random tiny Llama: `ignition prepare` with every
    check, and every graph's I/O replayed bitwise in Rust."""
    ap = argparse.ArgumentParser(prog="python -m ignition.capture", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--core-replay", type=Path, help="the Rust core_replay binary")
    args = ap.parse_args()
    from ignition.prepare import PrepareOptions, make_random_checkpoint, prepare

    tok = args.out / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    (tok / "tokenizer.json").write_text(TOKENIZER)
    (tok / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    ckpt = make_random_checkpoint(TINY, args.out / "checkpoint", 0, tok)
    options = PrepareOptions(
        decode_buckets="1,4",
        prefill_chunk=128,
        context_limit=256,
        core_replay=args.core_replay,
        served_name="tiny-llama-paged",
    )
    report = prepare(ckpt, args.out / "core", options)
    print(json.dumps({k: report.get(k) for k in ("timings", "export", "bitwise_equal_all")}, default=str))
    return 0 if report.get("bitwise_equal_all", args.core_replay is None) else 1


if __name__ == "__main__":
    sys.exit(main())
