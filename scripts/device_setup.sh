#!/usr/bin/env bash
# Run ON the GPU machine, from the repo root, with device/wheels carried (see device_wheels.sh).
#
# Installs the carried wheels into a local folder (no index, no dependency resolution: torch,
# numpy and CUDA are the machine's own) and prints the one line to eval:
#   eval "$(bash scripts/device_setup.sh)"
# Progress and the import check go to stderr; stdout is only the export line.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=${WHEELS:-device/wheels}
TARGET=${TARGET:-/tmp/lmcache_p2p_site}
PY=${PYTHON:-python3}

if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "[device_setup] no wheels in $WHEELS: run scripts/device_wheels.sh here first and carry device/wheels" >&2
  exit 1
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" \
  "$WHEELS"/*.whl >&2
path="$TARGET:$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
PYTHONPATH="$path" "$PY" - >&2 <<'PYEOF'
import msgspec, torch, zmq

print(f"[device_setup] torch {torch.__version__} cuda={torch.cuda.is_available()} x{torch.cuda.device_count()}, "
      f"pyzmq {zmq.__version__}, msgspec {msgspec.__version__}")
try:
    import nixl  # selects nixl_cu13 from torch's CUDA major

    print(f"[device_setup] nixl backend {nixl.__name__} ok")
except Exception as exc:  # still useful without NIXL: the NCCL transport needs only torch
    print(f"[device_setup] nixl import failed: {exc!r}")
try:
    import lmcache

    print(f"[device_setup] lmcache {getattr(lmcache, '__version__', '?')} ok")
except Exception as exc:  # the transports and the bench do not need it; the engine tests do
    print(f"[device_setup] lmcache import failed: {exc!r}")
PYEOF
echo "export PYTHONPATH=$path"
