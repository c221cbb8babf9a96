#!/usr/bin/env bash
# X prefillers + Y decoders + the proxy; Ctrl-C stops all.
#   PYTHON=python3 NUM_PREFILL=2 NUM_DECODE=2 MODEL=/path/to/model TRANSPORT=nixl|nccl DEVICE=cpu|cuda POLICY=least_loaded
#   TP=2 (both roles) or PREFILL_TP=1 DECODE_TP=2: vLLM's tensor-parallel size per role (default 1)
# On vLLM-CPU every instance takes ~3 GB and a core per TP rank: 2P2D wants 4 cores and ~12 GB. On GPUs every
# TP rank takes a GPU: 2P2D with PREFILL_TP=1 DECODE_TP=2 wants 6.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m lmcache_p2p.cli.main launch --prefill "${NUM_PREFILL:-2}" --decode "${NUM_DECODE:-2}" \
  ${MODEL:+--model "$MODEL"} --transport "${TRANSPORT:-nixl}" --device "${DEVICE:-cpu}" \
  ${TP:+--tp "$TP"} ${PREFILL_TP:+--prefill-tp "$PREFILL_TP"} ${DECODE_TP:+--decode-tp "$DECODE_TP"} \
  --policy "${POLICY:-least_loaded}" --buffer-size "${BUFFER_SIZE:-1GB}" "$@"
