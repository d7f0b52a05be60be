"""gds_offload: activation offloading from GPU memory to NVMe through GPUDirect Storage.

Usage::

    import gds_offload
    with gds_offload.attach(model) as off:
        loss = model(x).sum()
        loss.backward()
    print(off.stats())

The names below are imported on first use, so ``gds_offload.check`` (``gds-check``)
loads without torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gds_offload._version import __version__

if TYPE_CHECKING:
    from gds_offload.config import OffloadConfig
    from gds_offload.errors import ConfigError, GDSUnavailableError, OffloadError, SpillSpaceError
    from gds_offload.hooks import Offloader
    from gds_offload.offloader import attach, offloader_of
    from gds_offload.policy import Budget, BudgetError, Plan
    from gds_offload.ranks import PerRank, per_rank
    from gds_offload.stats import LayerStats, OffloadStats

_EXPORTS = {
    "attach": "gds_offload.offloader",
    "Offloader": "gds_offload.hooks",
    "offloader_of": "gds_offload.offloader",
    "OffloadConfig": "gds_offload.config",
    "Budget": "gds_offload.policy",
    "BudgetError": "gds_offload.policy",
    "Plan": "gds_offload.policy",
    "per_rank": "gds_offload.ranks",
    "PerRank": "gds_offload.ranks",
    "OffloadStats": "gds_offload.stats",
    "LayerStats": "gds_offload.stats",
    "OffloadError": "gds_offload.errors",
    "ConfigError": "gds_offload.errors",
    "GDSUnavailableError": "gds_offload.errors",
    "SpillSpaceError": "gds_offload.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gds_offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
