#!/usr/bin/env bash
# ON the GPU machine (device kind nvidia-h200-x2), from the repo root; scripts/gpu_prepare.sh made what it carries.
#
#   bash scripts/gpu_pass.sh stage         copy the carried bundle part(s) to /tmp/stage (one call per part)
#   bash scripts/gpu_pass.sh run [ARGS]    stage the last part, install the bundle (idempotent, seconds), make
#                                          the models (/tmp/models/tiny, /tmp/models/llama8b-shape and
#                                          /tmp/models/llama8b-128k: the 8B body with Llama-3.1's 128256-token
#                                          vocabulary and no tokenizer), then bench/e2e_gpu.py ARGS (default:
#                                          the full pass, see below)
#   bash scripts/gpu_pass.sh long [ARGS]   the same, then the long-prompt pass (bench/results/long_prompts.md):
#                                          single vs lmcache_p2p 1P1D (--one-gpu on a one-GPU machine), 8k-64k tokens
#                                          in, 2 out, the engines traced; ARGS (e.g. --systems, --results-dir) are
#                                          added to its defaults; LONG_POINTS replaces its --long points,
#                                          LONG_VLLM_ARGS adds vLLM flags for every server, LONG_DIRECT=0 drops
#                                          --direct-prefiller
#   bash scripts/gpu_pass.sh equal ARGS    the same set-up, then bench/e2e_gpu_equal.py --mode equal ARGS (greedy
#                                          equality through 1P1D against a single instance)
#   bash scripts/gpu_pass.sh kill ARGS     ... --mode kill ARGS (NCCL: the prefiller killed under load)
#   bash scripts/gpu_pass.sh faults [ARGS] the same set-up (tiny model only), then in one call of at most FAULTS_LIMIT_S
#                                          (570) seconds: bench/faults_gpu.py ARGS (the short fault scenarios on 1P2D,
#                                          NIXL over cuda_ipc with the VRAM arena and the asynchronous store, NCCL where
#                                          each instance has a GPU; FAULTS_MAX_S, default 420, at most), then the GPU
#                                          tests (pytest -m gpu GPU_TESTS, -n 4; the image's pytest, else the kit's
#                                          pytest-wheels) with the time left; each part under its own timeout.
#                                          Results $OUT/faults_gpu.json, $OUT/pytest_gpu.txt, $OUT/logs.tar.gz, pass.log
#   bash scripts/gpu_pass.sh tp [ARGS]     the same set-up, then the TP rows of bench/e2e_gpu_equal.py --mode equal (greedy
#                                          equality against a single instance at the decoder's TP size, every decoder
#                                          rank's LMCache retrieve checked): P TP1 -> D TP2 (3 GPUs), P TP2 -> D TP2
#                                          (4 GPUs); a row needing more GPUs than the machine has is skipped (said so);
#                                          TP_ROWS ("P:D:GPUS ...", default "1:2:3 2:2:4") replaces the rows, TP_MODEL
#                                          (default tiny=/tmp/models/tiny) the model; ARGS go to every row; results
#                                          $OUT/tp_p<P>_d<D>.json
#
# Results: $OUT/e2e_gpu.json, $OUT/e2e_gpu_parts.tar.gz (<system>.json per system, peer_copy_ceiling.json:
# unpack them into build/e2e_gpu_parts here and carry that folder next time: rates already measured are
# skipped; a later call on the same warm machine finds them in /tmp/e2e_gpu_parts_keep by itself),
# $OUT/logs.tar.gz (every server and bench log), $OUT/pass.log. GPU_BUILD (default build) is where the carried bundle, kit and parts are; GPU_PARTS (default
# $GPU_BUILD/e2e_gpu_parts) the carried results of earlier calls. The device tool sends the checkout its session
# started in: to run another worktree's code, carry a copy of it (scripts/gpu_prepare.sh --src) and run its
# gpu_pass.sh with GPU_BUILD pointing at the carried build folder.
set -uo pipefail
GPU_BUILD=$(cd "${GPU_BUILD:-build}" && pwd)
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/gpu_pass_out}
KEEP=/tmp/e2e_gpu_parts_keep  # this machine's parts between calls ($OUT is emptied before each call)
mkdir -p /tmp/stage "$OUT"

