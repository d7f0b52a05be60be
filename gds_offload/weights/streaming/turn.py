"""Whose turn it is to use a :class:`~gds_offload.weights.run.model.StreamedModel`'s ring, and
the forward of the module that runs its layers (the *pass*), wrapped.

The streamed layers share one ring of slots and one prediction of the next layer, so one
forward may use them at a time. A :class:`Turn` is a lock with an owner thread, re-entrant
on that thread:

* a pass through the decoder (the module holding the streamed layers, whose ``forward``
  :class:`PassForward` wraps) takes it for its whole length, *without waiting*: a second
  thread calling the model meanwhile gets :class:`~gds_offload.errors.OffloadError` at
  once, never a computation over the other pass's slots;
* a layer called on its own takes it for its forward, without waiting, as a pass does;
* a recompute (Hugging Face gradient checkpointing, in backward), a copy of a layer out of
  its slot for backward, :meth:`~gds_offload.weights.run.model.StreamedModel.close` and
  :meth:`~gds_offload.weights.run.model.StreamedModel.use_engine` wait for it (on CUDA,
  backward runs on autograd's own thread).

Waiting is done in slices, delivering held stop signals between them
(:mod:`gds_offload.runtime.interrupts`), so Ctrl-C still stops a waiting thread.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from gds_offload.errors import ConfigError, OffloadError
from gds_offload.runtime.interrupts import POLL_S, deliver

__all__ = ["PassForward", "Turn", "claim", "guard_closed"]


class Turn:
    """One owner thread at a time, re-entrant on it (see the module doc). ``describe``
    names the model in errors (its store)."""

    def __init__(self, describe: str) -> None:
        self._describe = describe
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._team: frozenset[int] = frozenset()  # threads the owner admitted (a layer-major team)

    def owned(self) -> bool:
        """The calling thread holds the turn (or was admitted to it by the thread that does)."""
        me = threading.get_ident()
        return self._owner == me or me in self._team

    def admit(self, idents: list[int]) -> None:
        """The owner lets ``idents`` (a :class:`~gds_offload.weights.streaming.team.Team`'s members, which
        take turns among themselves) use the model as if they held the turn, until :meth:`dismiss`."""
        assert self._owner == threading.get_ident(), "Turn.admit by a thread that does not hold the turn"
        self._team = frozenset(idents)

    def dismiss(self) -> None:
        """End :meth:`admit`."""
        self._team = frozenset()

    def enter(self, *, wait: bool) -> None:
        """Take the turn (again, if this thread holds it).

        Raises:
            OffloadError: ``wait=False`` and another thread holds it.
        """
        me = threading.get_ident()
        if me in self._team:
            return  # the owner holds the turn for its team
        if self._owner == me:
            self._depth += 1
            return
        if wait:
            while not self._lock.acquire(timeout=POLL_S):
                deliver()
        elif not self._lock.acquire(blocking=False):
            raise OffloadError(
                f"another thread is running the StreamedModel of {self._describe}: its streamed layers share one ring "
                f"of slots, so it runs one forward at a time. Give each thread its own load_streamed() of the store, "
                f"or serialize the calls (a threading.Lock around model(...) and generate())"
            )
        self._owner, self._depth = me, 1

    def exit(self) -> None:
        """Give back one :meth:`enter` of the owner thread."""
        if threading.get_ident() in self._team:
            return
        assert self.owned(), "Turn.exit on a thread that does not hold the turn"
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()

    def try_enter(self) -> bool:
        """:meth:`enter` without waiting; ``False`` (nothing taken) if another thread holds the turn."""
        try:
            self.enter(wait=False)
        except OffloadError:
            return False
        return True

    @contextlib.contextmanager
    def holding(self, *, wait: bool) -> Iterator[None]:
        """:meth:`enter` for the block, :meth:`exit` after it."""
        self.enter(wait=wait)
        try:
            yield
        finally:
            self.exit()


class PassForward:
    """``module.forward`` replaced by ``run(forward, args, kwargs)`` (an instance attribute, as
    Accelerate's hooks do; ``nn.Module.__call__`` looks it up there), until :meth:`restore`.

    A wrapper rather than forward hooks: ``nn.Module`` runs ``always_call`` hooks after an
    ``Exception`` only, never after ``KeyboardInterrupt``, and the pass must end (its turn given
    back, a layer left bound taken out) however the forward ends.
    """

    def __init__(self, module: nn.Module, run: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]) -> None:
        self.module = module
        self._had = "forward" in module.__dict__
        self._inner: Callable[..., Any] = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            return run(self._inner, args, kwargs)

        self._wrapper = forward
        module.forward = forward

    def restore(self) -> None:
        """Put the module's own forward back, if ours is still the one installed. Idempotent."""
        if self.module.__dict__.get("forward") is not self._wrapper:
            return
        if self._had:
            self.module.forward = self._inner
        else:
            del self.module.forward


class _Claim:
    """Who streams a model skeleton: the open StreamedModel, or the guards a closed one left."""

    def __init__(self, owner: Any, describe: str) -> None:
        self.owner = weakref.ref(owner)
        self.describe = describe
        self.guards: list[Any] = []


_CLAIMS: weakref.WeakKeyDictionary[nn.Module, _Claim] = weakref.WeakKeyDictionary()


def claim(model: nn.Module, owner: Any, describe: str) -> None:
    """``owner`` (a StreamedModel, with a ``closed`` property) streams ``model`` from ``describe``
    from now on; the guards a closed one left on it (:func:`guard_closed`) are removed.

    Raises:
        ConfigError: another StreamedModel that is still open streams ``model``.
    """
    prev = _CLAIMS.get(model)
    if prev is not None:
        other = prev.owner()
        if other is not None and not other.closed:
            raise ConfigError(
                f"this model is already streamed from {prev.describe} by a StreamedModel that is still open; "
                f"close() it first, or build another skeleton for {describe}"
            )
        for h in prev.guards:
            h.remove()
    _CLAIMS[model] = _Claim(owner, describe)


def guard_closed(model: nn.Module, layers: list[nn.Module], describe: str) -> None:
    """After close: calling one of ``layers`` (whose parameters are meta tensors now) raises
    :class:`OffloadError` saying so, instead of torch's own error about the meta device."""

    def refuse(module: nn.Module, args: Any) -> None:
        raise OffloadError(f"the StreamedModel of {describe} was closed, and this model's streamed layers have no weights; "
                           f"load the store again (gds_offload.weights.load_streamed)")  # fmt: skip

    entry = _CLAIMS.get(model)
    if entry is None:
        return
    entry.guards = [layer.register_forward_pre_hook(refuse) for layer in layers]
