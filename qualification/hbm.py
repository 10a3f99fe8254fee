"""The device's peak HBM bandwidth, for the batch-1 bound every decode figure is compared with.

The scripts beside this one take `--hbm-gbps`; without it the bandwidth follows the device's name
(a report timed on an H100 once used the H200's 4.8 TB/s, understating the fraction reached).
Datasheet figures; an unknown device needs `--hbm-gbps`."""

from __future__ import annotations

import subprocess

# Device name prefix (as nvidia-smi and the CUDA driver spell it) -> GB/s; longest prefix first.
PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("NVIDIA H200 NVL", 4800.0),
    ("NVIDIA H200", 4800.0),
    ("NVIDIA H100 NVL", 3900.0),
    ("NVIDIA H100 PCIe", 2000.0),
    ("NVIDIA H100 80GB HBM3", 3350.0),
    ("NVIDIA H100", 3350.0),
)


class UnknownDevice(Exception):
    """No datasheet bandwidth for this device: pass `--hbm-gbps`."""


def device_name() -> str:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return out.stdout.strip()


def peak_gbps(override: float | None = None, name: str | None = None) -> tuple[float, str]:
    """(GB/s, where it came from): `override` if given, else the datasheet figure for `name`
    (default: GPU 0's name)."""
    if override is not None:
        return override, "--hbm-gbps"
    name = device_name() if name is None else name
    for prefix, gbps in PEAK_GBPS:
        if name.startswith(prefix):
            return gbps, f"datasheet for {name}"
    raise UnknownDevice(f"no HBM bandwidth known for {name!r}: pass --hbm-gbps")
