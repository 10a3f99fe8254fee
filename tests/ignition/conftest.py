"""Shared fixtures of Ignition's CPU tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "ignition"
sys.path.insert(0, str(REPO))


def require_torch() -> object:
    """torch, or a skip; with IGNITION_REQUIRE_TORCH=1 (CI) a missing torch fails instead."""
    try:
        import torch
    except ImportError:
        if os.environ.get("IGNITION_REQUIRE_TORCH") == "1":
            pytest.fail("IGNITION_REQUIRE_TORCH=1 but torch is not installed")
        pytest.skip("torch is not installed")
    return torch


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
