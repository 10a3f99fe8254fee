"""Progress output for Ignition's phases (stderr, one line per event, timed)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

_stream: TextIO = sys.stderr


def note(message: str) -> None:
    print(f"[ignition]   {message}", file=_stream, flush=True)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Prints the phase on entry and its duration on exit (or that it failed)."""
    start = time.monotonic()
    print(f"[ignition] {name} ...", file=_stream, flush=True)
    try:
        yield
    except BaseException:
        print(f"[ignition] {name}: failed after {time.monotonic() - start:.1f} s", file=_stream, flush=True)
        raise
    print(f"[ignition] {name}: done in {time.monotonic() - start:.1f} s", file=_stream, flush=True)
