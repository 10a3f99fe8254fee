"""Address → buffer resolution, pointer-word scanning and library-kernel rejection."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ignition.core.manifest import Arena, Buffer, BufferRange, ParamSlot, Relocation

# Name prefixes of kernels that live only inside shared libraries (no recoverable image). Triton
# and Inductor kernels are extern "C" with their own names; a mangled C++ name is a library's.
LIBRARY_KERNEL_PREFIXES: tuple[str, ...] = (
    "cublas",
    "cublasLt",
    "cutlass",
    "nvjet",
    "gemv",
    "gemmk",
    "gemmSN",
    "splitKreduce",
    "sm50_",
    "sm60_",
    "sm70_",
    "sm75_",
    "sm80_",
    "sm86_",
    "sm89_",
    "sm90_",
    "sm100_",
    "sm120_",
    "ampere_",
    "volta_",
    "turing_",
    "hopper_",
    "cudnn",
    "_ZN",
    "void at::",
    "at::native",
)
# Recorded origins whose image was captured at load time (Triton's load hook, Inductor's
# static launcher records, an image-delivering provider).
IMAGE_ORIGINS: frozenset[str] = frozenset({"triton", "inductor_static_launcher", "provider"})


def library_kernel_reason(function_name: str, origin: str) -> str | None:
    """Why a kernel is a library kernel, or None when its image is exportable."""
    if origin not in IMAGE_ORIGINS:
        return f"origin {origin!r} has no recorded image"
    for prefix in LIBRARY_KERNEL_PREFIXES:
        if function_name.startswith(prefix):
            return f"name starts with library prefix {prefix!r}"
    return None


@dataclass(frozen=True)
class PointerWord:
    param_index: int
    byte_offset: int
    word: int


class AddressMap:
    """Resolves absolute addresses captured in the arena to (buffer, offset)."""

    def __init__(self, arena: Arena, buffers: list[Buffer]) -> None:
        self.arena = arena
        self.buffers = sorted(buffers, key=lambda b: b.offset)
        self._starts = [arena.base_address + b.offset for b in self.buffers]

    def find(self, address: int, byte_count: int = 1) -> BufferRange | None:
        """The buffer containing [address, address + byte_count), else None."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        b = self.buffers[i]
        within = address - self._starts[i]
        if within + max(byte_count, 1) > b.byte_size:
            return None
        return BufferRange(b.id, within)

    def around(self, address: int) -> str:
        """The buffers just below and above `address`, as arena offsets: what an unresolved
        pointer fell between."""
        i = bisect.bisect_right(self._starts, address) - 1
        below = self.buffers[i] if i >= 0 else None
        above = self.buffers[i + 1] if i + 1 < len(self.buffers) else None
        at = address - self.arena.base_address
        parts = [f"arena offset {at:#x}"]
        if below is not None:
            parts.append(f"after {below.name} [{below.offset:#x}, {below.end:#x})")
        if above is not None:
            parts.append(f"before {above.name} [{above.offset:#x}, {above.end:#x})")
        return ", ".join(parts)


def pointer_words(param_bytes: bytes, params: tuple[ParamSlot, ...]) -> list[PointerWord]:
    """Every 8-byte word at an 8-byte step from each parameter slot's start (as the loader scans)."""
    out = []
    for i, slot in enumerate(params):
        for at in range(slot.offset, slot.offset + slot.size - 7, 8):
            out.append(PointerWord(i, at - slot.offset, int.from_bytes(param_bytes[at : at + 8], "little")))
    return out


@dataclass(frozen=True)
class WordClass:
    relocation: Relocation | None
    # "arena-gap" (inside the arena, no buffer), "foreign" (another allocator), or None.
    problem: str | None


def classify(word: PointerWord, amap: AddressMap, foreign: list[tuple[int, int]]) -> WordClass:
    if amap.arena.contains(word.word):
        r = amap.find(word.word)
        if r is None:
            return WordClass(None, "arena-gap")
        return WordClass(Relocation(word.param_index, word.byte_offset, r.buffer_id, r.offset), None)
    if any(lo <= word.word < hi for lo, hi in foreign):
        return WordClass(None, "foreign")
    return WordClass(None, None)
