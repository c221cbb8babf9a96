#!/usr/bin/env bash
# ON the GPU machine (kind nvidia-h200), from the repo root of the sent checkout, after the bundle's parts were
# staged (scripts/gpu_pass.sh stage): one device call of the long-prompt work (bench/results/long_prompts/README.md),
# several passes of scripts/gpu_pass.sh long, each in its own results folder, packed into few files.
#
#   GPU_BUILD=build bash SRC/scripts/gpu_long_plan.sh PLAN      SRC: this checkout as carried (gpu_prepare.sh --src)
#
# PLAN: gather (bench/store_gather.py alone), call1 (single vs 1P1D vs direct at 16k/32k, 1P1D with the decoder busy
# at 16k@0.5, 64k through the 4 GB receive buffer, then the batched gather off: the A/B), call2 (the single instance
# beside a decoding neighbour; LMCache's PD at 16k; single with the decoder-busy point), call3
# (--max-num-batched-tokens 16384 for single and 1P1D).
# Each pass's results stay in /tmp/long/NAME on the machine (a later call on the same warm machine resumes them);
# $OUT/results.tgz holds every pass's e2e_gpu.json, parts and pass.log, $OUT/logs-NAME.tgz its server logs.
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
GPU_BUILD=$(cd "${GPU_BUILD:-build}" && pwd)
OUT=${OUT:-/tmp/gpu_plan_out}
SEED=${SEED:-$GPU_BUILD/long-seed}  # carried results of an earlier machine (NAME/parts/*.json): those rows are skipped
LIMIT_S=${LIMIT_S:-585}  # the device tool's 600 s per call, less the packing
started=$(date +%s)
mkdir -p /tmp/long "$OUT"

left() { echo $((LIMIT_S - ($(date +%s) - started))); }

pass() {  # pass NAME [ENV=VALUE ...] -- gpu_pass.sh long ARGS
  local name=$1; shift
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift
  local budget=$(( $(left) - 15 ))
  if [ "$budget" -lt 60 ]; then echo "[plan] $name: skipped, ${budget}s left"; return; fi
  mkdir -p "/tmp/long/$name/parts"
  compgen -G "$SEED/$name/parts/*.json" >/dev/null && cp -n "$SEED/$name/parts"/*.json "/tmp/long/$name/parts/"
  echo "[plan] $name: budget ${budget}s: ${envs[*]} $*"
  env "${envs[@]}" OUT="/tmp/long/$name/out" GPU_BUILD="$GPU_BUILD" bash "$SRC/scripts/gpu_pass.sh" long \
    --results-dir "/tmp/long/$name/parts" --log-dir "/tmp/long/$name/logs" --budget-s "$budget" --run-label "$name" "$@" \
    > "/tmp/long/$name/plan.log" 2>&1
  echo "[plan] $name: rc=$? after $(( $(date +%s) - started ))s; $(grep -c '"system"' /tmp/long/$name/out/e2e_gpu.json 2>/dev/null) rows"
  grep -E "ERROR|failed:|not started|stopped before" "/tmp/long/$name/plan.log" | head -5
}

gather() {  # the store gather alone (bench/store_gather.py): needs the bundle installed
  eval "$(bash "$GPU_BUILD/gpu-kit/install_bundle.sh" "$GPU_BUILD/gpu-bundle/bundle.sha")" || return
  mkdir -p /tmp/long/gather
  PYTHONPATH="$SRC:${PYTHONPATH:-}" python3 "$SRC/bench/store_gather.py" --out /tmp/long/gather/store_gather.json \
    2>&1 | tee /tmp/long/gather/store_gather.log | grep -v Warning | tail -8
}

IDLE="16000:seq:8,32000:seq:6"
bash "$SRC/scripts/gpu_pass.sh" stage >/dev/null 2>&1  # the last part, when this call carries it
case "${1:-}" in
  gather) gather ;;
  call1)
    pass single LONG_POINTS="$IDLE" -- --systems single
    pass p2p LONG_POINTS="$IDLE,16000:0.5:12:256,64000:seq:2" -- --systems lmcache_p2p-nixl
    pass p2p_gather_off LONG_POINTS="$IDLE" -- --systems lmcache_p2p-nixl --p2p-arg batched_gather=false ;;
  call2)
    pass neighbour LONG_POINTS="16000:0.5:12" LONG_DIRECT=0 -- --systems single-neighbour
    pass lmcache_pd LONG_POINTS="16000:seq:4" LONG_DIRECT=0 -- --systems lmcache-pd
    pass single_busy LONG_POINTS="16000:0.5:12:256" LONG_DIRECT=0 -- --systems single ;;
  call3)
    pass mnbt LONG_POINTS="$IDLE" LONG_VLLM_ARGS="--max-num-batched-tokens 16384" -- --systems single,lmcache_p2p-nixl ;;
  *) echo "usage: gpu_long_plan.sh gather|call1|call2|call3" >&2; exit 2 ;;
esac
# results: one archive of every pass's figures, one per pass of its logs (the device tool returns 8 files)
(cd /tmp/long && tar -czf "$OUT/results.tgz" --exclude='*/logs' --exclude='*/out/logs.tar.gz' .)
for d in /tmp/long/*/out/logs.tar.gz; do [ -f "$d" ] && cp "$d" "$OUT/logs-$(basename "$(dirname "$(dirname "$d")")").tgz"; done
ls -la "$OUT"; echo "[plan] done after $(( $(date +%s) - started ))s"
