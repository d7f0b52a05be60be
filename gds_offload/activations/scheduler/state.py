"""What the scheduler's paths share: :class:`SchedulerState`, guarded by one lock, and its accounting.

The :class:`~gds_offload.activations.scheduler.core.Scheduler` is assembled from this class and one class
per path (:class:`~gds_offload.activations.scheduler.writes.WritePath`,
:class:`~gds_offload.activations.scheduler.reads.ReadPath`), so that every path drives the same entry
transitions (:mod:`gds_offload.activations.scheduler.entry`) over the same state. Here: that state, and what
every path does to it besides moving an entry:

* which budget an entry's bytes count against (kept, writing, loaded), the resident
  totals and their peaks (:meth:`SchedulerState._account`); the write window's size;
* per-layer counters, and each finished forward's profile handed to the policy;
* freeing an entry's spill slot, and the write error ``on_error="raise"`` holds for the
  next hook;
* a forked child's fresh state (:meth:`SchedulerState.after_fork`), next to the
  ``__init__`` that first built it, so the two list the same fields.

Lock: ``self._lock`` (re-entrant) guards everything below. A method that does not take it
says that its caller holds it; it is never held while waiting for a read, and a pack that
finds the write window full waits on ``self._written``, a condition of that lock.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from gds_offload.activations.planning.profile import ForwardRecord, NoTiming
from gds_offload.activations.scheduler.entry import Entry
from gds_offload.activations.scheduler.forwards import Forwards
from gds_offload.activations.stats import LayerStats, OffloadStats
from gds_offload.errors import OffloadError

if TYPE_CHECKING:
    from gds_offload.activations.planning.policy import Policy
    from gds_offload.io.base import Engine, IOFuture
    from gds_offload.io.spill import SpillStore

__all__ = ["SchedulerState", "SchedulerConfig", "MIN_WRITE_WINDOW_BYTES", "cuda_ready"]

#: The derived write window is twice the largest layer's offloaded bytes, and at least this.
MIN_WRITE_WINDOW_BYTES = 64 << 20
#: The default read-ahead is the largest layer's offloaded bytes over this, at most the bytes below
#: (and at least one tensor: :meth:`~gds_offload.activations.scheduler.reads.ReadPath._prefetch_bytes`).
READ_AHEAD_DIVISOR = 16
MAX_READ_AHEAD_BYTES = 256 << 20
#: What ``_held`` counts (:attr:`Entry.budget`): bytes in memory kept, held by writes in flight,
#: read back; and bytes only on the drive that backward has yet to read (no memory).
_BUDGETS = ("kept", "writing", "loaded", "unread")


@dataclass(frozen=True)
class SchedulerConfig:
    #: Storages smaller than this stay in memory: small transfers cost more than they save.
    min_bytes: int
    #: Bytes read ahead of the tensor backward unpacks; ``None``: the policy's ``prefetch_units``
    #: whole layers when it asks for layers, else the default (:meth:`SchedulerState._read_ahead`).
    prefetch_bytes: int | None
    #: What a failed write does: keep the tensor resident and warn, or raise.
    on_error: Literal["fallback", "raise"]
    #: Checksum every slot after its write and check it after each read (see :mod:`gds_offload.io.integrity`).
    verify: bool = False
    #: Bytes that writes in flight may hold; ``None``: twice the largest layer's offloaded bytes.
    write_window_bytes: int | None = None


def cuda_ready(device: torch.device) -> Any:
    """An event on ``device``'s current stream: the engine waits on it before touching the bytes."""
    if device.type != "cuda":
        return None
    ready = torch.cuda.Event(blocking=True)  # engine threads sleep in synchronize(), not spin
    ready.record(torch.cuda.current_stream(device))
    return ready


