"""Tensors as the scheduler sees them."""
from __future__ import annotations

import torch

__all__ = ["byte_view"]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """All bytes of ``t``'s storage as a 1-D uint8 tensor (no copy), as the scheduler sees them."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
