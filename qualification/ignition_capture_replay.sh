#!/bin/bash
# GPU machine: `ignition prepare` on a seeded random tiny Llama with every check, each graph's I/O
# replayed in Rust (core_replay, fresh process; at the recorded base and relocated) and compared
# bitwise with torch's replay. Result: qualification/ignition_capture_replay.json.
# Usage (repo root, device): bash qualification/ignition_capture_replay.sh OUTDIR
# Needs target/release/examples/core_replay (cargo build --release -p helios-replay --features cuda --example core_replay).
set -u
OUTDIR=${1:-/tmp/ignition_capture}
export PYTHONUNBUFFERED=1
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m ignition.capture --out /tmp/tiny --core-replay target/release/examples/core_replay > "$OUTDIR/capture.log" 2>&1
echo "capture rc=$?"
cp /tmp/tiny/core.report.json "$OUTDIR/report.json" 2>/dev/null || cp /tmp/tiny/core.work/report.json "$OUTDIR/report.json"
