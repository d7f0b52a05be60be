"""The write path: where a packed storage goes (:class:`WritePath`, a base of the scheduler).

An entry the pack hook created is kept in memory (smaller than ``min_bytes``, or in a
layer the policy keeps), or given a spill slot and written (:meth:`WritePath._place`).
Before a write starts, the pack waits while writes in flight hold a full window
(backpressure: a drive slower than forward must not let its backlog hold every
activation); at least one write is always allowed in flight. When the write completes
(an engine thread, :meth:`WritePath._on_written`), the in-memory copy is dropped unless
backward is already near, and a failed write keeps the tensor in memory
(``on_error="fallback"``: warned once per file and error) or is raised at the next hook
(``on_error="raise"``). Nothing is lost on a failed write: the source is still in memory.

Every method runs with :class:`~gds_offload.activations.scheduler.state.SchedulerState`'s lock held,
or takes it itself (:meth:`WritePath._on_written`).
"""
from __future__ import annotations

import functools
import time
import warnings
from typing import TYPE_CHECKING

from gds_offload.activations.scheduler.entry import Entry, State
from gds_offload.activations.scheduler.state import SchedulerState, cuda_ready
from gds_offload.errors import OffloadError, SpillSpaceError
from gds_offload.io.integrity import checked_write, checksum

if TYPE_CHECKING:
    from gds_offload.activations.planning.profile import ForwardRecord
    from gds_offload.io.base import IOFuture

__all__ = ["WritePath"]


class WritePath(SchedulerState):
    """Placing an entry (kept, or a slot and a write), the write window, write completion and failure."""

    def _place(self, fwd: ForwardRecord, entry: Entry) -> None:
        """Keep ``entry`` in memory, or give it a slot and start its write. Caller holds the lock."""
        unit, layer = fwd.units[entry.unit], self._layer_stat(fwd.units[entry.unit].name)
        if entry.nbytes < self.config.min_bytes:
            fwd.fixed_bytes += entry.nbytes
            self._stats.bytes_small += entry.nbytes
        else:
            unit.eligible_bytes += entry.nbytes
        if entry.nbytes < self.config.min_bytes or not self.policy.offload(entry.unit):
            self._stats.bytes_kept += entry.nbytes
            layer.bytes_kept += entry.nbytes
            entry.move(State.KEPT)
            return
        self._wait_for_window(fwd, entry.nbytes)
        try:
            entry.slot = self.store.allocate(self.engine.slot_bytes(entry.nbytes, entry.device))
        except SpillSpaceError as exc:
            entry.move(State.KEPT)
            self._write_failed(entry, exc)
            return
        self._slotted.add(entry)
        entry.move(State.WRITING)
        self._account(entry)
        self._writing.add(entry)
        layer.bytes_offloaded += entry.nbytes
        unit.entries.append(entry)
        unit.offloaded_bytes += entry.nbytes
        self._largest_unit_bytes = max(self._largest_unit_bytes, unit.offloaded_bytes)
        assert entry.data is not None, "a WRITING entry holds its source"
        future = self.engine.write(entry.data, entry.slot, ready=cuda_ready(entry.device))
        entry.write = future
        future.add_done_callback(functools.partial(self._on_written, entry))

    def _wait_for_window(self, fwd: ForwardRecord, nbytes: int) -> None:
        """Backpressure: while writes in flight hold a full window, wait for some to finish.

        Without it, a drive slower than forward would let the backlog hold every
        activation in memory. At least one write is always allowed in flight.
        """
        window = self._window()
        self._stats.write_window_bytes = window
        if not self._writing or self._held["writing"] + nbytes <= window:
            return
        t0 = time.perf_counter()
        while self._writing and self._held["writing"] + nbytes > window and not self._stopped:
            self._written.wait(timeout=1.0)
        waited = time.perf_counter() - t0
        self._stats.write_wait_s += waited
        self._stats.io_wait_s += waited
        fwd.units[fwd.unit].write_wait_s += waited

    def _on_written(self, entry: Entry, future: IOFuture) -> None:
        """Engine thread: a write finished. Drop the in-memory copy unless backward is near."""
        if self._stopped:
            return
        exc = checked_write(future, entry.nbytes, entry.slot) if entry.slot is not None else None
        if exc is None and self.config.verify and entry.data is not None:
            entry.checksum = checksum(entry.data)  # outside the lock; the source is dropped only below
        with self._lock:
            self._writing.discard(entry)
            entry.write = None
            self._written.notify_all()
            if entry.generation != self._generation:
                return  # a forked child: this was the parent's write
            if exc is None:
                self._stats.bytes_offloaded += entry.nbytes
            if entry.state is State.RELEASED:
                entry.data = None
                self._account(entry)
                self._free_slot(entry)
            elif exc is not None:
                self._write_failed(entry, exc)
            elif self._backward_near(entry):
                entry.move(State.LOADED)  # keep serving it from memory
                self._account(entry)
            else:
                entry.move(State.ON_DRIVE)
                entry.data = None
                self._account(entry)

    def _backward_near(self, entry: Entry) -> bool:
        fwd = self.forwards.get(entry.forward_id)
        return fwd is not None and entry.unit < len(fwd.units) and fwd.units[entry.unit].prefetched

    def _write_failed(self, entry: Entry, exc: OffloadError) -> None:
        # Caller holds the lock. The source is still in memory: nothing is lost.
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        site = (entry.slot.file.describe() if entry.slot is not None else "allocate", getattr(cause, "errno", None))
        self._free_slot(entry)
        if entry.state is State.WRITING:
            entry.move(State.KEPT)
            self._account(entry)
        self._stats.bytes_fallback += entry.nbytes
        if self.config.on_error == "raise":
            self._error = OffloadError(
                f"could not offload {entry.nbytes} bytes ({exc}); the tensor is still in memory. "
                f"Free space in the spill directory or pass on_error='fallback' to keep such tensors resident"
            )
            self._error.__cause__ = exc
            return
        if str(site) not in self._warned:  # once per file and error, not per tensor
            self._warned.add(str(site))
            warnings.warn(
                f"gds_offload: {exc}. This tensor's {entry.nbytes} bytes, and those of every tensor "
                f"that cannot be written, stay in memory instead (stats().bytes_fallback counts them); "
                f"free space in the spill directory to offload them again.",
                RuntimeWarning,
                stacklevel=2,
            )
