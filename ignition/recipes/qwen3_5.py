"""The Qwen3.5 recipe (Transformers' `qwen3_5`): hybrid layers of Gated DeltaNet (GDN) and gated
full attention, text only. Structure and weights; torch-free except `build_meta_model`.

Two checkpoint layouts carry the same text model:
- `Qwen3_5ForCausalLM` (config `qwen3_5_text`): tensors under `model.`;
- `Qwen3_5ForConditionalGeneration` (config `qwen3_5`, text fields under `text_config`): tensors
  under `model.language_model.`, beside the vision encoder (`model.visual.`) and the multi-token
  prediction head (`mtp.`), which this recipe ignores by name, with the reason, while those
  features are absent.

Execution layout (every destination a row concatenation of checkpoint tensors, bytes unchanged):
- attention layers: `qkv` = q_proj (2·H·D rows: per head its query then its output gate, as
  Transformers' `view(..., -1, 2·D).chunk(2)` reads them), k_proj, v_proj; q/k norms; o_proj;
- GDN layers: `in_proj` = in_proj_qkv (query, key, value channels), in_proj_z (output gate),
  in_proj_b (write strength), in_proj_a (decay input); `conv` (depthwise, [channels, 1, K]);
  `dt_bias`, `a_log`, `gdn_norm` (gated RMSNorm over each value head), `out_proj`;
- every layer: `input_norm`, `post_attention_norm`, `gate_up`, `down`.
RMSNorms other than the GDN output norm are zero-centred (the forward multiplies by 1 + w).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ignition.core import safetensors_io as st
from ignition.core.manifest import SamplingDefaults
from ignition.recipes import UnsupportedArchitectureError, cards, mapping
from ignition.recipes.mapping import ConfigError, Disposition, Layout, Sources, Tied, WeightMapping, positive_int

# Transformers class -> model_type; the prefix of the text model's tensors.
ARCHITECTURES: dict[str, str] = {"Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5ForConditionalGeneration": "qwen3_5"}
PREFIX: dict[str, str] = {"Qwen3_5ForCausalLM": "model.", "Qwen3_5ForConditionalGeneration": "model.language_model."}
LINEAR, FULL = "linear_attention", "full_attention"
# Checkpoint rows per request slot: with ~20 MiB rows at the 0.8B geometry, 8 per slot keep a
# conversation's recent message endpoints without reserving gigabytes for rows.
SNAPSHOT_ROWS_PER_SLOT = 8


@dataclass(frozen=True)
class Qwen35Config:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    layer_types: tuple[str, ...]
    conv_kernel: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    # The top-level config.json (text fields nested under text_config for the multimodal class).
    raw: dict[str, Any] = field(compare=False, repr=False, default_factory=dict)

    @property
    def text(self) -> dict[str, Any]:
        """The text model's fields (config.json itself, or its `text_config`)."""
        nested = self.raw.get("text_config")
        return dict(nested) if isinstance(nested, dict) else dict(self.raw)

    @property
    def key_dim(self) -> int:
        return self.linear_key_heads * self.linear_key_dim

    @property
    def value_dim(self) -> int:
        return self.linear_value_heads * self.linear_value_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Qwen35Config:
        archs = tuple(cfg.get("architectures") or ())
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedArchitectureError(archs, tuple(sorted(ARCHITECTURES)))
        nested = cfg.get("text_config")
        text: dict[str, Any] = nested if isinstance(nested, dict) else cfg
        where = "text_config." if text is not cfg else ""

        def need(key: str) -> int:
            return positive_int(text, key, where)

        layers = need("num_hidden_layers")
        heads = need("num_attention_heads")
        kv = text.get("num_key_value_heads") or heads
        if heads % kv:
            raise ConfigError(where + "num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
        types = text.get("layer_types")
        if types is None:
            interval = int(text.get("full_attention_interval", 4))
            types = [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
        if len(types) != layers or any(t not in (LINEAR, FULL) for t in types):
            raise ConfigError(where + "layer_types", f"needs {layers} entries of {LINEAR!r}/{FULL!r}, got {types!r}")
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(where + "hidden_act", f"only silu is prepared, got {act!r}")
        key_heads, value_heads = need("linear_num_key_heads"), need("linear_num_value_heads")
        if value_heads % key_heads:
            raise ConfigError(where + "linear_num_value_heads", f"{value_heads} is not a multiple of {key_heads}")
        # The multimodal class keeps tie_word_embeddings at its top level.
        tie = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return cls(
            architecture=arch,
            hidden_size=need("hidden_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=text.get("head_dim") or need("hidden_size") // heads,
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie),
            attention_bias=bool(text.get("attention_bias", False)),
            layer_types=tuple(types),
            conv_kernel=need("linear_conv_kernel_dim"),
            linear_key_heads=key_heads,
            linear_value_heads=value_heads,
            linear_key_dim=need("linear_key_head_dim"),
            linear_value_dim=need("linear_value_head_dim"),
            raw=dict(cfg),
        )


def build_meta_model(config: Qwen35Config) -> Any:
    """The canonical Transformers model on the meta device (torch and transformers required)."""
    import torch
    import transformers

    def fields(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k not in ("model_type", "transformers_version", "architectures")}

    if config.architecture == "Qwen3_5ForCausalLM":
        cfg: Any = transformers.Qwen3_5TextConfig(**fields(config.raw))
    else:
        top = fields(config.raw)
        top["text_config"] = fields(config.text)
        cfg = transformers.Qwen3_5Config(**top)
    with torch.device("meta"):
        model = getattr(transformers, config.architecture)(cfg)
    return model.eval()


def layout(config: Qwen35Config) -> Layout:
    c = config
    p = PREFIX[c.architecture]
    h, d = c.hidden_size, c.head_dim
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    dests: list[tuple[str, Sources]] = [("embed_tokens", [(f"{p}embed_tokens.weight", (c.vocab_size, h))])]
    for i, kind in enumerate(c.layer_types):
        src, dst = f"{p}layers.{i}", f"layers.{i}"
        dests.append((f"{dst}.input_norm", [(f"{src}.input_layernorm.weight", (h,))]))
        if kind == FULL:
            a = f"{src}.self_attn"
            proj = [(f"{a}.q_proj", 2 * heads * d), (f"{a}.k_proj", kv * d), (f"{a}.v_proj", kv * d)]
            dests.append((f"{dst}.qkv", [(f"{name}.weight", (rows, h)) for name, rows in proj]))
            if c.attention_bias:
                dests.append((f"{dst}.qkv_bias", [(f"{name}.bias", (rows,)) for name, rows in proj]))
            dests.append((f"{dst}.q_norm", [(f"{a}.q_norm.weight", (d,))]))
            dests.append((f"{dst}.k_norm", [(f"{a}.k_norm.weight", (d,))]))
            dests.append((f"{dst}.o_proj", [(f"{a}.o_proj.weight", (h, heads * d))]))
            if c.attention_bias:
                dests.append((f"{dst}.o_proj_bias", [(f"{a}.o_proj.bias", (h,))]))
        else:
            g = f"{src}.linear_attn"
            hv = c.linear_value_heads
            in_proj = [("qkv", c.conv_channels), ("z", c.value_dim), ("b", hv), ("a", hv)]
            dests.append((f"{dst}.in_proj", [(f"{g}.in_proj_{n}.weight", (rows, h)) for n, rows in in_proj]))
            dests.append((f"{dst}.conv", [(f"{g}.conv1d.weight", (c.conv_channels, 1, c.conv_kernel))]))
            dests.append((f"{dst}.dt_bias", [(f"{g}.dt_bias", (hv,))]))
            dests.append((f"{dst}.a_log", [(f"{g}.A_log", (hv,))]))
            dests.append((f"{dst}.gdn_norm", [(f"{g}.norm.weight", (c.linear_value_dim,))]))
            dests.append((f"{dst}.out_proj", [(f"{g}.out_proj.weight", (h, c.value_dim))]))
        dests.append((f"{dst}.post_attention_norm", [(f"{src}.post_attention_layernorm.weight", (h,))]))
        m = f"{src}.mlp"
        ffn = c.intermediate_size
        dests.append((f"{dst}.gate_up", [(f"{m}.gate_proj.weight", (ffn, h)), (f"{m}.up_proj.weight", (ffn, h))]))
        dests.append((f"{dst}.down", [(f"{m}.down_proj.weight", (h, ffn))]))
    dests.append(("final_norm", [(f"{p}norm.weight", (h,))]))
    rules: dict[str, Disposition] = {}
    if c.tie_word_embeddings:
        rules["lm_head.weight"] = Tied(f"{p}embed_tokens.weight", "tie_word_embeddings: the LM head reads embed_tokens")
    else:
        dests.append(("lm_head", [("lm_head.weight", (c.vocab_size, h))]))
    ignored = [
        (re.compile(r"^mtp\."), "multi-token prediction head: not served until MTP drafts exist (speculation issue)"),
        (re.compile(r"^model\.visual\."), "vision encoder: this recipe serves text; image input is not prepared yet"),
    ]
    return Layout(dests, rules, ignored)


def expected_checkpoint_shapes(config: Qwen35Config) -> dict[str, tuple[int, ...]]:
    return layout(config).expected_shapes()


def plan_weight_mapping(
    config: Qwen35Config, checkpoint: dict[str, st.TensorInfo], files: dict[str, str] | None = None
) -> WeightMapping:
    return mapping.plan_weight_mapping(config, layout(config), checkpoint, files)


class Qwen35Recipe:
    name = "qwen3_5"
    architectures = ARCHITECTURES

    def parse_config(self, raw: dict[str, Any]) -> Qwen35Config:
        return Qwen35Config.from_dict(raw)

    def build_meta_model(self, config: Qwen35Config) -> Any:
        return build_meta_model(config)

    def plan_weight_mapping(
        self, config: Qwen35Config, checkpoint: dict[str, st.TensorInfo], files: dict[str, str] | None = None
    ) -> WeightMapping:
        return plan_weight_mapping(config, checkpoint, files)

    def sampling_card(self, config: Qwen35Config, card: str) -> SamplingDefaults:
        if card not in ("auto", "neutral"):
            raise ConfigError("--card", f"{card!r} is not a card of the {self.name} recipe")
        return cards.NEUTRAL

    def plan_program(self, config: Qwen35Config, eos: tuple[int, ...], capacities: Any) -> Any:
        """The hybrid forward (`ignition.capture.hybrid`). A continuation row holds every GDN
        layer's recurrent matrix (MiBs, where a dense recipe's row is one hidden vector), so
        snapshot rows are budgeted per slot instead of matching the pages."""
        import functools
        from dataclasses import replace

        from ignition.capture.hybrid import HybridGeometry, build_model
        from ignition.capture.program import ProgramPlan, capacity_fields

        rows = min(capacities.snapshot_rows, SNAPSHOT_ROWS_PER_SLOT * capacities.request_slots)
        caps = replace(capacities, snapshot_rows=rows)
        # Speculative programs verify W lanes per request; each lane's GDN state goes to its own
        # column (row), the accepted one then installed in the live row, so every slot owns
        # one row per lane of the widest program (the cache scheme's verification width).
        width = max((d + 1 for _, d in caps.speculative), default=1)
        geo = HybridGeometry.from_qwen35(config, eos, **capacity_fields(caps), verification_width=width)
        largest = max(caps.decode_buckets)
        return ProgramPlan(geo, caps, functools.partial(build_model, config, geo, largest))


RECIPE = Qwen35Recipe()
