"""Model recipes: canonical Transformers modules, weight mappings, execution layouts, programs.

A recipe is looked up by the Transformers architecture a checkpoint's config.json names (as
mistral.rs picks a loader by class name); an architecture no recipe claims is a typed error that
lists the supported ones. Everything model-specific (config fields, tensor names, fused layouts,
the prepared forward, which sampling card applies) lives in the recipe module; `prepare`,
`fetch-default`, `random-checkpoint` and `map-weights` only go through this interface. Adding a
family means one module that defines a `Recipe` and one line in `_MODULES`, plus its tests.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ignition.core import safetensors_io as st
    from ignition.core.manifest import SamplingDefaults
    from ignition.recipes.mapping import WeightMapping

# Recipe modules, each exporting `RECIPE`; imported on first lookup (they are torch-free).
_MODULES = ("ignition.recipes.llama", "ignition.recipes.qwen3_5")


class RecipeConfig(Protocol):
    """The structural view of a checkpoint's config.json a recipe parses."""

    @property
    def architecture(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def raw(self) -> dict[str, Any]: ...


class ProgramPlan(Protocol):
    """A recipe's prepared forward for one config and capacities, before any weight is loaded:
    what it will hold (for the memory planner) and how to build it on a device."""

    @property
    def capacities(self) -> Any:
        """The capacities the program is built for: those planned, or the recipe's adjustment
        (snapshot rows sized to its continuation row bytes)."""
        ...

    def geometry(self) -> dict[str, Any]: ...

    def state_bytes(self) -> int:
        """KV pages, continuation rows, histograms and pending tokens."""
        ...

    def pool_bytes(self) -> int:
        """Upper bound of one graph's private pool (temporaries of the largest capture)."""
        ...

    def build(self, weights: dict[str, Any], device: Any, options: Any) -> Any:
        """The `ignition.capture.program.Program` over `weights` (execution layout, on `device`);
        `options` is the `PrepareOptions` (attention kernel, decode projections)."""
        ...


class Recipe(Protocol):
    name: str
    # Transformers class name -> its model_type.
    architectures: dict[str, str]

    def parse_config(self, raw: dict[str, Any]) -> RecipeConfig:
        """Typed config fields; raises the recipe's ConfigError on a bad field."""
        ...

    def build_meta_model(self, config: Any) -> Any:
        """The canonical Transformers module on the meta device (needs torch + transformers)."""
        ...

    def plan_weight_mapping(
        self, config: Any, checkpoint: dict[str, st.TensorInfo], files: dict[str, str] | None = None
    ) -> WeightMapping:
        """Every checkpoint tensor placed, tied or ignored with a reason; torch-free."""
        ...

    def sampling_card(self, config: Any, card: str) -> SamplingDefaults:
        """The sampling defaults for `card` ("auto": the recipe recognizes its own checkpoints)."""
        ...

    def plan_program(self, config: Any, eos: tuple[int, ...], capacities: Any) -> ProgramPlan: ...


class RecipeError(Exception):
    """A checkpoint a recipe cannot take: unknown architecture, bad config field, a tensor the
    mapping cannot place, or a feature the recipe does not prepare yet. Typed per cause."""


@dataclass(eq=False)
class UnsupportedArchitectureError(RecipeError):
    architectures: tuple[str, ...]
    supported: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"no recipe for architectures {list(self.architectures)}; supported: {list(self.supported)}"


def registry() -> dict[str, Recipe]:
    """Architecture name -> recipe, for every registered recipe module."""
    out: dict[str, Recipe] = {}
    for module in _MODULES:
        recipe: Recipe = importlib.import_module(module).RECIPE
        for arch in recipe.architectures:
            out[arch] = recipe
    return out


def recipe_for(raw_config: dict[str, Any]) -> Recipe:
    """The recipe of the first architecture in config.json's `architectures` that one claims."""
    archs = tuple(raw_config.get("architectures") or ())
    known = registry()
    for arch in archs:
        if arch in known:
            return known[arch]
    raise UnsupportedArchitectureError(archs, tuple(sorted(known)))