class SchedulerState:
    """The scheduler's state and accounting; a base of :class:`~gds_offload.activations.scheduler.core.Scheduler`, never used alone."""

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
        self._held = dict.fromkeys(_BUDGETS, 0)
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
        self._held = dict.fromkeys(_BUDGETS, 0)
        self._engine_mark = engine.stats()

    # ------------------------------------------------------------------ accounting
    def _account(self, entry: Entry) -> None:
        """Move ``entry``'s bytes to the budget its state says (kept, writing, loaded, or none)."""
        new = entry.budget
        if new == entry.counted:
            return
        if entry.generation != self._generation:
            entry.counted = new  # counted in the parent's totals, not this child's
            return
        left = entry.counted
        if left is not None:
            self._held[left] -= entry.nbytes
        if new is not None:
            self._held[new] += entry.nbytes
        entry.counted = new
        if left == "unread":
            # Read (or freed unread): idle read buffers beyond the bytes still to read would
            # never be used again; the engine gives them back now and as they die.
            self.engine.trim(self._reusable())
        s = self._stats
        s.resident_bytes = self._held["kept"] + self._held["writing"] + self._held["loaded"]
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

    def _window(self) -> int:
        if self.config.write_window_bytes is not None:
            return self.config.write_window_bytes
        return max(MIN_WRITE_WINDOW_BYTES, 2 * self._largest_unit_bytes)

    def _read_ahead(self) -> int | None:
        """Bytes backward reads ahead of the tensor it unpacks; ``None``: whole layers (the
        policy's ``prefetch_units``, when it asks for layers: an adaptive plan, which simulates
        its reads layer by layer).

        Default: a sixteenth of the largest layer's offloaded bytes, at most
        :data:`MAX_READ_AHEAD_BYTES`, and at least one tensor. Reads finer than a layer
        hold, besides the tensors backward is using, only that much more: at backward's end,
        where the gradients peak, a layer read ahead whole would sit on top of them.
        """
        if self.config.prefetch_bytes is not None:
            return self.config.prefetch_bytes
        if self.policy.prefetch_units is not None:
            return None
        return max(1, min(MAX_READ_AHEAD_BYTES, self._largest_unit_bytes // READ_AHEAD_DIVISOR))

    def _reusable(self) -> int:
        """Idle read buffers worth keeping for reuse: reading whole layers, no more than the
        reads to come; reading by bytes, none. Each read's buffer then lives from its issue to
        autograd's last use, and none sits beside the gradients where backward ends (the demo
        model: 6 MiB less at that peak, step time unchanged)."""
        return self._held["unread"] if self._read_ahead() is None else 0

    def _free_slot(self, entry: Entry) -> None:
        # Caller holds the lock. A slot of an older generation is the parent's: left alone.
        slot, entry.slot = entry.slot, None
        if slot is None or entry.generation != self._generation:
            return
        self._slotted.discard(entry)
        self.engine.release(slot)
        self.store.free(slot)

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    # ------------------------------------------------------------------ profiles
    def _observe(self, fwd: ForwardRecord) -> None:
        """A forward's backward pass ended: its profile goes to the layer stats and the policy,
        and the engine gives back the idle read buffers that no read to come needs
        (:meth:`~gds_offload.io.base.Engine.trim`; all of them unless another forward's
        backward is still to run).

        Kept until the next backward, those buffers would sit in memory through the next
        forward, on top of the kept and written activations that peak there.
        """
        with self._lock:
            clock = fwd.clock
            if clock.cuda and not self.policy.needs_timing:
                clock = NoTiming()  # reading CUDA events synchronises the device
            now, before = self.engine.stats(), self._engine_mark
            self._engine_mark = now
            dw, dwt = now.bytes_written - before.bytes_written, now.write_busy_s - before.write_busy_s
            dr, drt = now.bytes_read - before.bytes_read, now.read_busy_s - before.read_busy_s
            profile = fwd.profile(clock, write_bps=dw / dwt if dw and dwt > 0 else 0.0, read_bps=dr / drt if dr and drt > 0 else 0.0)
            for u, p in zip(fwd.units, profile.units):
                s = self._layer_stat(u.name)
                s.forward_s += p.forward_s
                s.backward_s += p.backward_s
            reusable = self._reusable()
        self.engine.trim(reusable)
        self.policy.observe(profile)

    # ------------------------------------------------------------------ readout
    def snapshot(self) -> tuple[OffloadStats, list[LayerStats]]:
        """The live counters object and a copy of the per-layer rows, read under the lock."""
        with self._lock:
            return self._stats, [LayerStats(**vars(s)) for s in self._layer_stats.values()]

    def layer_stats(self) -> list[LayerStats]:
        return self.snapshot()[1]
