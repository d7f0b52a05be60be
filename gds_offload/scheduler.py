"""The pack/unpack hooks: where each saved tensor goes, and how it comes back.

Data path (see README, "How it works")::

    pack(t)   -> eligible? -> dedup (same forward, same version counter) -> place (slot, write window) -> write
    unpack(h) -> version check -> in memory? (kept, forwarded, loaded) : wait for its read, or read now -> view
    handle freed by autograd -> release the entry's memory and slot

Each storage's life is an :class:`~gds_offload.entry.Entry` with an explicit
:class:`~gds_offload.entry.State`; per-forward bookkeeping (units, timing, dedup) is a
:class:`~gds_offload.profile.ForwardRecord`.

The module is longer than the project's others on purpose: pack, write completion,
unpack, prefetch and release all drive the same entry transitions under one lock, and
keeping that orchestration in one place keeps the lock's invariants readable. The
transitions themselves live in :mod:`gds_offload.entry`, per-forward tracking in
:mod:`gds_offload.forwards`.

Threads: ``pack`` runs on the thread running the forward; each thread has its own
current forward, so several threads may run forward and backward on one attached model.
``unpack`` runs where autograd runs the node's backward (the calling thread on CPU;
autograd's device thread for CUDA). Write/read completions arrive on engine threads.
Handles can be freed on any of them. Shared state is guarded by one re-entrant lock,
never held while waiting for a read; a pack that finds the write window full waits on
a condition of that lock (which releases it).
"""
from __future__ import annotations

import functools
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gds_offload.entry import Entry, Handle, State, version_root
from gds_offload.errors import OffloadError, SpillSpaceError
from gds_offload.forwards import Forwards
from gds_offload.integrity import checked_read, checked_write, checksum
from gds_offload.profile import ForwardRecord, NoTiming
from gds_offload.stats import LayerStats, OffloadStats

if TYPE_CHECKING:
    from gds_offload.io.base import Engine, IOFuture
    from gds_offload.policy import Policy
    from gds_offload.store import Slot, SpillStore

__all__ = ["Scheduler", "SchedulerConfig", "MIN_WRITE_WINDOW_BYTES"]

#: The derived write window is twice the largest layer's offloaded bytes, and at least this.
MIN_WRITE_WINDOW_BYTES = 64 << 20


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
    #: Bytes that writes in flight may hold; ``None``: twice the largest layer's offloaded bytes.
    write_window_bytes: int | None = None


def _byte_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """All bytes of ``storage`` as a 1-D uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


def _cuda_ready(device: torch.device) -> Any:
    """An event on ``device``'s current stream: the engine waits on it before touching the bytes."""
    if device.type != "cuda":
        return None
    ready = torch.cuda.Event(blocking=True)  # engine threads sleep in synchronize(), not spin
    ready.record(torch.cuda.current_stream(device))
    return ready


