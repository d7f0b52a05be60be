"""Memory that is freed goes back to the system: :func:`predictable_malloc`.

A planned run must stay under a memory limit it predicts (:mod:`gds_offload.weights.planning.planner`), and
on Linux with glibc the process's resident memory is not what the model holds: glibc raises
its mmap threshold each time a large block is freed, so later activations of that size come
from the heap, whose free space is kept rather than returned; and each thread gets an arena of
its own, so the micro-batches of a layer-major team (:mod:`gds_offload.weights.streaming.team`, one
thread each, one at a time) each keep their own peak. Measured on a 12-layer model at 64
prompts, the peak came out 15-35% above the live tensors, and varied from run to run.

:func:`predictable_malloc` fixes the mmap threshold at 1 MiB (blocks above it are mapped and
unmapped: freed activations leave the resident set at once) and caps glibc at one arena, as
``MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_ARENA_MAX=1`` would. Blocks under the threshold (a
micro-batch's attention scores, its small activations) still come from the heap, whose free
chunks, fragmented by sizes that grow with the context, are kept: measured on a 16-layer GQA
model, each wave of ``generate_many`` peaked 3-4 MiB above the one before (31 MiB over 8 waves).
:func:`release_free` (the cycle collector, then glibc's ``malloc_trim``) gives them back between
waves. :func:`predictable_malloc` is process-wide and cannot be undone; ``generate_many`` and the planner's measurements call it, unless
``GDS_OFFLOAD_MALLOC=keep`` is set (then the plan's memory prediction may be low).
"""
from __future__ import annotations

import ctypes
import gc
import os
import threading

__all__ = ["MMAP_THRESHOLD", "predictable_malloc", "release_free"]

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


def release_free() -> None:
    """Give the heap's free memory back to the system (see the module doc): collect reference
    cycles (a finished micro-batch's cache objects), then ``malloc_trim(0)`` on glibc. A few
    milliseconds; call it between waves, not per layer."""
    gc.collect()
    if predictable_malloc():
        ctypes.CDLL(None).malloc_trim(0)
