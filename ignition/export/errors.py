"""Typed export failures. Each names the graph, node and kernel it is about."""

from __future__ import annotations

from dataclasses import dataclass


class ExportError(Exception):
    """Base of every export failure: the core is not written."""


@dataclass(eq=False)
class UnresolvedPointerError(ExportError):
    """A pointer-looking parameter word inside the arena that lies in no buffer."""

    graph: str
    node: int
    kernel: str
    param_index: int
    byte_offset: int
    word: int
    # The buffers on either side of the address (`AddressMap.around`), for diagnosis.
    around: str = ""

    def __str__(self) -> str:
        return (
            f"graph {self.graph} node {self.node}: kernel {self.kernel} parameter {self.param_index} "
            f"byte offset {self.byte_offset} holds {self.word:#x}, inside the arena but in no buffer"
            + (f" ({self.around})" if self.around else "")
        )


@dataclass(eq=False)
class ForeignPointerError(ExportError):
    """A parameter word pointing into device memory outside the arena (another allocator)."""

    graph: str
    node: int
    kernel: str
    param_index: int
    byte_offset: int
    word: int

    def __str__(self) -> str:
        return (
            f"graph {self.graph} node {self.node}: kernel {self.kernel} parameter {self.param_index} "
            f"byte offset {self.byte_offset} holds {self.word:#x}, device memory outside the preparation arena"
        )


@dataclass(eq=False)
class LibraryKernelError(ExportError):
    """A kernel whose exact image cannot be recovered (cuBLAS, cuBLASLt, CUTLASS, aten, ...)."""

    graph: str
    node: int
    kernel: str
    reason: str

    def __str__(self) -> str:
        return f"graph {self.graph} node {self.node}: library kernel {self.kernel} cannot be exported ({self.reason})"


@dataclass(eq=False)
class UnresolvedAddressError(ExportError):
    """A memcpy/memset/binding address range that does not lie inside one buffer."""

    graph: str
    where: str
    address: int
    byte_count: int

    def __str__(self) -> str:
        return (
            f"graph {self.graph} {self.where}: [{self.address:#x}, +{self.byte_count}) does not lie inside one buffer"
        )


@dataclass(eq=False)
class RecordingError(ExportError):
    """The recorded graph description is malformed."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"recording {self.field}: {self.reason}"


@dataclass(eq=False)
class MissingKernelImageError(ExportError):
    kernel: str
    path: str

    def __str__(self) -> str:
        return f"kernel {self.kernel}: recorded image {self.path} is missing"
