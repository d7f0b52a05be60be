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
from gds_offload.integrity import checked_read, checked_write, checksum
from gds_offload.profile import Clock, StepProfile, UnitProfile
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
    #: Bytes of reads kept in flight ahead of backward; ``None``: the policy's ``prefetch_units``.
    prefetch_bytes: int | None
    #: What a failed write does: keep the tensor resident and warn, or raise.
    on_error: Literal["fallback", "raise"]
    #: Checksum every slot after its write and check it after each read (see :mod:`gds_offload.integrity`).
    verify: bool = False


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
    #: xxh3-64 of the bytes written (``verify=True`` only).
    checksum: int | None = None


class _Handle:
    """What autograd stores in place of a saved tensor. Freed by autograd -> :meth:`Scheduler._release`."""

    __slots__ = ("entry", "offset", "size", "stride", "dtype", "unpacked", "scheduler", "forward_id", "__weakref__")

    def __init__(self, scheduler: Scheduler, entry: _Entry, t: torch.Tensor) -> None:
        self.scheduler = scheduler
        self.entry = entry
        self.offset = t.storage_offset()
        self.size = t.size()
        self.stride = t.stride()
        self.dtype = t.dtype
        self.unpacked = False
        self.forward_id = -1

    def __del__(self) -> None:
        if Scheduler is not None:  # None at interpreter shutdown: nothing left to free
            self.scheduler._release(self)


@dataclass
class _Unit:
    """Bookkeeping of one layer call of one forward. ``t_*`` are :class:`Clock` marks."""

    name: str
    t_start: Any = None
    entries: list[_Entry] = field(default_factory=list)
    offloaded_bytes: int = 0
    #: Bytes this unit could offload (>= min_bytes, after dedup), whatever the policy said.
    eligible_bytes: int = 0
    prefetched: bool = False
    #: Time backward waited for this unit's reads (not compute: subtracted from its backward time).
    io_wait_s: float = 0.0
    t_end: Any = None
    t_backward: Any = None


