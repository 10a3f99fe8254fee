"""What every recipe's weight mapping shares: the dispositions of checkpoint tensors, the
planner that accounts for every tensor, and streaming the execution layout. Torch-free.

A recipe declares its execution tensors as a `Layout`: each destination with its checkpoint
sources in row order (fused projections are row concatenations of row-major matrices), plus
rules for tensors that are tied to another or deliberately ignored. `plan_weight_mapping` then
places every checkpoint tensor exactly once or fails with a typed error naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ignition.core import safetensors_io as st
from ignition.core.manifest import Dtype
from ignition.recipes import RecipeError


@dataclass(eq=False)
class ConfigError(RecipeError):
    field: str
    reason: str

    def __str__(self) -> str:
        return f"config.json {self.field}: {self.reason}"


def positive_int(fields: dict[str, Any], key: str, where: str = "") -> int:
    """config.json's `key` (under `where`, e.g. "text_config.") as a positive integer."""
    v = fields.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(where + key, f"must be a positive integer, got {v!r}")
    return v


@dataclass(eq=False)
class UnknownTensorError(RecipeError):
    tensor: str
    file: str

    def __str__(self) -> str:
        return f"checkpoint tensor {self.tensor} ({self.file}) has no destination in the recipe's mapping"


@dataclass(eq=False)
class MissingTensorError(RecipeError):
    tensor: str
    destination: str

    def __str__(self) -> str:
        return f"checkpoint lacks {self.tensor}, needed by execution tensor {self.destination}"


@dataclass(eq=False)
class TensorShapeError(RecipeError):
    tensor: str
    expected: tuple[int, ...]
    actual: tuple[int, ...]

    def __str__(self) -> str:
        return f"checkpoint tensor {self.tensor}: shape {list(self.actual)}, config implies {list(self.expected)}"


@dataclass(eq=False)
class DuplicateTensorError(RecipeError):
    tensor: str
    files: tuple[str, str]

    def __str__(self) -> str:
        return f"checkpoint tensor {self.tensor} appears in both {self.files[0]} and {self.files[1]}"


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
    config: Any
    destinations: dict[str, Destination]
    entries: dict[str, Disposition]
    dtypes: dict[str, str]

    def summary(self) -> dict[str, int]:
        kinds = {"placed": 0, "tied": 0, "ignored": 0}
        for e in self.entries.values():
            kinds["placed" if isinstance(e, Placement) else "tied" if isinstance(e, Tied) else "ignored"] += 1
        return kinds


Sources = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class Layout:
    """A recipe's execution tensors for one config: (destination, its sources in row order),
    rules for tied or ignored checkpoint tensors by exact name, and ignored name patterns."""

    destinations: list[tuple[str, Sources]]
    rules: dict[str, Disposition] = field(default_factory=dict)
    ignored_patterns: list[tuple[re.Pattern[str], str]] = field(default_factory=list)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint must carry, with its shape."""
        return {name: shape for _, sources in self.destinations for name, shape in sources}


def plan_weight_mapping(
    config: Any, layout: Layout, checkpoint: dict[str, st.TensorInfo], files: dict[str, str] | None = None
) -> WeightMapping:
    """Accounts for every checkpoint tensor; raises on unknown, missing or mis-shaped ones."""
    entries: dict[str, Disposition] = {}
    destinations: dict[str, Destination] = {}
    owner = {name: dest for dest, sources in layout.destinations for name, _ in sources}
    for key in sorted(checkpoint):
        if key in owner:
            continue
        if key in layout.rules:
            entries[key] = layout.rules[key]
            continue
        reason = next((why for pattern, why in layout.ignored_patterns if pattern.match(key)), None)
        if reason is None:
            raise UnknownTensorError(key, (files or {}).get(key, "?"))
        entries[key] = Ignored(reason)
    for dest, sources in layout.destinations:
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
