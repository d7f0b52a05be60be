"""``attach(model)``: checks what it is given, then puts an :class:`Offloader` on the model.

:func:`attach` refuses what the offloader cannot serve before an engine starts or a spill
file exists: not a module, a ``torch.compile``'d or TorchScript module, a model without
parameters or with an offloader attached already, ``layers=`` that is not a list. It
resolves this rank's spill path (:func:`~gds_offload.activations.spill.ranks.rank_path`), builds the
:class:`~gds_offload.activations.config.OffloadConfig` (which checks every other argument), and returns
the :class:`Offloader` (:mod:`gds_offload.activations.offloader`: its hooks, per-thread forward state and
ownership rules). :func:`offloader_of` finds the offloader attached to a model.

The package's ``attach``, ``offloader_of`` and ``Offloader`` are imported from here.
"""
from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gds_offload.activations.config import DEFAULT_MIN_BYTES, OffloadConfig, OnError
from gds_offload.activations.layers import resolve_layers
from gds_offload.activations.offloader import Offloader
from gds_offload.activations.planning.policy import Budget
from gds_offload.activations.spill.ranks import PerRank, rank_path
from gds_offload.errors import ConfigError

__all__ = ["attach", "offloader_of", "Offloader"]


def attach(
    model: nn.Module,
    *,
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | PerRank | None = None,
    mode: str = "auto",
    policy: str | Budget = "all",
    budget: int | str | None = None,
    min_bytes: int | str = DEFAULT_MIN_BYTES,
    keep_last: int = 1,
    layers: Sequence[nn.Module | str] | None = None,
    prefetch_bytes: int | str | None = None,
    max_bandwidth: float | str | None = None,
    on_error: OnError = "fallback",
    num_threads: int | None = None,
    verify: bool = False,
    write_window: int | str | None = None,
) -> Offloader:
    """Offload the activations ``model`` saves for backward to NVMe (or host memory).

    Args:
        model: any ``nn.Module``. Its repeated blocks (``ModuleList``/``Sequential`` of one
            type) are found automatically; override with ``layers``.
        path: spill directory, or a list of them (one per drive; tensors are striped); one
            that does not exist is created (0700, parents as needed). Default:
            ``$GDS_OFFLOAD_DIR``, else ``<tmp>/gds_offload-<uid>``, which must belong to you.
            Every directory passes :func:`~gds_offload.io.directory.check_dir` (as in ``gds-check``).
            Per rank (:mod:`gds_offload.activations.spill.ranks`): ``{rank}``/``{local_rank}`` templates,
            :func:`~gds_offload.per_rank`, ``"auto"`` (the NVMe drive closest to the GPU);
            under torchrun/SLURM the default becomes ``<default>/rank<rank>``.
        mode: ``auto`` (GDS where usable, else KvikIO compat, else POSIX), ``gds``,
            ``compat``, ``posix`` or ``host``.
        policy: ``all``: offload every eligible tensor outside the last ``keep_last`` layers;
            ``adaptive``: measure a step, then offload the most that the drive can hide
            behind compute; a :class:`~gds_offload.activations.planning.policy.Budget`: keep peak activation
            memory under a target with the least I/O.
        budget: shorthand for ``policy=Budget(budget)`` (``"40GiB"``).
        min_bytes: storages smaller than this stay in memory (int or ``"1MiB"``).
        keep_last: number of last layer calls whose activations stay in memory
            (backward needs them first).
        layers: the blocks to plan by, as modules or qualified names.
        prefetch_bytes: bytes read ahead of the tensor backward unpacks, tensor by tensor in
            the reverse of the order forward saved them (at least one tensor; ``0``: each read
            starts when backward needs it). Default: a sixteenth of the largest layer's
            offloaded bytes, at most 256 MiB (``adaptive`` reads whole layers ahead instead
            when the drive needs more time).
        max_bandwidth: cap the engine at this many bytes/s (``"200MB/s"``): imitate a slow
            drive, or leave bandwidth to other jobs.
        on_error: when a write fails (drive full, I/O error): ``fallback`` keeps the tensor
            in memory and warns once; ``raise`` raises :class:`OffloadError` at the next hook.
        num_threads: I/O threads of the engine (default: the engine's measured default).
        verify: checksum (xxh3-64) every spill slot after its write and check it after each
            read; a mismatch raises :class:`OffloadError` naming the layer, tensor, file and
            offset. Off by default: without it, bytes changed on disk go undetected
            (see :mod:`gds_offload.io.integrity`).
        write_window: most bytes that writes in flight may hold in memory (int or ``"512MiB"``);
            when it is full, the pack hook waits for writes to finish (``stats().write_wait_s``).
            Default: twice the largest layer's offloaded bytes, at least 64 MiB. This bounds
            memory when the drive is slower than forward produces activations.

    Memory bound, from the first step on, however slow the drive: the saved activations the
    offloader holds in memory at once (``stats().peak_resident_bytes``) are at most
    ``K + max(W, L) + L + max(P, L)`` per backward pass running, until ``detach()``:

    * ``K``: what it keeps, never written (the last ``keep_last`` layer calls, storages under
      ``min_bytes``, units the policy keeps, failed writes): ``stats().peak_kept_bytes``;
    * ``W``: ``write_window``; writes in flight hold at most ``max(W, L)``;
    * ``L``: the largest layer's offloaded bytes in one forward; ``P``: ``prefetch_bytes``;
      reads hold at most ``L + max(P, L)``: the layer in backward and what is read ahead of it.

    With the defaults (``W = max(64 MiB, 2L)``, ``P = L/16``) that is ``K + W + 2L``. Reading by
    bytes (every policy but an ``adaptive`` plan that reads whole layers ahead), reads hold much
    less: the tensors backward is using, plus at most ``max(P, E)`` read ahead (``E``: the
    largest saved storage; none with ``prefetch_bytes=0``), and each read's buffer is freed when
    autograd is done with it. Reading whole layers, the ``posix`` and ``compat`` engines keep
    host read buffers freed by autograd for the reads still to come in that backward, never
    more than those reads' bytes (:meth:`~gds_offload.io.base.Engine.trim`): none is idle once
    backward has nothing left to read, where the gradients peak, nor through the next forward.
    ``stats()`` counts them (``peak_read_buffer_bytes``, ``idle_buffer_bytes``) and says what it
    leaves out (:class:`~gds_offload.activations.stats.OffloadStats`).

    Returns:
        The :class:`Offloader`; also a context manager that detaches on exit.

    Raises:
        ConfigError: bad arguments (the message names the argument and the fix).
        GDSUnavailableError: ``mode="gds"`` where GPUDirect Storage does not work.
    """
    _check_model(model)
    if _is_path_spec(path):  # anything else is refused by OffloadConfig.from_kwargs, with its own message
        path = rank_path(path, model=model)  # this rank's directories under torchrun/SLURM (gds_offload/activations/spill/ranks.py)
    config = OffloadConfig.from_kwargs(
        path=path, mode=mode, policy=policy, budget=budget, min_bytes=min_bytes, keep_last=keep_last,
        prefetch_bytes=prefetch_bytes, max_bandwidth=max_bandwidth, on_error=on_error, num_threads=num_threads,
        verify=verify, write_window=write_window,
    )
    return Offloader(model, config, resolve_layers(model, _checked_layers(layers)))


