"""Memory that is freed goes back to the system: :func:`predictable_malloc`.

A planned run must stay under a memory limit it predicts (:mod:`gds_offload.weights.planner`), and
on Linux with glibc the process's resident memory is not what the model holds: glibc raises
its mmap threshold each time a large block is freed, so later activations of that size come
from the heap, whose free space is kept rather than returned; and each thread gets an arena of
its own, so the micro-batches of a layer-major team (:mod:`gds_offload.weights.schedule`, one
thread each, one at a time) each keep their own peak. Measured on a 12-layer model at 64
prompts, the peak came out 15-35% above the live tensors, and varied from run to run.

:func:`predictable_malloc` fixes the mmap threshold at 1 MiB (blocks above it are mapped and
unmapped: freed activations leave the resident set at once) and caps glibc at one arena, as
``MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_ARENA_MAX=1`` would. It is process-wide and cannot be
undone; ``generate_many`` and the planner's measurements call it, unless
``GDS_OFFLOAD_MALLOC=keep`` is set (then the plan's memory prediction may be low).
"""
from __future__ import annotations

import ctypes
import os
import threading

__all__ = ["MMAP_THRESHOLD", "predictable_malloc"]

#: Blocks of at least this many bytes are mapped, and unmapped when freed.
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters
_M_ARENA_MAX = -8
_lock = threading.Lock()
_applied: bool | None = None


def predictable_malloc() -> bool:
    """Apply the settings of the module doc (once per process); ``True`` if they are in force."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if os.environ.get("GDS_OFFLOAD_MALLOC", "") == "keep":
        return False
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        version = ""
    if not version.startswith("glibc"):
        return False  # musl and others: no dynamic threshold, nothing to fix
    libc = ctypes.CDLL(None)
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return bool(libc.mallopt(_M_ARENA_MAX, 1) == 1 and ok)
