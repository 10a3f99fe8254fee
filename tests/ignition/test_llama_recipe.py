"""The Llama-family recipe on CPU: meta-device construction and the checkpoint weight mapping."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ignition.core import safetensors_io as st
from ignition.core.manifest import Dtype
from ignition.recipes.llama import (
    Checkpoint,
    Ignored,
    LlamaFamilyConfig,
    MissingTensorError,
    Placement,
    TensorShapeError,
    Tied,
    UnknownTensorError,
    UnsupportedArchitectureError,
    build_meta_model,
    expected_checkpoint_shapes,
    meta_parameter_shapes,
    plan_weight_mapping,
    stream_execution_layout,
)
from tests.ignition.conftest import FIXTURES, REPO, require_torch

CONFIGS = FIXTURES / "configs"
TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def config(name: str) -> LlamaFamilyConfig:
    return LlamaFamilyConfig.from_file(CONFIGS / f"{name}.json")


def headers(shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> dict[str, st.TensorInfo]:
    return {n: st.TensorInfo(n, dtype, s, (0, 0)) for n, s in shapes.items()}


def write_random_checkpoint(
    root: Path, cfg: dict[str, Any], seed: int, extra: dict[str, tuple[int, ...]] | None = None
) -> None:
    """A seeded random-weight checkpoint (bf16 bytes), torch-free, split over two shards."""
    rng = random.Random(seed)
    shapes = expected_checkpoint_shapes(LlamaFamilyConfig.from_dict(cfg)) | (extra or {})
    names = sorted(shapes)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    for shard, part in enumerate((names[::2], names[1::2])):
        tensors = {}
        for n in part:
            count = 1
            for d in shapes[n]:
                count *= d
            tensors[n] = st.TensorBytes(Dtype.BF16, shapes[n], rng.randbytes(count * 2))
        st.write(root / f"model-0000{shard + 1}-of-00002.safetensors", tensors)


# -- torch-free mapping ------------------------------------------------------------------------


def test_smollm2_mapping_accounts_for_every_tensor() -> None:
    c = config("smollm2-135m-instruct")
    shapes = expected_checkpoint_shapes(c)
    assert len(shapes) == 272  # 30 layers x 9 + embed + norm; lm_head is tied
    mapping = plan_weight_mapping(c, headers(shapes))
    assert mapping.summary() == {"placed": 272, "tied": 0, "ignored": 0}
    assert mapping.destinations["layers.0.qkv"].shape == (576 + 2 * 192, 576)
    assert mapping.destinations["layers.29.gate_up"].shape == (2 * 1536, 576)
    assert mapping.entries["model.layers.3.self_attn.v_proj.weight"] == Placement("layers.3.qkv", 768, 960)
    # A checkpoint that also stores the tied head accounts for it explicitly.
    with_head = plan_weight_mapping(c, headers(shapes | {"lm_head.weight": (49152, 576)}))
    assert isinstance(with_head.entries["lm_head.weight"], Tied)


def test_qwen3_mapping_has_qk_norms() -> None:
    c = config("qwen3-0.6b")
    assert c.qk_norm and c.head_dim == 128
    mapping = plan_weight_mapping(c, headers(expected_checkpoint_shapes(c)))
    assert mapping.destinations["layers.27.q_norm"].shape == (128,)
    assert mapping.destinations["layers.0.qkv"].shape == (16 * 128 + 2 * 8 * 128, 1024)


def test_unknown_tensor_is_an_error() -> None:
    c = config("smollm2-135m-instruct")
    shapes = expected_checkpoint_shapes(c) | {"model.layers.0.mlp.experts.0.weight": (4, 4)}
    with pytest.raises(UnknownTensorError) as e:
        plan_weight_mapping(c, headers(shapes), {"model.layers.0.mlp.experts.0.weight": "model.safetensors"})
    assert e.value.tensor == "model.layers.0.mlp.experts.0.weight"
    assert "model.safetensors" in str(e.value)


def test_missing_and_misshaped_tensors_are_errors() -> None:
    c = config("smollm2-135m-instruct")
    shapes = expected_checkpoint_shapes(c)
    del shapes["model.layers.7.self_attn.k_proj.weight"]
    with pytest.raises(MissingTensorError) as e:
        plan_weight_mapping(c, headers(shapes))
    assert e.value.destination == "layers.7.qkv"
    shapes = expected_checkpoint_shapes(c) | {"model.norm.weight": (575,)}
    with pytest.raises(TensorShapeError):
        plan_weight_mapping(c, headers(shapes))


def test_non_llama_architecture_is_rejected() -> None:
    with pytest.raises(UnsupportedArchitectureError):
        LlamaFamilyConfig.from_dict({**TINY, "architectures": ["Qwen3NextForCausalLM"]})


def test_random_checkpoint_streams_into_execution_layout(tmp_path: Path) -> None:
    inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
    write_random_checkpoint(tmp_path, TINY, seed=1234, extra={inv_freq: (2,)})
    ckpt = Checkpoint.open(tmp_path)
    mapping = plan_weight_mapping(LlamaFamilyConfig.from_dict(TINY), ckpt.tensors, ckpt.files)
    assert set(mapping.entries) == set(ckpt.tensors)  # every tensor accounted for
    assert isinstance(mapping.entries[inv_freq], Ignored)
    assert "lm_head" in mapping.destinations  # untied config: a real destination
    out = dict(stream_execution_layout(mapping, ckpt))
    qkv = out["layers.1.qkv"]
    a = "model.layers.1.self_attn"
    assert qkv.shape == (16 + 8 + 8, 16)
    assert qkv.data == ckpt.read(f"{a}.q_proj.weight") + ckpt.read(f"{a}.k_proj.weight") + ckpt.read(
        f"{a}.v_proj.weight"
    )
    placed = sum(1 for e in mapping.entries.values() if isinstance(e, Placement))
    assert placed == len(ckpt.tensors) - 1


def test_cli_map_weights(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, TINY, seed=7)
    proc = subprocess.run(
        [sys.executable, "-m", "ignition", "map-weights", "--model", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows["model.layers.1.mlp.up_proj.weight"] == {
        "kind": "Placement",
        "destination": "layers.1.gate_up",
        "row_start": 40,
        "row_end": 80,
    }


# -- torch: canonical modules on the meta device -------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen3-0.6b"])
def test_meta_model_matches_the_mapping(name: str) -> None:
    require_torch()
    import torch

    c = config(name)
    model = build_meta_model(c)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert type(model).__name__ == c.architecture
    shapes = meta_parameter_shapes(model)
    expected = expected_checkpoint_shapes(c)
    assert {k: v for k, v in shapes.items() if k != "lm_head.weight"} == expected
    mapping = plan_weight_mapping(c, headers(shapes))  # the canonical names, as the module spells them
    assert isinstance(mapping.entries["lm_head.weight"], Tied)
    assert not torch.cuda.is_initialized()


def test_transformers_random_checkpoint_maps_completely(tmp_path: Path) -> None:
    """A seeded random-weight checkpoint serialized by Transformers itself (its own key names)."""
    require_torch()
    import torch
    import transformers

    torch.manual_seed(0)
    for arch, extra in (("LlamaForCausalLM", {}), ("Qwen3ForCausalLM", {"head_dim": 8})):
        cfg = dict(TINY, architectures=[arch], model_type=arch.removesuffix("ForCausalLM").lower(), **extra)
        hf = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
        model = getattr(transformers, arch)(hf).to(torch.bfloat16)
        root = tmp_path / arch
        model.save_pretrained(root)
        ckpt = Checkpoint.open(root)
        c = LlamaFamilyConfig.from_file(root / "config.json")
        mapping = plan_weight_mapping(c, ckpt.tensors, ckpt.files)
        assert set(mapping.entries) == set(ckpt.tensors)
        out = dict(stream_execution_layout(mapping, ckpt))
        gate_up = out["layers.0.gate_up"]
        w = torch.cat([model.model.layers[0].mlp.gate_proj.weight, model.model.layers[0].mlp.up_proj.weight])
        assert gate_up.data == w.contiguous().view(torch.uint8).numpy().tobytes()


def test_registry_finds_recipes_by_architecture() -> None:
    """Recipes are looked up by the Transformers class config.json names; an architecture no
    recipe claims is a typed error listing the supported ones."""
    from ignition.recipes import UnsupportedArchitectureError as Unsupported
    from ignition.recipes import recipe_for

    assert recipe_for({"architectures": ["Qwen3ForCausalLM"]}).name == "llama"
    # The first claimed architecture wins; unknown ones before it are skipped.
    assert recipe_for({"architectures": ["Nope", "LlamaForCausalLM"]}).name == "llama"
    with pytest.raises(Unsupported) as e:
        recipe_for({"architectures": ["MambaForCausalLM"]})
    assert "LlamaForCausalLM" in e.value.supported and "MambaForCausalLM" in str(e.value)
    with pytest.raises(Unsupported):
        recipe_for({})


def test_llama_recipe_picks_its_sampling_card() -> None:
    from ignition.recipes import cards, recipe_for

    smol = json.loads((CONFIGS / "smollm2-135m-instruct.json").read_text())
    recipe = recipe_for(smol)
    assert recipe.sampling_card(recipe.parse_config(smol), "auto") is cards.SMOLLM2_135M_INSTRUCT
    tiny = recipe.parse_config(TINY)
    assert recipe.sampling_card(tiny, "auto") is cards.NEUTRAL
    assert recipe.sampling_card(tiny, "smollm2-135m-instruct") is cards.SMOLLM2_135M_INSTRUCT
