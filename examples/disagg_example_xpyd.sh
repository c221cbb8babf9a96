#!/usr/bin/env bash
# X prefillers + Y decoders + the proxy; Ctrl-C stops all.
#   PYTHON=python3 NUM_PREFILL=2 NUM_DECODE=2 MODEL=/path/to/model TRANSPORT=nixl|nccl DEVICE=cpu|cuda POLICY=least_loaded
# On vLLM-CPU every instance takes ~3 GB and one core: 2P2D wants 4 cores and ~12 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m lmcache_p2p.cli.main launch --prefill "${NUM_PREFILL:-2}" --decode "${NUM_DECODE:-2}" \
  ${MODEL:+--model "$MODEL"} --transport "${TRANSPORT:-nixl}" --device "${DEVICE:-cpu}" \
  --policy "${POLICY:-least_loaded}" --buffer-size "${BUFFER_SIZE:-1GB}" "$@"
