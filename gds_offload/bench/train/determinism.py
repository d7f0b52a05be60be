"""Deterministic CUDA kernels for comparing two training runs bit for bit.

A CUDA exactness check trains once without the offloader and once with it and compares
with ``torch.equal``. If torch picks a non-deterministic kernel, the runs differ without
the offloader having changed a bit, and the difference would be blamed on it.
:func:`deterministic_kernels` makes such a comparison deterministic:

- ``torch.use_deterministic_algorithms(True)`` with ``warn_only=False``. Ops with a
  deterministic CUDA implementation use it; SDPA's flash backward then runs its
  deterministic variant and memory-efficient attention's backward uses one key split
  (``aten/src/ATen/native/transformers/cuda/attention_backward.cu``: with ``warn_only=True``
  both only warn and stay non-deterministic). Ops with none raise ``RuntimeError``.
- ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``: attention as matmuls and a softmax,
  the backend the CPU exactness suite uses, so no fused attention kernel is compared.
- ``torch.backends.cudnn.deterministic = True``, ``benchmark = False``: cuDNN uses its
  deterministic algorithms and does not autotune.
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (:func:`set_cublas_workspace`): torch's deterministic
  mode refuses cuBLAS calls without it, and cuBLAS follows it only if it is in the
  environment before the process's first cuBLAS call (set it before CUDA starts). Set
  later, both runs of one process still share the same cuBLAS workspaces.

Excluded from a comparison (:data:`EXCLUDED`): SDPA's flash, memory-efficient and cuDNN
attention kernels (math runs instead), and every op without a deterministic CUDA kernel
(it raises, naming the op, so the check fails loudly instead of comparing noise). Runs on
different GPUs or CUDA versions may differ in bits: compare on one device, in one process.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from gds_offload.errors import ConfigError

__all__ = ["CUBLAS_WORKSPACE", "EXCLUDED", "deterministic_kernels", "set_cublas_workspace"]

#: The value set when the variable is absent; ``:16:8`` is the other deterministic one.
CUBLAS_WORKSPACE = ":4096:8"
_DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")

#: What a comparison under :func:`deterministic_kernels` leaves out.
EXCLUDED = (
    "SDPA flash attention (the math backend runs instead)",
    "SDPA memory-efficient attention (the math backend runs instead)",
    "SDPA cuDNN attention (the math backend runs instead)",
    "ops without a deterministic CUDA kernel (they raise RuntimeError rather than run)",
)


def set_cublas_workspace() -> None:
    """Put ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in the environment unless it is set already.

    Raises:
        ConfigError: it is set to a value torch's deterministic mode refuses.
    """
    value = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if value not in _DETERMINISTIC_WORKSPACES:
        raise ConfigError(
            f"CUBLAS_WORKSPACE_CONFIG={value!r} makes cuBLAS non-deterministic; unset it or set "
            f"{' or '.join(_DETERMINISTIC_WORKSPACES)} before CUDA starts"
        )


@contextlib.contextmanager
def deterministic_kernels() -> Iterator[None]:
    """Deterministic kernels for the block (see the module doc); everything is restored after.

    Process-wide settings: no other thread should run CUDA work it expects fast kernels
    for while the block runs.

    Raises:
        ConfigError: ``CUBLAS_WORKSPACE_CONFIG`` is set to a non-deterministic value.
    """
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    set_cublas_workspace()
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
