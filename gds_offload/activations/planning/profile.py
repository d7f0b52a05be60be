"""What one step looked like: per-unit compute times and bytes, and the bandwidth the engine sustained.

The scheduler fills a :class:`StepProfile` at the end of each backward; policies read it.
Forward time of a unit is from its layer's pre-hook to the next unit's start; backward
time from the pre-hook on its output's ``grad_fn`` to the next one (the first unit's
backward also holds what runs below it). On CUDA the boundaries are CUDA events, read
once the step's backward ends, so timing never synchronises the device mid-step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["UnitProfile", "StepProfile", "Clock", "NoTiming", "UnitRecord", "ForwardRecord", "simulate", "Simulation"]


@dataclass(frozen=True)
class UnitProfile:
    """One unit of one step. ``eligible_bytes``: bytes the unit could offload (after dedup, >= min_bytes)."""

    name: str
    forward_s: float
    backward_s: float
    eligible_bytes: int
    offloaded_bytes: int


@dataclass(frozen=True)
class StepProfile:
    units: tuple[UnitProfile, ...]
    #: Engine bandwidth sustained while busy (bytes/s); 0 when nothing moved.
    write_bps: float
    read_bps: float
    #: Training-thread time blocked on reads during this step's backward.
    io_wait_s: float
    #: Largest resident saved-activation bytes during this step.
    peak_resident_bytes: int
    #: Saved bytes never eligible (under min_bytes, outside the forward): resident whatever the plan.
    fixed_bytes: int

    @property
    def forward_s(self) -> float:
        return sum(u.forward_s for u in self.units)

    @property
    def backward_s(self) -> float:
        return sum(u.backward_s for u in self.units)


class Clock:
    """Timestamps at unit boundaries: host time on CPU, CUDA events on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        # On the model's device, not the calling thread's current one (device 0 unless set): a
        # model on cuda:1 would otherwise be timed on an idle GPU.
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def seconds(self, start: Any, end: Any) -> float:
        if start is None or end is None:
            return 0.0
        if not self.cuda:
            return max(0.0, end - start)
        end.synchronize()
        return max(0.0, start.elapsed_time(end) / 1e3)


@dataclass(frozen=True)
class Simulation:
    """Predicted behaviour of one placement (see :func:`simulate`)."""

    stall_s: float
    step_s: float
    peak_bytes: int
    io_bytes: int
    per_unit_stall_s: tuple[float, ...] = field(default=())
    #: Offloaded units whose write is still running when backward nears them: served from
    #: memory, so offloading them moved bytes but saved no memory.
    forwarded: frozenset[int] = frozenset()


def simulate(profile: StepProfile, offload: set[int], *, write_bps: float, read_bps: float, window_units: int = 1) -> Simulation:
    """Replay a step with ``offload`` as the offloaded units.

    Model: one drive serving a FIFO of writes then reads (a shared queue is the
    conservative choice: on one NVMe, reads queue behind writes). Unit ``k``'s write
    starts when its forward ends; backward visits units last to first and, as each unit
    starts, issues the reads of the next ``window_units`` offloaded units below it (the
    scheduler's prefetch); a unit whose write has not finished when its read would be
    issued is served from memory (forwarding).

    Returns the stall (backward waiting for reads), the step time, the peak of resident
    bytes, the bytes moved, and the units that would be forwarded.
    """
    units = profile.units
    n = len(units)
    wbps, rbps = max(write_bps, 1.0), max(read_bps, 1.0)
    offload = {k for k in offload if k < n and units[k].eligible_bytes}
    events: list[tuple[float, int]] = []  # (time, +/- bytes in memory)
    t = 0.0
    disk_free = 0.0
    write_done = [0.0] * n
    for k, u in enumerate(units):
        events.append((t, u.eligible_bytes))
        t += u.forward_s
        if k in offload:
            start = max(t, disk_free)
            disk_free = write_done[k] = start + u.eligible_bytes / wbps
    forward_end = t
    stalls = [0.0] * n
    read_done: dict[int, float] = {}
    io_bytes = sum(units[k].eligible_bytes for k in offload)

    def issue(k: int, now: float) -> None:
        nonlocal disk_free
        if k < 0 or k in read_done or k not in offload:
            return
        if write_done[k] > now:
            read_done[k] = -1.0  # still in memory when needed soon: forwarded
            return
        events.append((write_done[k], -units[k].eligible_bytes))  # left memory when written
        start = max(now, disk_free)
        disk_free = start + units[k].eligible_bytes / rbps
        read_done[k] = disk_free
        events.append((start, units[k].eligible_bytes))

    t = forward_end
    for k in range(n - 1, -1, -1):
        issue(k, t)
        ahead = [j for j in range(k - 1, -1, -1) if j in offload][:window_units]
        for j in ahead:
            issue(j, t)
        done = read_done.get(k, -1.0)
        if done > t:
            stalls[k] = done - t
            t = done
        t += units[k].backward_s
        events.append((t, -units[k].eligible_bytes))  # backward of k done: its tensors freed
    peak = level = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        level += delta
        peak = max(peak, level)
    forwarded = frozenset(k for k, done in read_done.items() if done < 0)
    return Simulation(sum(stalls), t, profile.fixed_bytes + peak, io_bytes, tuple(stalls), forwarded)


