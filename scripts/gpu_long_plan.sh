#!/usr/bin/env bash
# ON the GPU machine (kind nvidia-h200), from the repo root of the sent checkout, after the bundle's parts were
# staged (scripts/gpu_pass.sh stage): one device call of the long-prompt work (bench/results/long_prompts.md),
# several passes of scripts/gpu_pass.sh long, each in its own results folder, packed into few files.
#
#   GPU_BUILD=build bash SRC/scripts/gpu_long_plan.sh PLAN      SRC: this checkout as carried (gpu_prepare.sh --src)
#
# PLAN: gather (bench/store_gather.py alone), call1 (single vs 1P1D vs direct at 16k/32k, 1P1D with the decoder busy
# at 16k@0.5, 64k through the 4 GB receive buffer, then the batched gather off: the A/B), call2 (the single instance
# beside a decoding neighbour; LMCache's PD at 16k; single with the decoder-busy point), call3
# (--max-num-batched-tokens 16384 for single and 1P1D), detok (single and 1P1D at 16k/32k after the detokenizer's
# bounded context, after the TP engine tests over cuda_ipc), replay (the same after the first token's replay moved
# off the first byte's path), busy (single and 1P1D with 256 outputs at 16k @ 0.5 req/s:
# the decoder-busy split), credit (single and 1P1D at 32k and 64k: the buffer full for each prompt), pd16 (LMCache's PD, single
# and ours at 16k with --max-model-len 20000: LMCache's decoder cannot hold a 64k context beside its buffer).
# Each pass's results stay in /tmp/long/NAME on the machine (a later call on the same warm machine resumes them);
# $OUT/results.tgz holds every pass's e2e_gpu.json, parts and pass.log, $OUT/logs-NAME.tgz its server logs.
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
GPU_BUILD=$(cd "${GPU_BUILD:-build}" && pwd)
cd "$SRC"  # python -m imports from the working folder: this checkout's lmcache_p2p, not the sent one's
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

IDLE=${LONG_IDLE:-16000:seq:8,32000:seq:6}  # the idle rows: prompt tokens:rate:prompts

tp_gpu() {  # issue 20's engine-level TP tests over cuda_ipc (tests/backend/test_engine_tp_gpu.py), pytest from
  # the carried build/pytest-wheels (the bundle has none); log and junit in /tmp/long/tp_gpu
  eval "$(bash "$GPU_BUILD/gpu-kit/install_bundle.sh" "$GPU_BUILD/gpu-bundle/bundle.sha")" || return
  local d=/tmp/long/tp_gpu limit=$(( $(left) - 20 )); mkdir -p $d
  [ "$limit" -gt 240 ] && limit=240
  if [ "$limit" -lt 60 ]; then echo "[plan] tp_gpu: skipped, ${limit}s left"; return; fi
  python3 -m pip install -q --no-index --find-links "$GPU_BUILD/pytest-wheels" --target /tmp/pytest-site \
    pytest pytest-timeout > $d/pip.log 2>&1 || { tail -3 $d/pip.log; return; }
  PYTHONPATH="/tmp/pytest-site:$SRC:${PYTHONPATH:-}" timeout -k 10 "$limit" python3 -m pytest -m gpu \
    tests/backend/test_engine_tp_gpu.py -q -rA -p no:cacheprovider --timeout 200 --junitxml $d/junit.xml \
    > $d/pytest.log 2>&1
  echo "[plan] tp_gpu: rc=$? after $(( $(date +%s) - started ))s: $(grep -E '^(PASSED|FAILED|ERROR)|passed|failed' $d/pytest.log | tail -6 | tr '\n' ' ')"
}

running() {  # rows on the lmcache_p2p deployment a cut call left running: ROW NAME URL TOKENS RATE PROMPTS OUTPUT
  local d=/tmp/long/running m=/tmp/models/llama8b-long
  mkdir -p $d
  local rate=(--request-rate "$4")
  [ "$4" = seq ] && rate=(--request-rate inf --max-concurrency 1)
  local seed=7; [ "$4" = seq ] || seed=$(python3 -c "print(int(round($4*100)))")
  curl -s -X POST http://127.0.0.1:9100/stats/reset >/dev/null
  curl -s http://127.0.0.1:9100/metrics > $d/$1.metrics0.txt
  python3 -c 'import time; print(time.perf_counter())' > $d/$1.t0
  python3 -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url "$2" --model $m --tokenizer $m \
    --dataset-name random --random-input-len "$3" --random-output-len "$6" --num-prompts "$5" "${rate[@]}" \
    --ignore-eos --seed $seed --temperature 0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --save-detailed --result-dir $d --result-filename $1.json --disable-tqdm > $d/$1.log 2>&1
  echo "[plan] running $1: rc=$? $(grep -E 'Median TTFT|Failed' $d/$1.log | tr -s ' ' | tr '\n' ' ')"
  python3 -c 'import time; print(time.perf_counter())' > $d/$1.t1
  curl -s http://127.0.0.1:9100/stats > $d/$1.stats.json
  curl -s http://127.0.0.1:9100/metrics > $d/$1.metrics1.txt
}

