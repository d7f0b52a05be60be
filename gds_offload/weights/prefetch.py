"""Which streamed layer goes into which ring slot, and when: the fill order of a
:class:`~gds_offload.weights.stream.StreamedModel`.

The streamed layers run in *passes*: a forward goes up them (``0 .. n-1``); the recompute of
Hugging Face gradient checkpointing, in backward, goes down them (``n-1 .. 0``). :class:`Prefetch`
predicts the layers the model calls next and keeps every free slot filling with them:

* within a pass, the layers after the current one, in the pass's direction;
* past the end of a pass that the next pass repeats in the same direction (inference: the next
  decode step's forward), around to the first layers again;
* past the end of a pass that *turns*: nothing. The pass's last layers stay in their slots as
  *held* fills, and they are exactly the first layers of what follows, which uses them with no
  read. A checkpointed forward turns into its recompute, and a recompute into the next forward.
  Any other forward with grad mode on turns into its backward, which reads the weights autograd
  saved again (:mod:`gds_offload.weights.backward`): it copies the held layers out of their
  slots (:meth:`Prefetch.copy_held`), and the slots then fill with the next forward's first
  layers. (A forward with grad mode on that no backward follows makes the next forward's first
  layer a miss.)

A slot whose layer has finished keeps that layer's bytes until a fill starts writing it: a
fill of a layer still lying in a free slot takes that slot and reads nothing (all of a model's
streamed layers fit in the ring: they are read once).

A layer that is not the predicted one is a *miss*: the fills in flight are waited for and
dropped, and the prediction restarts from that layer. Prediction decides only what is read and
when, never which bytes a layer computes with: a fill is used only by the layer it holds, and a
held slot is one no fill has written since that layer's forward left it unchanged.

Every method runs on the thread holding the model's turn (:mod:`gds_offload.weights.turn`: the
one calling the model, or running a recompute or a backward through it), with stop signals held
(:mod:`gds_offload.weights.interrupts`); the ring's reads complete on the engine's threads. A wait
(for a fill in :meth:`Prefetch.drain`, or the caller's for :meth:`Prefetch.next_fill`'s) may raise
an interrupt; state changes only after a wait has returned, so every fill is, at any exception,
either in line with its read, or freed after it finished.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from gds_offload.weights.ring import Fill, Ring

if TYPE_CHECKING:
    import torch

    from gds_offload.weights.manifest import GroupEntry
    from gds_offload.weights.stream_stats import StreamStats

__all__ = ["Prefetch"]


class Prefetch:
    """The fills of ``ring``'s slots with ``groups`` (the streamed layers, in order), counted in ``stats``."""

    def __init__(self, ring: Ring, groups: list[GroupEntry], stats: StreamStats) -> None:
        self._ring, self._groups, self._stats = ring, groups, stats
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

    def take(self, fill: Fill) -> None:
        """``fill`` (from :meth:`next_fill`, finished) is the current layer's: it becomes :attr:`current`."""
        assert self._inflight and self._inflight[0] is fill, "take() of a fill that is not first in line"
        self._inflight.popleft()
        self.current = (fill.pos, fill.slot)
        if fill.held:
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
        self.drain()
        self._holds = [None] * len(self._holds)
        self.restart()

    def restart(self) -> None:
        """Drop the prediction: wait for the fills in flight, then fill the slots with the first
        layers, for a forward (e.g. after the engine was replaced)."""
        self.drain()
        self._direction, self._next, self._turns = 1, 0, False
        self.fill()

    def copy_held(self, pos: int) -> torch.Tensor | None:
        """Backward needs layer ``pos``'s bytes again: a copy of them (:meth:`Ring.copy
        <gds_offload.weights.ring.Ring.copy>`) out of the slot holding them at the turn after a
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
        fill = self._ring.start(g, pos, slot)  # first: if it raises, the slot is still free and unchanged
        self._free.pop()
        self._holds[slot] = None  # being written
        self._stats.reads[pos] += 1
        self._stats.bytes_read += g.nbytes
        return fill

    def _turn(self) -> None:
        """The end of a turning pass: the next goes the other way, from the layers held in the slots."""
        self._direction = -self._direction
        self._inflight = collections.deque(sorted(self._inflight, key=lambda f: f.pos * self._direction))
        ends = [f.pos for f in self._inflight]
        self._next = max(ends) + 1 if self._direction > 0 else min(ends) - 1
