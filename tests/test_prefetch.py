"""The fill order of a streamed model's ring (gds_offload/weights/streaming/prefetch.py), through
:class:`Prefetch`'s public methods on a ring that records what it is asked to do.

Each test drives the calls a :class:`~gds_offload.weights.run.model.StreamedModel` makes (a layer's
pre-hook: ``next_fill`` then ``take``; its post-hook: ``put_back``) and checks which layer is read
into which slot, in which order, and which are used again with no read. The expected orders are
worked out by hand from the module's doc.
"""
from __future__ import annotations

from typing import Any

import pytest

from gds_offload.weights.store.manifest import GroupEntry
from gds_offload.weights.streaming.prefetch import Prefetch
from gds_offload.weights.streaming.ring import Fill
from gds_offload.weights.streaming.stats import StreamStats


class RecordingRing:
    """The ring interface :class:`Prefetch` uses; every call is logged, no byte moves."""

    def __init__(self, slots: int) -> None:
        self.buffers: list[Any] = [None] * slots
        self.log: list[tuple[Any, ...]] = []

    def start(self, group: GroupEntry, pos: int, slot: int) -> Fill:
        self.log.append(("read", pos, slot))
        return Fill(pos, slot)

    def release(self, slot: int) -> None:
        self.log.append(("release", slot))

    def drop(self, fill: Fill) -> None:
        self.log.append(("drop", fill.pos, fill.slot))

    def settle(self, fill: Fill) -> None:
        self.log.append(("settle", fill.pos))

    def copy(self, group: GroupEntry, slot: int) -> str:
        self.log.append(("copy", group.layer, slot))
        return f"copy of layer {group.layer}"

    def reads(self) -> list[tuple[int, int]]:
        return [(e[1], e[2]) for e in self.log if e[0] == "read"]


class LendingRing(RecordingRing):
    """A ring that lends its slots to backward; ``views[slot]``: the tensors viewing it now."""

    lends = True

    def __init__(self, slots: int) -> None:
        super().__init__(slots)
        self.buffers = [f"slot {i}" for i in range(slots)]
        self.views = [1] * slots

    def wait(self, group: GroupEntry, fill: Fill) -> None:
        self.log.append(("wait", fill.pos))

    def failed(self, fill: Fill) -> bool:
        return False

    def uses(self, slot: int) -> int:
        return self.views[slot]

    def renew(self, slot: int) -> None:
        self.log.append(("renew", slot))
        self.buffers[slot] = f"new slot {slot}"
        self.views[slot] = 1


def _prefetch(layers: int, slots: int, *, lending: bool = False) -> tuple[Prefetch, Any, StreamStats]:
    groups = [GroupEntry(f"model.layers.{i}", i, 0, i * 4096, 4096, 0) for i in range(layers)]
    stats = StreamStats(tier="drive", device="cpu", ring="host", engine="fake", direct=True, slots=slots, slot_nbytes=4096,
                        streamed_layers=[g.name for g in groups], resident_layers=[], resident_nbytes=0,
                        loads=[0] * layers, reads=[0] * layers)  # fmt: skip
    ring = LendingRing(slots) if lending else RecordingRing(slots)
    return Prefetch(ring, groups, stats), ring, stats  # type: ignore[arg-type]  # the ring interface, duck-typed


def _run(p: Prefetch, order: list[int], *, direction: int = 1, turns: bool = False, intact: bool = True) -> list[bool]:
    """Call the layers in ``order`` as the hooks do; returns whether each one's fill was ``held`` (no read)."""
    held = []
    for pos in order:
        fill = p.next_fill(pos, direction=direction, turns=turns)
        held.append(fill.held)
        p.take(fill)
        assert p.current == (pos, fill.slot)
        p.put_back(intact=intact)
    return held


def test_a_forward_reads_ahead_into_every_free_slot_then_wraps_for_the_next_one() -> None:
    p, ring, stats = _prefetch(layers=4, slots=2)
    p.fill()
    assert ring.reads() == [(0, 0), (1, 1)], "the first two layers, one per slot"
    _run(p, [0, 1, 2, 3])
    # Each freed slot takes the next layer; past the last layer the next forward's first ones come.
    assert ring.reads() == [(0, 0), (1, 1), (2, 0), (3, 1), (0, 0), (1, 1)]
    assert stats.misses == 0 and stats.reused == 0 and stats.reads == [2, 2, 1, 1]


def test_a_turning_pass_keeps_its_last_layers_for_the_recompute_going_down() -> None:
    p, ring, stats = _prefetch(layers=4, slots=2)
    p.fill()
    assert _run(p, [0, 1, 2, 3], turns=True) == [False] * 4
    assert ring.reads() == [(0, 0), (1, 1), (2, 0), (3, 1)], "nothing read past the end of a turning pass"
    # The recompute goes down: layers 3 and 2 are still in their slots, 1 and 0 are read.
    assert _run(p, [3, 2, 1, 0], direction=-1, turns=True) == [True, True, False, False]
    assert ring.reads()[4:] == [(1, 1), (0, 0)]
    assert stats.reused == 2 and stats.misses == 0
    # ... and the next forward starts from the layers the recompute left: 0 and 1, again with no read.
    assert _run(p, [0, 1], turns=True) == [True, True]
    assert stats.reused == 4


def test_a_miss_waits_for_the_fills_in_flight_drops_them_and_restarts_from_that_layer() -> None:
    p, ring, stats = _prefetch(layers=5, slots=2)
    p.fill()  # 0 and 1 in flight
    fill = p.next_fill(3, direction=1, turns=False)
    assert ("drop", 0, 0) in ring.log and ("drop", 1, 1) in ring.log
    assert stats.misses == 1 and stats.wasted_reads == 2
    assert fill.pos == 3 and ring.reads()[2:] == [(3, 1), (4, 0)], "the prediction restarts from the missed layer"


