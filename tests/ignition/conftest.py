"""Shared fixtures of Ignition's CPU tests."""

from __future__ import annotations

import copy
import importlib
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "ignition"
sys.path.insert(0, str(REPO))


def require_torch() -> None:
    """Skips the test when torch is missing (then `import torch`); with IGNITION_REQUIRE_TORCH=1
    (CI) a missing torch fails instead."""
    try:
        importlib.import_module("torch")
    except ImportError:
        if os.environ.get("IGNITION_REQUIRE_TORCH") == "1":
            pytest.fail("IGNITION_REQUIRE_TORCH=1 but torch is not installed")
        pytest.skip("torch is not installed")


@pytest.fixture(scope="session")
def flare_bin() -> Path:
    """The `flare` binary: $FLARE_BIN, else target/debug/flare (built with `cargo build -p flare` if missing)."""
    env = os.environ.get("FLARE_BIN")
    path = Path(env) if env else REPO / "target" / "debug" / "flare"
    if not path.exists():
        if env:
            pytest.fail(f"FLARE_BIN={env} does not exist")
        subprocess.run(["cargo", "build", "-p", "flare", "--locked"], cwd=REPO, check=True)
    return path


def flare_check(flare: Path, core: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(flare), "check", str(core)], capture_output=True, text=True)


# How each sampling graph binds the pending tokens (ignition.capture.recorder.PENDING_DIRECTION).
PENDING_DIRECTION = {"decode": "state_read_write", "prefill": "state_write", "resume_sampling": "state_write"}


def with_pending_tokens(rec: dict[str, Any]) -> dict[str, Any]:
    """The recorded fixture as a device-fed capture records it: a zero-filled `pending_tokens`
    request-state buffer after the last allocation, bound by every sampling graph with its
    direction, and decode graphs that take `token_ids` (past the fixture's staging views)."""
    rec = copy.deepcopy(rec)
    base = int(rec["arena"]["base_address"], 16)
    slots = rec["capacities"]["request_slots"]
    end = max(a["offset"] + a["byte_size"] for a in rec["allocations"])
    offset = -(-end // 256) * 256
    rec["allocations"].append(
        {
            "name": "pending_tokens",
            "role": "request_state",
            "offset": offset,
            "byte_size": 4 * (slots + 1),
            "alignment": 256,
            "dtype": "i32",
            "shape": [slots + 1],
            "init": "zero",
        }
    )
    assert offset + 4 * (slots + 1) <= rec["arena"]["byte_size"]
    staging = next(a for a in rec["allocations"] if a["role"] == "staging_inputs")
    used = max(
        int(b["address"], 16) + 8 * math.prod(b["shape"])
        for g in rec["graphs"]
        for b in g["bindings"]
        if b["value"] != "completion_records"
    )
    tokens = -(-used // 256) * 256
    assert tokens + 64 <= base + staging["offset"] + staging["byte_size"]
    for g in rec["graphs"]:
        if g["kind"] == "decode":
            g["bindings"].append(
                {
                    "value": "token_ids",
                    "address": hex(tokens),
                    "dtype": "i32",
                    "shape": [g["capacity"]["request_count"]],
                }
            )
        g["bindings"].append(
            {
                "value": "pending_tokens",
                "address": hex(base + offset),
                "dtype": "i32",
                "shape": [slots + 1],
                "direction": PENDING_DIRECTION[g["kind"]],
            }
        )
    return rec
