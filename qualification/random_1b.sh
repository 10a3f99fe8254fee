#!/bin/bash
# GPU machine, one call: the ~1.07B seeded random-weight Llama (qualification/configs/llama_1b_random.json,
# SmolLM2's tokenizer) -> `ignition prepare` with numerics against Transformers -> `flare run CORE`
# with `flare bench` (decode c=1,2,4 x 256 tokens, cold 512/4096, prefix hit) -> Transformers
# generate with a static cache and the batch-1 HBM bound, in the same call.
# Binaries as in smollm2_e2e.sh (.dev/b1, .dev/b2). Usage: bash qualification/random_1b.sh OUTDIR
set -u
OUT=${1:-/tmp/random_1b}
mkdir -p "$OUT" /tmp/igncache
export PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin IGNITION_CACHE=/tmp/igncache
python3 -c "import lzma;open('/tmp/flare','wb').write(lzma.open('.dev/b2/flare.xz').read())" && chmod +x /tmp/flare
python3 -m ignition random-checkpoint --config qualification/configs/llama_1b_random.json --out /tmp/r1b \
  --tokenizer-from tests/fixtures/frontend/smollm2 > "$OUT/random.log" 2>&1
python3 qualification/make_reference_prompts.py /tmp/r1b /tmp/prompts1b.json
timeout 360 python3 -m ignition prepare --model /tmp/r1b --out /tmp/r1bcore --decode-buckets 1,2,4 \
  --prefill-chunk-size 256 --context-limit 4608 --served-name llama-1b-random \
  --reference-prompts /tmp/prompts1b.json > "$OUT/prepare.log" 2>&1
echo "prepare rc=$?"
cp /tmp/r1bcore.report.json "$OUT/" 2>/dev/null || cp /tmp/r1bcore.work/report.json "$OUT/r1bcore.report.json"
[ -f /tmp/r1bcore/manifest.pb ] || exit 4
timeout 200 python3 qualification/flare_vs_torch_replay.py --flare /tmp/flare --core /tmp/r1bcore \
  --tokenizer /tmp/r1b/tokenizer.json --reference /tmp/r1bcore.work/reference_generations.json \
  --out "$OUT/flare_vs_torch.json" --bench --bench-timeout 150 --log "$OUT/flare_run.log"
timeout 120 python3 qualification/hf_generate_baseline.py --model /tmp/r1b --out "$OUT/hf_generate.json" --tokens 256
