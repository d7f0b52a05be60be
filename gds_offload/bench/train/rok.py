"""The recompute-offload-keep (ROK) sweep: which micro-batch and placement is fastest within a memory limit.

For each micro-batch size and each placement (``keep``: everything in memory;
``recompute``: full layer-wise activation checkpointing; ``all``: offload every
eligible tensor; ``adaptive``: offload what the drive hides), one child process
trains the model and measures the median step time and the peak activation memory
(see :mod:`gds_offload.bench.train.child`). The points form the ROK curve: throughput
against activation memory. :func:`recommend` answers "with N bytes of activation
memory, which point gives the most tokens/s?".
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from gds_offload.bench.train.runner import run_mode
from gds_offload.bench.train.spec import RunResult, RunSpec

__all__ = ["PLACEMENTS", "Measured", "RokPoint", "sweep", "recommend", "frontier", "findings", "plot"]

#: Placement name -> (runner mode, attach policy).
PLACEMENTS: dict[str, tuple[str, str]] = {
    "keep": ("keep", "all"),
    "recompute": ("recompute", "all"),
    "all": ("offload", "all"),
    "adaptive": ("adaptive", "adaptive"),
}


class Measured(NamedTuple):
    """What a point that ran measured: its fields of :class:`RokPoint`, no longer optional."""

    tokens_per_s: float
    peak_activation_bytes: int


@dataclass(frozen=True)
class RokPoint:
    """One (micro-batch, placement) measurement."""

    placement: str
    batch: int
    status: str
    tokens_per_s: float | None
    median_step_s: float | None
    peak_activation_bytes: int | None
    error: str = ""
    losses_hex: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.tokens_per_s is not None and self.peak_activation_bytes is not None

    @property
    def measured(self) -> Measured:
        """``tokens_per_s`` and ``peak_activation_bytes`` of a point that ran (:attr:`ok`).

        Raises:
            ValueError: the point failed and measured nothing.
        """
        if not self.ok or self.tokens_per_s is None or self.peak_activation_bytes is None:
            raise ValueError(f"batch {self.batch} {self.placement} measured nothing ({self.status})")
        return Measured(self.tokens_per_s, self.peak_activation_bytes)


def sweep(
    base: RunSpec,
    batches: Sequence[int],
    placements: Sequence[str],
    *,
    on_point: Callable[[RokPoint], None] | None = None,
    timeout_s: float | None = None,
) -> list[RokPoint]:
    """Measure every (batch, placement) pair, each in its own child process.

    Raises:
        ValueError: an unknown placement name.
    """
    unknown = [p for p in placements if p not in PLACEMENTS]
    if unknown:
        raise ValueError(f"unknown placement(s) {unknown}; expected some of {', '.join(PLACEMENTS)}")
    points = []
    for batch in batches:
        for placement in placements:
            mode, policy = PLACEMENTS[placement]
            spec = dataclasses.replace(base, mode=mode, policy=policy, batch=batch)
            r: RunResult = run_mode(spec, timeout_s=timeout_s)
            point = RokPoint(
                placement, batch, r.status, r.tokens_per_s, r.median_step_s, r.peak_activation_bytes, r.error,
                tuple(r.losses_hex),
            )
            points.append(point)
            if on_point is not None:
                on_point(point)
    return points


def recommend(points: Sequence[RokPoint], memory_bytes: int) -> RokPoint | None:
    """The point with the most tokens/s whose peak activation memory fits ``memory_bytes``."""
    fitting = [p for p in points if p.ok and p.measured.peak_activation_bytes <= memory_bytes]
    return max(fitting, key=lambda p: p.measured.tokens_per_s, default=None)


def frontier(points: Sequence[RokPoint]) -> list[RokPoint]:
    """The Pareto frontier: points no other point beats on both memory and throughput, by memory."""
    ok = sorted((p for p in points if p.ok), key=lambda p: (p.measured.peak_activation_bytes, -p.measured.tokens_per_s))
    out: list[RokPoint] = []
    for p in ok:
        if not out or p.measured.tokens_per_s > out[-1].measured.tokens_per_s:
            out.append(p)
    return out


def findings(points: Sequence[RokPoint]) -> dict[str, Any]:
    """Per micro-batch, the ratios TBA reports: offload vs recompute memory, offload vs keep throughput."""
    out: dict[str, Any] = {}
    by = {(p.batch, p.placement): p for p in points if p.ok}
    for batch in sorted({p.batch for p in points}):
        keep, rec = by.get((batch, "keep")), by.get((batch, "recompute"))
        row: dict[str, Any] = {}
        for name in ("all", "adaptive"):
            off = by.get((batch, name))
            if off is None:
                continue
            tps, peak = off.measured
            if keep is not None:
                row[f"{name}_throughput_vs_keep"] = tps / keep.measured.tokens_per_s
                row[f"{name}_memory_vs_keep"] = peak / max(keep.measured.peak_activation_bytes, 1)
            if rec is not None:
                row[f"{name}_memory_vs_recompute"] = peak / max(rec.measured.peak_activation_bytes, 1)
                row[f"{name}_throughput_vs_recompute"] = tps / rec.measured.tokens_per_s
        out[str(batch)] = row
    return out


def plot(points: Sequence[RokPoint], out: Path, *, title: str, memory_bytes: int | None = None) -> Path:
    """Draw the ROK curve (tokens/s against peak activation memory) to ``out`` (PNG or SVG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = {"keep": "o", "recompute": "s", "all": "^", "adaptive": "D"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for placement in PLACEMENTS:
        pts = sorted((p for p in points if p.ok and p.placement == placement), key=lambda p: p.batch)
        if not pts:
            continue
        xs = [p.measured.peak_activation_bytes / 2**20 for p in pts]
        ys = [p.measured.tokens_per_s for p in pts]
        ax.plot(xs, ys, marker=markers.get(placement, "x"), label=placement)
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(f"b{p.batch}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if memory_bytes:
        ax.axvline(memory_bytes / 2**20, color="grey", linestyle="--", linewidth=1)
        best = recommend(points, memory_bytes)
        if best is not None:
            ax.scatter([best.measured.peak_activation_bytes / 2**20], [best.measured.tokens_per_s], s=160, facecolors="none", edgecolors="red")
    ax.set_xlabel("peak activation memory (MiB)")
    ax.set_ylabel("tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
