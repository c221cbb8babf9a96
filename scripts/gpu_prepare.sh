#!/usr/bin/env bash
# HERE (the CPU machine), from the repo root: everything the GPU pass carries, under build/ (gitignored).
#
#   build/gpu-bundle/parts/p0..p4, bundle.sha  real vLLM 0.24 + lmcache 0.5.3 + nixl + the small wheels the GPU
#                                              machine lacks (../shared/gpu/build_bundle.sh; ~3 min, cached)
#   build/gpu-kit/                             the kit's installer and model maker and LMCache's PD proxy
#   build/gpu-kit/wheels/                      vllm-router's abi3 wheel, orjson and setproctitle for Python 3.12,
#                                              and what lmcache 0.5.3's MP server needs beyond the bundle (blake3,
#                                              cryptography, OpenTelemetry: ~6 MB)
#                                              (../shared/gpu, ../shared/anchor: beside the checkout, they do
#                                              not travel to the device by themselves), and pytest-wheels/:
#                                              pytest, pytest-timeout, pytest-xdist and what they need (cp312,
#                                              ~2 MB; gpu_pass.sh faults installs them where the image lacks them)
#
# Then make the device calls it prints (BENCHMARKS.md, "GPU end to end"). Idempotent.
#   GPU_KIT=../shared/gpu ANCHOR=../shared/anchor bash scripts/gpu_prepare.sh [--src [BUILD_DIR]]
# --src also copies this checkout's code to BUILD_DIR/gpu-src (default build/), for when the device tool sends
# another checkout than this one (a helper's worktree): carry that folder and run its scripts/gpu_pass.sh.
# GPU_BUILD (default build) is where the bundle and kit are made or found (e.g. the sent checkout's build/);
# SRC_NAME (default gpu-src) names the copied folder; CODE_FROM=CHECKOUT takes lmcache_p2p/, configs/ and
# pyproject.toml from another checkout (bench/, scripts/ and tests/ stay this one's: new bench code on merged code).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_KIT=${GPU_KIT:-$(cd ../shared/gpu 2>/dev/null && pwd || echo ../shared/gpu)}
ANCHOR=${ANCHOR:-$(cd ../shared/anchor 2>/dev/null && pwd || echo ../shared/anchor)}
BUILD=${GPU_BUILD:-build}
mkdir -p "$BUILD/gpu-kit"
if [ ! -f "$BUILD/gpu-bundle/bundle.sha" ]; then
  bash "$GPU_KIT/build_bundle.sh" "$BUILD/gpu-bundle"
fi
cp "$GPU_KIT/install_bundle.sh" "$GPU_KIT/make_models.py" "$BUILD/gpu-kit/"
cp "$ANCHOR/pd_proxy.py" "$BUILD/gpu-kit/"
PYTEST_PINS=(pytest==9.2.0 pytest-timeout==2.4.0 pytest-xdist==3.8.0)  # the versions the CPU machines test with
if ! compgen -G "$BUILD/gpu-kit/pytest-wheels/pytest_xdist-*.whl" >/dev/null; then
  "${PYTHON:-.venv/bin/python}" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$BUILD/gpu-kit/pytest-wheels" "${PYTEST_PINS[@]}"
fi
# vllm-router (bench/e2e_gpu.py's vllm-nixl) and the two packages it needs that the bundle lacks, for the GPU
# machine's Python 3.12 (its aiohttp, fastapi and uvicorn come with vLLM); gpu_pass.sh installs them
if ! compgen -G "$BUILD/gpu-kit/wheels/vllm_router-*.whl" >/dev/null; then
  ${PIP:-.venv/bin/python -m pip} download --python-version 3.12 --only-binary=:all: --no-deps \
    -d "$BUILD/gpu-kit/wheels" vllm-router==0.1.17 orjson setproctitle
fi
# What lmcache 0.5.3's `lmcache server` (the vllm-nixl-lmcache-mp system, launch --connector nixl-lmcache-mp) imports
# that neither the bundle nor the GPU image has: blake3 (its default token hash), cryptography (its L2 serde, imported
# with its storage manager), OpenTelemetry (its metrics); the versions the CPU machines run lmcache 0.5.6 with
MP_SERVER_PINS=(blake3==1.0.11 cryptography==51.0.1 cffi==2.1.1 pycparser==3.12 opentelemetry-api==1.40.0
                opentelemetry-sdk==1.40.0 opentelemetry-semantic-conventions==0.61b0
                opentelemetry-exporter-prometheus==0.61b0 importlib_metadata==8.7.1 zipp==4.1.2)
if ! compgen -G "$BUILD/gpu-kit/wheels/blake3-*.whl" >/dev/null; then
  ${PIP:-.venv/bin/python -m pip} download --python-version 3.12 --only-binary=:all: --no-deps \
    -d "$BUILD/gpu-kit/wheels" "${MP_SERVER_PINS[@]}"
fi
if [ "${1:-}" = "--src" ]; then  # this checkout's code as a carried folder (for a device tool that sends another checkout)
  dest=${2:-$BUILD}/${SRC_NAME:-gpu-src}
  rm -rf "$dest" && mkdir -p "$dest"
  cp -r bench scripts tests "$dest/"  # tests: the fault pass imports tests/faults and runs the GPU tests
  if [ -n "${CODE_FROM:-}" ]; then  # its last commit, not whatever its working tree holds
    git -C "$CODE_FROM" archive HEAD lmcache_p2p configs pyproject.toml | tar -x -C "$dest"
    git -C "$CODE_FROM" log -1 --format='%h %s' > "$dest/CODE_FROM"
  else
    cp -r lmcache_p2p configs pyproject.toml "$dest/"
  fi
  rm -rf "$dest/bench/results"  # results stay here: they do not travel
  find "$dest" -name __pycache__ -prune -exec rm -rf {} +
  echo "[gpu_prepare] source copied to $dest ($(du -sh "$dest" | cut -f1)); carry it and run its scripts/gpu_pass.sh"
fi
parts=$(cd "$BUILD/gpu-bundle/parts" && ls p[0-9] | sort)
last=$(echo "$parts" | tail -n 1)
echo "[gpu_prepare] ready: $(echo $parts) in $BUILD/gpu-bundle/parts, kit in $BUILD/gpu-kit"
echo "[gpu_prepare] device calls, kind nvidia-h200-x2, back to back (an idle machine is given back after 30 s):"
for p in $parts; do
  [ "$p" = "$last" ] && break
  echo "  carry [\"$BUILD/gpu-bundle/parts/$p\"]  command: bash scripts/gpu_pass.sh stage"
done
echo "  carry [\"$BUILD/gpu-bundle/parts/$last\", \"$BUILD/gpu-bundle/bundle.sha\", \"$BUILD/gpu-kit\", \"$BUILD/e2e_gpu_parts\"]"
echo "        command: bash scripts/gpu_pass.sh run [bench/e2e_gpu.py arguments]"
echo "  or, the fault pass (kind nvidia-h200, one GPU is enough; timeout_s 600):"
echo "  carry [\"$BUILD/gpu-bundle/parts/$last\", \"$BUILD/gpu-bundle/bundle.sha\", \"$BUILD/gpu-kit\"]"
echo "        command: bash scripts/gpu_pass.sh faults"
