#!/usr/bin/env bash
# Run the plugin's backend tests against lmcache 0.5.3 (the version whose CUDA extension loads with
# the GPU machine's torch 2.11, and that vLLM 0.24 served with there) without touching .venv's
# lmcache 0.5.6: 0.5.3 goes into a throwaway --target dir that PYTHONPATH puts first; the engine
# processes the tests start inherit it (tests/backend/conftest.py keeps a caller's PYTHONPATH).
#
#   bash scripts/test_lmcache_053.sh [pytest args]
#
# 0.5.3 vs 0.5.6, for what the plugin uses (read in both wheels): StoragePluginInterface
# (abstract_backend.py) is byte-identical; plugins are built with the same keywords
# (config, dst_device, metadata, local_cpu_backend, loop); MemoryObjMetadata / TensorMemoryObj /
# MemoryFormat / CacheEngineKey are unchanged (0.5.6 only adds L1-manager methods and moves the
# pinned allocators from c_ops to device_ops). So no compatibility shim is needed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
TARGET=${TARGET:-/tmp/lmcache_053_site}
if [ ! -d "$TARGET/lmcache" ]; then
  "$PY" -m pip install -q --no-deps --target "$TARGET" lmcache==0.5.3 2> >(grep -v "is ignored" >&2)
fi
PYTHONPATH="$TARGET" "$PY" -c 'import lmcache, sys; v = lmcache.__version__; print("lmcache", v, "from", lmcache.__file__); sys.exit(v != "0.5.3")'
PYTHONPATH="$TARGET" "$PY" -m pytest tests/backend -q -p no:cacheprovider "$@"
