#!/usr/bin/env python3
"""Python counterpart of benches/frontend.rs: Transformers render + tokenize of the same
200-message agent conversation (qwen_style template, SmolLM2 tokenizer)."""
import json
import time
from pathlib import Path

from transformers import PreTrainedTokenizerFast

FIX = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "frontend"
PARA = "The agent inspects the repository, reads configuration files, runs the test-suite and reports findings — including Unicode like naïve café, 東京, and emoji 🚀✅. "


def conversation():
    tools = [{"type": "function", "function": {"name": "run", "description": "Run a shell command.",
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]
    msgs = [{"role": "system", "content": "You are a coding agent."}]
    i = 0
    while len(msgs) < 200:
        msgs.append({"role": "user", "content": f"Step {i}: " + PARA * 4})
        msgs.append({"role": "assistant", "content": PARA * 3, "tool_calls": [
            {"type": "function", "function": {"name": "run", "arguments": {"cmd": f"cargo test --step {i}"}}}]})
        msgs.append({"role": "tool", "content": PARA * 5})
        msgs.append({"role": "assistant", "content": f"Done with step {i}. " + PARA})
        i += 1
    return msgs[:200], tools


def main():
    tok = PreTrainedTokenizerFast(tokenizer_file=str(FIX / "smollm2" / "tokenizer.json"))
    tmpl = (FIX / "qwen_style" / "chat_template.jinja").read_text()
    msgs, tools = conversation()

    def once():
        text = tok.apply_chat_template(msgs, tools=tools, chat_template=tmpl, tokenize=False, add_generation_prompt=True)
        return text, tok(text, add_special_tokens=False)["input_ids"]

    text, ids = once()
    print(f"agent conversation: 200 messages, {len(text.encode())} bytes, {len(ids)} tokens")
    for _ in range(3):
        once()
    runs = 20
    t0 = time.perf_counter()
    for _ in range(runs):
        once()
    dt = (time.perf_counter() - t0) / runs
    print(f"transformers render+tokenize: {dt * 1e3:.2f} ms/iter")


if __name__ == "__main__":
    main()
