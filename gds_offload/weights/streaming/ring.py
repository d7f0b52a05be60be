"""The ring of layer buffers behind :class:`~gds_offload.weights.run.model.StreamedModel`: where a
streamed layer's bytes land, and what orders a layer's forward after its fill and before the
next fill of its slot.

One interface, three rings (:func:`make_ring` picks one):

* :class:`HostRing` (``device="cpu"``, ``tier="drive"``): page-aligned host buffers, filled by
  an engine's reads (posix ``O_DIRECT``, or KvikIO compat) on its threads. :meth:`Ring.wait`
  blocks on the read's future. Nothing to record at release: on the CPU a layer's post-hook
  runs after its kernels have finished.
* :class:`DeviceRing` (CUDA, ``tier="drive"``): device buffers, filled by the engine's
  device route (GDS: cuFile stream operations, DMA from the drive; compat and posix: pinned
  staging buffers copied on side streams, :mod:`gds_offload.io.staging`). Each slot has a
  CUDA event, recorded on the compute stream by :meth:`Ring.release` (after the layer's
  forward was *queued*: its kernels may still read the slot). A read into the slot is handed
  that event as ``ready``, and the engine orders its first write into the slot after it
  (the engine contract, :mod:`gds_offload.io.base`). :meth:`Ring.wait` blocks the model's
  thread on the read future; done means the bytes are in device memory, visible to every stream.
* :class:`PinnedRing` (CUDA, ``tier="host"``): every streamed layer lies in one pinned host
  arena (read once at load); a fill is ``copy_(non_blocking=True)`` on a side stream that
  first waits for the slot's release event and then records a fill event; :meth:`Ring.wait`
  makes the compute stream wait for that event, so the CPU never blocks.

Buffer ownership: the ring owns its buffers and the arena; :meth:`Ring.close` waits for
every fill and for the device before letting them go. A buffer of :meth:`Ring.fetch` (a layer
read again for backward, :mod:`gds_offload.weights.streaming.backward`) or of :meth:`Ring.copy` (a layer
copied out of the slot still holding it) belongs to whoever holds it.
"""
from __future__ import annotations

import ctypes
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gds_offload.errors import OffloadError
from gds_offload.io.base import Engine, IOFuture
from gds_offload.io.factory import make_engine
from gds_offload.io.layout import ALIGN, Slot, align_up, aligned_view
from gds_offload.node.choice import Choice
from gds_offload.runtime.interrupts import wait_done
from gds_offload.weights.errors import StoreCorruptError
from gds_offload.weights.store.files import StoreFiles, aligned_host_buffer, read_group
from gds_offload.weights.store.manifest import GroupEntry

if TYPE_CHECKING:
    pass


__all__ = ["Fill", "Ring", "HostRing", "DeviceRing", "PinnedRing", "make_read_engine", "wait_read"]


@dataclass
class Fill:
    """Slot ``slot`` being filled with streamed layer ``pos``: a read (``future``) or a copy
    (``event``); or ``held``: the slot still holds the layer's bytes, with nothing to wait for."""

    pos: int
    slot: int
    future: IOFuture | None = None
    event: Any = None
    held: bool = False


