"""A profile taken while other work runs notices it: a size is timed until its fastest runs agree
(or a cap is reached, and the profile says so), and a busy machine is named in a warning from
``plan`` and ``gds-offload plan``. Scripted run times: nothing here depends on the machine."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from gds_offload.weights.run.profile import SETTLED, settled, trust


def _script(times: list[float]) -> Iterator[tuple[float, int]]:
    for i, t in enumerate(times):
        yield t, 100 + i


def test_agreeing_runs_are_three_and_their_median() -> None:
    runs = _script([1.0, 1.1, 1.05])
    unsettled: list[str] = []
    assert settled(lambda: next(runs), "x", unsettled) == (1.05, 102)
    assert unsettled == []


def test_a_slowed_run_is_timed_again_and_left_out() -> None:
    """One run of three slowed 4x by another job: more runs until the three fastest agree."""
    runs = _script([1.0, 4.0, 1.1, 1.05])
    unsettled: list[str] = []
    assert settled(lambda: next(runs), "x", unsettled) == (1.05, 103)
    assert unsettled == []


def test_runs_that_never_agree_are_named_and_the_profile_warns() -> None:
    runs = _script([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    unsettled: list[str] = []
    seconds, _ = settled(lambda: next(runs), "decode of 8", unsettled)
    assert seconds == 2.0 and unsettled == ["decode of 8: 9 runs from 1 s to 9 s"]
    why = trust({"unsettled": unsettled, "load": [0.1, 0.5, 2]})
    assert why is not None and f"never agreed within {SETTLED - 1:.0%} (decode of 8" in why and "measure again on a quiet machine" in why


@pytest.mark.parametrize(("load", "busy"), [([0.5, 1.9, 2], False), ([3.2, 3.0, 2], True)])
def test_a_load_above_the_cores_before_measuring_is_named(load: list[float], busy: bool) -> None:
    why = trust({"unsettled": [], "load": load})
    assert (why is not None) == busy
    if busy:
        assert "the load average was 3.2 on 2 cores before measuring" in why  # type: ignore[operator]
