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

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from gds_offload.bench import procs
from gds_offload.bench.procs import child_command, child_env
from gds_offload.bench.train.spec import RunResult, RunSpec

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
    cmd = argv or child_command("gds_offload.bench.train.child", spec.to_json(), python=python)
    env = child_env()  # MKL_CBWR: see the module doc (bit-identical across processes)
    if spec.device.startswith("cuda"):
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if spec.measure_memory and not spec.device.startswith("cuda"):
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)

    def progress(event: dict[str, Any]) -> None:
        if on_event is not None and event.get("event") != "result":
            on_event(event)

    try:
        run = procs.run_child(cmd, env=env, timeout_s=timeout_s, on_event=progress)
    except OSError as exc:
        return RunResult(spec.mode, "error", f"cannot start {cmd[0]}: {exc}", spec.model, spec.device)
    result = run.last("result")
    if result is not None:
        result.pop("event", None)
        out = RunResult(**{k: v for k, v in result.items() if k in {f.name for f in fields(RunResult)}})
        out.returncode, out.wall_s = run.returncode, run.wall_s
        return out
    return RunResult(spec.mode, "error", run.failure(), spec.model, spec.device, spec.tokens_per_step, wall_s=run.wall_s,
                     returncode=run.returncode)  # fmt: skip
