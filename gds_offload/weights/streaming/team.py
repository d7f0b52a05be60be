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

The protocol, as a state table (:class:`MemberState`, :data:`MOVES`), kept under one lock:

=========  ==========================================  =========================================
state      how a member gets there                     what it may do there
=========  ==========================================  =========================================
NEW        :meth:`Team.run` made its thread             nothing yet
READY      its thread started (registered its ident)    wait for the gate and its first turn
RUNNING    its first turn came, nothing failed          compute; at each hand-over pass the turn on
LEFT       its call returned or raised, or it was       nothing: it never touches the model again
           cancelled while READY
=========  ==========================================  =========================================

Invariants: at most one RUNNING member is outside a hand-over wait (the one whose turn it is);
no member becomes RUNNING once the team has failed; and :meth:`Team.run` returns or raises only
when every member whose thread was started is LEFT. The caller learns that from the members'
own marks (each sets LEFT in a ``finally``, under the lock), never from ``Thread.join``: a
``KeyboardInterrupt`` landing in ``join`` can leave CPython believing a running thread stopped,
and a member still running backward after ``run`` returned would add its gradients to the
next step. The caller waits with stop signals held (:func:`~gds_offload.runtime.interrupts.held`)
and delivers them only between its waits, where the team's state is consistent; once it is
cancelled it waits for the members to leave with signals held, and they are delivered after.
"""
from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

from gds_offload.errors import OffloadError
from gds_offload.runtime.interrupts import POLL_S, deliver, held

__all__ = ["MOVES", "MemberState", "Team", "TeamCancelled", "check_move"]

T = TypeVar("T")


class TeamCancelled(OffloadError):
    """A member of a :class:`Team` stopped because another one raised (or the caller was interrupted)."""


class MemberState(enum.Enum):
    """Where one member of a :class:`Team` is. The only moves are those of :data:`MOVES`."""

    NEW = "new"  #: its thread is made, not yet running our code
    READY = "ready"  #: its thread runs, at the gate (before its call)
    RUNNING = "running"  #: inside its call (computing, or waiting for its turn at a hand-over)
    LEFT = "left"  #: its call returned or raised, or it was cancelled before calling: it touches nothing again


#: The legal moves of a member. A member becomes RUNNING only under the team's lock while no
#: member has failed and the caller has not been interrupted, so once the team is cancelled
#: the RUNNING members can only leave.
MOVES: dict[MemberState, frozenset[MemberState]] = {
    MemberState.NEW: frozenset({MemberState.READY}),
    MemberState.READY: frozenset({MemberState.RUNNING, MemberState.LEFT}),
    MemberState.RUNNING: frozenset({MemberState.LEFT}),
    MemberState.LEFT: frozenset(),
}


def check_move(member: int, old: MemberState, new: MemberState) -> MemberState:
    """``new``, if :data:`MOVES` allows ``member`` to go there from ``old``.

    Raises:
        OffloadError: the move is not in the table (a broken protocol, never a user's error).
    """
    if new not in MOVES[old]:
        raise OffloadError(f"micro-batch {member} of a layer-major team cannot go from {old.value} to {new.value}")
    return new


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
        self._states = [MemberState.NEW] * len(calls)
        self._started: list[int] = []  # members whose thread was started
        self._open = False  # the gate: members may take their first turn
        self._order = list(range(len(calls)))  # members still in the rotation
        self._now = 0  # the member whose turn it is
        self._members: dict[int, int] = {}  # thread ident -> member index
        self._failure: BaseException | None = None
        self._results: list[Any] = [None] * len(calls)
        #: Hand-overs so far (one per member per streamed layer, plus the last of each pass).
        self.handovers = 0

    # -- the state table ----------------------------------------------------------------------
    @property
    def states(self) -> list[MemberState]:
        """Each member's state now (a copy)."""
        with self._cond:
            return list(self._states)

    def _move(self, i: int, new: MemberState) -> None:
        """Member ``i`` moves to ``new`` (the lock held); :func:`check_move` refuses a move outside the table."""
        check_move(i, self._states[i], new)
        if new is MemberState.RUNNING and self._failure is not None:
            raise OffloadError(f"micro-batch {i} of a layer-major team cannot start: the team was cancelled")
        self._states[i] = new
        self._cond.notify_all()

    def _all_left(self) -> bool:
        return all(self._states[i] is MemberState.LEFT for i in self._started)

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

        Returns or raises only once every member has left (:class:`MemberState`), also when the
        caller is interrupted: no member computes after ``run``.

        Raises:
            The first exception a member raised (the others are cancelled and waited for), or
            the stop signal's exception (``KeyboardInterrupt``) if the caller was interrupted.
        """
        caller = _RngState(None, self._rng[0].cuda is not None)
        try:
            with held():  # signals are delivered only between the waits below (see the module doc)
                self._run(started)
        finally:
            caller.load()  # the members' draws do not move the caller's random-number state
        if self._failure is not None:
            raise self._failure
        return list(self._results)

    def _run(self, started: Callable[[list[int]], None] | None) -> None:
        n = len(self._calls)
        try:
            for i in range(n):
                threading.Thread(target=self._member, args=(i,), name=f"gds_offload-mb{i}", daemon=True).start()
                self._started.append(i)
            self._await(lambda: len(self._members) == n)
            if started is not None:
                started(list(self._members))
            with self._cond:
                self._open = True
                self._cond.notify_all()
            self._await(self._all_left)
        except BaseException as exc:
            self._cancel(exc)
            self._drain()
            raise

    def _await(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` (read under the lock), delivering held stop signals between slices.
        The members' moves and hand-overs wake it, so a signal is delivered at the next of them."""
        while True:
            with self._cond:
                if done():
                    return
                self._cond.wait(POLL_S)
            deliver()

    def _drain(self) -> None:
        """After a cancel: wait, delivering nothing, until every started member has left."""
        with self._cond:
            while not self._all_left():
                self._cond.wait(POLL_S)

    # -- internals ----------------------------------------------------------------------------
    def _member(self, i: int) -> None:
        with self._cond:
            self._members[threading.get_ident()] = i
            self._move(i, MemberState.READY)
        ran = False
        try:
            with self._cond:
                while not self._open and self._failure is None:
                    self._cond.wait()
                self._wait_turn(i)
                self._move(i, MemberState.RUNNING)
                ran = True
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
                if ran:
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
        pos = self._order.index(i)
        if self._now == i and len(self._order) > 1:
            self._now = self._order[(pos + 1) % len(self._order)]
        self._order.remove(i)
        self._move(i, MemberState.LEFT)

    def _cancel(self, exc: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = exc
            self._cond.notify_all()
