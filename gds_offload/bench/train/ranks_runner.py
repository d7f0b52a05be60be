"""One benchmark mode on N data-parallel ranks: ``gds-offload bench --nproc N``.

The parent (:func:`run_ranked`) starts ``N`` ranks of this module through torchrun
(:func:`~gds_offload.bench.train.torchrun.torchrun_command`, tied to the parent so that no rank
outlives it) and reads rank 0's events as :func:`~gds_offload.bench.train.runner.run_mode` reads a
one-process child's. Each rank (:func:`main`) joins the default process group (gloo on the
CPU, NCCL with one GPU per local rank), then runs the mode exactly as the one-process child
does (:func:`~gds_offload.bench.train.runner.run_here`: the same warm-up, timing, memory peak and
loss record), on the model wrapped in ``DistributedDataParallel`` (:func:`ddp_workload`):
step ``i`` of rank ``r`` trains on batch ``i * N + r`` of the one-process run's sequence, of
the same per-rank size. Offload modes ``attach`` on each rank, into its own spill directory
(``--path`` as a ``{local_rank}`` template, ``auto``, or by default ``<default>/rank<r>``).

Rank 0 gathers every rank's :class:`~gds_offload.bench.train.runner.RunResult` and emits them (a
``ranks`` event), then the job's row (:func:`combine_ranks`). A rank that fails emits a
``rank_error`` event naming itself before it exits; torchrun then stops the others, and the
parent's row says which rank failed first, and why, then what the others reported.
"""
from __future__ import annotations

import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from gds_offload.activations.spill.ranks import rank_env
from gds_offload.bench.procs import emit
from gds_offload.bench.train.child import child_spec, run_here
from gds_offload.bench.train.runner import run_mode
from gds_offload.bench.train.spec import RunResult, RunSpec, Unavailable
from gds_offload.bench.train.torchrun import torchrun_command
from gds_offload.bench.train.workload import Workload, build_workload

__all__ = ["RankedResult", "combine_ranks", "ddp_workload", "run_ranked", "main"]

#: Exit code of a rank on which the mode cannot run (``status="unavailable"``).
UNAVAILABLE_EXIT = 3


@dataclass
class RankedResult(RunResult):
    """A :class:`~gds_offload.bench.train.runner.RunResult` of a run on ``nproc`` processes.

    With ``nproc`` above 1 (:func:`combine_ranks`): ``step_s`` are the job's step
    times, each the slowest rank's; ``peak_activation_bytes`` the largest rank's;
    ``losses``, ``offload`` and the rest rank 0's; ``params_digest`` the ranks' digests,
    comma-separated where they differ. ``ranks`` holds every rank's own result.
    """

    nproc: int = 1
    ranks: list[dict[str, Any]] = field(default_factory=list)


def ddp_workload(spec: RunSpec, rank: int, world: int) -> Workload:
    """``spec``'s model in ``DistributedDataParallel``; this rank's step ``i`` trains on batch ``i * world + rank``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    wl = build_workload(spec)
    ids = [torch.device(spec.device).index] if spec.device.startswith("cuda") else None
    ddp = DistributedDataParallel(wl.model, device_ids=ids)
    return Workload(ddp, lambda i: wl.batch_fn(i * world + rank), wl.loss_fn)


def combine_ranks(results: list[RunResult]) -> RunResult:
    """The job's row from every rank's result (rank order); see :class:`RankedResult`.

    A step of data-parallel training ends when its slowest rank's does (the gradient
    all-reduce waits for every rank), so each step's time is the largest over the ranks.
    """
    first = results[0]
    steps = [max(col) for col in zip(*(r.step_s for r in results))]
    paused = [max(col) for col in zip(*(r.paired_keep_s for r in results))]
    peaks = [r.peak_activation_bytes for r in results]
    median = statistics.median(steps) if steps else None
    return replace(
        first,
        step_s=steps,
        paired_keep_s=paused,
        median_step_s=median,
        tokens_per_s=first.tokens_per_step / median if median else None,
        peak_activation_bytes=None if None in peaks else max(p for p in peaks if p is not None),
        params_digest=",".join(dict.fromkeys(r.params_digest for r in results)),
    )


def run_ranked(spec: RunSpec, nproc: int, *, on_event: Any = None, timeout_s: float | None = None) -> RankedResult:
    """Run ``spec`` on ``nproc`` ranks under torchrun; never raises for a failing rank (an
    ``error`` or ``unavailable`` row naming the ranks that failed, as reported by them)."""
    gathered: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []

    def seen(ev: dict[str, Any]) -> None:
        if ev.get("event") == "ranks":
            gathered.extend(ev["ranks"])
        elif ev.get("event") == "rank_error":
            failures.append(ev)
        elif on_event is not None:
            on_event(ev)

    argv = torchrun_command(nproc, "gds_offload.bench.train.ranks_runner", ["--spec", spec.to_json()], owned=True)
    row = run_mode(spec, on_event=seen, timeout_s=timeout_s, argv=argv)
    out = RankedResult(**asdict(row), nproc=nproc, ranks=gathered)
    if out.status != "ok" and failures:
        # The first rank to fail is the cause; the others mostly fail on it (a peer's closed connection).
        failures.sort(key=lambda ev: float(ev.get("time", 0)))
        out.status = "unavailable" if all(ev.get("status") == "unavailable" for ev in failures) else "error"
        first, *then = failures
        out.error = f"rank {first.get('rank')}: {first.get('error')}" + "".join(
            f"; then rank {ev.get('rank')}: {str(ev.get('error'))[:160]}" for ev in then)
    return out


def main(argv: list[str] | None = None) -> int:
    """One rank (started by :func:`run_ranked` under torchrun): run the ``--spec`` under DDP."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401 - before init_process_group: see examples/torchrun_ddp.py

    spec = child_spec(argv, "gds_offload.bench.train.ranks_runner", __doc__.splitlines()[0])
    cuda = spec.device.startswith("cuda")
    if cuda:  # one GPU per local rank
        torch.cuda.set_device(rank_env().local_rank or 0)
        spec = replace(spec, device=f"cuda:{torch.cuda.current_device()}")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = replace(spec, progress=spec.progress and rank == 0)  # one rank's progress is the job's
    try:
        mine = run_here(spec, emit if rank == 0 else lambda _ev: None, lambda s: ddp_workload(s, rank, world))
    except BaseException as exc:
        # torchrun stops the other ranks when this one exits: say first which rank failed, and why.
        if not isinstance(exc, (Unavailable, KeyboardInterrupt, SystemExit)):
            traceback.print_exc()
        status = "unavailable" if isinstance(exc, Unavailable) else "error"
        why = f"unavailable: {exc}" if status == "unavailable" else f"{type(exc).__name__}: {exc}"
        emit({"event": "rank_error", "rank": rank, "status": status, "error": why, "time": time.time()})
        return UNAVAILABLE_EXIT if status == "unavailable" else 1
    results: list[Any] = [None] * world
    dist.all_gather_object(results, mine.as_dict())
    if rank == 0:
        known = {f.name for f in fields(RunResult)}
        ranks = [RunResult(**{k: v for k, v in r.items() if k in known}) for r in results]
        emit({"event": "ranks", "ranks": results})
        emit({"event": "result", **combine_ranks(ranks).as_dict()})
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
