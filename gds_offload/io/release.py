"""Releasing what an owner holds when the collector frees it: one discipline for both halves.

The offloader (its engine and spill store) and a streamed model (its ring, engines and store
files) are dropped without ``detach()``/``close()`` often enough: a script ends, an object
goes out of scope. :func:`release_when_collected` ties the release to the owner's life:

* its callback holds what it releases, never the owner, so the owner can be collected;
* it never runs at interpreter exit: the process's descriptors close with it, and exit must
  not wait for a backlog of transfers;
* a release the collector starts off the main thread runs on a short-lived thread of its own:
  the collector may run on any thread, an engine worker included, which cannot join its own pool.

An explicit release cancels the finalizer first (``fin.detach()``), then releases on the
caller's thread. Nothing here imports torch.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["release_when_collected"]


def release_when_collected(owner: object, release: Callable[..., None], *args: Any) -> weakref.finalize:
    """Call ``release(*args)`` when ``owner`` is collected (see the module doc for when and on
    which thread). ``args`` must not hold ``owner``.

    Returns:
        The finalizer: ``detach()`` it before releasing explicitly, or when the resources pass
        to another owner.
    """
    fin = weakref.finalize(owner, _release_from_gc, release, *args)
    fin.atexit = False
    return fin


def _release_from_gc(release: Callable[..., None], *args: Any) -> None:
    if threading.current_thread() is threading.main_thread():
        release(*args)
    else:
        threading.Thread(target=release, args=args, name="gds_offload-release", daemon=True).start()
