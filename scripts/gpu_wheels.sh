#!/usr/bin/env bash
# Fetch the wheels scripts/gpu_check.sh installs on the GPU machine, which has no network and no
# KvikIO: kvikio-cu13 and libkvikio-cu13 26.10 for CPython 3.12 on x86-64 Linux, and the two
# small packages libkvikio loads that the machine lacks (rapids-logger, cuda-pathfinder). Its
# torch, CuPy, nvidia-cufile and numpy are its own: nothing here replaces them.
#
# Usage: scripts/gpu_wheels.sh [DIR]   (default wheels/gpu, ignored by git)
# Run it on a machine with registry access; it prints the folder's total size (under 16 MiB,
# so the folder travels with the working tree). Exit status: 0, or pip's on a failed download.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-wheels/gpu}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR" \
    "kvikio-cu13==26.10.*" "libkvikio-cu13==26.10.*" "rapids-logger==0.3.*" cuda-pathfinder
total=$(du -cb "$DIR"/*.whl | tail -n 1 | cut -f1)
echo "gpu_wheels: $(find "$DIR" -name '*.whl' | wc -l) wheels in $DIR, $total bytes"
if [ "$total" -ge $((16 << 20)) ]; then
    echo "gpu_wheels: $total bytes is over the 16 MiB a working tree may carry" >&2
    exit 1
fi
