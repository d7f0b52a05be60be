"""The read path: bringing offloaded bytes back (:class:`ReadPath`, a base of the scheduler).

Three callers need an entry's bytes in memory again:

* the unpack hook (:meth:`ReadPath._bytes_of`): the bytes already in memory (kept, a
  write still holding its source, loaded), else the entry's read (issued by prefetch, or
  issued now), waited for if it has not finished (a stall, counted);
* backward reaching a layer or unpacking a tensor (:meth:`ReadPath._prefetch`): the
  reads of the tensors backward will unpack next, in the reverse of the order forward
  saved them, up to the read-ahead in bytes (``prefetch_bytes``, else
  :meth:`~gds_offload.activations.scheduler.state.SchedulerState._read_ahead`); or,
  when the policy asks for layers (``prefetch_units``), of whole layers: that
  layer's and those of the offloaded layers below it;
* ``detach()`` (:meth:`ReadPath.materialize_all`): every live entry whose bytes are only
  on the drive, read back and kept, so a graph still alive runs its backward without the
  offloader.

A failed read marks the entry FAILED and frees its memory and slot at once
(:meth:`ReadPath._read_failed`): it is never matched by deduplication again, and every
later unpack of it raises the same :class:`~gds_offload.errors.OffloadError`, naming the
layer and tensor, without touching the drive. Reads are waited for without
:class:`~gds_offload.activations.scheduler.state.SchedulerState`'s lock held.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from gds_offload.activations.scheduler.entry import Entry, Handle, State
from gds_offload.activations.scheduler.state import SchedulerState, cuda_ready
from gds_offload.errors import OffloadError
from gds_offload.io.integrity import checked_read

if TYPE_CHECKING:
    from gds_offload.activations.planning.profile import ForwardRecord
    from gds_offload.io.base import IOFuture

__all__ = ["ReadPath"]


class ReadPath(SchedulerState):
    """Reading entries back: now (unpack), ahead (prefetch), all of them (detach)."""

    def _bytes_of(self, entry: Entry, handle: Handle) -> torch.Tensor:
        """The entry's bytes in memory: kept, forwarded, loaded, or read now (blocking)."""
        with self._lock:
            data = entry.bytes_in_memory()
            if data is not None:
                if entry.slot is not None and not entry.forwarded and data.untyped_storage()._cdata == entry.storage_ref.cdata:
                    entry.forwarded = True  # offloaded, but backward came before the source left memory
                    self._stats.bytes_forwarded += entry.nbytes
                return data
            if entry.state is State.FAILED:
                raise OffloadError(entry.failure)
            if entry.generation != self._generation:
                raise OffloadError(
                    f"a saved tensor {tuple(handle.size)} was offloaded before this process forked; its bytes are "
                    "in the parent's spill store. Run backward in the process that ran forward"
                )
            if entry.state is not State.READING:
                self._issue_read(entry)
                self._stats.reads_at_unpack += 1
            read, dst = entry.read, entry.data
        assert read is not None and dst is not None, "a read was issued for this entry"
        if not read.done():
            self._wait_for_read(entry, read)
        exc = read.error()
        if exc is not None:
            raise OffloadError(self._read_failed(entry, read, f"shape {tuple(handle.size)}, {handle.dtype}", exc))
        with self._lock:
            if entry.read is read:
                entry.read = None
                entry.move(State.LOADED)
                self._stats.bytes_read += entry.nbytes
        return dst

    def _wait_for_read(self, entry: Entry, read: IOFuture) -> None:
        with self._lock:
            self._stats.stalls += 1
        t0 = time.perf_counter()
        read.error()  # a failure is reported by the caller, with the layer and tensor it belongs to
        waited = time.perf_counter() - t0
        with self._lock:
            self._stats.io_wait_s += waited
            fwd = self.forwards.get(entry.forward_id)
            if fwd is not None:
                fwd.read_wait_s += waited
                if entry.unit < len(fwd.units):
                    fwd.units[entry.unit].read_wait_s += waited

    def _read_failed(self, entry: Entry, read: IOFuture, what: str, exc: BaseException) -> str:
        """Mark the entry FAILED and release its memory and slot at once; return the message.

        A FAILED entry is never matched by deduplication, and every later unpack of it
        raises the same message without touching the drive again."""
        with self._lock:
            if entry.state is State.READING and entry.read is read:
                fwd = self.forwards.get(entry.forward_id)
                where = fwd.units[entry.unit].name if fwd is not None and entry.unit < len(fwd.units) else f"unit {entry.unit}"
                entry.failure = (
                    f"cannot restore a saved tensor of layer {where} "
                    f"({what}, {entry.nbytes} bytes): {exc}"
                )
                entry.read = None
                entry.data = None
                entry.move(State.FAILED)
                self._account(entry)
                self._free_slot(entry)
            return entry.failure or str(exc)

    def _issue_read(self, entry: Entry) -> None:
        # Caller holds the lock; the entry's bytes are only on the drive.
        assert entry.slot is not None, f"an entry in state {entry.state.name} without bytes in memory has a slot"
        dst = self.engine.empty(entry.nbytes, entry.slot, entry.device)
        entry.data, entry.data_weak = dst, None
        entry.move(State.READING)
        self._account(entry)
        # Completes once all bytes arrived and, with verify, their checksum matched.
        read = checked_read(self.engine.read(dst, entry.slot, ready=cuda_ready(dst.device)), dst, entry.slot, entry.checksum)
        entry.read = read
        self._reads[read.token] = read
        read.add_done_callback(self._read_ended)

    def _read_ended(self, read: IOFuture) -> None:
        with self._lock:
            self._reads.pop(read.token, None)

    def _prefetch(self, forward_id: int, unit: int) -> None:
        """Issue the reads backward needs next, from ``unit`` down: by bytes or by whole layers
        (:meth:`~gds_offload.activations.scheduler.state.SchedulerState._read_ahead`)."""
        with self._lock:
            fwd = self.forwards.get(forward_id)
            if fwd is None:
                return
            ahead, units = self._read_ahead(), self.policy.prefetch_units
            if ahead is None and units is not None:
                self._prefetch_layers(fwd, unit, units)
            else:
                self._prefetch_bytes(fwd, unit, ahead or 0)

    def _prefetch_bytes(self, fwd: ForwardRecord, unit: int, window: int) -> None:
        """Read ahead, tensor by tensor in the reverse of their saving order, until the bytes
        read (or being read) and not yet unpacked reach ``window``; at least one tensor,
        unless ``window`` is 0 (each read then starts when backward unpacks it). Caller holds the lock."""
        if not self._held["unread"]:
            return  # every read is issued: no need to walk the entries at each unpack
        held = 0
        for k in range(min(unit, fwd.unit), -1, -1):
            u = fwd.units[k]
            for e in reversed(u.entries):
                if not e.pending or e.generation != self._generation:
                    continue  # unpacked already (autograd holds it), or the parent's
                if e.state is State.ON_DRIVE:
                    if held + e.nbytes > window and (held or not window):
                        return
                    self._issue_read(e)
                elif e.state not in (State.READING, State.LOADED, State.WRITING):
                    continue  # kept: in memory for good, not read
                # A write still in flight holds its bytes (served from memory if backward comes
                # first): they count against the window. The unit is never marked prefetched,
                # so a write that lands drops its source (WritePath._backward_near) and is read
                # back within the window: what is in memory ahead stays bounded by it.
                held += e.nbytes
                if held >= window:
                    return

    def _prefetch_layers(self, fwd: ForwardRecord, unit: int, max_units: int) -> None:
        """Issue the reads of ``unit`` and of up to ``max_units`` offloaded units below it
        (units kept in memory need no read and are not counted). Caller holds the lock."""
        ahead_units = 0
        for k in range(min(unit, fwd.unit), -1, -1):
            u = fwd.units[k]
            if k < unit and not u.offloaded_bytes:
                continue
            if k < unit:
                if ahead_units >= max_units:
                    break
                ahead_units += 1
            if u.prefetched:
                continue
            u.prefetched = True
            for e in u.entries:
                if e.state is State.ON_DRIVE and e.handles and e.generation == self._generation:
                    self._issue_read(e)

    def materialize_all(self) -> None:
        """Bring every live entry whose bytes are only on the drive back into memory, and free its slot.

        Called by ``detach()`` before the store closes, so a graph that is still alive
        can run its backward without the offloader.
        """
        with self._lock:
            live = [e for e in self._slotted if e.handles and e.state in (State.ON_DRIVE, State.READING, State.LOADED)]
        for e in live:
            with self._lock:
                data = e.bytes_in_memory()
                if data is None and e.state is not State.READING:
                    self._issue_read(e)
                read, data = e.read, data if data is not None else e.data
            if read is not None:
                exc = read.error()
                if exc is not None:
                    self._read_failed(e, read, "read back at detach()", exc)  # backward raises it when it needs this tensor
                    continue
            with self._lock:
                if e.state is State.READING:
                    e.read = None
                    e.move(State.LOADED)
                if e.state is State.LOADED:
                    e.data, e.data_weak = data, None
                    e.move(State.KEPT)
                    self._account(e)
                    self._free_slot(e)