stage() {
  compgen -G "$GPU_BUILD/gpu-bundle/parts/p[0-9]" >/dev/null && cp "$GPU_BUILD"/gpu-bundle/parts/p[0-9] /tmp/stage/
  echo "[gpu_pass] staged: $(cd /tmp/stage && ls p[0-9] 2>/dev/null | tr "\n" " ")($(du -cm /tmp/stage/p[0-9] | tail -n 1 | cut -f1) MiB)"
}

case "${1:-}" in
  stage) stage; exit 0 ;;
  run) shift; BENCH=bench/e2e_gpu.py ;;
  long) shift; BENCH=bench/e2e_gpu.py; LONG=1 ;;
  equal|kill) MODE=$1; shift; BENCH=bench/e2e_gpu_equal.py; set -- --mode "$MODE" "$@" ;;
  tp) shift; BENCH=bench/e2e_gpu_equal.py; TP=1 ;;
  faults) shift; BENCH=bench/faults_gpu.py; FAULTS=1 ;;
  *) echo "usage: gpu_pass.sh stage | run|long [bench/e2e_gpu.py arguments] | equal|kill|tp bench/e2e_gpu_equal.py arguments" \
          "| faults [bench/faults_gpu.py arguments]" >&2
     exit 2 ;;
esac
FAULTS_LIMIT_S=${FAULTS_LIMIT_S:-570}  # the fault pass from its start: the device tool ends a call at 600 s
FAULTS_MAX_S=${FAULTS_MAX_S:-420}  # bench/faults_gpu.py at most (SIGTERM then: it stops its servers, writes its rows)
FAULTS_KILL_GRACE_S=40  # after that SIGTERM, SIGKILL
PYTEST_MIN_S=${PYTEST_MIN_S:-90}  # what the GPU tests keep at least
PACK_S=15
GPU_TESTS=${GPU_TESTS:-"tests/backend/test_store_ready_gpu.py tests/backend/test_engine_gpu.py tests/transport"}
FAULTS_PIDS=/tmp/faults_gpu_pids  # every server bench/faults_gpu.py started: each leads its own session

left_s() { echo $((FAULTS_LIMIT_S - ($(date +%s) - start))); }

