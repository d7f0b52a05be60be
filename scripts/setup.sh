#!/usr/bin/env bash
# Set up gds_offload from a clean clone: a virtual environment in .venv with the
# package (editable), KvikIO/CuPy for CUDA 12, NVIDIA DALI (the token loader), and the test tools.
#
# KvikIO needs libcuda.so.1 even for host-memory I/O. On a machine without the
# NVIDIA driver, Debian's libcuda1 (section non-free) provides it; we install it
# when it is missing and apt is usable, so the KvikIO engine tests run instead of
# skipping. Override the torch requirement with TORCH_SPEC (default torch==2.13.0:
# whichever build pip's index offers; from PyPI on x86-64 Linux the CUDA build, on this
# project's machines the CPU build in their local wheel directory; see docs/setup.md).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${GDS_OFFLOAD_EXTRAS:-cu12,test,data}
PY=${PYTHON:-python3}

have_libcuda() { ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; }

if ! have_libcuda; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: libcuda.so.1 missing; installing Debian's libcuda1 (contrib non-free) for KvikIO's host I/O"
        f=/etc/apt/sources.list.d/debian.sources
        if [ -f "$f" ]; then
            sed -i -E 's/^Components: main$/Components: main contrib non-free/' "$f"
        fi
        if [ -f /etc/apt/sources.list ]; then
            sed -i -E '/^deb .*debian/ s/ main$/ main contrib non-free/' /etc/apt/sources.list
        fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libcuda1 >/dev/null
    else
        echo "setup: libcuda.so.1 missing and apt-get unusable (not root?): KvikIO engines will be unavailable, their tests skipped"
    fi
fi

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
echo "setup: done ($(.venv/bin/python -c 'import torch, gds_offload; print("torch", torch.__version__, "| gds_offload", gds_offload.__version__)'))"
