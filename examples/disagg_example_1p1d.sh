#!/usr/bin/env bash
# 1 prefiller + 1 decoder + the proxy, like LMCache's disagg_example_1p1d.sh; Ctrl-C stops all.
#   MODEL=/path/to/model  (default: the tiny local model, built on first use)
#   PYTHON=python3 (default .venv/bin/python) TRANSPORT=nixl|nccl DEVICE=cpu|cuda BUFFER_SIZE=1GB
#   TP=2 (both roles) or PREFILL_TP=2 DECODE_TP=1: vLLM's tensor-parallel size per role (default 1); on
#   vLLM-CPU a core per rank, on GPUs a GPU per rank (P TP1 -> D TP2 takes 3 GPUs)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m lmcache_p2p.cli.main launch --prefill 1 --decode 1 \
  ${MODEL:+--model "$MODEL"} --transport "${TRANSPORT:-nixl}" --device "${DEVICE:-cpu}" \
  ${TP:+--tp "$TP"} ${PREFILL_TP:+--prefill-tp "$PREFILL_TP"} ${DECODE_TP:+--decode-tp "$DECODE_TP"} \
  --buffer-size "${BUFFER_SIZE:-1GB}" "$@"