def test_with_a_slot_per_layer_every_layer_is_read_once() -> None:
    p, ring, stats = _prefetch(layers=3, slots=3)
    p.fill()
    _run(p, [0, 1, 2])
    assert _run(p, [0, 1, 2]) == [True, True, True]
    assert stats.reads == [1, 1, 1] and len(ring.reads()) == 3


def test_a_slot_whose_bytes_changed_is_read_again() -> None:
    p, ring, stats = _prefetch(layers=3, slots=3)
    p.fill()
    _run(p, [0, 1, 2], intact=False)  # e.g. a forward that wrote into its weights' slot
    assert _run(p, [0, 1, 2]) == [False, False, False]
    assert stats.reads == [2, 2, 2]


def test_backward_copies_the_held_layers_then_the_slots_fill_for_the_next_forward() -> None:
    p, ring, _ = _prefetch(layers=4, slots=2)
    p.fill()
    _run(p, [0, 1, 2, 3], turns=True)  # a forward with grad mode on turns into its backward
    assert p.copy_held(3) == "copy of layer 3" and ("copy", 3, 1) in ring.log
    assert ring.reads() == [(0, 0), (1, 1), (2, 0), (3, 1)], "a copy reads nothing"
    assert p.copy_held(1) is None, "layer 1 is in no slot: backward reads it from the store"
    assert p.copy_held(2) == "copy of layer 2"
    # Every held layer copied: the free slots fill with the next forward's first layers.
    assert ring.reads()[4:] == [(0, 0), (1, 1)]


def test_backward_borrows_the_slots_and_turns_into_the_next_forward() -> None:
    p, ring, stats = _prefetch(layers=4, slots=2, lending=True)
    p.fill()
    _run(p, [0, 1, 2, 3], turns=True)  # a forward with grad mode on: layers 2 and 3 stay in their slots
    assert p.lend(3) == ("slot 1", "held") and p.lend(3) == ("slot 1", None), "held: no read; asked again: the same"
    assert p.lend(2) == ("slot 0", "held")
    assert ring.reads()[4:] == [(1, 1)], "layer 3's slot, put back, is filled with the layer below the one lent"
    ring.views[0] += 1  # a tensor made from layer 2's slot outlives its backward
    assert p.lend(1) == ("slot 1", "read") and ("wait", 1) in ring.log
    renewed = ring.log.index(("renew", 0))
    assert ring.log[renewed + 1] == ("read", 0, 0) and stats.renewed_slots == 1, "a new buffer before the read"
    assert p.lend(0) == ("new slot 0", "read")
    p.end_lend()  # the next forward: layers 0 and 1 are where backward left them
    assert _run(p, [0, 1, 2, 3]) == [True, True, False, False]
    p.take(p.next_fill(0, direction=1, turns=False))
    assert p.lend(3) is None, "no lend while a forward holds a layer"


def test_a_slot_lent_again_unwritten_still_knows_the_tensors_of_its_first_lend() -> None:
    p, ring, stats = _prefetch(layers=2, slots=2, lending=True)
    p.fill()
    _run(p, [0, 1], turns=True)
    buf, how = p.lend(1) or (None, None)
    slot = ring.buffers.index(buf)
    ring.views[slot] += 1  # kept past backward
    p.lend(0)
    p.end_lend()
    assert _run(p, [0, 1], turns=True) == [True, True], "a ring holding every layer writes nothing"
    assert p.lend(1) == (buf, "held")  # lent again, its bytes unchanged: the kept tensor still counts
    p.forget()  # the store changed: every slot is read again
    assert ("renew", slot) in ring.log and stats.renewed_slots == 1


def test_a_failed_read_is_discarded_and_read_again_at_the_next_call() -> None:
    p, ring, _ = _prefetch(layers=3, slots=2)
    p.fill()
    fill = p.next_fill(0, direction=1, turns=False)
    p.discard(fill)  # its read failed: the caller discards it instead of taking it
    assert p.current is None
    fill = p.next_fill(0, direction=1, turns=False)
    assert not fill.held and fill.pos == 0 and ring.reads()[2] == (0, 1), "the failed layer is read again, into a free slot"


def test_restart_drops_the_prediction_and_fills_from_the_first_layer() -> None:
    p, ring, _ = _prefetch(layers=4, slots=2)
    p.fill()
    _run(p, [0, 1])  # 2 and 3 are in flight now
    p.restart()
    assert ("drop", 2, 0) in ring.log and ("drop", 3, 1) in ring.log
    assert ring.reads()[-2:] == [(0, 1), (1, 0)]


def test_settle_waits_for_reads_but_not_for_held_slots() -> None:
    p, ring, _ = _prefetch(layers=4, slots=2)
    p.fill()
    _run(p, [0, 1, 2, 3], turns=True)  # 2 and 3 held, nothing in flight
    p.settle()
    assert not any(e[0] == "settle" for e in ring.log)
    p.copy_held(3)
    p.copy_held(2)  # 0 and 1 in flight for the next forward
    p.settle()
    assert [e for e in ring.log if e[0] == "settle"] == [("settle", 0), ("settle", 1)]


@pytest.mark.parametrize("slots", [1, 2])
def test_decoding_reads_each_layer_once_per_forward_with_fewer_slots_than_layers(slots: int) -> None:
    p, ring, stats = _prefetch(layers=3, slots=slots)
    p.fill()
    for _ in range(4):
        assert _run(p, [0, 1, 2]) == [False, False, False]
    assert stats.misses == 0 and sum(stats.reads) == len(ring.reads())
    assert all(r >= 4 for r in stats.reads)
