"""Which streamed layer goes into which ring slot, and when: the fill order of a
:class:`~gds_offload.weights.run.model.StreamedModel`.

The streamed layers run in *passes*: a forward goes up them (``0 .. n-1``); the recompute of
Hugging Face gradient checkpointing, in backward, goes down them (``n-1 .. 0``). :class:`Prefetch`
predicts the layers the model calls next and keeps every free slot filling with them:

* within a pass, the layers after the current one, in the pass's direction;
* past the end of a pass that the next pass repeats in the same direction (inference: the next
  decode step's forward), around to the first layers again;
* past the end of a pass that *turns*: nothing. The pass's last layers stay in their slots as
  *held* fills, and they are exactly the first layers of what follows, which uses them with no
  read. A checkpointed forward turns into its recompute, and a recompute into the next forward.
  Any other forward with grad mode on turns into its backward, which needs the weights autograd
  saved again (:mod:`gds_offload.weights.streaming.backward`). On a ring that :attr:`~gds_offload.weights.streaming.ring.Ring.lends`
  (host slots), backward is a pass down the slots like a recompute (:meth:`Prefetch.lend`): it
  computes from the held layers where they lie, reads the layers below into the slots it frees,
  and turns into the next forward at layer 0, which it leaves in its slot. Elsewhere it copies the
  held layers out of their slots (:meth:`Prefetch.copy_held`) and reads the rest into buffers of
  their own, and the slots fill with the next forward's first layers. (A forward with grad mode on
  that no backward follows makes the next forward's first layer a miss.)

A slot lent to backward is written again only once no tensor made from it during the lend is
left (its storage's use count is back where it was, :meth:`Ring.uses
<gds_offload.weights.streaming.ring.Ring.uses>`): autograd frees the weights it unpacked when each node has
run, so that is the rule, but a tensor kept longer (a custom ``autograd.Function`` holding its
saved tensors) keeps the old buffer, and the slot gets a new one (``on_renew``), never another
layer's bytes under a live tensor.

A slot whose layer has finished keeps that layer's bytes until a fill starts writing it: a
fill of a layer still lying in a free slot takes that slot and reads nothing (all of a model's
streamed layers fit in the ring: they are read once).

A layer that is not the predicted one is a *miss*: the fills in flight are waited for and
dropped, and the prediction restarts from that layer. Prediction decides only what is read and
when, never which bytes a layer computes with: a fill is used only by the layer it holds, and a
held slot is one no fill has written since that layer's forward left it unchanged.

Every method runs on the thread holding the model's turn (:mod:`gds_offload.weights.streaming.turn`: the
one calling the model, or running a recompute or a backward through it), with stop signals held
(:mod:`gds_offload.runtime.interrupts`); the ring's reads complete on the engine's threads. A wait
(for a fill in :meth:`Prefetch.drain`, or the caller's for :meth:`Prefetch.next_fill`'s) may raise
an interrupt; state changes only after a wait has returned, so every fill is, at any exception,
either in line with its read, or freed after it finished.
"""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gds_offload.weights.streaming.ring import Fill, Ring

if TYPE_CHECKING:
    import torch

    from gds_offload.io.base import IOFuture
    from gds_offload.weights.store.manifest import GroupEntry
    from gds_offload.weights.streaming.stats import StreamStats

__all__ = ["Prefetch"]


