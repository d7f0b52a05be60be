"""A saved storage's life cycle (gds_offload/activations/scheduler/entry.py): every legal
move and every illegal one, through :meth:`Entry.move`.

The expected table is written out here from the life-cycle picture in the module's doc, not
read from the module, so a change to the module's table fails this test.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gds_offload.activations.scheduler.entry import Entry, State
from gds_offload.errors import OffloadError

S = State
#: Which states may follow each state (the picture in entry.py's doc).
LEGAL: dict[State, set[State]] = {
    S.NEW: {S.KEPT, S.WRITING},
    S.KEPT: {S.RELEASED},
    S.WRITING: {S.ON_DRIVE, S.LOADED, S.KEPT, S.RELEASED},
    S.ON_DRIVE: {S.READING, S.RELEASED},
    S.READING: {S.LOADED, S.FAILED, S.RELEASED},
    S.LOADED: {S.READING, S.KEPT, S.RELEASED},
    S.FAILED: {S.RELEASED},
    S.RELEASED: set(),
}


def _entry(state: State) -> Entry:
    t = torch.zeros(16)
    e = Entry(nbytes=64, device=t.device, forward_id=0, unit=3, storage_ref=StorageWeakRef(t.untyped_storage()), version=0, generation=0)
    e.state = state  # the state under test, set directly: reaching it by moves is what is under test
    return e


def test_the_table_covers_every_state() -> None:
    assert set(LEGAL) == set(State)


@pytest.mark.parametrize(("old", "new"), [(a, b) for a in State for b in sorted(LEGAL[a], key=lambda s: s.value)],
                         ids=lambda s: s.name)
def test_a_legal_move_changes_the_state(old: State, new: State) -> None:
    e = _entry(old)
    e.move(new)
    assert e.state is new


@pytest.mark.parametrize(("old", "new"), [(a, b) for a, b in itertools.product(State, State) if b not in LEGAL[a]],
                         ids=lambda s: s.name)
def test_an_illegal_move_raises_offload_error_and_changes_nothing(old: State, new: State) -> None:
    e = _entry(old)
    with pytest.raises(OffloadError, match=rf"cannot go from {old.name} to {new.name}; from {old.name} it may go to"):
        e.move(new)
    assert e.state is old


def test_a_whole_life_through_the_drive() -> None:
    e = _entry(S.NEW)
    for step in (S.WRITING, S.ON_DRIVE, S.READING, S.LOADED, S.READING, S.LOADED, S.RELEASED):
        e.move(step)
    assert e.state is S.RELEASED
    with pytest.raises(OffloadError, match="none \\(it is final\\)"):
        e.move(S.KEPT)
