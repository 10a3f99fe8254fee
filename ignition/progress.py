"""Progress output for Ignition's phases (stderr, one line per event, timed).

A phase that runs long says so once a minute; with `IGNITION_STACKS=1` each of those lines is
followed by every thread's Python stack (`faulthandler`), so a stalled compile shows where it is."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

_stream: TextIO = sys.stderr
HEARTBEAT_S = 60.0


def note(message: str) -> None:
    print(f"[ignition]   {message}", file=_stream, flush=True)


def _heartbeat(name: str, start: float, done: threading.Event, every: float) -> None:
    stacks = os.environ.get("IGNITION_STACKS") == "1"
    while not done.wait(every):
        print(f"[ignition] {name}: still running after {time.monotonic() - start:.0f} s", file=_stream, flush=True)
        if stacks:
            try:
                faulthandler.dump_traceback(file=_stream, all_threads=True)
            except (OSError, ValueError):  # a stream without a file descriptor (captured output)
                stacks = False


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Prints the phase on entry, a line every `HEARTBEAT_S` while it runs, and its duration on
    exit (or that it failed)."""
    start = time.monotonic()
    print(f"[ignition] {name} ...", file=_stream, flush=True)
    done = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(name, start, done, HEARTBEAT_S), daemon=True)
    beat.start()
    try:
        yield
    except BaseException:
        print(f"[ignition] {name}: failed after {time.monotonic() - start:.1f} s", file=_stream, flush=True)
        raise
    finally:
        done.set()
        beat.join()
    print(f"[ignition] {name}: done in {time.monotonic() - start:.1f} s", file=_stream, flush=True)
