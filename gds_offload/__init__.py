"""gds_offload: activation offloading from GPU memory to NVMe through GPUDirect Storage.

Usage::

    import gds_offload
    with gds_offload.attach(model) as off:
        loss = model(x).sum()
        loss.backward()
    print(off.stats())
"""
from gds_offload._version import __version__
from gds_offload.errors import ConfigError, GDSUnavailableError, OffloadError, SpillSpaceError
from gds_offload.offloader import Offloader, OffloadConfig, attach
from gds_offload.policy import Budget, BudgetError, Plan
from gds_offload.stats import LayerStats, OffloadStats

__all__ = [
    "__version__",
    "attach",
    "Budget",
    "BudgetError",
    "Plan",
    "Offloader",
    "OffloadConfig",
    "OffloadStats",
    "LayerStats",
    "OffloadError",
    "ConfigError",
    "GDSUnavailableError",
    "SpillSpaceError",
]
