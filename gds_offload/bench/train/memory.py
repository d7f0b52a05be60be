"""A benchmark child's peak activation memory: what is measured, from when, alike in every mode.

**Baseline**: taken once the model and its optimizer are built, AdamW's state included
(:func:`adamw_with_state`: the state its first step would create, created now), and before
anything of the mode is set up (``attach()``, checkpoint wrappers) or any step runs.

**Peak**: the highest point from the baseline to the end of the last step, warm-up and
first step included: a process dies at its highest peak, whichever step reaches it. With
``RunSpec(paired=True)`` the peak is that of the offloaded steps (warm-up included), not
of the steps run under ``paused()``.

* CPU: ``VmHWM`` minus ``VmRSS`` at the baseline, ``VmHWM`` reset to ``VmRSS`` there (``5``
  written to ``/proc/self/clear_refs``). The child runs with ``MALLOC_MMAP_THRESHOLD_=65536``
  so glibc returns freed large blocks to the OS and the resident set falls back between
  steps (see :mod:`gds_offload.bench.train.runner`).
* CUDA: ``torch.cuda.max_memory_allocated()`` minus ``memory_allocated()`` at the baseline.

Either way the figure holds, besides saved activations, gradients, backward temporaries
and the first step's one-time allocations (torch's kernels and thread pools), which every
mode has alike, and everything a mode allocates: for an offload mode, the activations it
keeps, those its writes in flight hold, those read back ahead, and its engine's buffers.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from gds_offload.bench.machine import CPU_SOURCE, CUDA_SOURCE
from gds_offload.bench.train.spec import RunResult, RunSpec

if TYPE_CHECKING:
    import torch

__all__ = ["Peak", "adamw_with_state", "proc_status_bytes"]



def proc_status_bytes(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> str:
    """Reset this process's ``VmHWM`` to its current RSS. Returns "" or why it failed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return ""
    except OSError as exc:
        return f"cannot reset VmHWM ({exc})"


def adamw_with_state(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, lr=lr)`` holding already the state its first ``step()``
    would create (both moments zero, ``step`` 0), so that the memory baseline holds it:
    optimizer state is not activation memory. Training with it is bit-identical to training
    with a fresh AdamW (tests/test_bench.py checks every loss, weight and moment)."""
    import torch

    params = list(params)
    opt = torch.optim.AdamW(params, lr=lr)
    state = {
        i: {
            "step": torch.tensor(0.0),  # the default dtype, as AdamW's own (float32, or float64 under that default)
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
        for i, p in enumerate(params)
    }
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
    return opt


class Peak:
    """The memory peak of a run (see the module doc): CUDA's allocator counters on a GPU,
    ``VmHWM`` on a CPU, nothing where memory is not measured."""

    def __init__(self, gpu: torch.device | None) -> None:
        self.gpu = gpu
        self.hwm = False  # VmHWM counts from a reset we made

    def start(self, spec: RunSpec, result: RunResult) -> None:
        """The baseline: put it and how the peak is measured in ``result``, and count the peak from now."""
        import torch

        if self.gpu is not None:
            torch.cuda.synchronize(self.gpu)
            result.base_bytes = torch.cuda.memory_allocated(self.gpu)
            torch.cuda.reset_peak_memory_stats(self.gpu)
            result.memory_source = CUDA_SOURCE
        elif spec.measure_memory:
            result.base_bytes = proc_status_bytes("VmRSS")
            why = _reset_hwm()
            self.hwm = not why
            result.memory_source = why or CPU_SOURCE
        else:
            result.memory_source = "not measured (measure_memory=False: default allocator settings)"

    @property
    def measuring(self) -> bool:
        return self.gpu is not None or self.hwm

    def reset(self) -> None:
        """Count the peak from now (paired runs: before each offloaded step)."""
        import torch

        if self.gpu is not None:
            torch.cuda.reset_peak_memory_stats(self.gpu)
        elif self.hwm:
            _reset_hwm()

    def now(self) -> int | None:
        """The peak since the last reset, in bytes (``None``: not measured)."""
        import torch

        if self.gpu is not None:
            return torch.cuda.max_memory_allocated(self.gpu)
        return proc_status_bytes("VmHWM") if self.hwm else None
