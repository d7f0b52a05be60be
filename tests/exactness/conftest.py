"""Fixtures of the exactness suite (``engine_modes``, ``timing`` and ``spill_dir`` come from ``tests/conftest.py``).

* ``exact``: :func:`helpers.exact.check` bound to the current engine (posix; compat where
  KvikIO is usable; host), timing and a fresh spill directory, so a test is
  ``exact(build, step)``;
* every test here runs with one intra-op thread (restored afterwards).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.exact import check

import gds_offload


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """Tiny ops on a shared 2-core machine: one intra-op thread is several times faster (no
    OpenMP threads spinning against other processes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def exact(engine_modes: str, timing: str, spill_dir: Path) -> Callable[..., gds_offload.OffloadStats]:
    """``check(build, step, **kw)`` for this engine, timing and spill directory."""
    return functools.partial(check, engine=engine_modes, timing=timing, spill_dir=spill_dir)
