#!/usr/bin/env bash
# 1 prefiller + 1 decoder + the proxy, like LMCache's disagg_example_1p1d.sh; Ctrl-C stops all.
#   MODEL=/path/to/model  (default: the tiny local model, built on first use)
#   PYTHON=python3 (default .venv/bin/python) TRANSPORT=nixl|nccl DEVICE=cpu|cuda BUFFER_SIZE=1GB
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m lmcache_p2p.cli.main launch --prefill 1 --decode 1 \
  ${MODEL:+--model "$MODEL"} --transport "${TRANSPORT:-nixl}" --device "${DEVICE:-cpu}" \
  --buffer-size "${BUFFER_SIZE:-1GB}" "$@"
