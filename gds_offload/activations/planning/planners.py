"""The planners: the runtime state of a policy, built afresh by every ``attach()``.

:func:`make_planner` turns a frozen configuration (:class:`~gds_offload.activations.planning.policy.OffloadAll`,
:class:`~gds_offload.activations.planning.policy.Adaptive`, :class:`~gds_offload.activations.planning.policy.Budget`)
into the object the scheduler asks (the :class:`~gds_offload.activations.planning.policy.Policy`
contract): which units to offload, what each step measured, the current plan. The configuration
is never changed and never shared state: two offloaders built from one ``Budget`` measure apart.
"""
from __future__ import annotations

from dataclasses import dataclass

from gds_offload.activations.planning.policy import (
    Adaptive,
    Budget,
    BudgetError,
    OffloadAll,
    OffloadDecisions,
    Policy,
    PolicyConfig,
    decisions,
)
from gds_offload.activations.planning.profile import Simulation, StepProfile, simulate
from gds_offload.units import format_bytes

__all__ = ["AdaptivePlanner", "AllPlanner", "BudgetPlanner", "make_planner"]


#: The read-ahead a budget plan's peak is simulated with: one layer, more than reading by bytes
#: holds, so the predicted peak bounds the one that runs.
_BUDGET_WINDOW = 1


class _Planner:
    """What every planner has: its policy's name, how backward reads ahead, and whether it reads step times."""

    name = ""
    #: Whole layers read ahead in backward; ``None``: tensor by tensor, the scheduler's read-ahead
    #: in bytes. Only a plan that simulates its reads layer by layer (adaptive's) asks for layers.
    prefetch_units: int | None = None
    #: Whether ``observe`` uses the profile's times (reading CUDA events synchronises the device).
    needs_timing = True


def make_planner(config: PolicyConfig) -> Policy:
    """A new planner for ``config``, with state of its own."""
    if isinstance(config, Budget):
        return BudgetPlanner(config)
    if isinstance(config, Adaptive):
        return AdaptivePlanner(config)
    return AllPlanner(config)


class AllPlanner(_Planner):
    """:class:`~gds_offload.activations.planning.policy.OffloadAll` at run time. Plans by bytes
    only: the scheduler need not read CUDA event times."""

    name, needs_timing = "all", False

    def __init__(self, config: OffloadAll) -> None:
        self.keep_last = config.keep_last
        self._first_kept = 1 << 62
        self._units = 0
        self._last: StepProfile | None = None

    def begin_forward(self, layer_calls: int) -> None:
        self._units = layer_calls + 1
        self._first_kept = layer_calls - self.keep_last + 1 if self.keep_last else 1 << 62

    def offload(self, unit: int) -> bool:
        return unit < self._first_kept

    def observe(self, profile: StepProfile) -> None:
        self._last = profile

    def plan(self) -> OffloadDecisions:
        offload = {k for k in range(self._units) if self.offload(k)}
        why = {k: ("offload all" if k in offload else f"last {self.keep_last} layer(s) kept") for k in range(self._units)}
        p = self._last
        return OffloadDecisions(
            self.name,
            decisions(p, offload, why, self._units),
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


class AdaptivePlanner(_Planner):
    """:class:`~gds_offload.activations.planning.policy.Adaptive` at run time (its doc says how it plans)."""

    name = "adaptive"

    def __init__(self, config: Adaptive) -> None:
        self.config = config
        self.keep_last = config.keep_last
        self.tolerance = config.tolerance
        self.warmup_steps = config.warmup_steps
        #: The prefetch depth of the current plan (chosen by each re-plan).
        self.prefetch_units = 1
        self._fallback = AllPlanner(OffloadAll(config.keep_last))
        self._measured = _Measured()
        self._plan: OffloadDecisions | None = None
        self._offload: set[int] | None = None
        self._planned_at: tuple[float, float] = (0.0, 0.0)
        self._planned_for: StepProfile | None = None
        self._events: list[str] = []
        self._unmeasured = config.warmup_steps

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
                if old and new and abs(new - old) / old > self.config.bandwidth_drift:
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
        for window in range(1, self.config.max_prefetch_units + 1):
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
        self._plan = OffloadDecisions(
            self.name, decisions(p, offload, reasons, n), m.write_bps, m.read_bps, sim,
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

    def plan(self) -> OffloadDecisions:
        if self._plan is None:
            p = self._fallback.plan()
            p.policy, p.reason = self.name, f"profiling (the first {self.warmup_steps + 1} steps offload all but the last layers)"
            return p
        return self._plan


class BudgetPlanner(_Planner):
    """:class:`~gds_offload.activations.planning.policy.Budget` at run time (its doc says how it plans)."""

    name = "budget"

    def __init__(self, config: Budget) -> None:
        self._limit = config.limit_bytes
        self._n = 0
        self._kept = 0  # number of units kept from the end
        self._error: BudgetError | None = None
        self._plan: OffloadDecisions | None = None
        self._events: list[str] = []
        self._measured = _Measured()

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
            current = simulate(p, set(range(n - self._kept)), write_bps=m.write_bps, read_bps=m.read_bps, window_units=_BUDGET_WINDOW)
            offset = max(0, measured - current.peak_bytes)
            while self._kept < n:
                trial = set(range(n - self._kept - 1))
                sim = simulate(p, trial, write_bps=m.write_bps, read_bps=m.read_bps, window_units=_BUDGET_WINDOW)
                if sim.peak_bytes + offset > self._limit:
                    break
                self._kept += 1
        offload = {k for k in range(n - self._kept)}
        sim = simulate(m.profile, offload, write_bps=m.write_bps, read_bps=m.read_bps, window_units=_BUDGET_WINDOW)  # type: ignore[arg-type]
        reasons = {k: ("offload: needed to stay under budget" if k in offload else "keep: fits in the budget") for k in range(n)}
        self._plan = OffloadDecisions(
            self.name, decisions(m.profile, offload, reasons, n), m.write_bps, m.read_bps, sim,
            reason=f"peak under {format_bytes(self._limit)} (measured {format_bytes(measured)})", events=list(self._events),
        )

    def plan(self) -> OffloadDecisions:
        if self._plan is None:
            return OffloadDecisions(self.name, [], reason=f"profiling: first step offloads everything to measure (budget {format_bytes(self._limit)})")
        return self._plan
