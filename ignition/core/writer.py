"""Writes a runtime-core directory: files first, then manifest.pb (see core.rs for the layout)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ignition.core.checks import check_core
from ignition.core.manifest import MANIFEST_FILE, RuntimeCore


@dataclass(eq=False)
class CorePathError(Exception):
    path: str
    reason: str

    def __str__(self) -> str:
        return f"core file {self.path!r}: {self.reason}"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _safe(relative: str) -> str:
    p = PurePosixPath(relative)
    if (
        not relative
        or p.is_absolute()
        or "\\" in relative
        or any(part in ("", ".", "..") for part in relative.split("/"))
    ):
        raise CorePathError(relative, "must be relative, '/'-separated, without '.' or '..'")
    return relative


class CoreDirectory:
    """A core directory being written. Files are written as they are added; the manifest last."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, str] = {}
        root.mkdir(parents=True, exist_ok=True)
        if (root / MANIFEST_FILE).exists():
            (root / MANIFEST_FILE).unlink()

    def add_file(self, relative: str, data: bytes) -> str:
        """Writes `data` at `relative`; returns its sha256."""
        _safe(relative)
        if relative in self.files:
            raise CorePathError(relative, "written twice")
        full = self.root / relative
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_bytes(data)
        digest = sha256_hex(data)
        self.files[relative] = digest
        return digest

    def write_manifest(self, core: RuntimeCore) -> Path:
        """Checks `core`, then writes manifest.pb atomically (rename over a temporary file)."""
        check_core(core)
        named = [f.path for f in core.payload_files] + [k.file for k in core.kernels]
        named += [core.frontend.tokenizer.path, core.frontend.chat_template.path]
        for path in named:
            if path not in self.files:
                raise CorePathError(path, "named by the manifest but not written")
        target = self.root / MANIFEST_FILE
        tmp = target.with_suffix(".pb.tmp")
        tmp.write_bytes(core.encode())
        os.replace(tmp, target)
        return target
