"""Hugging Face gradient checkpointing on streamed layers: the recompute binds the layer's weights.

A checkpointed Hugging Face layer (``GradientCheckpointingLayer``) runs, inside its forward,
``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)``; backward
recomputes by calling that ``partial``: the layer's forward *without* its module hooks, so
without the pre-hook that puts a streamed layer's weights in place (they are meta tensors
then). :meth:`Recompute.wrap` wraps the layer's ``_gradient_checkpointing_func`` so that the
function it checkpoints, when it finds the layer not bound (the recompute, on the backward
thread), binds it first and releases it after.

During a recompute the saved-tensor hooks of :class:`~gds_offload.weights.streaming.backward.SavedWeights`
*clone* the slot's views and hand every tensor on to the checkpoint's own hooks below: the
checkpoint matches what the recompute saves with what the original forward saved, one for
one, and a clone stays valid after the slot is refilled. The clones live until the
checkpoint's backward of the layer frees them.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from gds_offload.runtime.interrupts import held

__all__ = ["Recompute"]


class Recompute:
    """The wrappers one :class:`~gds_offload.weights.run.model.StreamedModel` put on checkpointed layers.

    Args:
        bind: ``bind(pos, module) -> bool``: put streamed layer ``pos`` in place for a recompute;
            ``False`` when it already is (the original forward, inside its hooks).
        release: ``release(pos, module)``: take it out again (also after the recompute raised).
    """

    def __init__(self, bind: Callable[[int, nn.Module], bool], release: Callable[[int, nn.Module], None]) -> None:
        self._bind, self._release = bind, release
        self._wrapped: list[tuple[nn.Module, Any]] = []

    def wrap(self, pos: int, module: nn.Module) -> None:
        """Wrap ``module``'s checkpointing function (once; again if Hugging Face replaced it)."""
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None or getattr(func, "__gds_offload_recompute__", None) is self:
            return

        def checkpointing(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return func(functools.partial(self._run, pos, module, fn), *args, **kwargs)

        checkpointing.__gds_offload_recompute__ = self  # type: ignore[attr-defined]
        self._wrapped.append((module, func))
        module._gradient_checkpointing_func = checkpointing  # type: ignore[assignment]

    def restore(self) -> None:
        """Put the original checkpointing functions back (where ours is still the one installed)."""
        for module, func in reversed(self._wrapped):
            if getattr(module.__dict__.get("_gradient_checkpointing_func"), "__gds_offload_recompute__", None) is self:
                module._gradient_checkpointing_func = func
        self._wrapped.clear()

    def _run(self, pos: int, module: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with held():  # a stop signal during the recompute arrives after the layer is released
            if not self._bind(pos, module):
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            finally:  # also for the checkpoint's own early stop, an exception raised through fn
                self._release(pos, module)