@dataclass
class _Forward:
    """Per-forward figures that become a :class:`StepProfile` when its backward ends."""

    clock: Clock
    #: Handles of this forward still held by autograd.
    live_handles: int = 0
    fixed_bytes: int = 0
    io_wait_s: float = 0.0
    peak_resident_bytes: int = 0


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
        #: Set at interpreter exit (:meth:`stop`): completions are ignored from then on.
        self._stopped = False
        #: Every entry that holds a spill slot (live handles or a write in flight).
        self._slotted: set[_Entry] = set()
        self._backward_started: set[int] = set()
        self._forwards: dict[int, _Forward] = {}
        self._engine_mark = engine.stats()

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
            clock = Clock(params[0].device if params else torch.device("cpu"))
            self._forwards[self._forward_id] = _Forward(clock, peak_resident_bytes=self._stats.resident_bytes)
            self._units[(self._forward_id, 0)] = _Unit("<pre>", t_start=clock.mark())
            self._stats.steps += 1
            return self._forward_id

    def end_forward(self) -> None:
        with self._lock:
            assert self._phase is Phase.FORWARD, f"end_forward in phase {self._phase}"
            self._layer_calls_last = self._unit
            unit = self._units.get((self._forward_id, self._unit))
            if unit is not None:
                unit.t_end = self._forwards[self._forward_id].clock.mark()
            self._phase = Phase.IDLE

    def begin_layer(self, name: str) -> None:
        """A layer call starts inside a forward (module forward pre-hook)."""
        with self._lock:
            if self._phase is not Phase.FORWARD:
                return  # recomputation under checkpoint during backward: not a new unit
            now = self._forwards[self._forward_id].clock.mark()
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
            if u is not None and u.t_backward is None:
                u.t_backward = self._forwards[forward_id].clock.mark()
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
                entry.handles += 1
                entry.pending += 1
            else:
                entry = self._new_entry(t, storage, key)  # counts its first handle itself
            fwd = self._forwards.get(self._forward_id) if self._phase is Phase.FORWARD else None
            if fwd is not None:
                fwd.live_handles += 1
            handle = _Handle(self, entry, t)
            handle.forward_id = self._forward_id if fwd is not None else -1
            return handle

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
        if self._error is not None:  # on_error="raise": a write failed; the tensor is still in memory
            with self._lock:
                self._raise_pending_error()
        self._note_backward(entry.forward_id)
        data = self._bytes_of(entry, handle)
        # A read buffer may start part-way into its allocation (Engine.empty); the engines keep
        # that offset a multiple of 64 bytes, so of every element size.
        start, rest = divmod(data.storage_offset(), handle.dtype.itemsize)
        assert rest == 0, f"read buffer at byte {data.storage_offset()} is not aligned for {handle.dtype}"
        out = torch.empty(0, dtype=handle.dtype, device=data.device).set_(
            data.untyped_storage(), start + handle.offset, handle.size, handle.stride
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
        # The first handle is counted before the write starts: a write that completes at once
        # (its callback runs inside engine.write) must not see handles == 0 and drop the bytes.
        entry = _Entry(nbytes, t.device, fid, unit, StorageWeakRef(storage), key, handles=1, pending=1)
        self._dedup[key] = entry
        self._stats.bytes_packed += nbytes
        entry.source = _byte_view(storage, t.device)
        self._count_resident(entry)
        u = self._units.get((fid, unit))
        layer = self._layer_stat(u.name if u else "<outside forward>")
        layer.bytes_packed += nbytes
        eligible = nbytes >= self.config.min_bytes and u is not None
        if eligible:
            u.eligible_bytes += nbytes
        elif fid in self._forwards:
            self._forwards[fid].fixed_bytes += nbytes
        if not eligible or not self.policy.offload(unit):
            entry.kept = True
            self._stats.bytes_kept += nbytes
            layer.bytes_kept += nbytes
            return entry
        try:
            entry.slot = self.store.allocate(self.engine.slot_bytes(nbytes, t.device))
        except SpillSpaceError as exc:
            self._write_failed(entry, exc)
            return entry
        self._slotted.add(entry)
        ready = None
        if t.device.type == "cuda":
            ready = torch.cuda.Event(blocking=True)  # engine threads sleep in synchronize(), not spin
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
        if self._stopped:
            return
        slot, src = entry.slot, entry.source
        exc = checked_write(future, entry.nbytes, slot) if slot is not None else None
        if exc is None and self.config.verify and src is not None:
            entry.checksum = checksum(src)  # outside the lock; the source is dropped only below
        with self._lock:
            self._inflight.discard(entry)
            if exc is not None:
                self._write_failed(entry, exc)
                if entry.handles == 0:
                    entry.source = None
                    self._uncount_resident(entry)
                return
            self._stats.bytes_offloaded += entry.nbytes
            if entry.handles == 0:
                self._free_slot(entry)
            unit = self._units.get((entry.forward_id, entry.unit))
            if entry.handles and unit is not None and unit.prefetched:
                return  # backward is about to need it: keep serving it from memory
            if entry.source is not None:
                entry.source = None
                self._uncount_resident(entry)

    def _write_failed(self, entry: _Entry, exc: OffloadError) -> None:
        # Caller holds the lock. The source is still in memory: nothing is lost.
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        site = (entry.slot.file.describe() if entry.slot is not None else "allocate", getattr(cause, "errno", None))
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
        if str(site) not in self._warned:  # once per file and error, not per tensor
            self._warned.add(str(site))
            warnings.warn(
                f"gds_offload: {exc}. This tensor's {entry.nbytes} bytes, and those of every tensor "
                f"that cannot be written, stay in memory instead (stats().bytes_fallback counts them); "
                f"free space in the spill directory to offload them again.",
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
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.finish_units(forward_id, observe=True))
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
        done = [f for f, fwd in self._forwards.items() if fwd.live_handles == 0]
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
            except OffloadError:
                pass  # raised below, with the layer and tensor it belongs to
            finally:
                waited = time.perf_counter() - t0
                with self._lock:
                    self._stats.io_wait_seconds += waited
                    fwd = self._forwards.get(entry.forward_id)
                    if fwd is not None:
                        fwd.io_wait_s += waited
                    unit = self._units.get((entry.forward_id, entry.unit))
                    if unit is not None:
                        unit.io_wait_s += waited
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
        dst = self.engine.empty(entry.nbytes, entry.slot, entry.device)
        ready = None
        if dst.device.type == "cuda":
            # The allocator may hand out memory a queued kernel still reads: let that finish first.
            ready = torch.cuda.Event(blocking=True)  # engine threads sleep in synchronize(), not spin
            ready.record(torch.cuda.current_stream(dst.device))
        entry.loaded = dst
        entry.loaded_weak = weakref.ref(dst)
        self._count_resident(entry)
        # Completes once all bytes arrived and, with verify, their checksum matched.
        entry.read = checked_read(self.engine.read(dst, entry.slot, ready=ready), dst, entry.slot, entry.checksum)

    def _prefetch(self, forward_id: int, unit: int) -> None:
        """Issue the reads of ``unit`` and of the offloaded units below it within the window.

        The window is ``prefetch_bytes`` when set, else the policy's ``prefetch_units``
        offloaded units (units kept in memory need no read and are not counted).
        """
        with self._lock:
            max_bytes = self.config.prefetch_bytes
            max_units = getattr(self.policy, "prefetch_units", 1)
            ahead_bytes = ahead_units = 0
            for k in range(unit, -1, -1):
                u = self._units.get((forward_id, k))
                if u is None or (k < unit and not u.offloaded_bytes):
                    continue
                if k < unit:
                    full = ahead_bytes + u.offloaded_bytes > max_bytes if max_bytes is not None else ahead_units >= max_units
                    if ahead_units and full:
                        break
                    ahead_units += 1
                    ahead_bytes += u.offloaded_bytes
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
            fwd = self._forwards.get(handle.forward_id)
            if fwd is not None:
                fwd.live_handles -= 1
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
        self._slotted.discard(entry)
        if entry.slot is not None:
            self.engine.release(entry.slot)
            self.store.free(entry.slot)
            entry.slot = None

    def _count_resident(self, entry: _Entry) -> None:
        if not entry.counted_resident:
            entry.counted_resident = True
            self._stats.resident_bytes += entry.nbytes
            self._stats.peak_resident_bytes = max(self._stats.peak_resident_bytes, self._stats.resident_bytes)
            for fwd in self._forwards.values():
                fwd.peak_resident_bytes = max(fwd.peak_resident_bytes, self._stats.resident_bytes)

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
    def finish_units(self, forward_id: int, *, observe: bool = False) -> None:
        """Drop the bookkeeping of a forward whose backward is done.

        With ``observe`` (called when its backward ends), its timings go to the layer
        stats and, as a :class:`StepProfile`, to the policy.
        """
        with self._lock:
            fwd = self._forwards.pop(forward_id, None)
            units = [self._units.pop(k) for k in sorted(k for k in self._units if k[0] == forward_id)]
            self._backward_started.discard(forward_id)
            if self._phase is Phase.BACKWARD:
                self._phase = Phase.IDLE
            if not observe or fwd is None or not units:
                return
            profile = self._profile(fwd, units)
            for u, p in zip(units, profile.units):
                s = self._layer_stat(u.name)
                s.forward_seconds += p.forward_s
                s.backward_seconds += p.backward_s
        self.policy.observe(profile)

    def _profile(self, fwd: _Forward, units: list[_Unit]) -> StepProfile:
        # Caller holds the lock. Reading CUDA event times synchronises the device once per
        # step; policies that do not plan by time skip it.
        clock = fwd.clock
        if clock.cuda and not getattr(self.policy, "needs_timing", True):
            clock = _NO_TIMING
        end_backward = clock.mark()
        rows = []
        for k, u in enumerate(units):
            t_next = units[k + 1].t_start if k + 1 < len(units) else u.t_end
            b_end = units[k - 1].t_backward if k >= 2 else (end_backward if k == 1 else None)
            rows.append(
                UnitProfile(
                    name=u.name,
                    forward_s=clock.seconds(u.t_start, t_next),
                    backward_s=max(0.0, clock.seconds(u.t_backward, b_end) - u.io_wait_s) if u.t_backward is not None else 0.0,
                    eligible_bytes=u.eligible_bytes,
                    offloaded_bytes=u.offloaded_bytes,
                )
            )
        now, before = self.engine.stats(), self._engine_mark
        self._engine_mark = now
        dw, dwt = now.bytes_written - before.bytes_written, now.write_busy_seconds - before.write_busy_seconds
        dr, drt = now.bytes_read - before.bytes_read, now.read_busy_seconds - before.read_busy_seconds
        return StepProfile(
            units=tuple(rows),
            write_bps=dw / dwt if dw and dwt > 0 else 0.0,
            read_bps=dr / drt if dr and drt > 0 else 0.0,
            io_wait_s=fwd.io_wait_s,
            peak_resident_bytes=fwd.peak_resident_bytes,
            fixed_bytes=fwd.fixed_bytes,
        )

    def stop(self) -> None:
        """Interpreter exit: ignore write completions from now on (no fallbacks, no warnings)."""
        self._stopped = True

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
            live = [e for e in self._slotted if e.handles and e.source is None]
        for e in live:
            with self._lock:
                if e.read is None and e.loaded is None and e.slot is not None:
                    self._issue_read(e)
                read, data = e.read, e.loaded
            if read is not None:
                try:
                    read.wait()
                except OffloadError:
                    with self._lock:  # backward raises the error when it needs this tensor
                        e.read, e.loaded = None, None
                        self._uncount_resident(e)
                    continue
            with self._lock:
                e.source, e.kept, e.read, e.loaded = data, True, None, None
                self._free_slot(e)

    def layer_stats(self) -> list[LayerStats]:
        with self._lock:
            return [LayerStats(**vars(s)) for s in self._layer_stats.values()]

    def phase(self) -> Phase:
        return self._phase


class _NoTiming(Clock):
    def __init__(self) -> None:
        self.cuda = False

    def mark(self) -> Any:
        return None

    def seconds(self, start: Any, end: Any) -> float:
        return 0.0


_NO_TIMING = _NoTiming()


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()
