"""The resident model a :class:`~gds_offload.weights.run.model.StreamedModel` is bit-identical to: :func:`as_reference`.

Streaming moves bytes, never values, so a streamed model computes what the same model does
with every tensor resident, *as the streamed model holds them*: every parameter frozen
(``requires_grad=False``: streamed layers are frozen, and :func:`~gds_offload.weights.load_streamed`
freezes the resident ones too; train them with ``requires_grad_(True)`` on both sides), and
every tensor starting at a 64-byte-aligned address (a store aligns tensors to 64 bytes).

Both matter to the last bit, on the CPU at least. ``torch.matmul`` folds its operands
differently when one requires grad, even under ``torch.no_grad()``; and a matrix-vector
product (a decode step) takes another code path when its matrix is 8- rather than
16-byte aligned, which ``from_pretrained``'s memory-mapped safetensors tensors often are.
Both give results that differ in the last bits of a float (tokens usually agree, scores do not).
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["as_reference"]


def as_reference(model: nn.Module) -> nn.Module:
    """Freeze ``model``'s parameters and copy every parameter and buffer into memory of its own
    (64-byte aligned on the CPU, 512 on CUDA: the allocators' own), in place; returns ``model``.

    Run on a resident model (``from_pretrained``) to get the reference a streamed model of the
    same checkpoint equals with ``torch.equal`` (see the module doc). Unfreeze afterwards the
    parameters you train on both sides. Ties (``lm_head`` and the embeddings) are kept.
    """
    copies: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for leaf, p in mod._parameters.items():
            if p is not None:
                if id(p) not in copies:
                    copies[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=False)
                mod._parameters[leaf] = copies[id(p)]  # type: ignore[assignment]
        for leaf, b in mod._buffers.items():
            if b is not None:
                if id(b) not in copies:
                    copies[id(b)] = b.clone()
                mod._buffers[leaf] = copies[id(b)]
    return model
