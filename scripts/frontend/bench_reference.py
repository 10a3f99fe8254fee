#!/usr/bin/env python3
"""Python counterpart of crates/helios-frontend/{benches/frontend.rs,examples/frontend_vs_transformers.rs}:
Transformers render + tokenize of the same 200-message agent conversation (qwen_style template,
SmolLM2 tokenizer).

  cold: the HF tokenizer's internal BPE word cache is cleared before every iteration
        (`tokenizer.model._clear_cache()`), so each iteration is a first-request cost.
        The compiled Jinja template stays cached (Transformers keeps it across calls), as the
        compiled template does on the Rust side.
  warm: repeated identical requests; the BPE word cache stays warm across iterations.

With --json prints one JSON line (bytes, tokens, ids_fnv, cold_ms, warm_ms: medians) for the
Rust example, which runs this script in the same run and prints the ratios.
"""

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

FIX = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "frontend"
PARA = (
    "The agent inspects the repository, reads configuration files, runs the test-suite and reports findings"
    " — including Unicode like naïve café, 東京, and emoji 🚀✅. "
)


def conversation() -> tuple[list[dict[str, Any]], list[Any]]:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "run",
                "description": "Run a shell command.",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
            },
        }
    ]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    i = 0
    while len(msgs) < 200:
        msgs.append({"role": "user", "content": f"Step {i}: " + PARA * 4})
        msgs.append(
            {
                "role": "assistant",
                "content": PARA * 3,
                "tool_calls": [
                    {"type": "function", "function": {"name": "run", "arguments": {"cmd": f"cargo test --step {i}"}}}
                ],
            }
        )
        msgs.append({"role": "tool", "content": PARA * 5})
        msgs.append({"role": "assistant", "content": f"Done with step {i}. " + PARA})
        i += 1
    return msgs[:200], tools


def fnv1a(ids: list[int]) -> int:
    """64-bit FNV-1a over the ids as little-endian u32 (same as the Rust example)."""
    h = 0xCBF29CE484222325
    for i in ids:
        for b in int(i).to_bytes(4, "little"):
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def main() -> None:
    as_json = "--json" in sys.argv[1:]
    runs = 20
    for a in sys.argv[1:]:
        if a.startswith("--runs="):
            runs = int(a.split("=", 1)[1])
    tok = PreTrainedTokenizerFast(tokenizer_file=str(FIX / "smollm2" / "tokenizer.json"))
    tmpl = (FIX / "qwen_style" / "chat_template.jinja").read_text()
    msgs, tools = conversation()

    def once() -> tuple[str, list[int]]:
        text = tok.apply_chat_template(
            msgs, tools=tools, chat_template=tmpl, tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str)
        return text, tok(text, add_special_tokens=False)["input_ids"]

    def timed(clear: bool) -> float:
        times = []
        for _ in range(runs):
            if clear:
                tok.backend_tokenizer.model._clear_cache()
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    text, ids = once()
    for _ in range(3):
        once()
    cold = timed(True)
    warm = timed(False)
    if as_json:
        print(
            json.dumps(
                {
                    "bytes": len(text.encode()),
                    "tokens": len(ids),
                    "ids_fnv": fnv1a(ids),
                    "cold_ms": cold,
                    "warm_ms": warm,
                    "runs": runs,
                }
            )
        )
        return
    print(f"agent conversation: 200 messages, {len(text.encode())} bytes, {len(ids)} tokens")
    print(f"transformers render+tokenize cold (BPE cache cleared each iter): {cold:.2f} ms/iter (median of {runs})")
    print(f"transformers render+tokenize warm: {warm:.2f} ms/iter (median of {runs})")


if __name__ == "__main__":
    main()
