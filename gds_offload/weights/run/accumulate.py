"""Gradient accumulation, layer-major: :func:`accumulate`.

``accumulate(lm, batches)`` does what ordinary accumulation does::

    for batch in batches:
        loss(model(**batch), batch).backward()

with ``per_load`` micro-batches sharing each weight load (:mod:`gds_offload.weights.streaming.team`): their
forwards go up the streamed layers together and their backwards come down together, so each
layer is read once per round of micro-batches in each direction instead of once per micro-batch.
Gradients reach ``.grad`` in the same order, micro-batch by micro-batch, so adapters, losses and
every gradient are ``torch.equal`` to the loop above on the same micro-batches. Random numbers
(dropout): micro-batch ``j`` draws what it would after ``torch.manual_seed(seed + j)``, so the
reference loop seeds each micro-batch the same way (with dropout off, any seed gives the loop's
own result). Activations may be offloaded too: ``gds_offload.attach(lm.model)`` composes. A wave
of one micro-batch shares nothing, so it runs as the loop above does, on the calling thread.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gds_offload.errors import ConfigError
from gds_offload.units import checked_int

if TYPE_CHECKING:
    from gds_offload.weights.run.handle import StreamedHandle

__all__ = ["accumulate"]

Loss = Callable[[Any, Mapping[str, Any]], torch.Tensor]


def accumulate(
    lm: StreamedHandle,
    batches: Sequence[Mapping[str, Any]],
    *,
    per_load: int | None = None,
    loss: Loss | None = None,
    seed: int | None = None,
) -> list[torch.Tensor]:
    """Forward and backward of every micro-batch in ``batches`` (keyword arguments of the model),
    ``per_load`` of them per weight load (default: all); their losses, detached, in order.

    Args:
        loss: ``loss(output, batch) -> scalar`` (default: ``output.loss``, a Hugging Face model
            given ``labels``); divide by the number of micro-batches there if you want a mean.
        seed: micro-batch ``j`` draws random numbers as after ``torch.manual_seed(seed + j)``
            (default: a base seed drawn from torch's generator).

    Raises:
        ConfigError: no batches, a batch that is not a mapping, a bad ``per_load``, grad mode off.
    """
    if not batches:
        raise ConfigError("batches=[]: give at least one micro-batch (a dict of the model's keyword arguments)")
    for j, b in enumerate(batches):
        if not isinstance(b, Mapping):
            raise ConfigError(f"batches[{j}] is a {type(b).__name__}; give each micro-batch as a dict of the model's keyword arguments")
    n = len(batches) if per_load is None else checked_int("per_load", per_load, low=1, what="micro-batches sharing each weight load")
    if not torch.is_grad_enabled():
        raise ConfigError("accumulate runs backward; call it with grad mode on (not under torch.no_grad())")
    base = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed
    model = lm.model
    losses: list[torch.Tensor] = []
    for start in range(0, len(batches), n):
        wave = batches[start : start + n]
        if len(wave) == 1:  # nothing to share a load with: the ordinary pass, on this thread
            losses.append(_alone(model, wave[0], loss, base + start))
            continue
        calls = [functools.partial(_step, model, b, loss) for b in wave]
        losses.extend(lm.run_team(calls, seeds=[base + start + j for j in range(len(wave))]))
    return losses


def _alone(model: Any, batch: Mapping[str, Any], loss: Loss | None, seed: int) -> torch.Tensor:
    """:func:`_step` drawing what it would after ``torch.manual_seed(seed)``; the caller's random state is kept."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        torch.manual_seed(seed)
        return _step(model, batch, loss)


def _step(model: Any, batch: Mapping[str, Any], loss: Loss | None) -> torch.Tensor:
    out = model(**batch)
    value = out.loss if loss is None else loss(out, batch)
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise ConfigError(f"the loss must be a scalar tensor, got {type(value).__name__}; pass loss=... or give the batch labels")
    value.backward()
    return value.detach()
