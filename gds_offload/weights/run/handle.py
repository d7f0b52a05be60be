"""What the functions built on a streamed model use of it: :class:`StreamedHandle`.

:func:`~gds_offload.weights.run.generation.generate_many` and
:func:`~gds_offload.weights.run.accumulate.accumulate` take a
:class:`~gds_offload.weights.run.model.StreamedModel`, whose methods of the same names delegate
to them. They are typed against this protocol, not the class, so that the model's module
imports them and nothing it builds on imports it back.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gds_offload.io.base import Engine
    from gds_offload.weights.planning.planner import Plan
    from gds_offload.weights.streaming.stats import StreamStats

__all__ = ["StreamedHandle"]


class StreamedHandle(Protocol):
    """The part of :class:`~gds_offload.weights.run.model.StreamedModel` that layer-major work uses."""

    model: nn.Module
    device: torch.device
    plan: Plan | None

    def run_team(self, calls: Sequence[Callable[[], Any]], *, seeds: Sequence[int | None] | None = None) -> list[Any]: ...

    def stats(self) -> StreamStats: ...

    def note_replan(self, why: str) -> None: ...

    def note_kv(self, bytes_read: int, bytes_written: int) -> None: ...

    def kv_engine(self) -> Engine: ...