pack_logs() {  # pack DEST DIR...: one gzip tarball under the device tool's 16 MiB per file (else each log's tail)
  local dest=$1 d; shift
  local dirs=(); for d in "$@"; do [ -d "$d" ] && dirs+=("${d#/tmp/}"); done
  [ ${#dirs[@]} -eq 0 ] && return
  tar -czf "$dest" -C /tmp "${dirs[@]}" 2>/dev/null
  if [ "$(stat -c %s "$dest" 2>/dev/null || echo 0)" -gt 15000000 ]; then
    rm -rf /tmp/log_tails && mkdir -p /tmp/log_tails
    (cd /tmp && find "${dirs[@]}" -type f \( -name '*.log' -o -name '*.yaml' -o -name '*.json' \) | while read -r f; do
      mkdir -p "/tmp/log_tails/$(dirname "$f")" && tail -n 3000 "$f" > "/tmp/log_tails/$f"; done)
    tar -czf "$dest" -C /tmp/log_tails .
    echo "[gpu_pass] logs over 15 MB: packed each one's last 3000 lines"
  fi
}

faults_pass() {  # bench/faults_gpu.py, then the GPU tests, each with a time limit that keeps the rest's time
  local rc flimit plimit pid
  python3 -m compileall -q -j 8 "${SITE:-/tmp/site}" >/dev/null 2>&1 &  # the bundle's .pyc (installed without)
  flimit=$(( $(left_s) - PYTEST_MIN_S - FAULTS_KILL_GRACE_S - PACK_S ))
  [ "$flimit" -gt "$FAULTS_MAX_S" ] && flimit=$FAULTS_MAX_S
  rm -f "$FAULTS_PIDS"
  echo "[gpu_pass] faults: limit ${flimit}s"
  timeout -k "$FAULTS_KILL_GRACE_S" "$flimit" python3 bench/faults_gpu.py --model /tmp/models/tiny \
    --out "$OUT/faults_gpu.json" --log-dir /tmp/faults_gpu_logs --pid-log "$FAULTS_PIDS" \
    --budget-s $((flimit - FAULTS_KILL_GRACE_S - 5)) "$@"
  rc=$?
  echo "[gpu_pass] faults rc=$rc after $(($(date +%s) - start))s"
  for pid in $(cat "$FAULTS_PIDS" 2>/dev/null); do kill -9 -- "-$pid" 2>/dev/null; done  # what a killed pass left
  if ! python3 -c "import pytest, xdist, pytest_timeout" 2>/dev/null; then
    python3 -m pip install -q --no-index --find-links "$GPU_BUILD/gpu-kit/pytest-wheels" --target /tmp/pytest-site \
      pytest pytest-timeout pytest-xdist && export PYTHONPATH="/tmp/pytest-site:$PYTHONPATH"
  fi
  plimit=$(( $(left_s) - PACK_S ))
  if [ "$plimit" -ge 30 ]; then
    echo "[gpu_pass] GPU tests: limit ${plimit}s: $GPU_TESTS"
    # shellcheck disable=SC2086  # GPU_TESTS is a list of paths
    timeout -k 10 "$plimit" python3 -m pytest -m gpu $GPU_TESTS -p no:cacheprovider -v -rfEs -n 4 --dist load \
      --timeout 150 --basetemp /tmp/pytest_gpu > "$OUT/pytest_gpu.txt" 2>&1
    echo "[gpu_pass] GPU tests rc=$? after $(($(date +%s) - start))s: $(tail -n 1 "$OUT/pytest_gpu.txt")"
  else
    echo "GPU tests not run: ${plimit}s left of FAULTS_LIMIT_S" | tee "$OUT/pytest_gpu.txt"
  fi
  pack_logs "$OUT/logs.tar.gz" /tmp/faults_gpu_logs /tmp/pytest_gpu
  return $rc
}

stage
set -o pipefail
{
  start=$(date +%s)
  eval "$(bash "$GPU_BUILD/gpu-kit/install_bundle.sh" "$GPU_BUILD/gpu-bundle/bundle.sha")" || exit 1
  export PYTHONPATH="$ROOT:$PYTHONPATH" PYTHONUNBUFFERED=1
  # vLLM loads our plugin only through an installed entry point; this copy is on PYTHONPATH, not installed
  python3 "$ROOT/scripts/plugin_metadata.py" "${SITE:-/tmp/site}" >/dev/null || exit 1
  # vllm-router for the vllm-nixl system, the LMCache MP server's imports for vllm-nixl-lmcache-mp
  if compgen -G "$GPU_BUILD/gpu-kit/wheels/*.whl" >/dev/null; then
    [ -d "${SITE:-/tmp/site}/vllm_router" ] && [ -d "${SITE:-/tmp/site}/blake3" ] || python3 -m pip install -q \
      --no-index --no-deps --no-compile --upgrade --target "${SITE:-/tmp/site}" "$GPU_BUILD"/gpu-kit/wheels/*.whl \
      || exit 1
  fi
  echo "[gpu_pass] installed in $(($(date +%s) - start))s"
  nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv
  [ -f /tmp/models/llama8b-shape/config.json ] || python3 "$GPU_BUILD/gpu-kit/make_models.py" /tmp/models || exit 1
  if [ -n "${FAULTS:-}" ]; then
    faults_pass "$@"
    rc=$?
    echo "[gpu_pass] fault pass rc=$rc after $(($(date +%s) - start))s"
    exit $rc
  fi
  [ -f /tmp/models/llama8b-128k/config.json ] || python3 - <<'PY' || exit 1
import json, os
src, dst = "/tmp/models/llama8b-shape", "/tmp/models/llama8b-128k"
os.makedirs(dst, exist_ok=True)
config = json.load(open(os.path.join(src, "config.json")))
config.update(vocab_size=128256, bos_token_id=128000, eos_token_id=128001, pad_token_id=None)
json.dump(config, open(os.path.join(dst, "config.json"), "w"), indent=1)
print("[gpu_pass] made", dst, "(vocab 128256, no tokenizer: serve with --skip-tokenizer-init)")
PY
  [ -f /tmp/models/llama8b-long/config.json ] || python3 - <<'PY' || exit 1
import json, os, shutil
src, dst = "/tmp/models/llama8b-shape", "/tmp/models/llama8b-long"
shutil.copytree(src, dst, dirs_exist_ok=True)
config = json.load(open(os.path.join(dst, "config.json")))
config.update(max_position_embeddings=131072)
json.dump(config, open(os.path.join(dst, "config.json"), "w"), indent=1)
print("[gpu_pass] made", dst, "(the 8B body with a 131072-token context, the tiny tokenizer)")
PY
  mkdir -p "$KEEP"
  GPU_PARTS=${GPU_PARTS:-$GPU_BUILD/e2e_gpu_parts}  # results of earlier calls, carried: what they measured is skipped
  # (those of earlier calls on this warm machine, already in $KEEP, are newer: carried ones only fill gaps)
  compgen -G "$GPU_PARTS/*.json" >/dev/null && cp -n "$GPU_PARTS"/*.json "$KEEP/"
  if [ "$BENCH" = bench/e2e_gpu.py ]; then
    if [ -n "${LONG:-}" ]; then  # the long-prompt pass: ARGS go before the defaults' "--" (later flags win)
      ngpu=$(nvidia-smi -L | wc -l)
      set -- --model /tmp/models/llama8b-long --max-model-len 65600 --output-len 2 --no-ceiling \
        --long "${LONG_POINTS:-8000:seq:8,16000:seq:8,32000:seq:6,64000:seq:3,16000:0.5:12}" \
        --systems single,lmcache_p2p-nixl --buffer-size 4GB --trace $([ "${LONG_DIRECT:-1}" = 1 ] && echo --direct-prefiller) \
        --single-gpu-memory-utilization prefiller --budget-s 560 --estimate-start-s 120 \
        $([ "$ngpu" -lt 2 ] && echo --one-gpu) "$@" -- --load-format dummy ${LONG_VLLM_ARGS:-}
    elif [ $# -eq 0 ]; then  # the full pass; a call of the device tool runs 10 minutes at most: --budget-s
      set -- --model /tmp/models/llama8b-shape --rates 1,2,4,8,16 --num-prompts 64 --budget-s 540 -- --load-format dummy
    fi
    set -- --out "$OUT/e2e_gpu.json" --lmcache-pd-proxy "$GPU_BUILD/gpu-kit/pd_proxy.py" "$@"
  fi
  if [ -n "${TP:-}" ]; then  # one equality run per TP row that fits the machine's GPUs
    ngpu=$(nvidia-smi -L | wc -l)
    rc=0
    for row in ${TP_ROWS:-1:2:3 2:2:4}; do
      IFS=: read -r ptp dtp need <<<"$row"
      if [ "$ngpu" -lt "$need" ]; then
        echo "[gpu_pass] TP row P TP$ptp -> D TP$dtp skipped: it needs $need GPUs, this machine has $ngpu"
        continue
      fi
      echo "[gpu_pass] TP row P TP$ptp -> D TP$dtp on $need GPUs"
      python3 "$BENCH" --mode equal --model "${TP_MODEL:-tiny=/tmp/models/tiny}" --prefill-tp "$ptp" --decode-tp "$dtp" \
        --results-dir "$KEEP/tp-p$ptp-d$dtp" --log-dir "/tmp/e2e_gpu_logs/tp-p$ptp-d$dtp" \
        --out "$OUT/tp_p${ptp}_d${dtp}.json" "$@" || rc=$?
    done
    tar -czf "$OUT/logs.tar.gz" -C /tmp/e2e_gpu_logs . 2>/dev/null
  else
    python3 "$BENCH" --results-dir "$KEEP" --log-dir /tmp/e2e_gpu_logs --logs-archive "$OUT/logs.tar.gz" "$@"
    rc=$?
  fi
  tar -czf "$OUT/e2e_gpu_parts.tar.gz" -C "$KEEP" .  # one file: the device tool returns 8 at most
  echo "[gpu_pass] $BENCH rc=$rc after $(($(date +%s) - start))s"
  ps -eo pid,args | grep -E "vllm|lmcache_p2p|pd_proxy" | grep -v grep | head -5
  exit $rc
} 2>&1 | tee "$OUT/pass.log"
