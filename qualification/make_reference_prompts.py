"""Prompts for the flare-vs-torch-replay comparison: text, token ids (the core's tokenizer, no
special tokens, as /v1/completions encodes), seed, sampling parameters, token budget.

    python3 qualification/make_reference_prompts.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

TEXTS = [
    ("The three primary colors are", {"temperature": 0.7, "top_p": 0.9, "top_k": 40}),
    ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', {"temperature": 0.5, "min_p": 0.05}),
    (
        "Write a short poem about the sea.\n",
        {
            "temperature": 1.0,
            "top_p": 0.95,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.3,
        },
    ),
    ("Paris is the capital of France. " * 40 + "Berlin is", {"temperature": 0.8, "top_k": 20}),
]


def main() -> None:
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    cfg = json.loads((model / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    # Every parameter explicit: the server fills unspecified ones from the core's defaults.
    neutral = {
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    prompts = [
        {
            "text": t,
            "prompt_ids": tok.encode(t, add_special_tokens=False).ids,
            "seed": 1234 + i,
            "max_tokens": 48,
            "params": {**neutral, **p},
            "eos": eos,
        }
        for i, (t, p) in enumerate(TEXTS)
    ]
    out.write_text(json.dumps(prompts, indent=1) + "\n")


if __name__ == "__main__":
    main()
