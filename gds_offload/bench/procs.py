"""The one child-process protocol of the commands and benchmarks: start, talk, stop, reap.

``demo``, ``bench``, ``rok``, ``bench-weights`` and ``bench-finetune`` run each mode in a child
process (``python -m MODULE --spec JSON``), and every child speaks the same protocol:

* **Start** (:func:`run_child`, parent side): the child gets its spec as one ``--spec JSON``
  argument (:func:`child_command`) and an environment from :func:`child_env` (unbuffered
  output, bit-identical MKL kernels across processes). Under a memory cap (``memory_limit``)
  the parent moves the child into its :class:`~gds_offload.bench.cgroup.MemoryCap` group and
  only then lets it go with one line on its stdin, so nothing the child does runs uncapped.
* **Child side** (:func:`read_spec`): ties itself to its parent (:func:`die_with_parent`),
  waits for that line when the parent says it will send one, and parses ``--spec``.
* **Talk**: the child writes events (progress, results) to stdout as JSON lines, one each,
  behind :data:`EVENT_PREFIX` (:func:`emit`); the parent passes each to ``on_event`` as it
  arrives and returns them all (:class:`ChildRun`), with the tail of stderr.
* **End**: a child past its timeout is killed; :func:`exit_reason` says why a child ended
  without its result, in one place ("killed by SIGKILL" is an out-of-memory kill, nearly
  always). Failing children become result rows, never exceptions in the parent.

Stopping: when the command is told to stop (``SIGTERM``, ``SIGHUP``, or Ctrl-C's ``SIGINT``),
its children must stop too and be reaped, and nothing may be left running or on disk:

* :func:`stop_signals` (entered by ``gds-offload``'s ``main``) turns ``SIGTERM`` and ``SIGHUP``
  into :class:`Terminated` on the main thread, as Python turns ``SIGINT`` into
  ``KeyboardInterrupt``; the exception unwinds the command through its ``finally`` blocks.
  A second signal while the first unwinds is ignored, so cleanup is not cut short.
* :func:`spawn` starts a child (registered before any handler can unwind past it) and
  :func:`reap` forwards the stop to it: ``SIGTERM``, then ``SIGKILL`` after a grace period,
  then ``wait``. :func:`run_child` reaps in a ``finally`` block.
* :func:`die_with_parent`, called first thing in a child, asks the kernel to send it
  ``SIGTERM`` if the parent dies without reaping it (``kill -9`` of the parent).

Nothing here imports torch.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gds_offload.bench.cgroup import CapReport, MemoryCap

__all__ = [
    "EVENT_PREFIX",
    "GO_ENV",
    "PARENT_ENV",
    "ChildRun",
    "Terminated",
    "child_command",
    "child_env",
    "die_with_parent",
    "emit",
    "exit_reason",
    "parse_event",
    "read_spec",
    "reap",
    "run_child",
    "spawn",
    "stop_signals",
]

#: Seconds a child gets to exit after ``SIGTERM`` before ``SIGKILL``.
GRACE_S = 5.0
#: The environment variable carrying the parent's pid to the child (see :func:`die_with_parent`).
PARENT_ENV = "GDS_OFFLOAD_PARENT_PID"
#: Set (to ``1``) when the parent lets the child go with a line on its stdin (see :func:`read_spec`).
GO_ENV = "GDS_OFFLOAD_WAIT_FOR_GO"
#: What starts an event line on a child's stdout (the rest of the line is the event as JSON).
EVENT_PREFIX = "@@gds_offload.event "
#: Lines of a child's stderr kept for its failure message.
ERR_TAIL_LINES = 40
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


# ---------------------------------------------------------------------------------------
# the protocol: parent side
# ---------------------------------------------------------------------------------------
#: Specs longer than this travel in a file (``--spec @PATH``): Linux refuses a single argument
#: over 128 KiB (``MAX_ARG_STRLEN``), and a spec may carry a benchmark's micro-batches.
SPEC_ARG_LIMIT = 64 * 1024


def child_command(module: str, spec_json: str, *, python: str | None = None) -> list[str]:
    """``python -m module --spec JSON``: how every benchmark child is started (``--spec @PATH``, a
    private file the child reads and removes, when the JSON is over :data:`SPEC_ARG_LIMIT`)."""
    arg = spec_json
    if len(spec_json) > SPEC_ARG_LIMIT:
        fd, path = tempfile.mkstemp(prefix="gds_offload-spec-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            fh.write(spec_json)
        arg = "@" + path
    return [python or sys.executable, "-m", module, "--spec", arg]


def child_env(extra: Mapping[str, str] | None = None, *, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: ``base`` (default: this process's) with unbuffered output, MKL's
    strict reproducibility unless ``MKL_CBWR`` is set (its CPU kernels can otherwise give
    different last bits in different processes, with or without the offloader), and ``extra``."""
    env = dict(os.environ if base is None else base, PYTHONUNBUFFERED="1")
    env.setdefault("MKL_CBWR", "AUTO,STRICT")
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class ChildRun:
    """A child that has exited: its status, its events, the rest of what it printed, and its memory group's report.

    Attributes:
        returncode: its exit status (negative: the signal that ended it).
        events: what it emitted (:func:`emit`), in order.
        out: the lines of its stdout that were not events.
        err: the last :data:`ERR_TAIL_LINES` lines of its stderr.
        wall_s: seconds from its start to its exit.
        timed_out: killed for running past its timeout.
        cap: its memory group's report (``None``: uncapped).
    """

    returncode: int
    events: list[dict[str, Any]] = field(default_factory=list)
    out: str = ""
    err: str = ""
    wall_s: float = 0.0
    timed_out: bool = False
    timeout_s: float | None = None
    cap: CapReport | None = None

    def last(self, kind: str) -> dict[str, Any] | None:
        """The last event named ``kind`` (``{"event": kind, ...}``), or None."""
        return next((e for e in reversed(self.events) if e.get("event") == kind), None)

    def failure(self, lines: int = 3) -> str:
        """Why the child ended without its result: :func:`exit_reason` and the last ``lines`` lines of its stderr."""
        why = exit_reason(self.returncode, timed_out_after=self.timeout_s if self.timed_out else None, capped=self.cap is not None)
        tail = self.err.strip().splitlines()[-lines:]
        return f"{why}: {' | '.join(tail)}" if tail else why


