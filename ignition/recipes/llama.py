"""The Llama-family recipe (LlamaForCausalLM, Qwen3ForCausalLM dense): structure and weights.

- `LlamaFamilyConfig.from_dict`: the structural fields of a checkpoint's config.json.
- `build_meta_model`: the canonical Transformers module on the meta device (no CUDA, no memory),
  used for naming and shapes; needs torch + transformers.
- `plan_weight_mapping`: every checkpoint tensor → exactly one execution-layout destination
  (a row range of it), or explicitly tied/ignored with a reason. Unknown or missing tensors and
  wrong shapes are errors. Torch-free: shapes follow from the config, and a test checks them
  against the meta model's parameters.
- `stream_execution_layout`: destination tensors assembled from the checkpoint's bytes
  (fused q/k/v and gate/up are row concatenations of row-major matrices), torch-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ignition.core import safetensors_io as st
from ignition.core.manifest import Dtype

ARCHITECTURES: dict[str, str] = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


@dataclass(eq=False)
class UnsupportedArchitectureError(Exception):
    architectures: tuple[str, ...]

    def __str__(self) -> str:
        return f"architectures {list(self.architectures)} are not Llama-family; supported: {sorted(ARCHITECTURES)}"


@dataclass(eq=False)
class ConfigError(Exception):
    field: str
    reason: str

    def __str__(self) -> str:
        return f"config.json {self.field}: {self.reason}"


@dataclass(eq=False)
class UnknownTensorError(Exception):
    tensor: str
    file: str

    def __str__(self) -> str:
        return f"checkpoint tensor {self.tensor} ({self.file}) has no destination in the Llama-family mapping"


@dataclass(eq=False)
class MissingTensorError(Exception):
    tensor: str
    destination: str

    def __str__(self) -> str:
        return f"checkpoint lacks {self.tensor}, needed by execution tensor {self.destination}"


@dataclass(eq=False)
class TensorShapeError(Exception):
    tensor: str
    expected: tuple[int, ...]
    actual: tuple[int, ...]

    def __str__(self) -> str:
        return f"checkpoint tensor {self.tensor}: shape {list(self.actual)}, config implies {list(self.expected)}"


@dataclass(eq=False)
class DuplicateTensorError(Exception):
    tensor: str
    files: tuple[str, str]

    def __str__(self) -> str:
        return f"checkpoint tensor {self.tensor} appears in both {self.files[0]} and {self.files[1]}"


@dataclass(frozen=True)
class LlamaFamilyConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    raw: dict[str, Any] = field(compare=False, repr=False, default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> LlamaFamilyConfig:
        archs = tuple(cfg.get("architectures") or ())
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedArchitectureError(archs)

        def need(key: str) -> int:
            v = cfg.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(key, f"must be a positive integer, got {v!r}")
            return v

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        kv = cfg.get("num_key_value_heads") or heads
        if heads % kv:
            raise ConfigError("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
        head_dim = cfg.get("head_dim") or hidden // heads
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=ARCHITECTURES[arch] == "qwen3",
            raw=dict(cfg),
        )

    @classmethod
    def from_file(cls, path: Path) -> LlamaFamilyConfig:
        return cls.from_dict(json.loads(path.read_text()))


def build_meta_model(config: LlamaFamilyConfig) -> Any:
    """The canonical Transformers model on the meta device (torch and transformers required)."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(
        ARCHITECTURES[config.architecture],
        **{k: v for k, v in config.raw.items() if k not in ("model_type", "transformers_version")},
    )
    model_cls = getattr(transformers, config.architecture)
    with torch.device("meta"):
        model = model_cls(cfg)
    return model.eval()


def meta_parameter_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Checkpoint-style names → shapes of the canonical module, without tied duplicates."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# Mapping


@dataclass(frozen=True)
class Placement:
    """Rows [row_start, row_end) of execution tensor `destination`."""

    destination: str
    row_start: int
    row_end: int


@dataclass(frozen=True)
class Tied:
    target: str
    reason: str


@dataclass(frozen=True)
class Ignored:
    reason: str


Disposition = Placement | Tied | Ignored


@dataclass(frozen=True)
class Destination:
    name: str
    shape: tuple[int, ...]
    # Checkpoint tensors in row order.
    sources: tuple[str, ...]


@dataclass(frozen=True)
class WeightMapping:
    config: LlamaFamilyConfig
    destinations: dict[str, Destination]
    entries: dict[str, Disposition]
    dtypes: dict[str, str]

    def summary(self) -> dict[str, int]:
        kinds = {"placed": 0, "tied": 0, "ignored": 0}
        for e in self.entries.values():
            kinds["placed" if isinstance(e, Placement) else "tied" if isinstance(e, Tied) else "ignored"] += 1
        return kinds


