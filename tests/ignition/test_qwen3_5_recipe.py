"""The Qwen3.5 recipe on CPU: config parsing, meta-device construction of both Transformers
classes, and a weight mapping that accounts for every checkpoint tensor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ignition.core import safetensors_io as st
from ignition.recipes import recipe_for
from ignition.recipes.mapping import Checkpoint, ConfigError, Ignored, Placement, Tied, stream_execution_layout
from ignition.recipes.qwen3_5 import (
    FULL,
    LINEAR,
    Qwen35Config,
    expected_checkpoint_shapes,
    plan_weight_mapping,
)
from tests.ignition.conftest import FIXTURES, REPO, require_torch

TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CAUSAL: dict[str, Any] = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **TEXT}
MULTIMODAL: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": dict(TEXT),
    "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64},
}


def headers(shapes: dict[str, tuple[int, ...]]) -> dict[str, st.TensorInfo]:
    return {name: st.TensorInfo(name, "BF16", shape, (0, 0)) for name, shape in shapes.items()}


def test_config_parses_layer_types_and_both_classes() -> None:
    c = Qwen35Config.from_dict(CAUSAL)
    # full_attention_interval defaults to 4: three GDN layers, then gated attention.
    assert c.layer_types == (LINEAR, LINEAR, LINEAR, FULL)
    assert c.gdn_layers() == [0, 1, 2] and c.attention_layers() == [3]
    assert (c.key_dim, c.value_dim, c.conv_channels) == (16, 32, 64)
    m = Qwen35Config.from_dict(MULTIMODAL)
    assert m.tie_word_embeddings and m.hidden_size == 64 and m.text["vocab_size"] == 128
    assert recipe_for(MULTIMODAL).name == recipe_for(CAUSAL).name == "qwen3_5"


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"layer_types": [LINEAR, FULL]}, "layer_types"),
        ({"layer_types": [LINEAR, "sliding_attention", LINEAR, FULL]}, "layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
    ],
)
def test_bad_config_fields_are_typed_errors(patch: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        Qwen35Config.from_dict({**CAUSAL, **patch})
    assert e.value.field == field
    # Nested under text_config, the error names where the field lives.
    with pytest.raises(ConfigError) as nested:
        Qwen35Config.from_dict({**MULTIMODAL, "text_config": {**TEXT, **patch}})
    assert nested.value.field == "text_config." + field


def test_multimodal_checkpoint_maps_every_tensor() -> None:
    """Vision and multi-token-prediction tensors are ignored by name with a reason; the text
    model's tensors are placed under `model.language_model.`; the tied head is declared."""
    c = Qwen35Config.from_dict(MULTIMODAL)
    shapes = dict(expected_checkpoint_shapes(c))
    shapes["model.visual.blocks.0.attn.qkv.weight"] = (96, 32)
    shapes["mtp.layers.0.mlp.down_proj.weight"] = (64, 96)
    shapes["lm_head.weight"] = (128, 64)
    mapping = plan_weight_mapping(c, headers(shapes))
    assert set(mapping.entries) == set(shapes)
    assert isinstance(mapping.entries["model.visual.blocks.0.attn.qkv.weight"], Ignored)
    assert "multi-token" in mapping.entries["mtp.layers.0.mlp.down_proj.weight"].reason  # type: ignore[union-attr]
    assert isinstance(mapping.entries["lm_head.weight"], Tied)
    # The GDN input projection: query/key/value channels, output gate, write strength, decay input.
    rows = [
        mapping.entries[f"model.language_model.layers.1.linear_attn.in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")
    ]
    spans = [(r.row_start, r.row_end) for r in rows if isinstance(r, Placement)]
    assert spans == [(0, 64), (64, 96), (96, 100), (100, 104)]
    assert mapping.destinations["layers.3.qkv"].shape == (2 * 4 * 16 + 2 * 2 * 16, 64)  # query+gate, key, value
    assert "layers.3.in_proj" not in mapping.destinations and "layers.0.qkv" not in mapping.destinations


def test_snapshot_rows_are_budgeted_per_slot() -> None:
    require_torch()
    from ignition.prepare import plan_capacities

    recipe = recipe_for(CAUSAL)
    c = recipe.parse_config(CAUSAL)
    caps = plan_capacities(c, "1,2,4", 128, 512, None)  # 8 pages per request, 64 in all
    plan = recipe.plan_program(c, (2,), caps)
    assert caps.snapshot_rows > 32 and plan.capacities.snapshot_rows == 32  # 8 per slot, 4 slots
    geo = plan.geometry()
    assert geo["snapshot_rows"] == 32 and tuple(geo["layer_kinds"]) == (LINEAR, LINEAR, LINEAR, FULL)


# -- torch: canonical modules on the meta device, and Transformers' own checkpoints -------------


@pytest.mark.parametrize("config", [CAUSAL, MULTIMODAL], ids=["causal", "multimodal"])
def test_meta_model_matches_the_mapping(config: dict[str, Any]) -> None:
    require_torch()
    import torch

    from ignition.recipes.llama import meta_parameter_shapes

    recipe = recipe_for(config)
    c = recipe.parse_config(config)
    shapes = meta_parameter_shapes(recipe.build_meta_model(c))
    mapping = recipe.plan_weight_mapping(c, headers(shapes))
    placed = {k for k, e in mapping.entries.items() if isinstance(e, Placement)}
    assert placed == set(expected_checkpoint_shapes(Qwen35Config.from_dict(config)))
    assert all(isinstance(e, Ignored) for k, e in mapping.entries.items() if k.startswith("model.visual."))
    assert not torch.cuda.is_initialized()


def test_transformers_random_checkpoint_streams_and_cli_validates(tmp_path: Path) -> None:
    """A checkpoint Transformers serialized itself maps completely, its fused GDN input
    projection is the byte concatenation of its parts, `map-weights` reads it, and `prepare`
    validates it and plans its program before stopping at the device check (exit 2 here)."""
    require_torch()
    from ignition.prepare import make_random_checkpoint

    root = make_random_checkpoint(CAUSAL, tmp_path / "ckpt", 3, FIXTURES)
    ckpt = Checkpoint.open(root)
    c = Qwen35Config.from_dict(json.loads((root / "config.json").read_text()))
    mapping = plan_weight_mapping(c, ckpt.tensors, ckpt.files)
    assert set(mapping.entries) == set(ckpt.tensors)
    out = dict(stream_execution_layout(mapping, ckpt))
    g = "model.layers.0.linear_attn"
    parts = [ckpt.read(f"{g}.in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]
    assert out["layers.0.in_proj"].data == b"".join(parts)
    assert out["layers.0.conv"].shape == (64, 1, 4)
    run = [sys.executable, "-m", "ignition"]
    mapped = subprocess.run([*run, "map-weights", "--model", str(root)], capture_output=True, text=True, cwd=REPO)
    assert mapped.returncode == 0, mapped.stderr
    prep = subprocess.run(
        [*run, "prepare", "--model", str(root), "--out", str(tmp_path / "core"), "--context-limit", "256"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert prep.returncode == 2 and "qwen3_5 recipe" in prep.stderr and "device" in prep.stderr, prep.stderr
