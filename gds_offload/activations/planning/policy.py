"""Which units (layer calls) to offload: the policies' configurations, and the plan they show.

A *unit* is one layer call within a forward: unit 0 holds what autograd saves
before the first layer (embeddings), unit ``k`` the ``k``-th layer call and what
follows it until the next layer starts (so the last unit also holds the head and
the loss). Backward needs the last units first, so keeping them costs nothing:
their reads could not be hidden anyway.

Policies (frozen configurations; each ``attach()`` builds its own planner from one,
:func:`~gds_offload.activations.planning.planners.make_planner`, so one ``Budget`` given to
two offloaders shares no measurement):

* :class:`OffloadAll` (``policy="all"``): everything but the last ``keep_last`` units.
* :class:`Adaptive` (``policy="adaptive"``): profiles a step after a warm-up one, then offloads the largest
  set of units whose I/O the simulated step hides behind compute (TBA's adaptive
  offloading, with backward measured rather than assumed to be 2x forward). Re-plans
  when bandwidth, sizes or the layer count drift.
* :class:`Budget` (``policy=Budget("40GiB")``): keep peak activation memory under a
  target with the least I/O; raises :class:`BudgetError` when even offloading every
  eligible unit cannot meet it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from gds_offload.activations.planning.profile import Simulation, StepProfile
from gds_offload.errors import ConfigError, OffloadError
from gds_offload.units import format_bytes, parse_bytes

__all__ = ["Policy", "PolicyConfig", "OffloadAll", "Adaptive", "Budget", "BudgetError", "OffloadDecisions", "UnitDecision", "decisions"]


class BudgetError(OffloadError):
    """A :class:`Budget` cannot be met even when every eligible tensor is offloaded."""


@dataclass(frozen=True)
class UnitDecision:
    unit: int
    name: str
    action: Literal["offload", "keep"]
    bytes: int
    forward_s: float
    backward_s: float
    why: str


@dataclass
class OffloadDecisions:
    """A policy's current decisions (offload or keep, per unit), with the measurements behind it.
    (``Plan`` before; that name now means only the weight planner's
    :class:`~gds_offload.weights.planning.planner.Plan`.)

    Printable as a rich table (``rich.print(off.plan())``).
    """

    policy: str
    decisions: list[UnitDecision]
    write_bps: float = 0.0
    read_bps: float = 0.0
    predicted: Simulation | None = None
    reason: str = ""
    #: Re-plans and unplanned stalls, oldest first: what changed and what was done.
    events: list[str] = field(default_factory=list)

    def offloaded_units(self) -> set[int]:
        return {d.unit for d in self.decisions if d.action == "offload"}

    def __str__(self) -> str:
        """A few lines with units (``print(off.plan())``); the fields, and ``rich.print`` for the whole table."""
        off = [d for d in self.decisions if d.action == "offload"]
        kept = [d for d in self.decisions if d.action == "keep"]
        shown = ", ".join(d.name for d in kept[:4]) + (f" and {len(kept) - 4} more" if len(kept) > 4 else "")
        lines = [f"gds_offload plan ({self.policy}): {self.reason or 'no reason given'}",
                 f"  offload {len(off)} of {len(self.decisions)} units ({format_bytes(sum(d.bytes for d in off))} a step); "
                 f"keep {len(kept)} ({format_bytes(sum(d.bytes for d in kept))}){': ' + shown if kept else ''}"]
        if self.predicted is not None:
            p = self.predicted
            lines.append(f"  measured write {self.write_bps / 1e9:.2f} GB/s, read {self.read_bps / 1e9:.2f} GB/s; predicted "
                         f"stall {p.stall_s * 1e3:.1f} ms of a {p.step_s * 1e3:.0f} ms step, peak {format_bytes(p.peak_bytes)}")
        if self.events:
            lines.append(f"  last of {len(self.events)} re-plans: {self.events[-1]}")
        lines.append("  per unit: rich.print(off.plan()), or its decisions")
        return "\n".join(lines)

    def __rich__(self) -> object:
        from rich.table import Table

        title = f"gds_offload plan ({self.policy}): {self.reason}"
        table = Table(title=title, title_justify="left")
        for col in ("unit", "layer", "action", "bytes", "fwd ms", "bwd ms", "why"):
            table.add_column(col, justify="right" if col in ("unit", "bytes", "fwd ms", "bwd ms") else "left")
        for d in self.decisions:
            table.add_row(
                str(d.unit), d.name, d.action, format_bytes(d.bytes), f"{d.forward_s * 1e3:.1f}", f"{d.backward_s * 1e3:.1f}", d.why
            )
        if self.predicted is not None:
            p = self.predicted
            table.caption = (
                f"write {self.write_bps / 1e9:.2f} GB/s, read {self.read_bps / 1e9:.2f} GB/s measured; predicted "
                f"stall {p.stall_s * 1e3:.1f} ms of {p.step_s * 1e3:.0f} ms, peak {format_bytes(p.peak_bytes)}"
            )
        return table


@runtime_checkable
class Policy(Protocol):
    """The contract between the scheduler and a placement policy.

    ``begin_forward`` runs on the training thread at the start of each forward with
    the number of layer calls the previous forward made (or the number of layers
    found, for the first). ``offload(unit)`` is then called from the pack hook, so it
    must be cheap and must not block. ``observe`` gets each step's profile when its
    backward ends (on the thread that ran backward). ``prefetch_units`` is how many
    offloaded units below the one in backward have their reads in flight; ``None``: reads go
    tensor by tensor, within the scheduler's read-ahead in bytes.
    """

    name: str
    prefetch_units: int | None
    #: Whether ``observe`` uses the profile's times (reading CUDA events synchronises the device).
    needs_timing: bool

    def begin_forward(self, layer_calls: int) -> None: ...

    def offload(self, unit: int) -> bool: ...

    def observe(self, profile: StepProfile) -> None: ...

    def plan(self) -> OffloadDecisions: ...


def decisions(profile: StepProfile | None, offload: set[int], why: dict[int, str], n_units: int) -> list[UnitDecision]:
    """One :class:`UnitDecision` per unit: its name and measured times (from ``profile``), offloaded or kept, and why."""
    out = []
    for k in range(n_units):
        u = profile.units[k] if profile is not None and k < len(profile.units) else None
        out.append(
            UnitDecision(
                unit=k,
                name=u.name if u else ("<pre>" if k == 0 else f"layer call {k}"),
                action="offload" if k in offload else "keep",
                bytes=u.eligible_bytes if u else 0,
                forward_s=u.forward_s if u else 0.0,
                backward_s=u.backward_s if u else 0.0,
                why=why.get(k, ""),
            )
        )
    return out


@dataclass(frozen=True)
class OffloadAll:
    """Offload every unit except the last ``keep_last`` layer calls (and what follows them)."""

    keep_last: int = 1


@dataclass(frozen=True)
class Adaptive:
    """Offload the largest set of units whose I/O hides behind compute.

    The first ``warmup_steps + 1`` steps offload everything but the last ``keep_last``
    units; the last of them is the profile. The warm-up steps are not measured: they pay
    one-time costs (read buffers mapped and faulted in, spill files grown), and a plan made
    from them could see a slow drive, keep every unit, and then never measure the drive
    again. The plan then keeps units from the end (they have the least compute left
    to hide their reads behind) until the simulated stall is under ``tolerance`` of the
    step. Later steps refine the measurements; the plan is redone when bandwidth moves
    by more than ``bandwidth_drift``, when sizes or the layer count change, or when a
    step stalls longer than predicted (recorded in :attr:`OffloadDecisions.events`).

    Args:
        keep_last: units always kept at the end.
        tolerance: allowed stall as a fraction of the step time.
        max_prefetch_units: deepest prefetch the plan may choose. A deeper prefetch hides
            slower reads but holds more units in memory; the plan picks the depth with the
            lowest predicted peak.
        warmup_steps: steps offloaded in full but not measured before the profiled one.
    """

    keep_last: int = 1
    tolerance: float = 0.02
    max_prefetch_units: int = 3
    warmup_steps: int = 1
    bandwidth_drift: float = 0.25

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"Adaptive(warmup_steps={self.warmup_steps!r}): unmeasured steps before the profile; use 0 or more")


@dataclass(frozen=True)
class Budget:
    """Keep peak saved-activation memory under ``bytes`` with the least I/O.

    The first step offloads everything eligible (the safest start) and measures. The
    plan then keeps units from the end (most I/O saved per byte kept: their reads come
    first and are the hardest to hide) while the predicted and measured peak stays
    under the budget. A step whose measured peak exceeds the budget tightens the plan.

    Raises:
        BudgetError: at the next forward, when a step that offloaded everything eligible
            still peaked over the budget (the message says by how much and why).
    """

    bytes: int | str

    def __post_init__(self) -> None:
        if self.limit_bytes <= 0:
            raise ConfigError(f"Budget({self.bytes!r}) must be positive, e.g. Budget('40GiB')")

    @property
    def limit_bytes(self) -> int:
        """The budget in bytes (``bytes`` parsed: ``"40GiB"`` -> 42949672960)."""
        return parse_bytes(self.bytes, name="Budget.bytes")


#: A policy's configuration, as ``attach(policy=...)`` resolves it.
PolicyConfig = OffloadAll | Adaptive | Budget


def __getattr__(name: str) -> Any:
    if name == "Plan":  # the old name, for one release
        warnings.warn("gds_offload.activations.planning.policy.Plan is now OffloadDecisions (gds_offload.OffloadDecisions)",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return OffloadDecisions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
