"""The pack/unpack hooks and the life of every saved tensor.

Data path (see README, "Architecture")::

    pack(t) -> policy.offload(unit)? -> dedup by storage -> store.allocate -> engine.write (async)
    unpack(h) -> still in memory? (forwarded) -> prefetched? wait : read now (a stall) -> view
    handle freed by autograd -> release memory and the spill slot

Deduplication works on *storages*, not tensors: a storage saved several times, or
several views of it (a transpose, q/k/v split out of one fused projection), is
written once, and every handle rebuilds its own view (offset, shape, stride, dtype)
over the bytes read back. Storages are identified by their ``StorageImpl`` and held
through a :class:`~torch.multiprocessing.reductions.StorageWeakRef`: a weak reference
keeps the ``StorageImpl`` object (not its memory) alive, so its address cannot be
recycled while the entry exists, and ``expired()`` says when the storage died.
The tensor's version counter is part of the key, so bytes changed in place between
two saves are never served from the older copy.

Threads: ``pack`` runs on the thread running forward. ``unpack`` runs where
autograd runs the node's backward (the calling thread on CPU; autograd's device
thread for CUDA). Write/read completions arrive on engine threads. Handles can be
freed on any of them. All shared state is guarded by one re-entrant lock, never
held while waiting for I/O.
"""
from __future__ import annotations

import enum
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gds_offload.errors import OffloadError, SpillSpaceError
from gds_offload.stats import LayerStats, OffloadStats

if TYPE_CHECKING:
    from gds_offload.io.base import Engine, IOFuture
    from gds_offload.policy import Policy
    from gds_offload.store import Slot, SpillStore

__all__ = ["Phase", "Scheduler", "SchedulerConfig"]


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class SchedulerConfig:
    #: Storages smaller than this stay in memory: small transfers cost more than they save.
    min_bytes: int
    #: Bytes of reads kept in flight ahead of backward; ``None``: twice the largest unit.
    prefetch_bytes: int | None
    #: What a failed write does: keep the tensor resident and warn, or raise.
    on_error: Literal["fallback", "raise"]


def _byte_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """All bytes of ``storage`` as a 1-D uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


@dataclass(eq=False)
class _Entry:
    """One storage's bytes, shared by every handle that saved a view of it."""

    nbytes: int
    device: torch.device
    forward_id: int
    unit: int
    storage_ref: StorageWeakRef | None
    key: tuple[int, int] | None
    #: The storage's bytes while resident: kept, write in flight, or fallback.
    source: torch.Tensor | None = None
    slot: Slot | None = None
    write: IOFuture | None = None
    read: IOFuture | None = None
    #: Bytes read back, held until every live handle unpacked once.
    loaded: torch.Tensor | None = None
    loaded_weak: weakref.ref[torch.Tensor] | None = None
    handles: int = 0
    pending: int = 0
    kept: bool = False
    forwarded: bool = False
    counted_resident: bool = False


class _Handle:
    """What autograd stores in place of a saved tensor. Freed by autograd -> :meth:`Scheduler._release`."""

    __slots__ = ("entry", "offset", "size", "stride", "dtype", "unpacked", "scheduler", "__weakref__")

    def __init__(self, scheduler: Scheduler, entry: _Entry, t: torch.Tensor) -> None:
        self.scheduler = scheduler
        self.entry = entry
        self.offset = t.storage_offset()
        self.size = t.size()
        self.stride = t.stride()
        self.dtype = t.dtype
        self.unpacked = False

    def __del__(self) -> None:
        self.scheduler._release(self)


@dataclass
class _Unit:
    """Bookkeeping of one layer call of one forward."""

    name: str
    entries: list[_Entry] = field(default_factory=list)
    offloaded_bytes: int = 0
    prefetched: bool = False
    t_start: float = 0.0
    t_end: float = 0.0
    t_backward: float = 0.0


