"""Which units (layer calls) to offload. The scheduler asks; policies decide.

A *unit* is one layer call within a forward: unit 0 holds what autograd saves
before the first layer (embeddings), unit ``k`` the ``k``-th layer call and what
follows it until the next layer starts (so the last unit also holds the head and
the loss). Backward needs the last units first, so keeping them costs nothing:
their reads could not be hidden anyway.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["Policy", "OffloadAll"]


@runtime_checkable
class Policy(Protocol):
    """The contract between the scheduler and a placement policy.

    ``begin_forward`` is called on the training thread at the start of each
    forward with the number of layer calls the previous forward made (or the number
    of layers found, for the first). ``offload(unit)`` is then called from the pack
    hook, so it must be cheap and must not block.
    """

    name: str

    def begin_forward(self, layer_calls: int) -> None: ...

    def offload(self, unit: int) -> bool: ...


@dataclass
class OffloadAll:
    """Offload every unit except the last ``keep_last`` layer calls (and what follows them)."""

    keep_last: int = 1
    name: str = "all"
    _first_kept: int = 1 << 62

    def begin_forward(self, layer_calls: int) -> None:
        self._first_kept = layer_calls - self.keep_last + 1 if self.keep_last else 1 << 62

    def offload(self, unit: int) -> bool:
        return unit < self._first_kept
