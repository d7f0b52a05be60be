"""Stop signals held back while a :class:`~gds_offload.weights.run.model.StreamedModel` changes its state.

A Python signal handler runs between any two bytecodes of the main thread, so Ctrl-C
(``SIGINT``, whose default handler raises ``KeyboardInterrupt``), and ``SIGTERM``/``SIGHUP``
where a program made them raise (``gds-offload``'s commands do), can land in the middle of
bookkeeping: between taking a slot off the free list and recording the read that fills it,
or after a lock is acquired and before the ``with`` that releases it is armed. A ring left
that way loses a slot for good, or lets a slot be refilled under a read still in flight.

:func:`held` replaces, for the duration of a block on the main thread, the Python handlers
of those signals with one that only records them. The recorded signals go to the handlers
that were replaced (which may raise) at *delivery points*, where nothing is half done:

* :func:`deliver`, called where the state is consistent (a hook's first line);
* :func:`wait_done`, a blocking wait for a transfer that delivers while it waits (every
  :data:`POLL_S`), so Ctrl-C during a slow read still stops the program at once, before
  anything has relied on the read having finished;
* the end of the outermost :func:`held` block, after the block's own clean-up.

A layer's compute inside a held block (the pass through the decoder) is therefore
interrupted at the next layer's hook, a few milliseconds later, instead of between two
bookkeeping steps. Off the main thread (where Python runs no signal handlers) the block is
unchanged. ``SIG_DFL`` and ``SIG_IGN`` are left alone: the default action ends the process,
leaving nothing in it to be consistent.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gds_offload.io.base import IOFuture

__all__ = ["POLL_S", "deliver", "held", "wait_done"]

#: How often a wait inside a held block looks for a recorded signal.
POLL_S = 0.05

_SIGNALS: tuple[int, ...] = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)

_Handler = Callable[[int, "FrameType | None"], Any]


class _State:
    """Main-thread only: the depth of nested :func:`held` blocks, the handlers they replaced, the signals recorded."""

    def __init__(self) -> None:
        self.depth = 0
        self.replaced: dict[int, _Handler] = {}
        self.pending: list[tuple[int, FrameType | None]] = []


_state = _State()


def _record(signum: int, frame: FrameType | None) -> None:
    if _state.depth > 0:
        _state.pending.append((signum, frame))
        return
    # Left installed by an exit that a signal cut short: hand over, and put the original back.
    original = _state.replaced.pop(signum, None)
    if original is not None:
        signal.signal(signum, original)
        original(signum, frame)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold stop signals for the block (see the module doc); re-entrant. Signals recorded
    and not yet delivered go to their handlers when the outermost block ends, which may raise."""
    if not _on_main_thread():
        yield
        return
    if _state.depth == 0:
        for s in _SIGNALS:
            h = signal.getsignal(s)
            if callable(h) and h is not _record:
                _state.replaced[s] = h
                signal.signal(s, _record)
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if _state.depth == 0:
            _release()


def _release() -> None:
    """Put the replaced handlers back (``SIGINT``'s last: it is the one that usually raises), then deliver."""
    replaced = sorted(_state.replaced.items(), key=lambda kv: kv[0] == signal.SIGINT)
    for s, h in replaced:
        signal.signal(s, h)
        del _state.replaced[s]
    pending, _state.pending = _state.pending, []
    handlers = dict(replaced)
    for signum, frame in pending:
        handler = handlers.get(signum)
        if handler is not None:
            handler(signum, frame)


def deliver() -> None:
    """Hand the signals recorded so far to their handlers now (which may raise: call it where
    the state is consistent). Nothing to do outside a held block or off the main thread."""
    while _state.pending and _state.depth > 0 and _on_main_thread():
        signum, frame = _state.pending.pop(0)
        handler = _state.replaced.get(signum)
        if handler is not None:
            handler(signum, frame)


def wait_done(future: IOFuture) -> None:
    """Block until ``future`` has finished (successfully or not; its error is not raised here),
    delivering recorded signals while it waits (see the module doc)."""
    if _state.depth == 0 or not _on_main_thread():
        future.error()
        return
    while True:
        deliver()
        try:
            future.error(POLL_S)
            return
        except concurrent.futures.TimeoutError:
            continue
