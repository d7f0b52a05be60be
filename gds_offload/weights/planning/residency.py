"""How many layers stay resident under a memory budget: :func:`plan_residency`.

``load_streamed(..., max_memory=...)`` spends a budget of bytes on ``device`` for weights:
the resident group (embeddings, final norm, head), then whole layers in model order, then the
ring that streams the rest. The plan takes the most leading layers that fit beside the ring
the remaining layers need; a layer kept resident is one layer fewer read every forward.
Activations, the KV cache and the allocator's slack are not weights and are not counted
(Accelerate's ``max_memory`` leaves them out too): leave room for them.
"""
from __future__ import annotations

from dataclasses import dataclass

from gds_offload.errors import ConfigError
from gds_offload.units import format_bytes
from gds_offload.weights.store.manifest import GroupEntry

__all__ = ["Residency", "plan_residency"]


@dataclass(frozen=True)
class Residency:
    """A split of a store's layers: the first ``resident_layers`` on the device, the rest streamed
    through ``slots`` ring buffers of ``slot_nbytes`` each. ``nbytes``: the weights' bytes on the device."""

    resident_layers: int
    slots: int
    slot_nbytes: int
    nbytes: int


def _split(resident: GroupEntry | None, layers: list[GroupEntry], n: int, slots: int) -> Residency:
    streamed = layers[n:]
    ring_slots = min(slots, len(streamed))
    slot_nbytes = max((g.padded_nbytes for g in streamed), default=0)
    held = (resident.padded_nbytes if resident else 0) + sum(g.padded_nbytes for g in layers[:n])
    return Residency(n, ring_slots, slot_nbytes, held + ring_slots * slot_nbytes)


def plan_residency(resident: GroupEntry | None, layers: list[GroupEntry], *, slots: int, max_memory: int | None,
                   resident_layers: int | None = None, hold_all: bool = False) -> Residency:  # fmt: skip
    """The split for ``resident_layers`` if given, else the most leading layers that fit ``max_memory``
    (``None``: no budget, no resident layers). ``hold_all`` (``tier="host"`` on the CPU): every
    layer is resident whatever ``resident_layers`` says, and ``max_memory`` must hold them all.

    Raises:
        ConfigError: both are given; ``resident_layers`` is out of range; or ``max_memory`` is too
            small for the resident group and the ring, or for every layer with ``hold_all`` (the
            message gives the bytes needed).
    """
    if resident_layers is not None and max_memory is not None:
        raise ConfigError(f"resident_layers={resident_layers} and max_memory={max_memory}: pass one; max_memory chooses resident_layers")
    if resident_layers is not None and not 0 <= resident_layers <= len(layers):
        raise ConfigError(f"resident_layers={resident_layers}: the store has {len(layers)} layers; use 0..{len(layers)}")
    if hold_all:
        held = _split(resident, layers, len(layers), slots)
        if max_memory is not None and held.nbytes > max_memory:
            raise ConfigError(f"max_memory={format_bytes(max_memory)}: tier='host' on the CPU holds every layer, "
                              f"{format_bytes(held.nbytes)} in all; raise max_memory or use tier='drive'")  # fmt: skip
        return held
    if max_memory is None:
        return _split(resident, layers, resident_layers or 0, slots)
    # More resident layers can need less in all (the ring shrinks once fewer layers than slots
    # remain), so every split is tried rather than stopping at the first that does not fit.
    fits = [s for s in (_split(resident, layers, n, slots) for n in range(len(layers) + 1)) if s.nbytes <= max_memory]
    if not fits:
        least = _split(resident, layers, 0, slots)
        raise ConfigError(
            f"max_memory={format_bytes(max_memory)} holds not even the resident group and the ring: they need "
            f"{format_bytes(least.nbytes)} ({least.slots} slot(s) of {format_bytes(least.slot_nbytes)}); "
            f"raise max_memory" + (" or pass fewer slots" if least.slots > 1 else "")
        )
    return max(fits, key=lambda s: s.resident_layers)
