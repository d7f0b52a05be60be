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
have_libaio_headers() { [ -f /usr/include/libaio.h ]; }

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
# The peers the performance page compares against, so that the suite checks their tokens against
# the resident model's (tests/test_bench_peers.py). AirLLM without dependency resolution: its
# requirements are already here, and resolving them would replace the CPU torch. DeepSpeed's
# async_io op needs libaio-dev and is built once, here, not inside a test (about 2 minutes on
# 2 cores; cached in torch's extension directory). GDS_OFFLOAD_PEERS=0 skips this step.
if [ "${GDS_OFFLOAD_PEERS:-1}" = 1 ]; then
    if ! have_libaio_headers; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libaio-dev >/dev/null 2>&1 \
                || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libaio-dev >/dev/null; }
        else
            echo "setup: libaio-dev missing and apt-get unusable (not root?): DeepSpeed's NVMe peer test will be skipped"
        fi
    fi
    .venv/bin/python -m pip install -q --no-deps "airllm==4.0.0" scipy sentencepiece
    if have_libaio_headers; then
        .venv/bin/python - <<'PY'
import sys
from gds_offload.bench.weights.peer_loaders import build_deepspeed_ops, deepspeed_aio_built
if not deepspeed_aio_built()[0]:
    print("setup: building DeepSpeed's async_io op once (about 2 minutes on 2 cores)", flush=True)
    built, why = build_deepspeed_ops()
    if not built:
        sys.exit(f"setup: {why}")
PY
    fi
fi
echo "setup: done ($(.venv/bin/python -c 'import torch, gds_offload; print("torch", torch.__version__, "| gds_offload", gds_offload.__version__)'))"
