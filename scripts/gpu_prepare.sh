#!/usr/bin/env bash
# HERE (the CPU machine), from the repo root: everything the GPU pass carries, under build/ (gitignored).
#
#   build/gpu-bundle/parts/p0..p4, bundle.sha  real vLLM 0.24 + lmcache 0.5.3 + nixl + the small wheels the GPU
#                                              machine lacks (../shared/gpu/build_bundle.sh; ~3 min, cached)
#   build/gpu-kit/                             the kit's installer and model maker and LMCache's PD proxy
#                                              (../shared/gpu, ../shared/anchor: beside the checkout, they do
#                                              not travel to the device by themselves)
#
# Then make the device calls it prints (BENCHMARKS.md, "GPU end to end"). Idempotent.
#   GPU_KIT=../shared/gpu ANCHOR=../shared/anchor bash scripts/gpu_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_KIT=${GPU_KIT:-../shared/gpu}
ANCHOR=${ANCHOR:-../shared/anchor}
BUILD=build
mkdir -p "$BUILD/gpu-kit"
if [ ! -f "$BUILD/gpu-bundle/bundle.sha" ]; then
  bash "$GPU_KIT/build_bundle.sh" "$BUILD/gpu-bundle"
fi
cp "$GPU_KIT/install_bundle.sh" "$GPU_KIT/make_models.py" "$BUILD/gpu-kit/"
cp "$ANCHOR/pd_proxy.py" "$BUILD/gpu-kit/"
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
