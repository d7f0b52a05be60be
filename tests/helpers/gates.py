"""Hardware gates and the engines that run on this machine, as pytest marks and params."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gds_offload.io.kvikio.engine import kvikio_status

__all__ = ["ENGINES", "ENGINE_MODES", "FILE_ENGINE_MODES", "KVIK_OK", "KVIK_WHY", "cuda_test", "requires_cuda", "requires_root"]

KVIK_OK, KVIK_WHY = kvikio_status()
_COMPAT_SKIP = (
    f"KvikIO unusable: needs libcuda.so.1 (the NVIDIA driver library; Debian: apt-get install libcuda1) "
    f"and kvikio-cu12 ({KVIK_WHY})"
)

#: The engines that run on this machine, as pytest params.
ENGINE_MODES = [
    pytest.param("posix", id="posix"),
    pytest.param("compat", id="compat", marks=() if KVIK_OK else pytest.mark.skip(reason=_COMPAT_SKIP)),
    pytest.param("host", id="host"),
]
#: The engines that write files (for file-only tests).
FILE_ENGINE_MODES = ENGINE_MODES[:2]
#: Storage engines that run on this machine (compat only where KvikIO can do host I/O), as names.
ENGINES: list[str] = ["posix"] + (["compat"] if KVIK_OK else [])

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA): torch.cuda.is_available() is False"
)
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount tmpfs")


def cuda_test(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as a GPU test and skip it without CUDA."""
    return pytest.mark.gpu(requires_cuda(fn))
