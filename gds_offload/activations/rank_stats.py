"""The offloader's counters combined over the ranks of a job: ``off.stats(all_ranks=True)``.

:func:`reduce_stats` is a collective over torch.distributed's default process group
(gloo, NCCL, or a mixed ``cpu:gloo,cuda:nccl`` group): every rank must call it, in the
same order relative to its other collectives, or the job hangs. It costs one
``all_gather_object`` (engine names, layer names) and two ``all_reduce`` calls.

How each field combines:

* byte counters, ``stalls``, ``reads_at_unpack``, seconds (I/O busy and wait time), ``resident_bytes``,
  ``spill_file_bytes``, ``write_window_bytes``: summed (totals over the job);
* ``peak_*``: the largest of the ranks' peaks (each rank's peak is at its own moment,
  so this is the worst rank, not the peak of the sum);
* ``steps``: the most steps any rank ran (data-parallel ranks step together), so
  per-step figures (``bytes_offloaded / steps``) are totals per step of the whole job;
* ``ranks``: how many ranks were combined;
* ``engine``, ``engine_reason``, ``gds``: one value when every rank agrees, else
  ``rank<i>: ...`` per rank; ``gds`` only when every rank uses GDS;
* ``layers``: rows with the same name summed (a pipeline stage's layers appear once,
  from the ranks that run them).
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch

from gds_offload.activations.stats import LayerStats, OffloadStats
from gds_offload.errors import ConfigError

__all__ = ["reduce_stats"]

_TEXT = ("engine", "engine_reason", "gds", "layers")
_MAX_FIELDS = ("steps",)
_LAYER_INTS = ("bytes_packed", "bytes_offloaded", "bytes_kept")
_LAYER_FLOATS = ("forward_s", "backward_s")


def _group_device(dist: Any) -> torch.device:
    """Where the default group's collectives take tensors: the CPU for gloo (and MPI), else this rank's GPU."""
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _process_group() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "stats(all_ranks=True) combines every rank's counters over torch.distributed's default process group, "
            "but none is initialised in this process; call torch.distributed.init_process_group() first "
            "(torchrun, srun and accelerate set its environment), or call stats() for this rank's counters"
        )
    return dist


def _agreed(values: list[Any]) -> Any:
    if all(v == values[0] for v in values):
        return values[0]
    return "; ".join(f"rank{i}: {v}" for i, v in enumerate(values))


def reduce_stats(local: OffloadStats) -> OffloadStats:
    """This rank's counters combined with every other rank's (see the module docstring).

    Args:
        local: this rank's :meth:`~gds_offload.Offloader.stats`.

    Returns:
        The combined :class:`~gds_offload.OffloadStats`, the same on every rank.

    Raises:
        ConfigError: no default process group is initialised.
    """
    dist = _process_group()
    world = dist.get_world_size()
    meta: list[Any] = [None] * world
    dist.all_gather_object(meta, (local.engine, local.engine_reason, local.gds, [row.name for row in local.layers]))
    names = list(dict.fromkeys(n for m in meta for n in m[3]))
    rows = {row.name: row for row in local.layers}
    ints = [f.name for f in fields(OffloadStats) if f.name not in _TEXT and f.type in ("int", int) and f.name != "ranks"]
    floats = [f.name for f in fields(OffloadStats) if f.name not in _TEXT and f.type in ("float", float)]
    summed = [n for n in ints if not n.startswith("peak_") and n not in _MAX_FIELDS]
    maxed = [n for n in ints if n.startswith("peak_") or n in _MAX_FIELDS]
    device = _group_device(dist)
    empty = LayerStats("")
    sum_i = [getattr(local, n) for n in summed] + [getattr(rows.get(n, empty), k) for n in names for k in _LAYER_INTS]
    sum_f = [getattr(local, n) for n in floats] + [getattr(rows.get(n, empty), k) for n in names for k in _LAYER_FLOATS]
    t_i = torch.tensor(sum_i, dtype=torch.int64, device=device)
    t_f = torch.tensor(sum_f, dtype=torch.float64, device=device)
    t_m = torch.tensor([getattr(local, n) for n in maxed], dtype=torch.int64, device=device)
    dist.all_reduce(t_i, op=dist.ReduceOp.SUM)
    dist.all_reduce(t_f, op=dist.ReduceOp.SUM)
    dist.all_reduce(t_m, op=dist.ReduceOp.MAX)
    vi, vf, vm = t_i.tolist(), t_f.tolist(), t_m.tolist()
    out: dict[str, Any] = {n: int(v) for n, v in zip(summed, vi)} | {n: float(v) for n, v in zip(floats, vf)}
    out |= {n: int(v) for n, v in zip(maxed, vm)}
    layer_i, layer_f = vi[len(summed):], vf[len(floats):]
    layers = []
    n_i, n_f = len(_LAYER_INTS), len(_LAYER_FLOATS)
    for j, name in enumerate(names):
        packed, offloaded, kept = (int(v) for v in layer_i[j * n_i:(j + 1) * n_i])
        fwd_s, bwd_s = (float(v) for v in layer_f[j * n_f:(j + 1) * n_f])
        layers.append(LayerStats(name, bytes_packed=packed, bytes_offloaded=offloaded, bytes_kept=kept,
                                 forward_s=fwd_s, backward_s=bwd_s))
    return replace(
        local,
        **out,
        ranks=world,
        engine=_agreed([m[0] for m in meta]),
        engine_reason=_agreed([m[1] for m in meta]),
        gds=all(m[2] for m in meta),
        layers=layers,
    )
