"""Hugging Face ``Trainer`` integration: :class:`OffloadCallback`.

Usage::

    from transformers import Trainer
    from gds_offload.integrations.transformers import OffloadCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[OffloadCallback(path="/mnt/nvme/spill")])
    trainer.train()

The callback attaches the offloader when training begins (``on_train_begin``), adds a handful
of named figures to every log entry (``on_log``; keys prefixed ``gds_offload/``:
:meth:`OffloadCallback.figures`) and detaches
when training ends (``on_train_end``). Layers are found by
:func:`gds_offload.activations.layers.find_layers` (``model.layers.N`` for Llama, ``transformer.h.N``
for GPT-2). ``model.gradient_checkpointing_enable()`` works alongside: the checkpointed
layers save (almost) nothing, so only what lies outside them is offloaded.

.. note:: Log order
   ``Trainer`` runs its reporting integrations (``report_to``: TensorBoard, W&B, ...)
   before user callbacks, so they log an entry before this callback adds its figures.
   The figures still land in ``trainer.state.log_history`` and in what later callbacks
   (and the console printer) see. For the reporters to get them too, install the
   callback first: :meth:`OffloadCallback.install`.
"""
from __future__ import annotations

import inspect
from typing import Any

from transformers import TrainerCallback

from gds_offload.activations.attach import attach
from gds_offload.activations.offloader import Offloader
from gds_offload.activations.stats import OffloadStats
from gds_offload.errors import ConfigError

__all__ = ["OffloadCallback", "LOG_PREFIX"]

#: Prefix of the keys this callback adds to the trainer's logs.
LOG_PREFIX = "gds_offload/"

_MIB = 2**20


class OffloadCallback(TrainerCallback):
    """Offload activations to NVMe for the duration of ``Trainer.train()``.

    Args:
        **attach_kwargs: passed to :func:`gds_offload.attach` (``path``, ``mode``,
            ``policy``, ``min_bytes``, ...). Checked against its signature here, so a typo
            fails when the callback is created, not when training starts.

    Attributes:
        offloader: the attached :class:`~gds_offload.Offloader` while training, else None.
        final_stats: the offloader's :class:`~gds_offload.OffloadStats` at the end of the
            last training run (None before one ended).
        final_stats_all_ranks: under ``torchrun``/``accelerate launch`` (a process group of
            more than one rank), every rank's final counters combined
            (:meth:`~gds_offload.Offloader.stats` with ``all_ranks=True``, gathered when
            training ends, on every rank); None otherwise.

    Raises:
        ConfigError: an argument :func:`gds_offload.attach` does not take.
    """

    def __init__(self, **attach_kwargs: Any) -> None:
        params = inspect.signature(attach).parameters
        unknown = sorted(k for k in attach_kwargs if k not in params or k == "model")
        if unknown:
            allowed = ", ".join(k for k in params if k != "model")
            raise ConfigError(f"OffloadCallback got {unknown}, which attach() does not take; allowed: {allowed}")
        self.attach_kwargs = attach_kwargs
        self.offloader: Offloader | None = None
        self.final_stats: OffloadStats | None = None
        self.final_stats_all_ranks: OffloadStats | None = None

    @classmethod
    def install(cls, trainer: Any, **attach_kwargs: Any) -> OffloadCallback:
        """Create the callback and put it *first* in ``trainer``'s callbacks, so the reporting
        integrations see its figures in the same log entry. Returns the callback."""
        callback = cls(**attach_kwargs)
        trainer.callback_handler.callbacks.insert(0, callback)
        return callback

    def figures(self) -> dict[str, float | int]:
        """A handful of the offloader's figures since it was attached, as ``{"gds_offload/<name>": number}``:

        ``steps``; ``offloaded_mib`` (written to the drive, in all) and ``kept_mib`` (kept in memory,
        in all); ``peak_resident_mib`` (the most saved-activation memory held at once);
        ``io_wait_s`` (time training waited on the drive) and ``io_hidden`` (the share of the
        drive's busy time it did not wait for, 0 to 1); ``fallback_mib`` (writes that failed and
        stayed in memory). Every counter: ``callback.offloader.stats()`` (``final_stats`` after training).
        """
        if self.offloader is None:
            return {}
        s = self.offloader.stats()
        hidden = s.io_hidden()
        return {
            LOG_PREFIX + "steps": s.steps,
            LOG_PREFIX + "offloaded_mib": round(s.bytes_offloaded / _MIB, 2),
            LOG_PREFIX + "kept_mib": round(s.bytes_kept / _MIB, 2),
            LOG_PREFIX + "peak_resident_mib": round(s.peak_resident_bytes / _MIB, 2),
            LOG_PREFIX + "io_wait_s": round(s.io_wait_s, 4),
            LOG_PREFIX + "io_hidden": round(1.0 if hidden is None else hidden, 4),
            LOG_PREFIX + "fallback_mib": round(s.bytes_fallback / _MIB, 2),
        }

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise ConfigError("OffloadCallback.on_train_begin got no model from the Trainer; pass model= to Trainer")
        if self.offloader is not None:  # a previous train() ended without on_train_end
            self.offloader.detach()
        self.offloader = attach(model, **self.attach_kwargs)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        figures = self.figures()
        if not figures or logs is None:
            return
        logs.update(figures)
        last = state.log_history[-1] if state.log_history else None
        if isinstance(last, dict) and last.get("step") == state.global_step and all(k in last for k in logs if k not in figures):
            last.update(figures)  # Trainer appended this entry just before calling on_log

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.offloader is None:
            return
        self.final_stats = self.offloader.stats()
        if _world_size() > 1:  # the Trainer ends training on every rank: the collective is matched
            self.final_stats_all_ranks = self.offloader.stats(all_ranks=True)
        self.offloader.detach()
        self.offloader = None


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
