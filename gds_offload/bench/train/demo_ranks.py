"""``gds-offload demo --nproc N``: the demo on N data-parallel ranks, launched through torchrun.

:func:`launch` re-runs the same demo options as ``python -m torch.distributed.run
--nproc-per-node N --standalone -m gds_offload.commands.demo_ranks ...``; each rank then
(:func:`main`) trains the demo model wrapped in ``DistributedDataParallel`` (NCCL on GPUs,
one per local rank; gloo on the CPU), first without the offloader, then with
``attach(model)`` (each rank spills to its own directory: ``--path`` may be a
``{local_rank}`` template or ``auto``; by default ``<default>/rank<rank>``), the same
weights and the same batches (each rank its own). Rank 0 prints every rank's counters
combined (``stats(all_ranks=True)``), the step times, and whether every loss and the final
parameters on every rank are bit-identical to the run without the offloader (exit code 1
when not).

Unlike the one-process demo, both runs share each rank's process, so no peak memory is
measured from outside: the summary shows the offloader's own peak resident bytes (the
largest rank's) against the bytes it saved per step.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import gds_offload
from gds_offload.activations.spill.ranks import rank_env
from gds_offload.bench.train.child import child_spec
from gds_offload.bench.train.spec import attach_kwargs, parse_mode
from gds_offload.bench.train.workload import build_workload
from gds_offload.units import format_bytes

__all__ = ["main"]


def _train(work: Any, spec: Any, rank: int, world: int, attach_kw: dict[str, Any] | None) -> tuple[list[Any], list[float], list[Any], Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = work.model
    off = gds_offload.attach(model, **attach_kw) if attach_kw is not None else None
    ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if spec.device.startswith("cuda") else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    losses, times = [], []
    for step in range(spec.warmup + spec.steps):
        torch.manual_seed(spec.seed + 1000 * step + rank)  # dropout masks: the same in both runs
        t0 = time.perf_counter()
        loss = work.loss_fn(ddp, work.batch_fn(step * world + rank))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if spec.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach().clone())
        if rank == 0:
            print(f"{'offload' if off else 'keep'} step {step + 1}/{spec.warmup + spec.steps}: loss {loss.item():.6f}, "
                  f"{times[-1]:.2f} s", flush=True)
    stats = None
    if off is not None:
        stats = off.stats(all_ranks=True)  # a collective: every rank calls it here
        off.detach()
    return losses, times[spec.warmup:], [p.detach().clone() for p in model.parameters()], stats


def _summary(stats: Any, keep_s: float, off_s: float, exact: bool, world: int) -> Any:
    from rich.table import Table

    steps = max(1, stats.steps)
    table = Table(title=f"demo summary, all {stats.ranks} ranks (world size {world})")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("median step time, keep / offload (rank 0)", f"{keep_s:.3f} s / {off_s:.3f} s ({off_s / keep_s:.2f}x)")
    for name in ("bytes_packed", "bytes_offloaded", "bytes_deduplicated", "bytes_read", "bytes_kept", "bytes_fallback"):
        table.add_row(f"{name.removeprefix('bytes_')} per step, all ranks", format_bytes(getattr(stats, name) / steps))
    table.add_row("offloader peak resident (largest rank)", format_bytes(stats.peak_resident_bytes))
    table.add_row("I/O wait per step, all ranks", f"{stats.io_wait_s / steps:.3f} s")
    table.add_row("engine", f"{stats.engine} ({'GDS' if stats.gds else 'no GDS'})")
    table.add_row("losses and parameters bit-identical on every rank", "[green]yes[/]" if exact else "[red]NO[/]")
    return table


def main(argv: list[str] | None = None) -> int:
    """One rank of the demo (started by ``gds-offload demo --nproc N`` under torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401 - before init_process_group: see examples/torchrun_ddp.py
    from rich.console import Console

    spec = child_spec(argv, "gds_offload.bench.train.demo_ranks", __doc__.splitlines()[0])
    launched = rank_env()
    device = spec.device
    if device.startswith("cuda"):
        torch.cuda.set_device(launched.local_rank or 0)
        device = f"cuda:{torch.cuda.current_device()}"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, launched.local_world_size or 1)))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = replace(spec, device=device)
    _, engine = parse_mode(spec.mode)
    attach_kw = attach_kwargs(spec, engine or "auto", spec.policy)
    keep = _train(build_workload(spec), spec, rank, world, None)
    off = _train(build_workload(spec), spec, rank, world, attach_kw)
    same = all(torch.equal(a, b) for a, b in zip(keep[0], off[0])) and all(torch.equal(a, b) for a, b in zip(keep[2], off[2]))
    flag = torch.tensor([int(same)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    exact = bool(flag.item())
    if rank == 0:
        console = Console() if Console().is_terminal else Console(width=120)
        console.print(_summary(off[3], statistics.median(keep[1]), statistics.median(off[1]), exact, world))
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