def exit_reason(returncode: int, *, timed_out_after: float | None = None, capped: bool = False) -> str:
    """One line saying how a child ended. ``SIGKILL`` from nobody here is the kernel's
    out-of-memory killer (or a memory group's limit), nearly always: the line says so."""
    if timed_out_after is not None:
        return f"timed out after {timed_out_after:.0f} s (killed)"
    if returncode == -signal.SIGKILL:
        return "killed by SIGKILL (out of memory" + (" under its memory cap" if capped else "") + "? see `dmesg`)"
    if returncode < 0:
        return f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
    return f"exit code {returncode}"


def run_child(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    memory_limit: int | None = None,
) -> ChildRun:
    """Run ``cmd`` (a child speaking this protocol, or a launcher whose children do) to its end.

    Args:
        cmd: the command, usually :func:`child_command`.
        env: its environment (default: :func:`child_env`).
        timeout_s: kill it after this many seconds.
        on_event: called on this thread with each event as it arrives.
        memory_limit: run it in a :class:`~gds_offload.bench.cgroup.MemoryCap` of this many
            bytes (``None``: uncapped; 0 is refused, never "uncapped"); it is let go only once inside.

    Raises:
        OSError: the command cannot be started.
        ConfigError: the memory cap cannot be had (before the child starts).
    """
    cap = MemoryCap(memory_limit) if memory_limit is not None else None
    env = dict(child_env() if env is None else env)
    if cap is not None:
        env[GO_ENV] = "1"
    t0 = time.perf_counter()
    try:
        proc = spawn(list(cmd), stdin=subprocess.PIPE if cap is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    except BaseException:
        if cap is not None:
            cap.close()
        raise
    err_tail: collections.deque[str] = collections.deque(maxlen=ERR_TAIL_LINES)
    events: list[dict[str, Any]] = []
    out: list[str] = []
    timed_out = threading.Event()
    timer = None
    reader = None
    report = None
    try:
        assert proc.stderr is not None and proc.stdout is not None, "stdout and stderr are pipes"
        reader = threading.Thread(target=err_tail.extend, args=(proc.stderr,), daemon=True)
        reader.start()
        if timeout_s:
            timer = threading.Timer(timeout_s, _kill_on_timeout, (proc, timed_out))
            timer.daemon = True
            timer.start()
        if cap is not None:
            assert proc.stdin is not None, "stdin is a pipe under a cap"
            cap.add(proc.pid)
            proc.stdin.write("go\n")  # inside its group now: let it go
            proc.stdin.close()
        for line in proc.stdout:
            event = parse_event(line)
            if event is None:
                out.append(line)
                continue
            events.append(event)
            if on_event is not None:
                on_event(event)
        proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        reap(proc)  # a no-op once it has exited; on an exception (a stop signal) it stops the child first
        if cap is not None:
            report = cap.close()
    if reader is not None:
        reader.join(timeout=5)
    return ChildRun(proc.returncode, events, "".join(out), "".join(err_tail), time.perf_counter() - t0,
                    timed_out.is_set(), timeout_s, report)  # fmt: skip


def _kill_on_timeout(proc: subprocess.Popen[str], timed_out: threading.Event) -> None:
    """The timer's job in :func:`run_child`: say why the child ends, then end it."""
    timed_out.set()
    proc.kill()


def parse_event(line: str) -> dict[str, Any] | None:
    """The event on one line of a child's stdout, or None when the line is not one."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        event = json.loads(line[len(EVENT_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


# ---------------------------------------------------------------------------------------
# the protocol: child side
# ---------------------------------------------------------------------------------------
def read_spec(argv: Sequence[str] | None, module: str, description: str) -> str:
    """A child's only argument, ``--spec JSON`` (returned as text), read once the child is tied
    to its parent (:func:`die_with_parent`) and, under a memory cap, let go by it."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--spec", required=True, help="the run, as JSON (or @PATH: a file holding it, removed once read)")
    args = parser.parse_args(argv)
    die_with_parent()
    if os.environ.pop(GO_ENV, None):  # not inherited by what this child starts
        sys.stdin.readline()
    if args.spec.startswith("@"):
        path = Path(args.spec[1:])
        text = path.read_text()
        path.unlink(missing_ok=True)
        return text
    return str(args.spec)


def emit(event: Mapping[str, Any]) -> None:
    """Write ``event`` to stdout as one line the parent reads (:data:`EVENT_PREFIX` + JSON)."""
    sys.stdout.write(EVENT_PREFIX + json.dumps(dict(event)) + "\n")
    sys.stdout.flush()
