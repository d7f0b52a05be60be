"""Which units (layer calls) to offload. The scheduler asks; policies decide.

A *unit* is one layer call within a forward: unit 0 holds what autograd saves
before the first layer (embeddings), unit ``k`` the ``k``-th layer call and what
follows it until the next layer starts (so the last unit also holds the head and
the loss). Backward needs the last units first, so keeping them costs nothing:
their reads could not be hidden anyway.

Policies:

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

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from gds_offload.activations.planning.profile import Simulation, StepProfile, simulate
from gds_offload.errors import ConfigError, OffloadError
from gds_offload.units import format_bytes, parse_bytes

__all__ = ["Policy", "OffloadAll", "Adaptive", "Budget", "BudgetError", "Plan", "UnitDecision"]


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
class Plan:
    """A policy's current placement, with the measurements behind it.

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
    offloaded units below the one in backward have their reads in flight.
    """

    name: str
    prefetch_units: int
    #: Whether ``observe`` uses the profile's times (reading CUDA events synchronises the device).
    needs_timing: bool

    def begin_forward(self, layer_calls: int) -> None: ...

    def offload(self, unit: int) -> bool: ...

    def observe(self, profile: StepProfile) -> None: ...

    def plan(self) -> Plan: ...


def _decisions(profile: StepProfile | None, offload: set[int], why: dict[int, str], n_units: int) -> list[UnitDecision]:
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


@dataclass
class OffloadAll:
    """Offload every unit except the last ``keep_last`` layer calls (and what follows them)."""

    keep_last: int = 1
    name: str = "all"
    prefetch_units: int = 1
    #: Plans by bytes only: the scheduler need not read CUDA event times.
    needs_timing: bool = False
    _first_kept: int = 1 << 62
    _units: int = 0
    _last: StepProfile | None = None

    def begin_forward(self, layer_calls: int) -> None:
        self._units = layer_calls + 1
        self._first_kept = layer_calls - self.keep_last + 1 if self.keep_last else 1 << 62

    def offload(self, unit: int) -> bool:
        return unit < self._first_kept

    def observe(self, profile: StepProfile) -> None:
        self._last = profile

    def plan(self) -> Plan:
        offload = {k for k in range(self._units) if self.offload(k)}
        why = {k: ("offload all" if k in offload else f"last {self.keep_last} layer(s) kept") for k in range(self._units)}
        p = self._last
        return Plan(
            self.name,
            _decisions(p, offload, why, self._units),
            write_bps=p.write_bps if p else 0.0,
            read_bps=p.read_bps if p else 0.0,
            reason=f"every eligible tensor outside the last {self.keep_last} layer(s)",
        )


@dataclass
class _Measured:
    """Exponential moving averages of what steps measured, per unit."""

    profile: StepProfile | None = None
    write_bps: float = 0.0
    read_bps: float = 0.0

    def update(self, p: StepProfile, alpha: float = 0.5) -> None:
        # Bandwidth only moves when the step moved bytes; a unit-count change resets.
        if self.profile is None or len(self.profile.units) != len(p.units):
            self.profile = p
            self.write_bps = p.write_bps or self.write_bps
            self.read_bps = p.read_bps or self.read_bps
            return
        units = tuple(
            type(u)(
                name=u.name,
                forward_s=(1 - alpha) * o.forward_s + alpha * u.forward_s,
                backward_s=(1 - alpha) * o.backward_s + alpha * u.backward_s,
                eligible_bytes=u.eligible_bytes,
                offloaded_bytes=u.offloaded_bytes,
            )
            for o, u in zip(self.profile.units, p.units)
        )
        self.profile = StepProfile(units, p.write_bps, p.read_bps, p.io_wait_s, p.peak_resident_bytes, p.fixed_bytes)
        # A slower drive counts at once (a stall costs more than a missed saving); a faster
        # one is believed gradually.
        self.write_bps = _blend(self.write_bps, p.write_bps, alpha)
        self.read_bps = _blend(self.read_bps, p.read_bps, alpha)


def _blend(old: float, new: float, alpha: float) -> float:
    if not new:
        return old
    if not old or new < old:
        return new
    return (1 - alpha) * old + alpha * new


def _drift(old: StepProfile, new: StepProfile, tol: float = 0.10) -> str:
    """Why a plan made for ``old`` no longer fits ``new`` ('' when it still fits)."""
    if len(old.units) != len(new.units):
        return f"layer calls changed from {len(old.units) - 1} to {len(new.units) - 1}"
    a = sum(u.eligible_bytes for u in old.units)
    b = sum(u.eligible_bytes for u in new.units)
    if a and abs(b - a) / a > tol:
        return f"saved bytes per step changed from {format_bytes(a)} to {format_bytes(b)} (batch or sequence size?)"
    return ""


@dataclass
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
    step stalls longer than predicted (recorded in :attr:`Plan.events`).

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
    name: str = "adaptive"
    prefetch_units: int = 1
    needs_timing: bool = True
    _fallback: OffloadAll = field(default_factory=OffloadAll)
    _measured: _Measured = field(default_factory=_Measured)
    _plan: Plan | None = None
    _offload: set[int] | None = None
    _planned_at: tuple[float, float] = (0.0, 0.0)
    _planned_for: StepProfile | None = None
    _events: list[str] = field(default_factory=list)
    _unmeasured: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"Adaptive(warmup_steps={self.warmup_steps!r}): unmeasured steps before the profile; use 0 or more")
        self._fallback = OffloadAll(self.keep_last)
        self._unmeasured = self.warmup_steps

    def begin_forward(self, layer_calls: int) -> None:
        self._fallback.begin_forward(layer_calls)

    def offload(self, unit: int) -> bool:
        return self._fallback.offload(unit) if self._offload is None else unit in self._offload

    def observe(self, profile: StepProfile) -> None:
        if self._unmeasured > 0:
            self._unmeasured -= 1
            return
        m = self._measured
        m.update(profile)
        if self._planned_for is None:
            self._replan("first profile")
            return
        why = _drift(self._planned_for, profile)
        if not why:
            wb, rb = self._planned_at
            for label, old, new in (("write", wb, m.write_bps), ("read", rb, m.read_bps)):
                if old and new and abs(new - old) / old > self.bandwidth_drift:
                    why = f"{label} bandwidth moved from {old / 1e9:.2f} to {new / 1e9:.2f} GB/s"
                    break
        if not why and self._plan is not None and self._plan.predicted is not None:
            predicted = self._plan.predicted.stall_s
            step = self._plan.predicted.step_s
            if profile.io_wait_s > predicted + self.tolerance * step:
                why = f"step stalled {profile.io_wait_s * 1e3:.0f} ms on reads, plan predicted {predicted * 1e3:.0f} ms"
        if why:
            self._replan(why)

    def _replan(self, why: str) -> None:
        m = self._measured
        p = m.profile
        assert p is not None, "replan needs a profile"
        n = len(p.units)
        best: tuple[set[int], Simulation, dict[int, str], int] | None = None
        for window in range(1, self.max_prefetch_units + 1):
            offload, sim, reasons = self._fit(p, window)
            if best is None or sim.peak_bytes < best[1].peak_bytes:
                best = (offload, sim, reasons, window)
        assert best is not None, "max_prefetch_units >= 1"
        offload, sim, reasons, window = best
        self._offload = offload
        self.prefetch_units = window
        self._planned_at = (m.write_bps, m.read_bps)
        self._planned_for = p
        if why != "first profile" or self._events:
            self._events.append(f"re-planned: {why}; offloading {len(offload)} of {n} units")
        self._plan = Plan(
            self.name, _decisions(p, offload, reasons, n), m.write_bps, m.read_bps, sim,
            reason=f"offload {len(offload)} of {n} units, prefetch {window} ahead, I/O hidden behind compute",
            events=list(self._events),
        )

    def _fit(self, p: StepProfile, window: int) -> tuple[set[int], Simulation, dict[int, str]]:
        """The largest prefix of units to offload whose I/O hides, with ``window`` units of prefetch."""
        m = self._measured
        n = len(p.units)
        first_kept = max(0, n - self.keep_last)
        offload = {k for k in range(first_kept) if p.units[k].eligible_bytes}
        reasons = {k: f"last {self.keep_last} kept" for k in range(first_kept, n)}
        sim = simulate(p, offload, write_bps=m.write_bps, read_bps=m.read_bps, window_units=window)
        # Keep from the end until the I/O hides behind compute and every offloaded unit
        # really leaves memory (a write still running when backward arrives saves nothing).
        while offload:
            if sim.stall_s > self.tolerance * sim.step_s:
                k = max(offload)
                stall = sim.per_unit_stall_s[k]
                reasons[k] = f"kept: its read would stall backward ({stall * 1e3:.0f} ms)" if stall else "kept: the I/O queue would stall reads below it"
            elif sim.forwarded & offload:
                k = max(sim.forwarded & offload)
                reasons[k] = "kept: its write would not finish before backward needs it"
            else:
                break
            offload.discard(k)
            sim = simulate(p, offload, write_bps=m.write_bps, read_bps=m.read_bps, window_units=window)
        for k in offload:
            reasons[k] = "offload: hidden behind compute"
        for k in range(first_kept):
            reasons.setdefault(k, "nothing eligible")
        return offload, sim, reasons

    def plan(self) -> Plan:
        if self._plan is None:
            p = self._fallback.plan()
            p.policy, p.reason = self.name, f"profiling (the first {self.warmup_steps + 1} steps offload all but the last layers)"
            return p
        return self._plan


@dataclass
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
    name: str = "budget"
    prefetch_units: int = 1
    needs_timing: bool = True
    _limit: int = 0
    _n: int = 0
    _kept: int = 0  # number of units kept from the end
    _error: BudgetError | None = None
    _plan: Plan | None = None
    _events: list[str] = field(default_factory=list)
    _measured: _Measured = field(default_factory=_Measured)

    def __post_init__(self) -> None:
        self._limit = parse_bytes(self.bytes, name="Budget.bytes")
        if self._limit <= 0:
            raise ConfigError(f"Budget({self.bytes!r}) must be positive, e.g. Budget('40GiB')")

    def begin_forward(self, layer_calls: int) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        self._n = layer_calls + 1

    def offload(self, unit: int) -> bool:
        return unit < self._n - self._kept

    def observe(self, profile: StepProfile) -> None:
        m = self._measured
        m.update(profile)
        measured = profile.peak_resident_bytes
        n = len(profile.units)
        if measured > self._limit:
            if self._kept == 0:
                over = measured - self._limit
                largest = max((u.eligible_bytes for u in profile.units), default=0)
                self._error = BudgetError(
                    f"Budget({format_bytes(self._limit)}) cannot be met: offloading every eligible tensor still peaked at "
                    f"{format_bytes(measured)} ({format_bytes(over)} over). Of that, {format_bytes(profile.fixed_bytes)} is "
                    f"never offloadable (tensors under min_bytes), a layer's own activations ({format_bytes(largest)} for the "
                    f"largest) are in memory while it runs and while its neighbour is prefetched, and the rest waits for the "
                    f"drive (write {m.write_bps / 1e9:.2f} GB/s). Raise the budget, lower min_bytes, use a faster drive, "
                    f"or shrink the micro-batch"
                )
                return
            self._kept -= 1
            self._events.append(f"measured peak {format_bytes(measured)} over budget: keeping {self._kept} units")
        else:
            # Keep more units at the end while the prediction, calibrated by this step's
            # measured peak, stays under the budget.
            p = m.profile
            assert p is not None, "observe recorded a profile"
            current = simulate(p, set(range(n - self._kept)), write_bps=m.write_bps, read_bps=m.read_bps, window_units=self.prefetch_units)
            offset = max(0, measured - current.peak_bytes)
            while self._kept < n:
                trial = set(range(n - self._kept - 1))
                sim = simulate(p, trial, write_bps=m.write_bps, read_bps=m.read_bps, window_units=self.prefetch_units)
                if sim.peak_bytes + offset > self._limit:
                    break
                self._kept += 1
        offload = {k for k in range(n - self._kept)}
        sim = simulate(m.profile, offload, write_bps=m.write_bps, read_bps=m.read_bps, window_units=self.prefetch_units)  # type: ignore[arg-type]
        reasons = {k: ("offload: needed to stay under budget" if k in offload else "keep: fits in the budget") for k in range(n)}
        self._plan = Plan(
            self.name, _decisions(m.profile, offload, reasons, n), m.write_bps, m.read_bps, sim,
            reason=f"peak under {format_bytes(self._limit)} (measured {format_bytes(measured)})", events=list(self._events),
        )

    def plan(self) -> Plan:
        if self._plan is None:
            return Plan(self.name, [], reason=f"profiling: first step offloads everything to measure (budget {format_bytes(self._limit)})")
        return self._plan