class Scheduler:
    """Owns the pack/unpack hooks' state. Created and driven by :class:`~gds_offload.offloader.Offloader`."""

    def __init__(
        self,
        config: SchedulerConfig,
        policy: Policy,
        engine: Engine,
        store: SpillStore,
        stats: OffloadStats,
    ) -> None:
        self.config = config
        self.policy = policy
        self.engine = engine
        self.store = store
        self._stats = stats
        self._lock = threading.RLock()
        self._phase = Phase.IDLE
        self._forward_id = -1
        self._unit = 0
        self._layer_calls_last = 0
        self._units: dict[tuple[int, int], _Unit] = {}
        self._dedup: dict[tuple[int, int], _Entry] = {}
        self._param_storages: set[int] = set()
        self._layer_stats: dict[str, LayerStats] = {}
        self._warned: set[str] = set()
        self._error: OffloadError | None = None
        self._inflight: set[_Entry] = set()
        self._backward_started: set[int] = set()

    # ------------------------------------------------------------------ phases
    def begin_forward(self, params: list[torch.Tensor], expected_layer_calls: int) -> int:
        """Start a forward (training thread). Returns the forward id."""
        with self._lock:
            self._raise_pending_error()
            self._prune_units()
            self._phase = Phase.FORWARD
            self._forward_id += 1
            self._unit = 0
            self._param_storages = {p.untyped_storage()._cdata for p in params}
            calls = self._layer_calls_last or expected_layer_calls
            self.policy.begin_forward(calls)
            self._units[(self._forward_id, 0)] = _Unit("<pre>", t_start=time.perf_counter())
            self._stats.steps += 1
            return self._forward_id

    def end_forward(self) -> None:
        with self._lock:
            assert self._phase is Phase.FORWARD, f"end_forward in phase {self._phase}"
            self._layer_calls_last = self._unit
            unit = self._units.get((self._forward_id, self._unit))
            if unit is not None:
                unit.t_end = time.perf_counter()
            self._phase = Phase.IDLE

    def begin_layer(self, name: str) -> None:
        """A layer call starts inside a forward (module forward pre-hook)."""
        with self._lock:
            if self._phase is not Phase.FORWARD:
                return  # recomputation under checkpoint during backward: not a new unit
            now = time.perf_counter()
            prev = self._units.get((self._forward_id, self._unit))
            if prev is not None:
                prev.t_end = now
            self._unit += 1
            self._units[(self._forward_id, self._unit)] = _Unit(name, t_start=now)

    def current_position(self) -> tuple[int, int] | None:
        """(forward id, unit) while inside a forward, else None."""
        with self._lock:
            return (self._forward_id, self._unit) if self._phase is Phase.FORWARD else None

    def on_unit_backward(self, forward_id: int, unit: int) -> None:
        """Backward reached ``unit`` (a grad_fn pre-hook on the unit's output): prefetch below it."""
        self._note_backward(forward_id)
        with self._lock:
            u = self._units.get((forward_id, unit))
            if u is not None and not u.t_backward:
                u.t_backward = time.perf_counter()
        self._prefetch(forward_id, unit)

    # ------------------------------------------------------------------ hooks
    def pack(self, t: torch.Tensor) -> Any:
        """``pack_hook(tensor) -> handle``: runs when autograd saves ``t`` during forward.

        Returns ``t`` itself for parameters (and views of them) and for tensors that
        cannot be offloaded (sparse, nested, quantized, subclasses, meta); else a
        :class:`_Handle`. Never blocks on I/O: writes are handed to the engine.
        """
        if self._unsupported(t):
            with self._lock:
                self._stats.bytes_unsupported += _nbytes(t)
            return t
        storage = t.untyped_storage()
        sid = storage._cdata
        if sid in self._param_storages:
            return t
        with self._lock:
            self._raise_pending_error()
            key = (sid, t._version)
            entry = self._dedup.get(key)
            if entry is not None and entry.storage_ref is not None and not entry.storage_ref.expired():
                self._stats.bytes_deduplicated += entry.nbytes
                self._move_to_current_unit(entry)
            else:
                entry = self._new_entry(t, storage, key)
            entry.handles += 1
            entry.pending += 1
            return _Handle(self, entry, t)

    def unpack(self, handle: Any) -> torch.Tensor:
        """``unpack_hook(handle) -> tensor``: runs when backward needs the saved tensor.

        Returns a tensor equal to the packed one in value, size, stride, dtype and
        device. Serves it from memory when it is still there (forwarding), else waits
        for its prefetched read, else reads it now. May be called more than once per
        handle (``retain_graph``); each call returns identical data.

        Raises:
            OffloadError: the read failed; names the layer, tensor, file and offset.
        """
        if not isinstance(handle, _Handle):
            return handle
        entry = handle.entry
        self._note_backward(entry.forward_id)
        data = self._bytes_of(entry, handle)
        out = torch.empty(0, dtype=handle.dtype, device=data.device).set_(
            data.untyped_storage(), handle.offset, handle.size, handle.stride
        )
        with self._lock:
            if not handle.unpacked:
                handle.unpacked = True
                entry.pending -= 1
                if entry.pending == 0 and entry.loaded is not None:
                    entry.loaded = None  # autograd holds it now; keep a weak ref for re-unpacks
                    self._uncount_resident(entry)
        self._prefetch(entry.forward_id, entry.unit)
        return out

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _unsupported(t: torch.Tensor) -> bool:
        return (
            t.layout is not torch.strided
            or t.is_nested
            or t.is_quantized
            or t.is_meta
            or t.is_conj()
            or t.is_neg()
            or type(t) not in (torch.Tensor, torch.nn.Parameter)
        )

    def _new_entry(self, t: torch.Tensor, storage: torch.UntypedStorage, key: tuple[int, int]) -> _Entry:
        # Caller holds the lock.
        fid, unit = (self._forward_id, self._unit) if self._phase is Phase.FORWARD else (-1, 0)
        nbytes = storage.nbytes()
        entry = _Entry(nbytes, t.device, fid, unit, StorageWeakRef(storage), key)
        self._dedup[key] = entry
        self._stats.bytes_packed += nbytes
        entry.source = _byte_view(storage, t.device)
        self._count_resident(entry)
        u = self._units.get((fid, unit))
        layer = self._layer_stat(u.name if u else "<outside forward>")
        layer.bytes_packed += nbytes
        if nbytes < self.config.min_bytes or fid < 0 or not self.policy.offload(unit):
            entry.kept = True
            self._stats.bytes_kept += nbytes
            layer.bytes_kept += nbytes
            return entry
        try:
            entry.slot = self.store.allocate(nbytes)
        except SpillSpaceError as exc:
            self._write_failed(entry, exc)
            return entry
        ready = None
        if t.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(t.device))
        self._inflight.add(entry)
        layer.bytes_offloaded += nbytes
        if u is not None:
            u.entries.append(entry)
            u.offloaded_bytes += nbytes
        entry.write = self.engine.write(entry.source, entry.slot, ready=ready)
        entry.write.add_done_callback(lambda f, e=entry: self._on_written(e, f))
        return entry

    def _on_written(self, entry: _Entry, future: IOFuture) -> None:
        """Engine thread: a write finished. Drop the in-memory copy unless it is still needed."""
        with self._lock:
            self._inflight.discard(entry)
            try:
                future.wait(0)
            except OffloadError as exc:
                self._write_failed(entry, exc)
                if entry.handles == 0:
                    entry.source = None
                    self._uncount_resident(entry)
                return
            self._stats.bytes_offloaded += entry.nbytes
            if entry.handles == 0:
                self._free_slot(entry)
            if entry.source is not None:
                entry.source = None
                self._uncount_resident(entry)

    def _write_failed(self, entry: _Entry, exc: OffloadError) -> None:
        # Caller holds the lock. The source is still in memory: nothing is lost.
        self._free_slot(entry)
        entry.kept = True
        self._stats.bytes_fallback += entry.nbytes
        if self.config.on_error == "raise":
            self._error = OffloadError(
                f"could not offload {entry.nbytes} bytes ({exc}); the tensor is still in memory. "
                f"Free space in the spill directory or pass on_error='fallback' to keep such tensors resident"
            )
            self._error.__cause__ = exc
            return
        where = str(exc).split(" failed:")[0] if isinstance(exc, OffloadError) else str(exc)
        if where not in self._warned:
            self._warned.add(where)
            warnings.warn(
                f"gds_offload: {exc}. Tensors that cannot be written stay in memory "
                f"(stats().bytes_fallback counts them); free space to offload again.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _note_backward(self, forward_id: int) -> None:
        if forward_id in self._backward_started:
            return
        with self._lock:
            if forward_id in self._backward_started:
                return
            self._backward_started.add(forward_id)
            self._phase = Phase.BACKWARD if self._phase is Phase.IDLE else self._phase
        try:  # run finish_units when this backward call ends
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.finish_units(forward_id))
        except RuntimeError:
            pass  # unpacked outside a backward pass (e.g. grad_fn._saved_*): nothing to finish

    def _move_to_current_unit(self, entry: _Entry) -> None:
        # Caller holds the lock. A storage saved again by a later layer is needed first by
        # that layer's backward: prefetch it with that layer.
        if self._phase is not Phase.FORWARD or entry.forward_id != self._forward_id or entry.unit >= self._unit:
            return
        old = self._units.get((entry.forward_id, entry.unit))
        new = self._units.get((self._forward_id, self._unit))
        if old is None or new is None or entry not in old.entries:
            return
        old.entries.remove(entry)
        old.offloaded_bytes -= entry.nbytes
        new.entries.append(entry)
        new.offloaded_bytes += entry.nbytes
        entry.unit = self._unit

    def _prune_units(self) -> None:
        # Caller holds the lock. Forwards whose backward never ran (or ran without our
        # end-of-backward callback) are dropped once no handle of theirs is alive.
        done = {f for (f, _) in self._units} - {
            f for (f, _), u in self._units.items() if any(e.handles for e in u.entries)
        }
        for fid in done:
            self.finish_units(fid)

    def _bytes_of(self, entry: _Entry, handle: _Handle) -> torch.Tensor:
        """The entry's bytes in memory: forwarded, loaded, or read now (blocking)."""
        with self._lock:
            if entry.source is not None:
                if entry.slot is not None and not entry.forwarded:
                    entry.forwarded = True  # offloaded, but backward came before the write finished
                    self._stats.bytes_forwarded += entry.nbytes
                return entry.source
            loaded = entry.loaded if entry.loaded is not None else (entry.loaded_weak() if entry.loaded_weak else None)
            if loaded is not None and entry.read is None:
                return loaded
            if entry.read is None:
                self._issue_read(entry)
            read, dst = entry.read, entry.loaded
        assert read is not None and dst is not None, "a read was issued for this entry"
        if not read.done():
            with self._lock:
                self._stats.stalls += 1
            t0 = time.perf_counter()
            try:
                read.wait()
            finally:
                with self._lock:
                    self._stats.io_wait_seconds += time.perf_counter() - t0
        try:
            read.wait(0)
        except OffloadError as exc:
            with self._lock:
                if entry.read is read:
                    entry.read, entry.loaded = None, None
                    self._uncount_resident(entry)
            u = self._units.get((entry.forward_id, entry.unit))
            raise OffloadError(
                f"cannot restore a saved tensor of layer {u.name if u else entry.unit} "
                f"(shape {tuple(handle.size)}, {handle.dtype}, {entry.nbytes} bytes): {exc}"
            ) from exc
        with self._lock:
            if entry.read is read:
                entry.read = None
                self._stats.bytes_read += entry.nbytes
        return dst

    def _issue_read(self, entry: _Entry) -> None:
        # Caller holds the lock; entry has no bytes in memory.
        assert entry.slot is not None, "an entry without bytes in memory has a slot"
        dst = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
        ready = None
        if dst.device.type == "cuda":
            # The allocator may hand out memory a queued kernel still reads: let that finish first.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dst.device))
        entry.loaded = dst
        entry.loaded_weak = weakref.ref(dst)
        self._count_resident(entry)
        entry.read = self.engine.read(dst, entry.slot, ready=ready)

    def _prefetch(self, forward_id: int, unit: int) -> None:
        """Issue reads for the units below ``unit`` within the prefetch window."""
        with self._lock:
            window = self.config.prefetch_bytes
            if window is None:
                sizes = [u.offloaded_bytes for (f, _), u in self._units.items() if f == forward_id]
                window = 2 * max(sizes, default=0)
            budget = window
            for k in range(unit, -1, -1):
                u = self._units.get((forward_id, k))
                if u is None:
                    continue
                if k < unit - 1 and budget < u.offloaded_bytes:
                    break  # the unit in use and the next one always; further ones within the window
                budget -= u.offloaded_bytes
                if u.prefetched:
                    continue
                u.prefetched = True
                for e in u.entries:
                    if e.source is None and e.loaded is None and e.read is None and e.slot is not None and e.handles:
                        self._issue_read(e)

    def _release(self, handle: _Handle) -> None:
        """Autograd freed a handle (any thread). The last handle frees memory and slot."""
        entry = handle.entry
        with self._lock:
            entry.handles -= 1
            if not handle.unpacked:
                entry.pending -= 1
            if entry.handles:
                return
            if entry.key is not None and self._dedup.get(entry.key) is entry:
                del self._dedup[entry.key]
            entry.loaded = None
            entry.loaded_weak = None
            if entry.source is not None and entry.write is not None and not entry.write.done():
                return  # _on_written frees the slot and the source
            if entry.source is not None or entry.counted_resident:
                entry.source = None
                self._uncount_resident(entry)
            if entry.read is None or entry.read.done():
                self._free_slot(entry)
            else:
                entry.read.add_done_callback(lambda _f, e=entry: self._free_slot_locked(e))

    def _free_slot_locked(self, entry: _Entry) -> None:
        with self._lock:
            self._free_slot(entry)

    def _free_slot(self, entry: _Entry) -> None:
        if entry.slot is not None:
            self.engine.release(entry.slot)
            self.store.free(entry.slot)
            entry.slot = None

    def _count_resident(self, entry: _Entry) -> None:
        if not entry.counted_resident:
            entry.counted_resident = True
            self._stats.resident_bytes += entry.nbytes
            self._stats.peak_resident_bytes = max(self._stats.peak_resident_bytes, self._stats.resident_bytes)

    def _uncount_resident(self, entry: _Entry) -> None:
        if entry.counted_resident and entry.source is None and entry.loaded is None:
            entry.counted_resident = False
            self._stats.resident_bytes -= entry.nbytes

    def _layer_stat(self, name: str) -> LayerStats:
        s = self._layer_stats.get(name)
        if s is None:
            s = self._layer_stats[name] = LayerStats(name)
        return s

    # ------------------------------------------------------------------ lifecycle
    def finish_units(self, forward_id: int) -> None:
        """Drop the bookkeeping of a forward whose backward is done (its timings go to the layer stats)."""
        with self._lock:
            for key in [k for k in self._units if k[0] == forward_id]:
                u = self._units.pop(key)
                s = self._layer_stat(u.name)
                if u.t_end > u.t_start:
                    s.forward_seconds += u.t_end - u.t_start
            self._backward_started.discard(forward_id)
            if self._phase is Phase.BACKWARD:
                self._phase = Phase.IDLE

    def wait_inflight(self) -> None:
        """Block until every write in flight has finished."""
        while True:
            with self._lock:
                pending = [e.write for e in self._inflight if e.write is not None]
            if not pending:
                return
            for f in pending:
                try:
                    f.wait()
                except OffloadError:
                    pass  # _on_written recorded it and kept the data

    def materialize_all(self) -> None:
        """Bring every live tensor whose bytes are only in storage back into memory.

        Called by ``detach()`` before the store closes, so a graph that is still alive
        can run its backward without the offloader.
        """
        with self._lock:
            live = [e for u in self._units.values() for e in u.entries if e.handles and e.source is None]
        for e in live:
            with self._lock:
                if e.read is None and e.loaded is None and e.slot is not None:
                    self._issue_read(e)
                read, data = e.read, e.loaded
            if read is not None:
                read.wait()
            with self._lock:
                e.source, e.kept, e.read, e.loaded = data, True, None, None
                self._free_slot(e)

    def layer_stats(self) -> list[LayerStats]:
        with self._lock:
            return [LayerStats(**vars(s)) for s in self._layer_stats.values()]

    def phase(self) -> Phase:
        return self._phase


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()
