#!/usr/bin/env python3
"""Differential reference: Transformers' apply_chat_template + tokenization + decode.

Writes tests/fixtures/frontend/differential.json (deterministic), or with --check
regenerates in memory and exits 1 when the committed file differs.
Needs: transformers, tokenizers, jinja2 (no torch).
"""

import json
import random
import sys
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "frontend"
OUT = FIX / "differential.json"

TEMPLATES = {
    "smollm2": json.loads((FIX / "smollm2" / "tokenizer_config.json").read_text())["chat_template"],
    "qwen_style": (FIX / "qwen_style" / "chat_template.jinja").read_text(),
}
TOKENIZERS = {
    "smollm2": FIX / "smollm2" / "tokenizer.json",
    "deepseek": FIX / "deepseek" / "tokenizer.json",
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": 'City <name> & "country"'},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Web search — ünïcode 🔍",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "limit": {"type": "number"}}},
    },
}

TEXTS = [
    "Hello!",
    "Wie geht's dir? Ünïcödé ß",
    "日本語のテキストです。",
    "Emoji 🎉🌍👩‍👩‍👧 mix",
    "  leading and trailing  ",
    "line1\nline2\n\nline4",
    'tabs\tand \\ backslashes "quotes"',
    "Code: ```python\nprint('hi')\n```",
    "Ελληνικά και русский",
    "مرحبا بالعالم",
    "numbers 1234567890 3.14159",
    "<b>html-ish</b> & entities",
    "🙂",
    "x" * 50,
    "Mixed 中文 and English, ok?",
]


def tool_call(name: str, args: dict[str, Any], as_string: bool = False) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False) if as_string else args},
    }


def conversations() -> list[dict[str, Any]]:
    rng = random.Random(1234)
    convs: list[dict[str, Any]] = []
    # Plain chats.
    for i in range(14):
        msgs: list[dict[str, Any]] = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": rng.choice(TEXTS)})
        for t in range(1 + i % 4):
            msgs.append({"role": "user", "content": rng.choice(TEXTS)})
            if t < i % 4:
                msgs.append({"role": "assistant", "content": rng.choice(TEXTS)})
        convs.append({"messages": msgs, "add_generation_prompt": i % 2 == 0})
    # Continuation of a final assistant message.
    for _ in range(6):
        msgs = [
            {"role": "user", "content": rng.choice(TEXTS)},
            {"role": "assistant", "content": rng.choice(["Sure, here", "Certainly! 🎉 The", "答えは", "Step 1:"])},
        ]
        convs.append({"messages": msgs, "continue_final_message": True})
    # Tools, tool calls (single and parallel), tool results.
    for i in range(14):
        tools = [WEATHER, SEARCH] if i % 2 else [WEATHER]
        msgs = [{"role": "user", "content": rng.choice(TEXTS)}]
        calls = [tool_call("get_weather", {"city": rng.choice(["Zürich", "東京", "New York"]), "days": i})]
        if i % 3 == 0:
            calls.append(tool_call("search", {"q": rng.choice(TEXTS), "limit": 2.5}, as_string=i % 2 == 0))
        msgs.append({"role": "assistant", "content": "" if i % 2 else "Let me check.", "tool_calls": calls})
        for _ in calls:
            msgs.append({"role": "tool", "content": json.dumps({"result": rng.choice(TEXTS)}, ensure_ascii=False)})
        if i % 4 == 1:
            msgs.append({"role": "assistant", "content": rng.choice(TEXTS)})
            msgs.append({"role": "user", "content": "thanks"})
        convs.append({"messages": msgs, "tools": tools, "add_generation_prompt": True})
    # Reasoning content.
    for i in range(10):
        msgs = [
            {"role": "user", "content": rng.choice(TEXTS)},
            {"role": "assistant", "content": rng.choice(TEXTS), "reasoning_content": "I think " + rng.choice(TEXTS)},
        ]
        if i % 2:
            msgs.append({"role": "user", "content": rng.choice(TEXTS)})
        if i % 3 == 0:
            msgs[1]["content"] = "<think>\ninline reasoning 🤔\n</think>\n\n" + rng.choice(TEXTS)
            del msgs[1]["reasoning_content"]
        extra = {"enable_thinking": False} if i % 4 == 0 else {}
        convs.append({"messages": msgs, "add_generation_prompt": bool(i % 2), "extra": extra})
    # Long-ish multi-turn agent loop.
    for i in range(4):
        msgs = [{"role": "system", "content": "You are an agent."}]
        for _ in range(6 + i):
            msgs.append({"role": "user", "content": rng.choice(TEXTS)})
            msgs.append(
                {"role": "assistant", "content": "", "tool_calls": [tool_call("search", {"q": rng.choice(TEXTS)})]}
            )
            msgs.append({"role": "tool", "content": rng.choice(TEXTS)})
            msgs.append({"role": "assistant", "content": rng.choice(TEXTS)})
        convs.append({"messages": msgs, "tools": [SEARCH], "add_generation_prompt": True})
    return convs


def build() -> str:
    toks = {k: PreTrainedTokenizerFast(tokenizer_file=str(v)) for k, v in TOKENIZERS.items()}
    cases = []
    for ci, conv in enumerate(conversations()):
        for tmpl_name, tok_name in (("qwen_style", "smollm2"), ("smollm2", "smollm2"), ("qwen_style", "deepseek")):
            if tmpl_name == "smollm2" and conv.get("tools"):
                continue
            tok = toks[tok_name]
            kwargs = dict(conv.get("extra", {}))
            text = tok.apply_chat_template(
                conv["messages"],
                tools=conv.get("tools"),
                chat_template=TEMPLATES[tmpl_name],
                tokenize=False,
                add_generation_prompt=conv.get("add_generation_prompt", False),
                continue_final_message=conv.get("continue_final_message", False),
                **kwargs,
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
            cases.append(
                {
                    "name": f"conv{ci:02d}-{tmpl_name}-{tok_name}",
                    "template": tmpl_name,
                    "tokenizer": tok_name,
                    "input": {
                        "messages": conv["messages"],
                        "tools": conv.get("tools"),
                        "add_generation_prompt": conv.get("add_generation_prompt", False),
                        "continue_final_message": conv.get("continue_final_message", False),
                        "extra": conv.get("extra", {}),
                    },
                    "text": text,
                    "ids": ids,
                    "decoded": tok.decode(ids),
                    "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
                }
            )
    return json.dumps({"cases": cases}, ensure_ascii=False, indent=1) + "\n"


if __name__ == "__main__":
    data = build()
    if "--check" in sys.argv[1:]:
        if not OUT.exists() or OUT.read_text() != data:
            print(f"differential reference mismatch: regenerate with {Path(__file__).name}", file=sys.stderr)
            sys.exit(1)
        print("differential reference matches")
    else:
        OUT.write_text(data)
        print(f"wrote {OUT} ({len(json.loads(data)['cases'])} cases)")
