#!/bin/bash
# GPU machine: capture a Triton-only decode/prefill step on the fixed-address arena, export it as a
# runtime core, replay each graph in Rust (core_replay, fresh process; at the recorded base and
# forced to relocate) and compare the output bytes with torch's replay.
# Usage (repo root, device): bash qualification/ignition_capture_replay.sh OUTDIR
# Needs target/release/examples/core_replay (cargo build --release -p helios-replay --features cuda --example core_replay).
set -u
OUTDIR=${1:-/tmp/ignition_capture}
export PYTHONUNBUFFERED=1
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
rm -rf /tmp/cap
python3 -m ignition.capture --out /tmp/cap --core-replay target/release/examples/core_replay --repeat 200 ${DIAGNOSE:+--diagnose} \
  > "$OUTDIR/capture.log" 2>&1
echo "capture rc=$?"
cp /tmp/cap/report.json "$OUTDIR/report.json" 2>/dev/null
tar czf "$OUTDIR/core.tgz" -C /tmp/cap core recording/recorded_graph.json 2>/dev/null
ls -la "$OUTDIR"
if [ -n "${DIAGNOSE:-}" ]; then
  tar czf "$OUTDIR/decode_io.tgz" -C /tmp/cap io/decode_b4 rust/decode_b4 rust_reloc/decode_b4 again full 2>/dev/null
fi
