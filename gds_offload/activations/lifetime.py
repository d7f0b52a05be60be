"""What keeps an attached :class:`~gds_offload.activations.offloader.Offloader` alive, and what releases it
when nobody calls ``detach()``.

:class:`InterruptGuard` is ``model.forward`` while an offloader is attached. It pops the
saved-tensor hooks when ``KeyboardInterrupt`` or ``SystemExit`` leaves forward
(``always_call`` forward hooks cover ``Exception`` only); through it the model holds the
offloader and the offloader the model, a cycle the collector frees.
:func:`release_finalizer` ties the engine and the spill store to the offloader's life: its
callback holds them, never the offloader, so a model dropped without ``detach()`` gives
back its threads, descriptors and disk space when the collector frees it (the ownership
note in :mod:`gds_offload.activations.offloader`).

The finalizer follows the package's one discipline (:mod:`gds_offload.io.release`, shared
with the weight half's streamed models): never at interpreter exit, and off the main thread
on a thread of its own. Nothing here imports torch.
"""
from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

from gds_offload.io.release import release_when_collected

if TYPE_CHECKING:
    from gds_offload.io.base import Engine
    from gds_offload.io.spill import SpillStore

__all__ = ["InterruptGuard", "release", "release_finalizer"]


class InterruptGuard:
    """``model.forward`` while an offloader is attached: calls the real forward, and when a
    ``BaseException`` that is not an ``Exception`` (KeyboardInterrupt, SystemExit) leaves it,
    runs ``on_abort`` so the saved-tensor hooks are popped at once. (``always_call`` forward
    hooks cover ``Exception`` only.)

    Copying or pickling the model yields its plain forward (``__reduce__``), never the guard.
    """

    def __init__(self, forward: Any, on_abort: Any) -> None:
        self.forward = forward
        self._on_abort = on_abort
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.forward(*args, **kwargs)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._on_abort()
            raise

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _unguarded, (self.forward,)


def _unguarded(forward: Any) -> Any:
    return forward


def release_finalizer(owner: object, engine: Engine, store: SpillStore) -> weakref.finalize:
    """Close ``engine`` and ``store`` when ``owner`` is collected
    (:func:`~gds_offload.io.release.release_when_collected`: never at interpreter exit, off the
    main thread on a thread of its own)."""
    return release_when_collected(owner, release, engine, store)


def release(engine: Engine, store: SpillStore) -> None:
    """Wait for the engine's transfers, stop its threads, then close (and so delete) the spill files."""
    try:
        engine.close()
    finally:
        store.close()

