"""Reading what a :class:`~gds_offload.weights.run.model.StreamedModel` keeps in memory, once, at load:
the resident groups (embeddings, final norm, head, leading layers) and, for ``tier="host"``, the
streamed layers' host arena."""
from __future__ import annotations

import torch
from torch import nn

from gds_offload.io.base import Engine
from gds_offload.weights.store.files import StoreFiles, aligned_host_buffer, read_group, view_of
from gds_offload.weights.store.manifest import GroupEntry
from gds_offload.weights.streaming.bind import Binding
from gds_offload.weights.streaming.ring import wait_read

__all__ = ["load_resident", "move_free_buffers", "read_arena"]


def read_arena(engine: Engine, files: StoreFiles, groups: list[GroupEntry], *, verify: bool) -> tuple[torch.Tensor, dict[str, int]]:
    """Read ``groups`` into one page-aligned host arena: ``(arena, offset of each group in it)``.

    Raises:
        OffloadError: a read failed. StoreCorruptError: ``verify`` found a bad checksum.
    """
    bases, total = {}, 0
    for g in groups:
        bases[g.name] = total
        total += g.padded_nbytes
    arena = aligned_host_buffer(total)
    futures = [read_group(engine, files, g, arena[bases[g.name] :], verify=verify) for g in groups]
    for g, f in zip(groups, futures):
        wait_read(g, f)
    return arena, bases


def load_resident(
    engine: Engine, files: StoreFiles, binding: Binding, groups: list[GroupEntry], device: torch.device, *, verify: bool
) -> int:
    """Read ``groups``, put them on ``device`` and bind their tensors there (frozen parameters);
    returns the bytes they hold."""
    if not groups:
        return 0
    arena, bases = read_arena(engine, files, groups, verify=verify)
    if device.type != "cpu":
        arena = arena.to(device)
    for g in groups:
        for name in binding.by_group.get(g.name, []):
            buf = arena[bases[g.name] :]
            binding.place(name, binding.as_parameter(name, view_of(buf, binding.entries[name], g.offset)))
    return arena.numel()


def move_free_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (not in any store: rotary ``inv_freq``) left on another device go to ``device``."""
    for mod in model.modules():
        for leaf, b in mod._buffers.items():
            if b is not None and not b.is_meta and b.device != device and leaf in mod._non_persistent_buffers_set:
                mod._buffers[leaf] = b.to(device)