def offloader_of(model: nn.Module) -> Offloader | None:
    """The offloader attached to ``model`` now; ``None`` when none is (never attached, or detached)."""
    ref = getattr(model, "_gds_offloader", None)
    owner = ref() if isinstance(ref, weakref.ref) else None
    return owner if owner is not None and owner.attached else None


def _is_path_spec(path: Any) -> bool:
    """Whether ``path`` has a shape :func:`~gds_offload.activations.spill.ranks.rank_path` resolves (None, a
    directory, a list of them, :func:`~gds_offload.per_rank`)."""
    if path is None or isinstance(path, (str, os.PathLike, PerRank, dict)):  # a dict: rank_path points to per_rank
        return True
    return isinstance(path, (list, tuple)) and all(isinstance(p, (str, os.PathLike)) for p in path)


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise ConfigError(
            "attach() got a torch.compile'd module; saved-tensor hooks do not run inside compiled graphs. "
            "Attach to the uncompiled model (model._orig_mod), or compile only submodules inside its layers"
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise ConfigError(
            f"attach() got a TorchScript module ({type(model).__name__}, from torch.jit.script or torch.jit.trace); "
            "TorchScript runs forward as one graph, so the per-layer hooks the offloader plans by cannot be "
            "registered (script) or never run (trace). Offload the eager model: attach to the eager module, "
            "before scripting or tracing it"
        )
    if offloader_of(model) is not None:
        raise ConfigError("an offloader is already attached to this model; call .detach() on it first")
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"{type(model).__name__} has no parameters; attach() offloads activations of a trained model")


def _checked_layers(layers: Any) -> Any:
    """``layers=`` must be a sequence of modules or names, not one string (or other iterable)."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes, nn.Module)):
        kind = "a module" if isinstance(layers, nn.Module) else f"a {type(layers).__name__}"
        raise ConfigError(
            f"layers={layers!r} is {kind}, not a list; pass a list of modules or qualified names, e.g. "
            f"layers=[{layers!r}]" if isinstance(layers, str) else
            f"layers={type(layers).__name__} is {kind}, not a list; pass a list of modules or qualified names, "
            f"e.g. layers=list(model.blocks)"
        )
    if not isinstance(layers, Sequence):
        raise ConfigError(
            f"layers={layers!r} ({type(layers).__name__}) is not a list; pass a list of modules or qualified names"
        )
    return layers

