"""Deprecated module path: the policies now live in :mod:`gds_offload.activations.planning.policy`
(``gds_offload.Budget``, ``gds_offload.Adaptive``). Kept for one release."""
from __future__ import annotations

import warnings

from gds_offload.activations.planning.policy import Adaptive, Budget, BudgetError, OffloadAll, Policy, UnitDecision
from gds_offload.activations.planning.policy import OffloadDecisions as Plan

__all__ = ["Adaptive", "Budget", "BudgetError", "OffloadAll", "Plan", "Policy", "UnitDecision"]

warnings.warn(
    "gds_offload.policy is deprecated: use gds_offload.Budget, gds_offload.Adaptive, ... "
    "(defined in gds_offload.activations.planning.policy)", DeprecationWarning, stacklevel=2,
)