@dataclass(eq=False)
class UnitRecord:
    """What the scheduler records of one unit (layer call) of one forward. ``t_*`` are :class:`Clock` marks."""

    name: str
    t_start: Any = None
    t_end: Any = None
    t_backward: Any = None
    #: Entries offloaded from this unit (their reads are issued together, ahead of its backward).
    entries: list[Any] = field(default_factory=list)
    offloaded_bytes: int = 0
    #: Bytes this unit could offload (>= min_bytes, after dedup), whatever the policy said.
    eligible_bytes: int = 0
    prefetched: bool = False
    #: Time backward waited for this unit's reads, and forward for the write window:
    #: waiting, not compute, so subtracted from the unit's times.
    read_wait_s: float = 0.0
    write_wait_s: float = 0.0


@dataclass(eq=False)
class ForwardRecord:
    """One forward of the attached model, from its root pre-hook until its backward ends.

    Owned by the scheduler; touched under its lock. ``dedup`` maps ``(storage, version)``
    to the entries saved over that storage in *this* forward only: bytes are never shared
    across forwards, since a buffer refilled between steps may keep its version.
    """

    id: int
    clock: Clock
    #: Storages of the model's parameters and buffers: saved as they are, never offloaded.
    param_storages: frozenset[int]
    #: What keeps those storages' addresses from being reused during this forward.
    param_refs: list[Any] = field(default_factory=list)
    units: list[UnitRecord] = field(default_factory=list)
    dedup: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    #: Handles of this forward still held by autograd.
    live_handles: int = 0
    fixed_bytes: int = 0
    read_wait_s: float = 0.0
    peak_resident_bytes: int = 0
    #: The root forward returned (an inner backward, e.g. a gradient penalty, may run before).
    ended: bool = False
    #: A callback is queued to run when the current backward pass ends.
    backward_queued: bool = False

    @property
    def unit(self) -> int:
        return len(self.units) - 1

    def begin_unit(self, name: str) -> UnitRecord:
        now = self.clock.mark()
        if self.units:
            self.units[-1].t_end = now
        self.units.append(UnitRecord(name, t_start=now))
        return self.units[-1]

    def end(self) -> None:
        self.units[-1].t_end = self.clock.mark()
        self.ended = True

    def profile(self, clock: Clock, *, write_bps: float, read_bps: float) -> StepProfile:
        """This forward and its backward as a :class:`StepProfile` (call once its backward ended).

        ``clock``: this record's clock, or one that reads no CUDA events (policies that do not
        plan by time skip the device synchronisation that reading them costs).
        """
        end_backward = clock.mark()
        units = self.units
        rows = []
        for k, u in enumerate(units):
            t_next = units[k + 1].t_start if k + 1 < len(units) else u.t_end
            b_end = units[k - 1].t_backward if k >= 2 else (end_backward if k == 1 else None)
            backward = clock.seconds(u.t_backward, b_end) - u.read_wait_s if u.t_backward is not None else 0.0
            rows.append(
                UnitProfile(
                    name=u.name,
                    forward_s=max(0.0, clock.seconds(u.t_start, t_next) - u.write_wait_s),
                    backward_s=max(0.0, backward),
                    eligible_bytes=u.eligible_bytes,
                    offloaded_bytes=u.offloaded_bytes,
                )
            )
        return StepProfile(
            units=tuple(rows),
            write_bps=write_bps,
            read_bps=read_bps,
            io_wait_s=self.read_wait_s,
            peak_resident_bytes=self.peak_resident_bytes,
            fixed_bytes=self.fixed_bytes,
        )


class NoTiming(Clock):
    """A clock that records nothing (see :meth:`ForwardRecord.profile`)."""

    def __init__(self) -> None:
        self.cuda = False

    def mark(self) -> Any:
        return None

    def seconds(self, start: Any, end: Any) -> float:
        return 0.0