class Prefetch:
    """The fills of ``ring``'s slots with ``groups`` (the streamed layers, in order), counted in
    ``stats``; ``on_renew(slot)`` after :meth:`Ring.renew <gds_offload.weights.streaming.ring.Ring.renew>`
    gave a slot still viewed a new buffer (the caller makes its views of the new one)."""

    def __init__(self, ring: Ring, groups: list[GroupEntry], stats: StreamStats, *,
                 on_renew: Callable[[int], None] | None = None) -> None:  # fmt: skip
        self._ring, self._groups, self._stats, self._on_renew = ring, groups, stats, on_renew
        self._read_clock = _ReadClock(stats)
        #: Fills in the order their layers are expected: reads in flight (or done) and held slots.
        self._inflight: collections.deque[Fill] = collections.deque()
        self._free = list(range(len(ring.buffers)))[::-1]
        #: The layer whose bytes each slot holds (``None``: being written, unknown, or changed).
        self._holds: list[int | None] = [None] * len(ring.buffers)
        #: The layer computing now, and its slot.
        self.current: tuple[int, int] | None = None
        self._next = 0  # the next layer to fill; outside 0..n-1 once the pass's last is issued
        self._direction = 1
        self._turns = False  # the pass in progress is followed by one going the other way
        #: The current layer is lent to a backward (:meth:`lend`), not bound for a forward.
        self.lending = False
        self._lent: dict[int, int] = {}  # slot -> its storage's use count when first lent since its last write

    def next_fill(self, pos: int, *, direction: int, turns: bool) -> Fill:
        """Layer ``pos`` starts a forward going ``direction`` (``1`` up, ``-1`` down), in a pass
        that ``turns`` (is followed by one the other way): its fill, left first in line. The
        caller waits for it (unless it is ``held``), then calls :meth:`take` (or :meth:`discard`
        if the read failed). On a miss this waits for the fills in flight first; an exception
        there (Ctrl-C) leaves every fill either waited for and freed, or as it was."""
        assert self.current is None, "a layer's fill asked for while another layer is current"
        self._direction, self._turns = direction, turns
        if not (self._inflight and self._inflight[0].pos == pos):
            if self._inflight:
                self._stats.misses += 1
                self._stats.wasted_reads += sum(not f.held for f in self._inflight)
                self.drain()
            self._next = pos
            self.fill()
        assert self._inflight and self._inflight[0].pos == pos, f"no fill for layer {pos}: a ring slot was lost"
        return self._inflight[0]

    def take(self, fill: Fill, *, forward: bool = True) -> None:
        """``fill`` (from :meth:`next_fill`, finished) is the current layer's: it becomes :attr:`current`
        (a held one counts in ``stats.reused`` for a ``forward``; backward counts its own)."""
        assert self._inflight and self._inflight[0] is fill, "take() of a fill that is not first in line"
        self._inflight.popleft()
        self.current = (fill.pos, fill.slot)
        if fill.held and forward:
            self._stats.reused += 1

    def discard(self, fill: Fill) -> None:
        """``fill`` (first in line) finished with an error: free its slot, so the next forward
        of its layer reads it again. A fill whose read is still running must not be discarded."""
        assert self._inflight and self._inflight[0] is fill, "discard() of a fill that is not first in line"
        self._inflight.popleft()
        self._holds[fill.slot] = None
        self._free.append(fill.slot)

    def put_back(self, *, intact: bool) -> None:
        """The current layer's forward has finished (or raised); ``intact``: its slot's bytes are
        unchanged. Hold the slot for the next pass if this pass turns and has no fills left to issue,
        else free it; at the end of a turning pass, turn; then fill the free slots."""
        assert self.current is not None, "put_back without a current layer"
        pos, slot = self.current
        self._ring.release(slot)
        self.current = None
        self._holds[slot] = pos if intact else None
        n = len(self._groups)
        if intact and self._turns and not 0 <= self._next < n:
            self._inflight.append(Fill(pos, slot, held=True))
            if pos == (n - 1 if self._direction > 0 else 0):
                self._turn()
        else:
            self._free.append(slot)
        self.fill()

    def fill(self) -> None:
        """Start filling the free slots with the next layers (see the module doc)."""
        n = len(self._groups)
        while self._free:
            pos = self._next
            if not 0 <= pos < n:
                if self._turns:
                    return  # this pass's layers are all in slots or on their way; the next pass starts from them
                pos %= n
            if (self.current is not None and self.current[0] == pos) or any(f.pos == pos for f in self._inflight):
                return  # every streamed layer is in a slot or on its way
            self._inflight.append(self._start(pos))
            self._next = pos + self._direction

    def drain(self) -> None:
        """Wait for every read in flight (reads cannot be cancelled) and free every slot but the
        current one's. Each fill is freed only after its wait returned: an exception in a wait
        (Ctrl-C) leaves that fill and the ones after it in line, as they were."""
        while self._inflight:
            f = self._inflight[0]
            if not f.held:
                self._ring.drop(f)
            self._inflight.popleft()
            if not f.held:
                self._holds[f.slot] = None  # the read may have failed
            self._free.append(f.slot)

    def forget(self) -> None:
        """The store's bytes changed (a training step wrote new weights): wait for the fills in
        flight, forget what every slot holds, and fill the slots again from the first layer."""
        self.end_lend(intact=False)
        self.drain()
        self._holds = [None] * len(self._holds)
        self.restart()

    def restart(self) -> None:
        """Drop the prediction: wait for the fills in flight, then fill the slots with the first
        layers, for a forward (e.g. after the engine was replaced)."""
        self.end_lend()
        self.drain()
        self._direction, self._next, self._turns = 1, 0, False
        self.fill()

    def lend(self, pos: int) -> tuple[torch.Tensor, str | None] | None:
        """Backward needs layer ``pos``'s bytes: ``(the slot's buffer, how)``, lent until backward
        needs another layer (:meth:`end_lend`); ``how`` is ``"read"`` (into the slot), ``"held"``
        (left there by the forward) or ``None`` (lent already); ``None`` where this ring cannot lend
        or a forward holds a layer. Ask again at every use: a layer put back may be written. Backward goes down the layers as a pass that turns into the next
        forward: the layer lent before is put back, and the free slots fill with the layers below.
        A wait that raises (Ctrl-C, a failed read) lends nothing and leaves the fills as they were
        (a failed one discarded)."""
        if not self._ring.lends or (self.current is not None and not self.lending):
            return None
        if self.current is not None:
            if self.current[0] == pos:
                return self._ring.buffers[self.current[1]], None
            self.end_lend()
        start = time.perf_counter()  # a miss's drain waits too
        fill = self.next_fill(pos, direction=-1, turns=True)
        if not fill.held:
            try:
                self._ring.wait(self._groups[pos], fill)
            except BaseException:
                if self._ring.failed(fill):
                    self.discard(fill)
                raise
        self._stats.stall_s += time.perf_counter() - start
        self.take(fill, forward=False)
        self.lending = True
        # Before backward makes any tensor of it; a slot lent again unwritten keeps its first count.
        self._lent.setdefault(fill.slot, self._ring.uses(fill.slot))
        return self._ring.buffers[fill.slot], "held" if fill.held else "read"

    def end_lend(self, *, intact: bool = True) -> None:
        """The layer lent to backward is done with: put it back (:meth:`put_back`); nothing if none is lent.
        ``intact=False``: the store's bytes changed since (the slot holds nothing usable)."""
        if self.lending:
            self.lending = False
            self.put_back(intact=intact)

    def check_lent(self) -> None:
        """Before the ring's own views of its slots are made again (they count in :meth:`Ring.uses
        <gds_offload.weights.streaming.ring.Ring.uses>`): renew each slot a tensor made during a lend still views, and forget the counts."""
        for slot, lent in list(self._lent.items()):
            if self._ring.uses(slot) > lent:
                self._renew(slot)
        self._lent.clear()

    def copy_held(self, pos: int) -> torch.Tensor | None:
        """Backward needs layer ``pos``'s bytes again: a copy of them (:meth:`Ring.copy
        <gds_offload.weights.streaming.ring.Ring.copy>`) out of the slot holding them at the turn after a
        forward, or ``None`` (read them from the store). The slot is then free, still holding the
        layer. Once backward has copied every held layer, the free slots fill with the next
        forward's first layers (backward itself does not read through the ring)."""
        held = next((f for f in self._inflight if f.held and f.pos == pos), None)
        if held is None:
            return None
        buf = self._ring.copy(self._groups[pos], held.slot)  # first: if it raises (no memory), nothing changed
        self._inflight.remove(held)
        self._free.append(held.slot)
        if not self._inflight:
            self._direction, self._next, self._turns = 1, 0, False
            self.fill()
        return buf

    def settle(self) -> None:
        """Block until the reads in flight have landed (they stay for the layers they hold)."""
        for f in self._inflight:
            if not f.held:
                self._ring.settle(f)

    def _start(self, pos: int) -> Fill:
        """A fill of layer ``pos``: the free slot that still holds it, else a read into a free slot."""
        if pos in self._holds:
            # A slot holding ``pos`` is free: fill() skips the current layer and those on their way.
            slot = self._holds.index(pos)
            self._free.remove(slot)
            return Fill(pos, slot, held=True)
        slot = self._free[-1]
        g = self._groups[pos]
        lent = self._lent.pop(slot, None)
        if lent is not None and self._ring.uses(slot) > lent:
            self._renew(slot)  # a tensor backward made from it is still alive: it keeps the old buffer
        fill = self._ring.start(g, pos, slot)  # if it raises, the slot is still free and unchanged
        self._free.pop()
        self._holds[slot] = None  # being written
        self._stats.reads[pos] += 1
        self._stats.bytes_read += g.nbytes
        if fill.future is not None:
            self._read_clock.issued(fill.future)
        return fill

    def _renew(self, slot: int) -> None:
        self._ring.renew(slot)
        self._stats.renewed_slots += 1
        if self._on_renew is not None:
            self._on_renew(slot)

    def _turn(self) -> None:
        """The end of a turning pass: the next goes the other way, from the layers held in the slots."""
        self._direction = -self._direction
        self._inflight = collections.deque(sorted(self._inflight, key=lambda f: f.pos * self._direction))
        ends = [f.pos for f in self._inflight]
        self._next = max(ends) + 1 if self._direction > 0 else min(ends) - 1


class _ReadClock:
    """The wall time with at least one fill's read in flight, added to ``stats.read_s`` (reads that
    overlap count once). Issued on the model's thread, landed on the engine's threads."""

    def __init__(self, stats: StreamStats) -> None:
        self._stats, self._lock = stats, threading.Lock()
        self._inflight, self._since = 0, 0.0

    def issued(self, future: IOFuture) -> None:
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1
        future.add_done_callback(self._landed)

    def _landed(self, _future: IOFuture) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self._stats.read_s += time.perf_counter() - self._since
