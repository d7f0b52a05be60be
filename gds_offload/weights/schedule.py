"""Layer-major execution: ``n`` micro-batches share each weight load.

Balance Beam's point is compute per byte moved: a streamed layer read once should serve as
many tokens as memory allows. A model's own ``forward`` (and Hugging Face's ``generate``,
which calls it) runs one batch through all the layers; to run ``n`` micro-batches through
layer ``k`` before any reaches layer ``k + 1``, :class:`Team` runs each micro-batch's whole
computation (``model(...)``, ``model.generate(...)``) in a thread of its own and lets one
thread run at a time, handing over at every streamed layer's pre-hook:

* micro-batch 0 runs up to layer 0's pre-hook (embeddings, masks, positions) and hands over
  to micro-batch 1, which does the same, and so on; the last hands back to micro-batch 0;
* micro-batch 0 runs layer 0 (its weights bound once, by the first member to reach it) and
  stops at layer 1's pre-hook; micro-batch 1 runs layer 0 with the same weights; ...; the
  last member's hand-over brings micro-batch 0 to layer 1, whose weights were read while
  the ``n`` micro-batches computed layer 0;
* after the last layer each member runs on to its next hand-over: the head, the sampling
  of a decode step, the next step's embeddings.

Members run with the caller's grad mode and autocast settings (thread-local state a new thread
would not inherit). With grad mode on, each member's ``backward`` (called inside its computation)
hands over too, at each streamed layer it reaches (on the CPU, where autograd runs a backward on
the thread that called it): the members' backwards go down the layers together, each layer's
weights read once per round, and gradients reach ``.grad`` in the members' order, as ordinary
gradient accumulation adds them. On CUDA autograd runs backwards on a device thread of its own,
so there the members' backwards run one after another (exact, without the shared reads).

Because exactly one member runs at a time, in a fixed order, every micro-batch computes
exactly what it would alone: the same kernels on the same inputs (``torch.equal`` to the
resident model running the micro-batches one after another). Each member also has its own
random-number state (CPU and CUDA), swapped in and out at every hand-over, so sampling and
dropout draw from the stream they would draw from alone: the state ``seeds[i]`` gives.

A member that finishes (or raises) leaves the rotation; one that raises cancels the others
(they raise :class:`TeamCancelled` at their next hand-over) and :meth:`Team.run` re-raises
its exception once every member has stopped. Ctrl-C in the calling thread does the same.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

from gds_offload.errors import OffloadError

__all__ = ["Team", "TeamCancelled"]

T = TypeVar("T")

#: How often the calling thread wakes while it waits for the members (Ctrl-C stops it there).
_JOIN_S = 0.05


class TeamCancelled(OffloadError):
    """A member of a :class:`Team` stopped because another one raised (or the caller was interrupted)."""


class _RngState:
    """One member's random-number state: the CPU generator's, and the current CUDA device's if any."""

    def __init__(self, seed: int | None, cuda: bool) -> None:
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if cuda else None
        if seed is not None:
            torch.manual_seed(seed)
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if cuda else None
        torch.set_rng_state(saved_cpu)
        if saved_cuda is not None:
            torch.cuda.set_rng_state(saved_cuda)

    def load(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)

    def save(self) -> None:
        self.cpu = torch.get_rng_state()
        if self.cuda is not None:
            self.cuda = torch.cuda.get_rng_state()


