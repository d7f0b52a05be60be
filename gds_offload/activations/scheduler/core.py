"""The pack/unpack hooks: where each saved tensor goes, and how it comes back.

Data path (see README, "How it works")::

    pack(t)   -> eligible? -> dedup (same forward, same version counter) -> place (slot, write window) -> write
    unpack(h) -> version check -> in memory? (kept, forwarded, loaded) : wait for its read, or read now -> view
    handle freed by autograd -> release the entry's memory and slot

Each storage's life is an :class:`~gds_offload.activations.scheduler.entry.Entry` with an explicit
:class:`~gds_offload.activations.scheduler.entry.State`; per-forward bookkeeping (units, timing, dedup) is a
:class:`~gds_offload.activations.planning.profile.ForwardRecord`.

Pack, write completion, unpack, prefetch and release all drive the same entry
transitions under one lock. :class:`Scheduler` keeps the hooks autograd calls (pack:
eligibility, dedup, the new entry; unpack: the view over the bytes; release) and what the
offloader drives (forwards, stop, in-flight waits, engine swaps); it inherits the rest,
one module per job, all over the same state:

* :mod:`gds_offload.activations.scheduler.state`: that state and the lock's rules, and the
  accounting every path shares (budgets, peaks, layer stats, profiles, slot freeing);
* :mod:`gds_offload.activations.scheduler.writes`: placing an entry, the write window, write completion
  and failure;
* :mod:`gds_offload.activations.scheduler.reads`: reads now, prefetch, read-back at ``detach()``.

The transitions themselves live in :mod:`gds_offload.activations.scheduler.entry`, per-forward tracking in
:mod:`gds_offload.activations.scheduler.forwards`.

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
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gds_offload.activations.scheduler.entry import Entry, Handle, State, version_root
from gds_offload.activations.scheduler.reads import ReadPath
from gds_offload.activations.scheduler.state import MIN_WRITE_WINDOW_BYTES, SchedulerConfig
from gds_offload.activations.scheduler.writes import WritePath

if TYPE_CHECKING:
    from gds_offload.activations.planning.profile import ForwardRecord
    from gds_offload.io.base import Engine, IOFuture
    from gds_offload.io.layout import Slot

__all__ = ["Scheduler", "SchedulerConfig", "MIN_WRITE_WINDOW_BYTES"]


def _byte_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """All bytes of ``storage`` as a 1-D uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


class Scheduler(WritePath, ReadPath):
    """The pack/unpack hooks over :class:`~gds_offload.activations.scheduler.state.SchedulerState`. Created and
    driven by :class:`~gds_offload.activations.offloader.Offloader`."""

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
        :class:`~gds_offload.activations.scheduler.entry.Handle`. Blocks only when the write window is full.
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

    # ------------------------------------------------------------------ lifecycle
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


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()
