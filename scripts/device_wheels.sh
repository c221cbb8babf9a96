#!/usr/bin/env bash
# Prepare, HERE, the wheels the GPU machine lacks, into device/wheels/ (gitignored).
#
# The device machine has Python 3.12 and torch 2.11+cu130 but no pyzmq, msgspec, nixl or lmcache,
# and no network. This downloads cp312 manylinux wheels of those (pinned to what we test with), plus
# lmcache 0.5.3 (its CUDA extension loads with torch 2.11; 0.5.4-0.5.6's does not) and the three
# small packages its engine imports that the image lacks (aiofile, caio, cachetools); slims
# nixl-cu13 (drops the nixl_ep_cu13 package: expert-parallel kernels, ~27 MiB, unused for KV
# transfer) and checks that everything fits the device tool's carry budget. Idempotent: wheels
# already in device/wheels/ are kept.
#
# Then, in a device `run`: carry ["device/wheels"] and start the command with
#   eval "$(bash scripts/device_setup.sh)"
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=device/wheels
PY=${PYTHON:-.venv/bin/python}
MAX_MIB=${MAX_MIB:-60}
PINS=(pyzmq==27.3.0 msgspec==0.23.0 nixl==1.5.1 nixl-cu13==1.5.1
      lmcache==0.5.3 aiofile==3.12.3 caio==0.12.10 cachetools==8.0.2)
DROP_PREFIX=nixl_ep_cu13/

mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

have() {  # have NAME VERSION: a wheel of that distribution and version is already in $OUT
  local stem=${1//-/_}
  compgen -G "$OUT/${stem}-${2}-*.whl" >/dev/null
}

for pin in "${PINS[@]}"; do
  name=${pin%%==*}
  version=${pin##*==}
  if have "$name" "$version"; then
    echo "[device_wheels] have $pin"
    continue
  fi
  echo "[device_wheels] downloading $pin (cp312, manylinux x86_64)"
  # pip matches each --platform tag exactly: list the manylinux tags these projects publish.
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$tmp" "$pin" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
done

# Slim nixl-cu13: re-zip without nixl_ep_cu13/ (and drop its lines from RECORD, so the wheel
# stays self-consistent). Everything else, permissions included, is kept as it was.
for whl in "$tmp"/nixl_cu13-*.whl; do
  [ -e "$whl" ] || continue
  echo "[device_wheels] slimming $(basename "$whl") (dropping $DROP_PREFIX)"
  "$PY" - "$whl" "$OUT/$(basename "$whl")" "$DROP_PREFIX" <<'PYEOF'
import sys
import zipfile

src, dst, drop = sys.argv[1:4]
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst + ".part", "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
    for info in zin.infolist():
        if info.filename.startswith(drop):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if not line.startswith(drop)).encode()
        out = zipfile.ZipInfo(info.filename, info.date_time)
        out.external_attr = info.external_attr
        out.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(out, data)
import os

os.replace(dst + ".part", dst)
PYEOF
  rm -f "$whl"
done
# The other wheels go in as downloaded.
for whl in "$tmp"/*.whl; do
  [ -e "$whl" ] && mv "$whl" "$OUT/"
done

total_kib=$(du -sk "$OUT" | cut -f1)
ls -l "$OUT"
echo "[device_wheels] $OUT holds $((total_kib / 1024)) MiB (limit ${MAX_MIB} MiB)"
if [ "$total_kib" -gt $((MAX_MIB * 1024)) ]; then
  echo "[device_wheels] too large to carry: remove stale wheels from $OUT" >&2
  exit 1
fi
