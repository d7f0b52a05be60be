"""gds_offload: activation offloading from GPU memory to NVMe through GPUDirect Storage.

Usage::

    import gds_offload
    with gds_offload.attach(model) as off:
        loss = model(x).sum()
        loss.backward()
    print(off.stats())

The names below, and the subpackages (``gds_offload.weights``, ``gds_offload.data``,
``gds_offload.integrations``, ``gds_offload.models``, ``gds_offload.io``), are imported on
first use, so ``gds_offload.check`` (``gds-check``) loads without torch.
"""
from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from gds_offload._moved import install as _install_moved
from gds_offload._version import __version__

_install_moved()  # old module paths still import, with a DeprecationWarning (gds_offload._moved)

if TYPE_CHECKING:
    from gds_offload import data, integrations, io, models, weights
    from gds_offload.activations.attach import attach, offloader_of
    from gds_offload.activations.config import OffloadConfig
    from gds_offload.activations.offloader import Offloader
    from gds_offload.activations.planning.policy import Adaptive, Budget, BudgetError, OffloadAll, OffloadDecisions
    from gds_offload.activations.spill.ranks import PerRank, per_rank, rank_env
    from gds_offload.activations.stats import LayerStats, OffloadStats
    from gds_offload.errors import ConfigError, GDSUnavailableError, OffloadError, SpillSpaceError

_EXPORTS = {
    "attach": "gds_offload.activations.attach",
    "Offloader": "gds_offload.activations.offloader",
    "offloader_of": "gds_offload.activations.attach",
    "OffloadConfig": "gds_offload.activations.config",
    "Budget": "gds_offload.activations.planning.policy",
    "Adaptive": "gds_offload.activations.planning.policy",
    "OffloadAll": "gds_offload.activations.planning.policy",
    "BudgetError": "gds_offload.activations.planning.policy",
    "OffloadDecisions": "gds_offload.activations.planning.policy",
    "per_rank": "gds_offload.activations.spill.ranks",
    "PerRank": "gds_offload.activations.spill.ranks",
    "rank_env": "gds_offload.activations.spill.ranks",
    "OffloadStats": "gds_offload.activations.stats",
    "LayerStats": "gds_offload.activations.stats",
    "OffloadError": "gds_offload.errors",
    "ConfigError": "gds_offload.errors",
    "GDSUnavailableError": "gds_offload.errors",
    "SpillSpaceError": "gds_offload.errors",
}
#: Subpackages served as attributes (``gds_offload.weights.convert(...)`` after ``import gds_offload``).
_SUBPACKAGES = ("weights", "data", "integrations", "models", "io")

__all__ = ["__version__", *_EXPORTS, *_SUBPACKAGES]


def __getattr__(name: str) -> Any:
    if name == "Plan":  # the old name of OffloadDecisions, for one release (no cache: each use warns)
        warnings.warn("gds_offload.Plan is now gds_offload.OffloadDecisions (Plan names the weight planner's, "
                      "gds_offload.weights.Plan)", DeprecationWarning, stacklevel=2)  # fmt: skip
        return importlib.import_module("gds_offload.activations.planning.policy").OffloadDecisions
    if name in _SUBPACKAGES:
        value = importlib.import_module(f"gds_offload.{name}")
    else:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'gds_offload' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
