"""Checksums of spill slots: what ``attach(..., verify=True)`` adds.

With ``verify``, every offloaded storage gets an xxh3-64 checksum of its bytes, and
every read is checked against it before backward may use the bytes. A mismatch
raises :class:`~gds_offload.errors.OffloadError` naming the slot (file, offset) and
both checksums; the scheduler adds the layer and the tensor's shape.

Where the hashing runs (never on the training thread):

* after a write: on the engine thread that completed it (the write future's done
  callback). The source bytes are still held by the scheduler until that callback
  has run, so the hash covers exactly the bytes that were written.
* after a read: on the engine thread that completed it, before the read's future
  (the one the scheduler waits on) is marked done.

CPU tensors are hashed in place (xxh3 runs at several GB/s per core). CUDA tensors
are copied to host memory first (a device-to-host copy per tensor per direction):
KvikIO's compat-mode bounce buffers and the GDS direct path expose no host copy of
the bytes. That copy costs PCIe bandwidth, so ``verify`` is a debugging and
validation aid on GPUs, not a default.

.. warning::
   Without ``verify`` nothing checks the bytes that come back: a drive or filesystem
   that corrupts data silently, or a process that writes into the spill file (root
   can, through ``/proc/<pid>/fd``), goes undetected and the gradients are wrong.
   Short reads, I/O errors and truncated files are detected either way.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from gds_offload.errors import OffloadError
from gds_offload.io.base import IOFuture

if TYPE_CHECKING:
    from gds_offload.io.layout import Slot

__all__ = ["checksum", "checked_read", "checked_write"]


def checksum(data: torch.Tensor, *, streams: Callable[[torch.device], Any] | None = None) -> int:
    """xxh3-64 of the bytes of a contiguous ``uint8`` tensor.

    CUDA tensors are copied to host first, on this thread's own side stream (``streams(device)``;
    default: one from torch's pool per thread and device, which never waits for the legacy
    default stream), so a verified fill on an engine thread does not wait for all the compute
    queued on the device. The copy waits for no stream: call it only on bytes whose transfer has
    finished (a completed read into them, or a completed write out of them), as both callers do.
    """
    assert data.dtype == torch.uint8 and data.is_contiguous(), "checksum takes contiguous byte tensors"
    if data.device.type != "cpu":
        side = (streams or _side_stream)(data.device)
        with torch.cuda.stream(side):
            data = data.cpu()  # cudaMemcpyAsync on the side stream, then a sync of that stream only
    return xxhash.xxh3_64_intdigest(data.numpy().data)


_local = threading.local()


def _side_stream(device: torch.device) -> Any:
    cache: dict[torch.device, Any] = _local.__dict__.setdefault("streams", {})
    if device not in cache:
        cache[device] = torch.cuda.Stream(device=device)
    return cache[device]


def _where(slot: Slot) -> str:
    return f"{slot.file.describe()} offset {slot.offset}"


def checked_write(future: IOFuture, nbytes: int, slot: Slot) -> OffloadError | None:
    """The error of a finished write, or None. A write that moved fewer than ``nbytes`` is an error."""
    exc = future.error(0)
    if exc is not None:
        return exc if isinstance(exc, OffloadError) else OffloadError(str(exc))
    moved = future.moved()
    if moved != nbytes:
        return OffloadError(f"short write: {moved} of {nbytes} bytes reached {_where(slot)}")
    return None


def checked_read(future: IOFuture, dst: torch.Tensor, slot: Slot, expected: int | None) -> IOFuture:
    """A future that completes when ``future`` (a read into ``dst``) did and its bytes were checked.

    Checks, on the engine thread that completed the read: all ``dst.numel()`` bytes
    arrived, and, when ``expected`` is given, their checksum matches. Either failure
    becomes an :class:`OffloadError` on the returned future; ``dst`` is never handed out.
    """
    out: Future[int] = Future()
    nbytes = dst.numel()

    def check(done: IOFuture) -> None:
        failure = done.error(0)
        if failure is not None:
            out.set_exception(failure)
            return
        try:
            moved = done.moved()
            if moved != nbytes:
                raise OffloadError(f"short read: {moved} of {nbytes} bytes came back from {_where(slot)}")
            if expected is not None:
                actual = checksum(dst)
                if actual != expected:
                    raise OffloadError(
                        f"corrupt spill slot at {_where(slot)}: xxh3 checksum {actual:016x}, "
                        f"expected {expected:016x} (written {nbytes} bytes). The spill file was "
                        f"changed after the write, or the drive returned bad data"
                    )
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            out.set_exception(exc.with_traceback(None))  # no frames: they would hold dst until GC
            return
        out.set_result(moved)

    future.add_done_callback(check)
    return IOFuture(out, nbytes)
