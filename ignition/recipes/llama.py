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

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ignition.core import safetensors_io as st
from ignition.core.manifest import SamplingDefaults
from ignition.recipes import UnsupportedArchitectureError, cards, mapping
from ignition.recipes.mapping import (
    Checkpoint,
    ConfigError,
    Destination,
    Disposition,
    DuplicateTensorError,
    Ignored,
    Layout,
    MissingTensorError,
    Placement,
    Sources,
    TensorShapeError,
    Tied,
    UnknownTensorError,
    WeightMapping,
    positive_int,
    stream_execution_layout,
)

# Re-exported: the recipe's public surface (tests and tools import them from here).
__all__ = [
    "ARCHITECTURES",
    "RECIPE",
    "Checkpoint",
    "ConfigError",
    "Destination",
    "Disposition",
    "DuplicateTensorError",
    "Ignored",
    "LlamaFamilyConfig",
    "MissingTensorError",
    "Placement",
    "TensorShapeError",
    "Tied",
    "UnknownTensorError",
    "UnsupportedArchitectureError",
    "WeightMapping",
    "build_meta_model",
    "expected_checkpoint_shapes",
    "layout",
    "meta_parameter_shapes",
    "plan_weight_mapping",
    "stream_execution_layout",
]

ARCHITECTURES: dict[str, str] = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


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
            raise UnsupportedArchitectureError(archs, tuple(sorted(ARCHITECTURES)))

        def need(key: str) -> int:
            return positive_int(cfg, key)

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


def layout(config: LlamaFamilyConfig) -> Layout:
    """Execution destinations (with their ordered sources and shapes) and the tied/ignored rules."""
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv, inter, v = config.num_key_value_heads * config.head_dim, config.intermediate_size, config.vocab_size
    dests: list[tuple[str, Sources]] = [
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
    inv_freq = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
    why = "rotary inverse frequencies are recomputed from the config's rope parameters"
    return Layout(dests, rules, [(inv_freq, why)])


def expected_checkpoint_shapes(config: LlamaFamilyConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must carry, with its shape."""
    return layout(config).expected_shapes()


def plan_weight_mapping(
    config: LlamaFamilyConfig, checkpoint: dict[str, st.TensorInfo], files: dict[str, str] | None = None
) -> WeightMapping:
    """Accounts for every checkpoint tensor; raises on unknown, missing or mis-shaped ones."""
    return mapping.plan_weight_mapping(config, layout(config), checkpoint, files)


# ---------------------------------------------------------------------------------------------
# The recipe


def _paged_llama(
    config: LlamaFamilyConfig, geo: Any, largest_bucket: int, weights: dict[str, Any], device: Any, options: Any
) -> Any:
    """The paged Llama forward (`ignition.capture.paged.PagedLlama`) over the streamed weights;
    decode projections through `flare::gemv` when asked and every bucket fits it; sampling through
    `flare::sample` when asked."""
    from ignition.capture.paged import GEMV_MAX_ROWS, PagedLlama, rope_parameters

    gemv = options.decode_projections == "gemv" and options.attention_kernel and largest_bucket <= GEMV_MAX_ROWS
    sampler = options.sampler == "kernel"
    inv, scaling = rope_parameters(config.raw, device)
    return PagedLlama(geo, weights, inv.to(device), scaling, options.attention_kernel, gemv, sampler)


class LlamaRecipe:
    """LlamaForCausalLM and Qwen3ForCausalLM (dense): the `ignition.recipes.Recipe` interface."""

    name = "llama"
    architectures = ARCHITECTURES

    def parse_config(self, raw: dict[str, Any]) -> LlamaFamilyConfig:
        return LlamaFamilyConfig.from_dict(raw)

    def build_meta_model(self, config: LlamaFamilyConfig) -> Any:
        return build_meta_model(config)

    def plan_weight_mapping(
        self, config: LlamaFamilyConfig, checkpoint: dict[str, st.TensorInfo], files: dict[str, str] | None = None
    ) -> WeightMapping:
        return plan_weight_mapping(config, checkpoint, files)

    def sampling_card(self, config: LlamaFamilyConfig, card: str) -> SamplingDefaults:
        """ "auto": SmolLM2-135M-Instruct's card for its checkpoints (the fetched default, recognized
        by its name in config.json or its geometry), else the neutral card."""
        if card == "auto":
            smollm2 = "SmolLM2" in json.dumps(config.raw) or (
                config.hidden_size,
                config.num_hidden_layers,
                config.vocab_size,
            ) == (576, 30, 49152)
            card = "smollm2-135m-instruct" if smollm2 else "neutral"
        return cards.SMOLLM2_135M_INSTRUCT if card == "smollm2-135m-instruct" else cards.NEUTRAL

    def plan_program(self, config: LlamaFamilyConfig, eos: tuple[int, ...], capacities: Any) -> Any:
        from ignition.capture.paged import Geometry
        from ignition.capture.program import ProgramPlan, capacity_fields

        geo = Geometry.from_recipe(config, eos, **capacity_fields(capacities))
        largest = max(capacities.decode_buckets)
        return ProgramPlan(geo, capacities, functools.partial(_paged_llama, config, geo, largest))


RECIPE = LlamaRecipe()
