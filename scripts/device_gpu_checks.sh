#!/usr/bin/env bash
# Run ON the GPU machine (device kind nvidia-h200-x2), from the repo root, with device/wheels
# carried (scripts/device_wheels.sh prepares them here). Everything issue 4 asks of the device,
# in one command; every step has its own time limit and log under $LOGS (default: $OUT):
#
#   bench         bench/transfer.py --device cuda (alone on the machine: it is the measurement)
#   tests         pytest -m gpu: the transport contract suite on VRAM (NIXL cuda_ipc, NIXL staged,
#                 NCCL, NCCL staged), the NCCL GPU tests, the engine-level plugin test (lmcache 0.5.3)
#   alternatives  the host->VRAM routes the staging ring replaces (UCX alone, three settings),
#                 32 MiB chunks, 512 MiB; runs beside the tests (an order-of-magnitude question)
#
#   STEPS="bench tests alternatives" bash scripts/device_gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."

LOGS=${LOGS:-${OUT:-/tmp/lmcache_p2p_logs}}
STEPS=${STEPS:-"bench tests alternatives"}
mkdir -p "$LOGS"
# NVLink multicast stays off on these machines (KINDS.md); a failed NCCL op fails its pair only.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=2 PYTHONUNBUFFERED=1 LMCACHE_TRACK_USAGE=false PYTHONHASHSEED=0

eval "$(bash scripts/device_setup.sh 2>"$LOGS/setup.log")" || { cat "$LOGS/setup.log"; exit 1; }
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m; } \
  >>"$LOGS/setup.log" 2>&1
cat "$LOGS/setup.log"

run_step() {  # run_step NAME LIMIT_S COMMAND...: log to $LOGS/NAME.log, print its tail
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  echo "== $name: rc=$rc in $(($(date +%s) - start))s (limit ${limit}s)" | tee -a "$LOGS/$name.log"
  return $rc
}

show() {  # the useful end of a log: result lines first, then the tail
  grep -E "^(nixl|nccl|path|\[transfer\]|PASSED|FAILED|ERROR|SKIPPED|=+ .*(passed|failed|error))" "$1" | head -80
  echo "-- tail of $1"
  tail -n "${2:-25}" "$1"
}

has() { [[ " $STEPS " == *" $1 "* ]]; }

if has bench; then
  run_step bench 200 python3 bench/transfer.py --device cuda --out "$LOGS/transfer_gpu.json"
  show "$LOGS/bench.log" 12
fi

pids=()
if has alternatives; then
  run_step alternatives 150 python3 bench/transfer.py --device cuda --chunk-sizes 32M --total-bytes 512M \
    --repeats 1 --out "$LOGS/transfer_gpu_alternatives.json" \
    --paths "nixl host->vram unstaged,nixl host->vram unstaged frag=cuda,nixl host->vram unstaged +sm frag=cuda" &
  pids+=($!)
fi
if has tests; then
  run_step tests 330 python3 -m pytest -m gpu tests/transport tests/backend -q -rA -p no:cacheprovider \
    -n 4 --dist load --timeout 200 &
  pids+=($!)
fi
for pid in "${pids[@]}"; do wait "$pid"; done
if has tests; then
  show "$LOGS/tests.log" 40
  # Engine logs of failed engine tests live in pytest's tmp dirs: keep their ends.
  for log in $(find /tmp/pytest-of-* -name '*.log' -newer "$LOGS/setup.log" 2>/dev/null | head -8); do
    { echo "-- $log"; grep -E "ERROR|Error|Traceback|lmcache_p2p" "$log" | tail -n 30; } >>"$LOGS/tests.log"
  done
fi
if has alternatives; then
  show "$LOGS/alternatives.log" 8
fi
ls -la "$LOGS"