def _layout(
    config: LlamaFamilyConfig,
) -> tuple[list[tuple[str, list[tuple[str, tuple[int, ...]]]]], dict[str, Disposition]]:
    """Execution destinations (with their ordered sources and shapes) and the tied/ignored rules."""
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv, inter, v = config.num_key_value_heads * config.head_dim, config.intermediate_size, config.vocab_size
    dests: list[tuple[str, list[tuple[str, tuple[int, ...]]]]] = [
        ("embed_tokens", [("model.embed_tokens.weight", (v, h))]),
    ]
    for i in range(config.num_hidden_layers):
        p, d = f"model.layers.{i}", f"layers.{i}"
        a = f"{p}.self_attn"
        dests.append((f"{d}.input_norm", [(f"{p}.input_layernorm.weight", (h,))]))
        dests.append(
            (
                f"{d}.qkv",
                [(f"{a}.q_proj.weight", (q, h)), (f"{a}.k_proj.weight", (kv, h)), (f"{a}.v_proj.weight", (kv, h))],
            )
        )
        if config.attention_bias:
            dests.append(
                (
                    f"{d}.qkv_bias",
                    [(f"{a}.q_proj.bias", (q,)), (f"{a}.k_proj.bias", (kv,)), (f"{a}.v_proj.bias", (kv,))],
                )
            )
        if config.qk_norm:
            dests.append((f"{d}.q_norm", [(f"{a}.q_norm.weight", (config.head_dim,))]))
            dests.append((f"{d}.k_norm", [(f"{a}.k_norm.weight", (config.head_dim,))]))
        dests.append((f"{d}.o_proj", [(f"{a}.o_proj.weight", (h, q))]))
        if config.attention_bias:
            dests.append((f"{d}.o_proj_bias", [(f"{a}.o_proj.bias", (h,))]))
        dests.append((f"{d}.post_attention_norm", [(f"{p}.post_attention_layernorm.weight", (h,))]))
        m = f"{p}.mlp"
        dests.append((f"{d}.gate_up", [(f"{m}.gate_proj.weight", (inter, h)), (f"{m}.up_proj.weight", (inter, h))]))
        dests.append((f"{d}.down", [(f"{m}.down_proj.weight", (h, inter))]))
        if config.mlp_bias:
            dests.append((f"{d}.gate_up_bias", [(f"{m}.gate_proj.bias", (inter,)), (f"{m}.up_proj.bias", (inter,))]))
            dests.append((f"{d}.down_bias", [(f"{m}.down_proj.bias", (h,))]))
    dests.append(("final_norm", [("model.norm.weight", (h,))]))
    rules: dict[str, Disposition] = {}
    if config.tie_word_embeddings:
        rules["lm_head.weight"] = Tied(
            "model.embed_tokens.weight", "tie_word_embeddings: the LM head reads embed_tokens"
        )
    else:
        dests.append(("lm_head", [("lm_head.weight", (v, h))]))
    return dests, rules


_INV_FREQ = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def expected_checkpoint_shapes(config: LlamaFamilyConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must carry, with its shape."""
    dests, _ = _layout(config)
    return {name: shape for _, sources in dests for name, shape in sources}


def plan_weight_mapping(
    config: LlamaFamilyConfig, checkpoint: dict[str, st.TensorInfo], files: dict[str, str] | None = None
) -> WeightMapping:
    """Accounts for every checkpoint tensor; raises on unknown, missing or mis-shaped ones."""
    dests, rules = _layout(config)
    entries: dict[str, Disposition] = {}
    destinations: dict[str, Destination] = {}
    owner = {name: dest for dest, sources in dests for name, _ in sources}
    for key in sorted(checkpoint):
        if key in owner:
            continue
        if key in rules:
            entries[key] = rules[key]
        elif _INV_FREQ.match(key):
            entries[key] = Ignored("rotary inverse frequencies are recomputed from the config's rope parameters")
        else:
            raise UnknownTensorError(key, (files or {}).get(key, "?"))
    for dest, sources in dests:
        row = 0
        for name, shape in sources:
            info = checkpoint.get(name)
            if info is None:
                raise MissingTensorError(name, dest)
            if tuple(info.shape) != shape:
                raise TensorShapeError(name, shape, tuple(info.shape))
            entries[name] = Placement(dest, row, row + shape[0])
            row += shape[0]
        first = sources[0][1]
        destinations[dest] = Destination(dest, (row, *first[1:]), tuple(n for n, _ in sources))
    for key, e in entries.items():
        if isinstance(e, Tied) and e.target not in checkpoint:
            raise MissingTensorError(e.target, f"tied {key}")
    return WeightMapping(config, destinations, entries, {k: v.dtype for k, v in checkpoint.items()})


# ---------------------------------------------------------------------------------------------
# Checkpoint access


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    tensors: dict[str, st.TensorInfo]
    files: dict[str, str]

    @classmethod
    def open(cls, root: Path) -> Checkpoint:
        tensors: dict[str, st.TensorInfo] = {}
        files: dict[str, str] = {}
        for path in sorted(root.glob("*.safetensors")):
            for name, info in st.read_header(path).items():
                if name in files:
                    raise DuplicateTensorError(name, (files[name], path.name))
                tensors[name], files[name] = info, path.name
        return cls(root, tensors, files)

    def read(self, name: str) -> bytes:
        return st.read_tensor(self.root / self.files[name], self.tensors[name])


def stream_execution_layout(mapping: WeightMapping, ckpt: Checkpoint) -> Iterator[tuple[str, st.TensorBytes]]:
    """Yields each execution tensor, one at a time (fused ones are row concatenations)."""
    for dest in mapping.destinations.values():
        dtypes = {ckpt.tensors[s].dtype for s in dest.sources}
        if len(dtypes) != 1:
            raise TensorShapeError(dest.name, dest.shape, ())
        data = b"".join(ckpt.read(s) for s in dest.sources)
        yield dest.name, st.TensorBytes(Dtype.from_safetensors(dtypes.pop()), dest.shape, data)
