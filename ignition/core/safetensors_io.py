"""A torch-free safetensors writer and header reader over raw bytes.

Writes any dtype the runtime core uses (including BF16 and FP8, which numpy lacks) from bytes
the caller already holds. Layout: u64 little-endian header length, JSON header padded with
spaces to a multiple of 8, then tensor data in header order.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from ignition.core.manifest import Dtype


@dataclass(frozen=True)
class TensorBytes:
    dtype: Dtype
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        expected = self.dtype.size
        for d in self.shape:
            expected *= d
        if expected != len(self.data):
            raise TensorSizeError(tuple(self.shape), self.dtype.name, expected, len(self.data))


@dataclass(eq=False)
class TensorSizeError(Exception):
    shape: tuple[int, ...]
    dtype: str
    expected: int
    actual: int

    def __str__(self) -> str:
        return f"tensor of shape {list(self.shape)} {self.dtype} needs {self.expected} bytes, got {self.actual}"


@dataclass(eq=False)
class SafetensorsFormatError(Exception):
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: not a valid safetensors file: {self.reason}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]


def serialize(tensors: dict[str, TensorBytes], metadata: dict[str, str] | None = None) -> bytes:
    """Safetensors bytes of `tensors`, in the dict's order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in tensors.items():
        header[name] = {
            "dtype": t.dtype.safetensors_name,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(t.data)],
        }
        offset += len(t.data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(t.data for t in tensors.values())


def write(path: Path, tensors: dict[str, TensorBytes], metadata: dict[str, str] | None = None) -> bytes:
    data = serialize(tensors, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names → dtype/shape/offsets, reading only the header."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise SafetensorsFormatError(str(path), "shorter than 8 bytes")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 1024 * 1024:
            raise SafetensorsFormatError(str(path), f"header length {n} is implausible")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise SafetensorsFormatError(str(path), f"header is not JSON: {e}") from e
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = TensorInfo(name, info["dtype"], tuple(info["shape"]), (start, end))
    return out


def read_tensor(path: Path, info: TensorInfo) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n + info.data_offsets[0])
        return f.read(info.data_offsets[1] - info.data_offsets[0])
