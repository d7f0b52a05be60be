"""Child processes of the commands that train or benchmark: started, stopped with their parent, reaped.

``demo``, ``bench``, ``rok`` and ``bench-weights`` run each mode in a child process. When the
command is told to stop (``SIGTERM``, ``SIGHUP``, or Ctrl-C's ``SIGINT``), its children must
stop too and be reaped, and nothing may be left running or on disk:

* :func:`stop_signals` (entered by ``gds-offload``'s ``main``) turns ``SIGTERM`` and ``SIGHUP``
  into :class:`Terminated` on the main thread, as Python turns ``SIGINT`` into
  ``KeyboardInterrupt``; the exception unwinds the command through its ``finally`` blocks.
  A second signal while the first unwinds is ignored, so cleanup is not cut short.
* :func:`spawn` starts a child (registered before any handler can unwind past it) and
  :func:`reap` forwards the stop to it: ``SIGTERM``, then ``SIGKILL`` after a grace period,
  then ``wait``. Callers reap in a ``finally`` block.
* :func:`die_with_parent`, called first thing in a child, asks the kernel to send it
  ``SIGTERM`` if the parent dies without reaping it (``kill -9`` of the parent).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["PARENT_ENV", "Terminated", "die_with_parent", "reap", "spawn", "stop_signals"]

#: Seconds a child gets to exit after ``SIGTERM`` before ``SIGKILL``.
GRACE_S = 5.0
#: The environment variable carrying the parent's pid to the child (see :func:`die_with_parent`).
PARENT_ENV = "GDS_OFFLOAD_PARENT_PID"
_PR_SET_PDEATHSIG = 1


class Terminated(BaseException):
    """The command got ``SIGTERM`` or ``SIGHUP``. A ``BaseException``, like ``KeyboardInterrupt``,
    so that ``except Exception`` blocks do not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class _State:
    """What the handler knows: a stop under way, and critical sections that defer it."""

    def __init__(self) -> None:
        self.stopping = False
        self.deferred = 0
        self.pending: int | None = None


_state = _State()


def _handler(signum: int, _frame: Any) -> None:
    if _state.stopping:
        return  # already unwinding: let the cleanup finish
    if _state.deferred:
        _state.pending = signum
        return
    _state.stopping = True
    raise Terminated(signum)


@contextlib.contextmanager
def stop_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Within the block, ``signals`` raise :class:`Terminated` on the main thread.

    The previous handlers come back afterwards. Off the main thread (where Python cannot
    install handlers) the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _handler) for s in signals}
    _state.stopping, _state.pending = False, None
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _state.stopping, _state.pending = False, None


@contextlib.contextmanager
def _deferred() -> Iterator[None]:
    """A stop signal arriving inside the block is raised when the block ends."""
    _state.deferred += 1
    try:
        yield
    finally:
        _state.deferred -= 1
    _raise_pending()


def _raise_pending() -> None:
    pending, _state.pending = _state.pending, None
    if pending is not None and not _state.deferred and not _state.stopping:
        _state.stopping = True
        raise Terminated(pending)


def spawn(cmd: list[str], **popen_kw: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(cmd, **popen_kw)``, with this process's pid in the child's environment
    (:data:`PARENT_ENV`). A stop signal that arrives while the child starts is acted on once it
    has started: the child is reaped, then :class:`Terminated` is raised, so no child is left
    without an owner."""
    env = dict(popen_kw.pop("env", None) or os.environ)
    env[PARENT_ENV] = str(os.getpid())
    _state.deferred += 1
    try:
        proc = subprocess.Popen(cmd, env=env, **popen_kw)
    finally:
        _state.deferred -= 1
    if _state.pending is not None and not _state.deferred:
        reap(proc)
        _raise_pending()
    return proc


def reap(proc: subprocess.Popen[Any], grace_s: float = GRACE_S) -> int:
    """Stop ``proc`` if it still runs (``SIGTERM``; ``SIGKILL`` after ``grace_s``) and wait for it.

    Returns:
        Its exit status (negative: the signal that ended it).
    """
    with _deferred():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        return proc.returncode


def die_with_parent() -> None:
    """In a child started by :func:`spawn`: get ``SIGTERM`` when the parent dies (Linux
    ``PR_SET_PDEATHSIG``), and exit at once if it already has. No-op elsewhere."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # the parent died before prctl: nobody will reap this run
        os._exit(128 + signal.SIGTERM)