attach() {  # the running deployment's rows, then it is stopped
  eval "$(bash "$GPU_BUILD/gpu-kit/install_bundle.sh" "$GPU_BUILD/gpu-bundle/bundle.sha")" || return
  for _ in $(seq 60); do curl -s http://127.0.0.1:9100/health | grep -q '"decoders": *1' && break; sleep 2; done
  curl -s http://127.0.0.1:9100/health; echo
  running off16 http://127.0.0.1:9100 16000 seq 8 2
  running off16_direct http://127.0.0.1:7100 16000 seq 8 2
  running off32 http://127.0.0.1:9100 32000 seq 6 2
  running off32_direct http://127.0.0.1:7100 32000 seq 6 2
  running too_large64 http://127.0.0.1:9100 64000 seq 2 2
  running busy16 http://127.0.0.1:9100 16000 0.5 12 256
  local pid; pid=$(pgrep -f "lmcache_p2p.cli.main launch --device cuda" | head -n 1)
  [ -n "$pid" ] && kill -TERM "$pid"
  for _ in $(seq 45); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  cp -r /tmp/long/p2p_gather_off/logs/lmcache_p2p-nixl /tmp/long/running/deployment_logs 2>/dev/null
  echo "[plan] attach done after $(( $(date +%s) - started ))s"
}
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
  solo)  # one 1P1D start (current code): the decoder busy, the prefill beside a decoding decoder, 64k too large
    LONG_POINTS=16000:seq:1 OUT=/tmp/long/setup bash "$SRC/scripts/gpu_pass.sh" long --systems , \
      --results-dir /tmp/long/setup/parts --log-dir /tmp/long/setup/logs >/tmp/long/setup.log 2>&1  # bundle, models
    eval "$(bash "$GPU_BUILD/gpu-kit/install_bundle.sh" "$GPU_BUILD/gpu-bundle/bundle.sha")" || exit 1
    L=/tmp/long/solo/logs; mkdir -p $L/trace
    E2E_GPU_TRACE_DIR=$L/trace PYTHONPATH="$SRC/bench/gpu_trace:$SRC:$PYTHONPATH" python3 -m lmcache_p2p.cli.main \
      launch --device cuda --prefill 1 --decode 1 --transport nixl --model /tmp/models/llama8b-long --log-dir $L \
      --buffer-size 4GB --max-model-len 65600 --gpu-memory-utilization 0.85 --on-exit stop --proxy-workers 4 \
      --gpus 0,0 --share-gpus -- --no-enable-prefix-caching --load-format dummy > $L/launch.out 2>&1 &
    launcher=$!
    for _ in $(seq 200); do curl -s http://127.0.0.1:9100/health | grep -q '"decoders": *1' && break; sleep 2; done
    echo "[plan] solo up after $(( $(date +%s) - started ))s: $(curl -s http://127.0.0.1:9100/health)"
    running busy16 http://127.0.0.1:9100 16000 0.5 12 256
    python3 -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url http://127.0.0.1:7200 \
      --model /tmp/models/llama8b-long --tokenizer /tmp/models/llama8b-long --dataset-name random \
      --random-input-len 16000 --random-output-len 4096 --num-prompts 4 --request-rate inf --max-concurrency 1 \
      --ignore-eos --seed 3 --disable-tqdm > /tmp/long/running/decoder_load.log 2>&1 &
    load=$!; sleep 8
    running beside16_direct http://127.0.0.1:7100 16000 0.5 12 2
    kill -TERM $load; sleep 2; running too_large64 http://127.0.0.1:9100 64000 seq 2 2
    kill -TERM $launcher; for _ in $(seq 40); do kill -0 $launcher 2>/dev/null || break; sleep 1; done
    cp -r $L /tmp/long/running/deployment_logs ;;
  attach)
    attach
    pass neighbour LONG_POINTS="16000:0.5:12" LONG_DIRECT=0 -- --systems single-neighbour ;;
  credit)  # 1P1D where one prompt's KV fills the receive buffer (32k), and past it (64k): the freed-slot announcement
    pass p2p_credit LONG_POINTS="32000:seq:6,64000:seq:2" -- --systems single,lmcache_p2p-nixl ;;
  pd16)  # LMCache's PD at 16k beside single and ours, one run, a context its decoder's KV cache can hold
    pass pd16 LONG_POINTS="16000:seq:4" LONG_DIRECT=0 -- --systems lmcache-pd,single,lmcache_p2p-nixl --max-model-len 20000 ;;
  detok)  # after the detokenizer's bounded context: single beside 1P1D at 16k/32k; the TP engine tests (cuda_ipc);
    # the single instance decoding 256 tokens of its own (the decoder-busy split)
    tp_gpu
    pass detok LONG_POINTS="$IDLE" LONG_DIRECT=0 -- --systems single,lmcache_p2p-nixl ;;
  replay)  # after the streaming side's deferred replay of the first token: single beside 1P1D at 16k/32k
    pass replay LONG_POINTS="$IDLE" LONG_DIRECT=0 -- --systems single,lmcache_p2p-nixl ;;
  busy)  # the decoder-busy split, side by side: the single instance decoding 256 tokens of its own, 1P1D likewise
    pass busy LONG_POINTS="16000:0.5:12:256" LONG_DIRECT=0 -- --systems single,lmcache_p2p-nixl ;;
  call3)
    pass mnbt LONG_POINTS="$IDLE" LONG_VLLM_ARGS="--max-num-batched-tokens 16384" -- --systems single,lmcache_p2p-nixl ;;
  *) echo "usage: gpu_long_plan.sh gather|call1|call2|credit|pd16|detok|replay|busy|call3" >&2; exit 2 ;;
esac
# results: one archive of every pass's figures, one per pass of its logs (the device tool returns 8 files)
(cd /tmp/long && tar -czf "$OUT/results.tgz" --exclude='*/logs' --exclude='*/out/logs.tar.gz' .)
for d in /tmp/long/*/out/logs.tar.gz; do [ -f "$d" ] && cp "$d" "$OUT/logs-$(basename "$(dirname "$(dirname "$d")")").tgz"; done
ls -la "$OUT"; echo "[plan] done after $(( $(date +%s) - started ))s"