class Team(Generic[T]):
    """``len(calls)`` micro-batches computed layer-major (see the module doc).

    Args:
        calls: each member's whole computation, e.g. ``lambda: model.generate(ids_i, ...)``.
        seeds: the seed of each member's random-number state: member ``i`` draws what
            ``torch.manual_seed(seeds[i])`` followed by ``calls[i]()`` alone would. ``None``
            (or a ``None`` seed): the caller's state when the team was built. The caller's own
            state is the same after :meth:`run` as before it.
    """

    def __init__(self, calls: Sequence[Callable[[], T]], *, seeds: Sequence[int | None] | None = None) -> None:
        # The caller's thread-local modes, which a new thread does not inherit: grad mode and autocast.
        self._grad = torch.is_grad_enabled()
        self._autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        if not calls:
            raise ValueError("a Team needs at least one member")
        if seeds is not None and len(seeds) != len(calls):
            raise ValueError(f"{len(seeds)} seeds for {len(calls)} members")
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._calls = list(calls)
        self._rng = [_RngState(s, cuda) for s in (seeds if seeds is not None else [None] * len(calls))]
        self._cond = threading.Condition()
        self._order = list(range(len(calls)))  # members still running, in rotation order
        self._now = 0  # the member whose turn it is
        self._members: dict[int, int] = {}  # thread ident -> member index
        self._failure: BaseException | None = None
        self._results: list[Any] = [None] * len(calls)
        #: Hand-overs so far (one per member per streamed layer, plus the last of each pass).
        self.handovers = 0

    # -- for the hooks ------------------------------------------------------------------------
    def member(self) -> bool:
        """The calling thread is one of this team's members."""
        return threading.get_ident() in self._members

    def idents(self) -> list[int]:
        """The members' thread idents (they count as the model's turn's owners while the team runs)."""
        return list(self._members)

    def arrive(self) -> None:
        """A member reached a hand-over point (a streamed layer's pre-hook): the next member runs,
        and this one resumes on its next turn, with its own random-number state.

        Raises:
            TeamCancelled: another member raised, or the caller was interrupted.
        """
        i = self._members[threading.get_ident()]
        with self._cond:
            self._rng[i].save()
            self._pass_on(i)
            self._wait_turn(i)

    # -- for the caller -----------------------------------------------------------------------
    def run(self, *, started: Callable[[list[int]], None] | None = None) -> list[T]:
        """Run every member to the end; their results, in order. ``started(idents)`` runs once
        every member's thread exists, before any of them computes (to admit them to the model's turn).

        Raises:
            The first exception a member raised (the others are cancelled and waited for).
        """
        caller = _RngState(None, self._rng[0].cuda is not None)
        try:
            return self._run(started)
        finally:
            caller.load()  # the members' draws do not move the caller's random-number state

    def _run(self, started: Callable[[list[int]], None] | None) -> list[T]:
        threads = [threading.Thread(target=self._member, args=(i,), name=f"gds_offload-mb{i}", daemon=True) for i in range(len(self._calls))]
        gate = threading.Event()
        self._gate = gate
        for t in threads:
            t.start()
        with self._cond:
            while len(self._members) < len(threads):
                self._cond.wait()
        try:
            if started is not None:
                started(list(self._members))
            gate.set()
            for t in threads:
                while t.is_alive():
                    t.join(_JOIN_S)
        except BaseException as exc:
            self._cancel(exc)
            gate.set()
            for t in threads:
                t.join()
            raise
        if self._failure is not None:
            raise self._failure
        return list(self._results)

    # -- internals ----------------------------------------------------------------------------
    def _member(self, i: int) -> None:
        with self._cond:
            self._members[threading.get_ident()] = i
            self._cond.notify_all()
        self._gate.wait()
        try:
            with self._cond:
                self._wait_turn(i)
            with contextlib.ExitStack() as modes:
                modes.enter_context(torch.set_grad_enabled(self._grad))
                for device_type, dtype in self._autocast:
                    modes.enter_context(torch.autocast(device_type, dtype=dtype))
                self._results[i] = self._calls[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to run()
            if not isinstance(exc, TeamCancelled):
                self._cancel(exc)
        finally:
            with self._cond:
                self._rng[i].save()
                self._leave(i)

    def _wait_turn(self, i: int) -> None:
        while self._now != i and self._failure is None:
            self._cond.wait()
        if self._failure is not None:
            raise TeamCancelled(f"micro-batch {i} stopped: {type(self._failure).__name__}: {self._failure}")
        self._rng[i].load()

    def _pass_on(self, i: int) -> None:
        """Member ``i`` (whose turn it is) hands over to the next member in the rotation."""
        pos = self._order.index(i)
        self._now = self._order[(pos + 1) % len(self._order)]
        self.handovers += 1
        self._cond.notify_all()

    def _leave(self, i: int) -> None:
        if i not in self._order:
            return
        pos = self._order.index(i)
        if self._now == i and len(self._order) > 1:
            self._now = self._order[(pos + 1) % len(self._order)]
        self._order.remove(i)
        self._cond.notify_all()

    def _cancel(self, exc: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = exc
            self._cond.notify_all()
