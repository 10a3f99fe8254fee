"""The fixed-address preparation arena: a CUDAPluggableAllocator over one reserved VA range.

`arena_alloc.c` is compiled with nvcc at run time (the GPU machine has the toolkit; nothing is
prebuilt), loaded once, initialized at the chosen base, and handed to `torch.cuda.MemPool`s.
Everything the exported graphs touch is allocated from pools of this allocator, so every
address a graph holds lies in [base, base + used).
"""

from __future__ import annotations

import ctypes as C
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_BASE = 0x7E00_0000_0000
GIB = 1 << 30
SOURCE = Path(__file__).with_name("arena_alloc.c")


def _nvcc() -> str:
    for cand in (shutil.which("nvcc"), os.environ.get("CUDA_HOME", "") + "/bin/nvcc", "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    raise FileNotFoundError("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")


def build_allocator(build_dir: Path) -> Path:
    """Compiles arena_alloc.c into a shared library (nvcc, linked against the driver API)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    so = build_dir / "libflare_arena.so"
    nvcc = _nvcc()
    cuda = Path(nvcc).resolve().parent.parent
    cmd = [
        nvcc,
        "-shared",
        "-O2",
        "-Xcompiler",
        "-fPIC",
        "-o",
        str(so),
        str(SOURCE),
        f"-L{cuda}/lib64/stubs",
        f"-L{cuda}/lib64",
        "-lcuda",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return so


@dataclass(frozen=True)
class Segment:
    offset: int
    size: int
    freed: bool


class FixedArena:
    """One reserved range at `base` (whole GiB), `mapped` bytes backed, bump-allocated."""

    def __init__(
        self, so: Path, base: int = DEFAULT_BASE, reserve: int = GIB, mapped: int = GIB // 2, device: int = 0
    ) -> None:
        import torch

        torch.cuda.init()
        torch.cuda.set_device(device)
        torch.zeros(1, device=f"cuda:{device}")  # the primary context is current from here on
        self.so = so
        self.lib = C.CDLL(str(so))
        self.lib.flare_arena_base.restype = C.c_uint64
        for f in ("flare_arena_used", "flare_arena_mapped", "flare_arena_reserved", "flare_arena_failed_allocs"):
            getattr(self.lib, f).restype = C.c_size_t
        got = C.c_uint64(0)
        reserve = -(-reserve // GIB) * GIB
        r = self.lib.flare_arena_init(
            C.c_uint64(base), C.c_size_t(reserve), C.c_size_t(mapped), C.c_int(device), C.byref(got)
        )
        if r != 0:
            raise RuntimeError(f"flare_arena_init failed with CUresult {r}")
        self.requested_base = base
        self.base = int(got.value)
        self.reserved = int(self.lib.flare_arena_reserved())
        self.mapped = int(self.lib.flare_arena_mapped())
        self.allocator = torch.cuda.memory.CUDAPluggableAllocator(str(so), "flare_arena_alloc", "flare_arena_free")

    def pool(self) -> torch.cuda.MemPool:
        import torch

        return torch.cuda.MemPool(self.allocator.allocator())

    @property
    def used(self) -> int:
        return int(self.lib.flare_arena_used())

    @property
    def failed_allocs(self) -> int:
        return int(self.lib.flare_arena_failed_allocs())

    def segments(self) -> list[Segment]:
        out = []
        for i in range(self.lib.flare_arena_segment_count()):
            off, size, freed = C.c_size_t(), C.c_size_t(), C.c_int()
            self.lib.flare_arena_segment(C.c_int(i), C.byref(off), C.byref(size), C.byref(freed))
            out.append(Segment(off.value, size.value, bool(freed.value)))
        return out

    def contains(self, address: int) -> bool:
        return self.base <= address < self.base + self.used