class Scheduler:
    """Owns the pack/unpack hooks' state. Created and driven by :class:`~gds_offload.hooks.Offloader`."""

    def __init__(self, config: SchedulerConfig, policy: Policy, engine: Engine, store: SpillStore, stats: OffloadStats) -> None:
        self.config = config
        self.policy = policy
        self.engine = engine
        self.store = store
        self._stats = stats
        self._lock = threading.RLock()
        self._written = threading.Condition(self._lock)
        self.forwards = Forwards(self._lock, self._observe)
        self._largest_unit_bytes = 0
        self._held = {"kept": 0, "writing": 0, "loaded": 0}
        self._writing: set[Entry] = set()
        #: Reads in flight (their futures' tokens), prefetched ones and released ones included.
        self._reads: dict[Any, IOFuture] = {}
        #: Every entry of this generation that holds a spill slot.
        self._slotted: set[Entry] = set()
        self._layer_stats: dict[str, LayerStats] = {}
        self._warned: set[str] = set()
        self._error: OffloadError | None = None
        #: Bumped in a forked child: entries of older generations belong to the parent's store.
        self._generation = 0
        #: Set at interpreter exit (:meth:`stop`): completions are ignored from then on.
        self._stopped = False
        self._engine_mark = engine.stats()
        stats.write_window_bytes = self._window()

    # ------------------------------------------------------------------ forwards
    def begin_forward(self, params: list[torch.Tensor], expected_layer_calls: int) -> int:
        """Start a forward on this thread. Returns its id. On error nothing has changed."""
        with self._lock:
            self._raise_pending_error()
            self.forwards.drop_unreached()
            # Weak references keep each StorageImpl (not its memory) alive for the forward, so a
            # parameter storage freed meanwhile (ZeRO-3 partitions them) cannot hand its address
            # to an activation that would then pass for a parameter.
            refs = [StorageWeakRef(p.untyped_storage()) for p in params if not self._unsupported(p)]
            self.policy.begin_forward(self.forwards.layer_calls_last or expected_layer_calls)
            device = params[0].device if params else torch.device("cpu")
            fwd = self.forwards.begin(device, frozenset(r.cdata for r in refs), self._stats.resident_bytes)
            fwd.param_refs = refs
            self._stats.steps += 1
            return fwd.id

    def end_forward(self) -> None:
        with self._lock:
            self.forwards.end()

    def begin_layer(self, name: str) -> None:
        """A layer call starts inside this thread's forward (module forward pre-hook)."""
        self.forwards.begin_layer(name)

    def current_position(self) -> tuple[int, int] | None:
        """(forward id, unit) while this thread is inside a forward, else None."""
        fwd = self.forwards.current()
        return (fwd.id, fwd.unit) if fwd is not None else None

    def on_unit_backward(self, forward_id: int, unit: int) -> None:
        """Backward reached ``unit`` (a grad_fn pre-hook on the unit's output): prefetch below it."""
        self.forwards.note_backward(forward_id)
        with self._lock:
            fwd = self.forwards.get(forward_id)
            if fwd is not None and unit < len(fwd.units) and fwd.units[unit].t_backward is None:
                fwd.units[unit].t_backward = fwd.clock.mark()
        self._prefetch(forward_id, unit)

    # ------------------------------------------------------------------ hooks
    def pack(self, t: torch.Tensor) -> Any:
        """``pack_hook(tensor) -> handle``: runs when autograd saves ``t`` during forward.

        Returns ``t`` itself for parameters, buffers and views of them, and for tensors
        that cannot be offloaded (sparse, nested, quantized, subclasses, meta); else a
        :class:`~gds_offload.entry.Handle`. Blocks only when the write window is full.
        """
        fwd = self.forwards.current()
        if fwd is None:
            return t  # hooks left on this thread by a forward that was not ours to track
        if self._unsupported(t):
            with self._lock:
                self._stats.bytes_unsupported += _nbytes(t)
            return t
        root = version_root(t)
        storage = t.untyped_storage()
        sid = storage._cdata
        # nn.Parameter covers parameters swapped in during forward (FSDP2's unsharded ones).
        if sid in fwd.param_storages or isinstance(root, torch.nn.Parameter):
            return t
        with self._lock:
            self._raise_pending_error()
            key = (sid, t._version)
            entry = next((e for e in fwd.dedup.get(key, ()) if e.may_share(root, t._version)), None)
            if entry is not None:
                self._stats.bytes_deduplicated += entry.nbytes
                self._move_to_current_unit(fwd, entry)
                entry.handles += 1
                entry.pending += 1
                entry.add_root(root)
            else:
                entry = self._new_entry(fwd, t, storage, root)
                fwd.dedup.setdefault(key, []).append(entry)
                self._place(fwd, entry)
            fwd.live_handles += 1
            return Handle(entry, t, root, self.release)

    def unpack(self, handle: Any) -> torch.Tensor:
        """``unpack_hook(handle) -> tensor``: runs when backward needs the saved tensor.

        Returns a tensor equal to the packed one in value, size, stride, dtype and
        device. May be called more than once per handle (``retain_graph``).

        Raises:
            RuntimeError: the saved tensor was modified in place after it was saved
                (autograd's own error, which it cannot raise through hooks).
            OffloadError: the bytes could not be restored; names the layer and tensor.
        """
        if not isinstance(handle, Handle):
            return handle
        handle.check_version()
        entry = handle.entry
        if self._error is not None:  # on_error="raise": a write failed; the tensor is still in memory
            with self._lock:
                self._raise_pending_error()
        self.forwards.note_backward(entry.forward_id)
        data = self._bytes_of(entry, handle)
        # A read buffer may start part-way into its allocation (Engine.empty); the engines keep
        # that offset a multiple of 64 bytes, so of every element size.
        start, rest = divmod(int(data.storage_offset()), handle.dtype.itemsize)
        assert rest == 0, f"read buffer at byte {data.storage_offset()} is not aligned for {handle.dtype}"
        out = torch.empty(0, dtype=handle.dtype, device=data.device).set_(
            data.untyped_storage(), start + handle.offset, handle.size, handle.stride
        )
        if data.is_cuda:
            # The buffer may have been allocated on another stream (a prefetch, or detach() on
            # the caller's): the allocator must not reuse it before backward's kernels ran.
            data.record_stream(torch.cuda.current_stream(data.device))
        with self._lock:
            if not handle.unpacked:
                handle.unpacked = True
                entry.pending -= 1
                if entry.pending == 0 and entry.state is State.LOADED and entry.data is not None:
                    entry.data_weak = weakref.ref(entry.data)  # autograd holds it now
                    entry.data = None
                    self._account(entry)
        self._prefetch(entry.forward_id, entry.unit)
        return out

    # ------------------------------------------------------------------ pack steps
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
            or torch._C._functorch.is_functorch_wrapped_tensor(t)
        )

    def _new_entry(self, fwd: ForwardRecord, t: torch.Tensor, storage: torch.UntypedStorage, root: torch.Tensor) -> Entry:
        # Caller holds the lock. The first handle is counted before any write starts: a write
        # that completes at once must not find handles == 0 and drop the bytes.
        nbytes = storage.nbytes()
        entry = Entry(nbytes, t.device, fwd.id, fwd.unit, StorageWeakRef(storage), t._version, self._generation, handles=1, pending=1)
        entry.add_root(root)
        entry.data = _byte_view(storage, t.device)
        self._account(entry)
        self._stats.bytes_packed += nbytes
        unit = fwd.units[fwd.unit]
        self._layer_stat(unit.name).bytes_packed += nbytes
        return entry

    def _place(self, fwd: ForwardRecord, entry: Entry) -> None:
        """Keep ``entry`` in memory, or give it a slot and start its write. Caller holds the lock."""
        unit, layer = fwd.units[entry.unit], self._layer_stat(fwd.units[entry.unit].name)
        if entry.nbytes < self.config.min_bytes:
            fwd.fixed_bytes += entry.nbytes
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
        future = self.engine.write(entry.data, entry.slot, ready=_cuda_ready(entry.device))
        entry.write = future
        future.add_done_callback(functools.partial(self._on_written, entry))

    def _window(self) -> int:
        if self.config.write_window_bytes is not None:
            return self.config.write_window_bytes
        return max(MIN_WRITE_WINDOW_BYTES, 2 * self._largest_unit_bytes)

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
        self._stats.write_wait_seconds += waited
        self._stats.io_wait_seconds += waited
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

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _move_to_current_unit(self, fwd: ForwardRecord, entry: Entry) -> None:
        # Caller holds the lock. A storage saved again by a later layer is needed first by
        # that layer's backward: prefetch it with that layer.
        old = fwd.units[entry.unit]
        if entry.unit >= fwd.unit or entry not in old.entries:
            return
        old.entries.remove(entry)
        old.offloaded_bytes -= entry.nbytes
        new = fwd.units[fwd.unit]
        new.entries.append(entry)
        new.offloaded_bytes += entry.nbytes
        entry.unit = fwd.unit

    # ------------------------------------------------------------------ unpack steps
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
            self._stats.io_wait_seconds += waited
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
        read = checked_read(self.engine.read(dst, entry.slot, ready=_cuda_ready(dst.device)), dst, entry.slot, entry.checksum)
        entry.read = read
        self._reads[read.token] = read
        read.add_done_callback(self._read_ended)

    def _read_ended(self, read: IOFuture) -> None:
        with self._lock:
            self._reads.pop(read.token, None)

    def _prefetch(self, forward_id: int, unit: int) -> None:
        """Issue the reads of ``unit`` and of the offloaded units below it within the window.

        The window is ``prefetch_bytes`` when set, else the policy's ``prefetch_units``
        offloaded units (units kept in memory need no read and are not counted).
        """
        with self._lock:
            fwd = self.forwards.get(forward_id)
            if fwd is None:
                return
            max_bytes, max_units = self.config.prefetch_bytes, self.policy.prefetch_units
            ahead_bytes = ahead_units = 0
            for k in range(min(unit, fwd.unit), -1, -1):
                u = fwd.units[k]
                if k < unit and not u.offloaded_bytes:
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
                    if e.state is State.ON_DRIVE and e.handles and e.generation == self._generation:
                        self._issue_read(e)

    # ------------------------------------------------------------------ release
    def release(self, handle: Handle) -> None:
        """Autograd freed a handle (any thread). The last handle frees memory and slot."""
        entry = handle.entry
        with self._lock:
            fwd = self.forwards.get(entry.forward_id)
            if fwd is not None:
                fwd.live_handles -= 1
            entry.handles -= 1
            if not handle.unpacked:
                entry.pending -= 1
            if entry.handles:
                return
            was = entry.state
            entry.move(State.RELEASED)
            entry.data_weak = None
            if was is State.WRITING:
                self._account(entry)
                return  # _on_written frees the slot and the source
            entry.data = None
            self._account(entry)
            read = entry.read
            if read is None or read.done():
                entry.read = None
                self._free_slot(entry)
            else:
                read.add_done_callback(functools.partial(self._free_slot_after_read, entry))

    def _free_slot_after_read(self, entry: Entry, _read: IOFuture) -> None:
        with self._lock:
            entry.read = None
            self._free_slot(entry)

    def _free_slot(self, entry: Entry) -> None:
        # Caller holds the lock. A slot of an older generation is the parent's: left alone.
        slot, entry.slot = entry.slot, None
        if slot is None or entry.generation != self._generation:
            return
        self._slotted.discard(entry)
        self.engine.release(slot)
        self.store.free(slot)

    def _account(self, entry: Entry) -> None:
        """Move ``entry``'s bytes to the budget its state says (kept, writing, loaded, or none)."""
        new = entry.budget
        if new == entry.counted:
            return
        if entry.generation != self._generation:
            entry.counted = new  # counted in the parent's totals, not this child's
            return
        if entry.counted is not None:
            self._held[entry.counted] -= entry.nbytes
        if new is not None:
            self._held[new] += entry.nbytes
        entry.counted = new
        s = self._stats
        s.resident_bytes = sum(self._held.values())
        s.peak_resident_bytes = max(s.peak_resident_bytes, s.resident_bytes)
        s.peak_kept_bytes = max(s.peak_kept_bytes, self._held["kept"])
        s.peak_writing_bytes = max(s.peak_writing_bytes, self._held["writing"])
        s.peak_loaded_bytes = max(s.peak_loaded_bytes, self._held["loaded"])
        for fwd in self.forwards.records():
            fwd.peak_resident_bytes = max(fwd.peak_resident_bytes, s.resident_bytes)

    def _layer_stat(self, name: str) -> LayerStats:
        s = self._layer_stats.get(name)
        if s is None:
            s = self._layer_stats[name] = LayerStats(name)
        return s

    # ------------------------------------------------------------------ profiles
    def _observe(self, fwd: ForwardRecord) -> None:
        """A forward's backward pass ended: its profile goes to the layer stats and the policy."""
        with self._lock:
            clock = fwd.clock
            if clock.cuda and not self.policy.needs_timing:
                clock = NoTiming()  # reading CUDA events synchronises the device
            now, before = self.engine.stats(), self._engine_mark
            self._engine_mark = now
            dw, dwt = now.bytes_written - before.bytes_written, now.write_busy_seconds - before.write_busy_seconds
            dr, drt = now.bytes_read - before.bytes_read, now.read_busy_seconds - before.read_busy_seconds
            profile = fwd.profile(clock, write_bps=dw / dwt if dw and dwt > 0 else 0.0, read_bps=dr / drt if dr and drt > 0 else 0.0)
            for u, p in zip(fwd.units, profile.units):
                s = self._layer_stat(u.name)
                s.forward_seconds += p.forward_s
                s.backward_seconds += p.backward_s
        self.policy.observe(profile)

    # ------------------------------------------------------------------ lifecycle
    def snapshot(self) -> tuple[OffloadStats, list[LayerStats]]:
        """The live counters object and a copy of the per-layer rows, read under the lock."""
        with self._lock:
            return self._stats, [LayerStats(**vars(s)) for s in self._layer_stats.values()]

    def stop(self) -> None:
        """Interpreter exit: ignore write completions from now on (no fallbacks, no warnings)."""
        self._stopped = True
        with self._lock:
            self._written.notify_all()

    def wait_inflight(self) -> None:
        """Block until every write and read in flight has finished (successfully or not)."""
        while True:
            with self._lock:
                pending = [e.write for e in self._writing if e.write is not None] + list(self._reads.values())
            if not pending:
                return
            for f in pending:
                f.error()  # failures are recorded where the transfer's owner handles them

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

    def after_fork(self, engine: Engine, store: SpillStore) -> None:
        """In a forked child: a new engine and store. The parent's entries keep what they hold
        in memory; those whose bytes are only in the parent's store can no longer be restored."""
        self._lock = threading.RLock()  # another thread may have held the old one at fork
        self._written = threading.Condition(self._lock)
        self.forwards.after_fork(self._lock)
        self._generation += 1
        self.engine, self.store = engine, store
        self._writing.clear()
        self._reads.clear()
        self._slotted.clear()
        self._held = {"kept": 0, "writing": 0, "loaded": 0}
        self._engine_mark = engine.stats()

    def spilled(self) -> list[tuple[Slot, int]]:
        """``(slot, nbytes)`` of each live entry whose bytes are only on the drive."""
        with self._lock:
            return [(e.slot, e.nbytes) for e in self._slotted if e.handles and e.state is State.ON_DRIVE and e.slot is not None]

    def use_engine(self, engine: Engine) -> None:
        """Move bytes through ``engine`` from now on (no transfer may be in flight)."""
        with self._lock:
            assert not self._writing and not any(e.state is State.READING for e in self._slotted), "transfers in flight"
            self.engine = engine
            self._engine_mark = engine.stats()

    def layer_stats(self) -> list[LayerStats]:
        return self.snapshot()[1]


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()
