"""The public :func:`plan`: measure the model here (:func:`~gds_offload.weights.run.measure.measure`),
then choose (:func:`~gds_offload.weights.planning.planner.choose`)."""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable

from gds_offload.units import parse_bytes
from gds_offload.weights.planning.planner import Plan, check_feasible, choose
from gds_offload.weights.planning.workload import Workload
from gds_offload.weights.run.measure import measure
from gds_offload.weights.run.profile import trust

__all__ = ["plan"]

def plan(
    store: str | os.PathLike[str],
    workload: Workload,
    *,
    memory: int | str,
    device: str = "cpu",
    engine: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Measure the model in ``store`` on this machine (:func:`measure`,
    in a child process) and choose the fastest shape for ``workload`` under ``memory`` bytes
    (``"1.2GiB"``): :func:`~gds_offload.weights.planning.planner.choose`. Checks what it can before measuring.

    Raises:
        ConfigError: ``memory`` below what any plan needs (before measuring when the store alone
            shows it), a workload longer than the model's positions, or no plan that fits.
    """
    limit = parse_bytes(memory, name="memory")
    check_feasible(store, workload, limit)
    profile = measure(store, workload, device=device, engine=engine, progress=progress, memory=limit)
    doubt = trust(profile.measured)
    if doubt is not None:
        warnings.warn(f"the profile of {store} was {doubt}", stacklevel=2)
    return choose(profile, workload, limit)
