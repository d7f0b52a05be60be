"""What a layer's KV cache on the drive adds to its forward, measured for the planner
(:func:`~gds_offload.weights.run.profile.profile_generate` calls it).

With ``kv="drive"`` each layer's attention reads its past back from the drive (:class:`KVPool`,
read ahead while the layer before computes), concatenates the new positions onto it and writes
them out. Priced as drive bandwidth alone, hidden behind compute, this came to nothing; measured
on a 40-layer Granite shape, decode steps on the drive took 1.5x their in-memory time per layer
(buffers allocated per read and write, the records unpacked and packed, the engine's threads
beside the compute on two cores), and a plan on the drive ran at 0.82x its prediction where the
same plan with its caches in memory ran within 3%.

So the profile times it: for a few micro-batch sizes, one decode step of the second streamed layer
(its past read while the first computes, as in a run) on a cache in a real :class:`KVPool`, and the
same step on a cache in memory. The difference, against the bytes the layer's cache moves in that
step, is :attr:`~gds_offload.weights.planning.workload.Profile.kv_drive`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from gds_offload.errors import ConfigError
from gds_offload.io.directory import spill_dir_origin
from gds_offload.weights.run.generation import cache_argument
from gds_offload.weights.run.kv import KVPool, kv_shape

__all__ = ["time_kv_on_drive"]

LayerTimes = Callable[[Callable[[], Any]], list[float]]
Settle = Callable[[Callable[[], tuple[float, int]], str], tuple[float, int]]


def time_kv_on_drive(lm: Any, cfg: Any, dtype: torch.dtype, *, sizes: list[int], ctx: int, vocab: int, layer_times: LayerTimes,
                     random_cache: Callable[[int, int], Any], settle: Settle, max_runs: int) -> list[tuple[float, float]]:  # fmt: skip
    """``(bytes, seconds)`` for each micro-batch size ``b`` in ``sizes``: the bytes one decode step of
    one layer moves with its cache on the drive (``b x (ctx + 1)`` positions of keys and values,
    per sequence as :attr:`~gds_offload.weights.planning.workload.Profile.kv_record_nbytes` counts
    them: the past read, the new position written) and the seconds that layer's forward takes
    beyond the same step on a cache of ``ctx`` positions in memory (never below 0).

    ``layer_times(call)`` runs ``call`` (a forward that stops after the first two streamed layers)
    and returns each layer's compute seconds; ``random_cache(b, ctx)`` is a cache in memory;
    ``settle(run, what)`` times ``run`` until its fastest runs agree (at most ``max_runs`` runs).
    ``[]`` when the model's caches cannot go to the drive (sliding-window layers: ``kv_shape``
    refuses them, and so does the planner).
    """
    model, device = lm.model, lm.device
    out: list[tuple[float, float]] = []
    for b in sizes:
        try:
            shape = kv_shape(model.config, batch=b, max_positions=ctx + 2 * max_runs + 4, dtype=dtype)
        except ConfigError:
            return []
        ids = torch.randint(0, vocab, (b, 1), device=device)

        def in_memory(b: int = b, ids: torch.Tensor = ids) -> tuple[float, int]:
            mask = torch.ones(b, ctx + 1, dtype=torch.long, device=device)
            call = functools.partial(model, ids, attention_mask=mask, use_cache=True, **{cache_argument(): random_cache(b, ctx)})
            return layer_times(call)[1], 0

        pool = KVPool([shape], engine=lm.kv_engine(), directory=spill_dir_origin()[0], device=device)
        try:
            cache = pool.cache(0)
            past = torch.randint(0, vocab, (b, ctx), device=device)
            layer_times(functools.partial(model, past, attention_mask=torch.ones_like(past), use_cache=True, **{cache_argument(): cache}))

            def on_drive(b: int = b, ids: torch.Tensor = ids, cache: Any = cache) -> tuple[float, int]:
                mask = torch.ones(b, cache.get_seq_length() + 1, dtype=torch.long, device=device)
                return layer_times(functools.partial(model, ids, attention_mask=mask, use_cache=True, **{cache_argument(): cache}))[1], 0

            on_drive()  # warm-up: the engine's first reads and writes
            drive = settle(on_drive, f"decode of {b} on {ctx} cached on the drive")[0]
        finally:
            pool.close()
        in_memory()
        memory = settle(in_memory, f"decode of {b} on {ctx} cached in memory (layer 2)")[0]
        out.append((float((ctx + 1) * shape.position_nbytes), max(drive - memory, 0.0)))
    return out
