"""Run one benchmark mode in a child process, and read back what it measured.

Each mode runs in its own process (``python -m gds_offload.bench.train.child --spec JSON``,
:mod:`gds_offload.bench.train.child`) so that its memory peak is its own: nothing another mode
allocated, cached or leaked can raise or hide it. The parent (:func:`run_mode`) reads the
child's progress as JSON lines on its stdout and gets back a
:class:`~gds_offload.bench.train.spec.RunResult`; a child that fails, is killed (out of memory)
or times out becomes a result with ``status="error"``, never an exception in the parent.
What a run is and the mode names: :mod:`gds_offload.bench.train.spec`; the models it trains:
:mod:`gds_offload.bench.train.workload`.

.. note:: The allocator setting costs time
   Returning every large block makes each step fault its pages in again: every mode's
   steps take longer than with glibc's defaults, alike, so the ratios between modes hold.
   ``RunSpec(measure_memory=False)`` (``--no-memory``) runs with the defaults and reports
   no memory peak. It cannot be switched inside one process: once glibc's heap holds large
   free blocks it serves later requests from them whatever the threshold (``mallopt`` plus
   ``malloc_trim`` after the warm-up leaves a higher peak).

.. note:: Bit-identical across processes
   Children run with ``MKL_CBWR=AUTO,STRICT`` (unless the environment sets ``MKL_CBWR``):
   MKL's conditional numerical reproducibility, strict mode. Without it, MKL's CPU kernels
   can give different last bits in different processes, with or without the offloader. It
   does not remove every difference (``recompute`` rows, which use no offloader, can still
   differ in the last bits of the last step). So the rest is torch's or MKL's, and
   ``gds-offload demo`` re-checks in one process
   (:func:`~gds_offload.bench.train.child.exact_in_process`) before it blames the offloader.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from gds_offload.bench.procs import reap, spawn
from gds_offload.bench.train.spec import EVENT_PREFIX, RunResult, RunSpec

__all__ = ["run_mode"]


def run_mode(
    spec: RunSpec,
    *,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    timeout_s: float | None = None,
    python: str | None = None,
    argv: list[str] | None = None,
) -> RunResult:
    """Run ``spec`` in a child process and return what it measured. Never raises for a
    failing child: a crash, a kill (out of memory) or a timeout is a ``status="error"`` row.

    Args:
        spec: the run.
        on_event: called on this thread with each progress event (``{"event": "setup"|"step", ...}``).
        timeout_s: kill the child after this many seconds.
        python: the interpreter (default: this one).
        argv: the command to start instead of this module's child: a launcher whose children
            emit the same events (``bench --nproc``: torchrun, see :mod:`gds_offload.bench.train.ranks_runner`).
    """
    cmd = argv or [python or sys.executable, "-m", "gds_offload.bench.train.child", "--spec", spec.to_json()]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("MKL_CBWR", "AUTO,STRICT")  # see the module doc: bit-identical across processes
    if spec.measure_memory and not spec.device.startswith("cuda"):
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if spec.device.startswith("cuda"):
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    t0 = time.perf_counter()
    try:
        proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    except OSError as exc:
        return RunResult(spec.mode, "error", f"cannot start {cmd[0]}: {exc}", spec.model, spec.device)
    timer = None
    try:
        err_tail: collections.deque[str] = collections.deque(maxlen=40)
        assert proc.stderr is not None, "stderr is a pipe"
        reader = threading.Thread(target=err_tail.extend, args=(proc.stderr,), daemon=True)
        reader.start()
        timed_out = threading.Event()
        if timeout_s:
            timer = threading.Timer(timeout_s, _kill_on_timeout, (proc, timed_out))
            timer.daemon = True
            timer.start()
        result = _read_events(proc, on_event)
        rc = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        reap(proc)  # a no-op after wait(); on an exception (a stop signal) it stops the child first
    reader.join(timeout=5)
    wall = time.perf_counter() - t0
    if result is not None:
        result.pop("event", None)
        out = RunResult(**{k: v for k, v in result.items() if k in {f.name for f in fields(RunResult)}})
        out.returncode, out.wall_s = rc, wall
        return out
    if timed_out.is_set():
        why = f"timed out after {timeout_s:.0f} s (killed)"
    elif rc == -9:
        why = "killed by SIGKILL (out of memory? see `dmesg`)"
    elif rc < 0:
        why = f"killed by signal {-rc}"
    else:
        why = f"exit code {rc}"
    tail = "".join(err_tail).strip().splitlines()[-3:]
    detail = f"{why}: {' | '.join(tail)}" if tail else why
    return RunResult(spec.mode, "error", detail, spec.model, spec.device, spec.tokens_per_step, wall_s=wall, returncode=rc)


def _kill_on_timeout(proc: subprocess.Popen[str], timed_out: threading.Event) -> None:
    """The timer's job in :func:`run_mode`: say why the child ends, then end it."""
    timed_out.set()
    proc.kill()


def _read_events(proc: subprocess.Popen[str], on_event: Callable[[dict[str, Any]], None] | None) -> dict[str, Any] | None:
    """Pass the child's progress events to ``on_event`` until its stdout ends; return its result event."""
    result: dict[str, Any] | None = None
    assert proc.stdout is not None, "stdout is a pipe"
    for line in proc.stdout:
        if not line.startswith(EVENT_PREFIX):
            continue
        try:
            event = json.loads(line[len(EVENT_PREFIX) :])
        except json.JSONDecodeError:
            continue
        if event.get("event") == "result":
            result = event
        elif on_event is not None:
            on_event(event)
    return result