class Ring:
    """``buffers``: one uint8 tensor per slot, each at least the largest streamed layer's padded size."""

    kind = "ring"
    #: Host memory holding the streamed layers (the pinned tier).
    host_nbytes = 0
    #: Backward may compute from the slots themselves (:meth:`Prefetch.lend
    #: <gds_offload.weights.streaming.prefetch.Prefetch.lend>`): where the tensors viewing a slot can be counted
    #: (:meth:`uses`) and a slot still viewed can be given a new buffer (:meth:`renew`).
    lends = False

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers

    def start(self, group: GroupEntry, pos: int, slot: int) -> Fill:
        """Begin filling ``slot`` with ``group``'s bytes; returns at once."""
        raise NotImplementedError(f"{type(self).__name__} does not fill slots")

    def wait(self, group: GroupEntry, fill: Fill) -> None:
        """Order what the model's thread queues next (the layer's forward) after ``fill``.

        Raises:
            OffloadError: the read failed (names the layer). StoreCorruptError: ``verify`` found a bad checksum.
        """

    def drop(self, fill: Fill) -> None:
        """A fill no layer will use: wait until it no longer writes its slot (errors ignored)."""

    def failed(self, fill: Fill) -> bool:
        """``fill`` has finished, with an error (its slot is no longer written, and holds nothing usable)."""
        return False

    def settle(self, fill: Fill) -> None:
        """Block the calling thread until ``fill`` has finished (successfully or not); it stays
        usable, and :meth:`wait` still reports its error."""

    def release(self, slot: int) -> None:
        """The layer that used ``slot`` has been queued: no fill may write ``slot`` before it finishes."""

    def close(self) -> None:
        """Wait for fills in flight and for the device; free the buffers. Idempotent."""

    def copy(self, group: GroupEntry, slot: int) -> torch.Tensor:
        """A new buffer holding the first ``group.padded_nbytes`` of ``slot`` (which holds
        ``group``'s bytes, its fill finished), owned as :meth:`fetch`'s are. The copy is queued on
        the calling thread's current stream, which is the one to use the buffer on; the slot's
        next fill is ordered after it (:meth:`release`)."""
        buf = self._new_buffer(group.padded_nbytes)
        buf.copy_(self.buffers[slot][: group.padded_nbytes])
        self.release(slot)
        return buf

    def uses(self, slot: int) -> int:
        """How many tensors share ``slot``'s storage now (the ring's own views included)."""
        return int(torch._C._storage_Use_Count(self.buffers[slot].untyped_storage()._cdata))

    def renew(self, slot: int) -> None:
        """Give ``slot`` a buffer of its own size, holding nothing; the old one stays with the tensors
        that still view it, unchanged, until they are freed."""
        self.buffers[slot] = self._new_buffer(self.buffers[slot].numel())

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A buffer like the slots (page-aligned host memory, or 4 KiB-aligned device memory), every
        page touched once, as a slot's are after its first fill (for timing reads as the ring sees them)."""
        buf = self._new_buffer(nbytes)
        buf.zero_()
        return buf

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of memory of its own where the slots are: page-aligned on the host, 4 KiB-aligned on a GPU."""
        device = self.buffers[0].device
        return aligned_host_buffer(nbytes) if device.type == "cpu" else _aligned_device_buffer(nbytes, device)

    def fetch(self, group: GroupEntry) -> Callable[[], torch.Tensor]:
        """Start reading ``group`` into a new buffer on the ring's device, outside the slots;
        returns at once. The returned waiter blocks until the bytes are there (raising as
        :meth:`wait` does, and again on every call after a failure) and returns the buffer
        (uint8, ``group.padded_nbytes``, page-aligned), ready for the stream current where the
        waiter is called (on a GPU the waiter orders that stream after the copy). Any thread."""
        raise NotImplementedError(f"{type(self).__name__} cannot read a layer outside its slots")


def wait_read(group: GroupEntry, future: IOFuture) -> None:
    """Block on a read of ``group`` (delivering held stop signals meanwhile,
    :func:`~gds_offload.runtime.interrupts.wait_done`); an I/O error is re-raised naming the layer."""
    wait_done(future)
    try:
        future.wait()
    except StoreCorruptError:
        raise
    except OffloadError as exc:
        raise OffloadError(f"reading {group.describe()} from the weight store failed: {exc}") from exc


class HostRing(Ring):
    """Host slots filled by ``engine`` reads (see the module doc)."""

    kind = "host"
    lends = hasattr(torch._C, "_storage_Use_Count")

    def time_reads(self, groups: list[GroupEntry], piece_nbytes: int) -> tuple[int, float]:
        """Read ``groups`` one after another through the engine into one :meth:`scratch` buffer of at
        most ``piece_nbytes`` (a larger group in aligned pieces: the drive's rate, without a buffer a
        layer long beyond what a run holds), discarding the bytes; ``(bytes, seconds)``. The caller
        has settled the fills in flight, so the drive does nothing else meanwhile."""
        piece = min(max(g.padded_nbytes for g in groups), align_up(piece_nbytes))
        buf = self.scratch(piece)
        start = time.perf_counter()
        for g in groups:
            whole = self.files.slot(g)
            for at in range(0, whole.nbytes, piece):
                n = min(piece, whole.nbytes - at)
                wait_read(g, self.engine.read(buf[:n], Slot(whole.file, whole.offset + at, n)))
        return sum(g.padded_nbytes for g in groups), time.perf_counter() - start

    def __init__(self, engine: Engine, files: StoreFiles, buffers: list[torch.Tensor], *, verify: bool) -> None:
        super().__init__(buffers)
        self.engine, self.files, self.verify = engine, files, verify

    def start(self, group: GroupEntry, pos: int, slot: int) -> Fill:
        return Fill(pos, slot, future=read_group(self.engine, self.files, group, self.buffers[slot], verify=self.verify))

    def wait(self, group: GroupEntry, fill: Fill) -> None:
        assert fill.future is not None, "a host ring fill without a read"
        wait_read(group, fill.future)

    def drop(self, fill: Fill) -> None:
        if fill.future is not None:
            wait_done(fill.future)  # the error of a read nobody uses does not matter

    def failed(self, fill: Fill) -> bool:
        return fill.future is not None and fill.future.failed()

    def settle(self, fill: Fill) -> None:
        if fill.future is not None:
            wait_done(fill.future)  # wait() raises the error later, where the layer needs it

    def fetch(self, group: GroupEntry) -> Callable[[], torch.Tensor]:
        return self._fetch_into(group, self._new_buffer(group.padded_nbytes), None)

    def _fetch_into(self, group: GroupEntry, buf: torch.Tensor, ready: Any) -> Callable[[], torch.Tensor]:
        future = read_group(self.engine, self.files, group, buf, verify=self.verify, ready=ready)

        def done() -> torch.Tensor:
            wait_read(group, future)
            return buf

        return done


class DeviceRing(HostRing):
    """Device slots filled by engine reads, each guarded by its release event (see the module doc)."""

    kind = "device"
    lends = False  # a slot's next fill is ordered by its release event, which renew() would have to replace

    def __init__(self, engine: Engine, files: StoreFiles, buffers: list[torch.Tensor], *, verify: bool, device: torch.device) -> None:
        super().__init__(engine, files, buffers, verify=verify)
        self.device = device
        self._released = _allocated(buffers, device)

    def start(self, group: GroupEntry, pos: int, slot: int) -> Fill:
        ready = self._released[slot]
        return Fill(pos, slot, future=read_group(self.engine, self.files, group, self.buffers[slot], verify=self.verify, ready=ready))

    def release(self, slot: int) -> None:
        self._released[slot].record(torch.cuda.current_stream(self.device))

    def fetch(self, group: GroupEntry) -> Callable[[], torch.Tensor]:
        buf = self._new_buffer(group.padded_nbytes)
        # The caching allocator may hand out memory that queued kernels still read.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return self._fetch_into(group, buf, ready)

    def close(self) -> None:
        torch.cuda.synchronize(self.device)


class PinnedRing(Ring):
    """Device slots filled from a pinned host arena by copies on a side stream (see the module doc).

    Args:
        arena: page-aligned host bytes holding every streamed group at ``bases[name]``;
            pinned here with ``cudaHostRegister`` (if that fails, a warning, and the copies are
            synchronous but still correct).
    """

    kind = "pinned"

    def __init__(self, arena: torch.Tensor, bases: dict[str, int], buffers: list[torch.Tensor], *, device: torch.device) -> None:
        super().__init__(buffers)
        self.arena, self.bases, self.device = arena, bases, device
        self.pinned = _pin(arena)
        self.host_nbytes = arena.numel()
        self._side = torch.cuda.Stream(device=device)
        self._released = _allocated(buffers, device)
        self._filled = [torch.cuda.Event() for _ in buffers]
        self._closed = False

    def start(self, group: GroupEntry, pos: int, slot: int) -> Fill:
        base = self.bases[group.name]
        with torch.cuda.stream(self._side):
            self._side.wait_event(self._released[slot])
            self.buffers[slot][: group.nbytes].copy_(self.arena[base : base + group.nbytes], non_blocking=True)
            self._filled[slot].record(self._side)
        return Fill(pos, slot, event=self._filled[slot])

    def wait(self, group: GroupEntry, fill: Fill) -> None:
        # Captures the fill's record as it is now; the slot's next fill records again only after release.
        torch.cuda.current_stream(self.device).wait_event(fill.event)

    def settle(self, fill: Fill) -> None:
        fill.event.synchronize()

    def release(self, slot: int) -> None:
        self._released[slot].record(torch.cuda.current_stream(self.device))

    def fetch(self, group: GroupEntry) -> Callable[[], torch.Tensor]:
        """The copy starts now, on the side stream, after what the compute stream has queued (the
        caching allocator may hand out memory a queued kernel still reads), so the layer below is
        copied while backward computes this one; the waiter makes the compute stream wait for it."""
        base = self.bases[group.name]
        buf = self._new_buffer(group.padded_nbytes)
        ready, done = torch.cuda.Event(), torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            self._side.wait_event(ready)
            buf.copy_(self.arena[base : base + group.padded_nbytes], non_blocking=True)
            done.record(self._side)

        def wait() -> torch.Tensor:
            torch.cuda.current_stream(self.device).wait_event(done)
            buf.record_stream(torch.cuda.current_stream(self.device))  # used there: not reused before its kernels finish
            return buf

        return wait

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize(self.device)
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())


def _allocated(buffers: list[torch.Tensor], device: torch.device) -> list[Any]:
    """One release event per slot, recorded now on the stream that allocated the slots: a slot's
    first fill (a cuFile DMA, a side-stream copy) is ordered after whatever that stream still had
    queued on the memory the caching allocator handed out."""
    events = []
    for _ in buffers:
        e = torch.cuda.Event()
        e.record(torch.cuda.current_stream(device))
        events.append(e)
    return events


def _clear_last_cuda_error(cudart: Any) -> None:
    """Reset the CUDA runtime's last error: a failed ``cudaHostRegister`` leaves it set, and
    torch's next launch check would report it as its own. Torch's ``cudart()`` binding may lack
    ``cudaGetLastError``; the runtime torch loaded globally has it."""
    clear = getattr(cudart, "cudaGetLastError", None)
    if clear is not None:
        clear()
        return
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (OSError, AttributeError):
        pass  # no global libcudart: the error stays set, as it would without this call


def _pin(arena: torch.Tensor) -> bool:
    """Page-lock ``arena`` in place (one registration, no power-of-two rounding as with
    ``pin_memory=True``); ``False`` with a warning if CUDA refuses (its error is cleared, so the
    next kernel launch does not report it as its own)."""
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(arena.data_ptr(), arena.numel(), 0))
    if err:
        _clear_last_cuda_error(cudart)
        warnings.warn(
            f"cudaHostRegister of the {arena.numel()} byte host tier failed (cudaError {err}); copies to the GPU "
            f"will be synchronous. Raise the locked-memory limit (ulimit -l) or use tier='drive'",
            stacklevel=4,
        )
    return err == 0


def _aligned_device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of device memory starting at a 4 KiB boundary (cuFile's direct path DMAs
    aligned buffers; the caching allocator only promises 512 bytes). The view keeps its block alive."""
    return aligned_view(torch.empty(nbytes + ALIGN, dtype=torch.uint8, device=device), nbytes)


