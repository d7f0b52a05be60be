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

Contracts: the finalizer never runs at interpreter exit (the process's descriptors close
with it, and exit must not wait for a write backlog); a release the collector starts off
the main thread runs on a thread of its own (an engine worker cannot join its own pool).
Nothing here imports torch.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gds_offload.activations.offloader import Offloader
    from gds_offload.activations.spill.store import SpillStore
    from gds_offload.io.base import Engine

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


def release_finalizer(owner: Offloader, engine: Engine, store: SpillStore) -> weakref.finalize:
    """Close ``engine`` and ``store`` when ``owner`` is collected (never at interpreter exit:
    the process's descriptors close with it, and exit must not wait for a write backlog)."""
    fin = weakref.finalize(owner, _release_from_gc, engine, store)
    fin.atexit = False
    return fin


def release(engine: Engine, store: SpillStore) -> None:
    """Wait for the engine's transfers, stop its threads, then close (and so delete) the spill files."""
    try:
        engine.close()
    finally:
        store.close()


def _release_from_gc(engine: Engine, store: SpillStore) -> None:
    """:func:`release` for an offloader the collector freed. The collector may run on any
    thread, an engine worker included, which cannot join its own pool: off the main thread
    the release runs on a short-lived thread of its own."""
    if threading.current_thread() is threading.main_thread():
        release(engine, store)
    else:
        threading.Thread(target=release, args=(engine, store), name="gds_offload-release", daemon=True).start()