def make_read_engine(choice: Choice, device: torch.device, num_threads: int | None) -> Engine:
    """The engine for a ring's reads, as ``choice`` (:func:`~gds_offload.node.choice.choose_engine`,
    asked once by the model) names it, with ``num_threads`` (``None``: the engine's default;
    posix on the CPU: 4, on a GPU: 8). Files are opened read-only (a store may be shared, or on a
    read-only mount), and no read buffers are pooled: fills land in the ring's."""
    if choice.engine == "posix" and not num_threads:
        num_threads = 4 if device.type == "cpu" else 8
    return make_engine(choice.engine, strict=choice.strict, read_only=True, num_threads=num_threads, read_pool_bytes=0)


def make_ring(
    *, tier: str, device: torch.device, engine: Engine, files: StoreFiles, groups: list[GroupEntry], slots: int,
    verify: bool, load: Any,
) -> Ring | None:  # fmt: skip
    """The ring for ``groups`` (the streamed layers), or ``None`` when none are streamed.

    ``load(groups) -> (arena, bases)``: reads groups into one page-aligned host arena (used
    by ``tier="host"`` on a GPU). Allocates ``min(slots, len(groups))`` buffers of the
    largest group's padded size on ``device``.
    """
    if not groups:
        return None
    n = min(slots, len(groups))
    nbytes = max(g.padded_nbytes for g in groups)
    if device.type == "cpu":
        return HostRing(engine, files, [aligned_host_buffer(nbytes) for _ in range(n)], verify=verify)
    buffers = [_aligned_device_buffer(nbytes, device) for _ in range(n)]
    if tier == "host":
        arena, bases = load(groups)
        return PinnedRing(arena, bases, buffers, device=device)
    return DeviceRing(engine, files, buffers, verify=verify, device=device)
