"""A PNG of a benchmark: median step time and peak activation memory per mode (matplotlib, Agg)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_results"]


def _get(row: Any, name: str) -> Any:
    return row.get(name) if isinstance(row, dict) else getattr(row, name, None)


def plot_results(results: Sequence[Any], out: str | Path, *, title: str = "gds-offload bench") -> Path:
    """Draw side-by-side bars of median step time (s) and peak activation memory (MiB or GiB) per mode.

    Bars are labelled with their ratio to ``keep``: a row's own ``step_ratio`` /
    ``memory_ratio`` when it has them (``bench --rounds``: the median of per-round
    ratios), else the bar over ``keep``'s when ``keep`` ran. A ``paired_ratio``
    (``bench --paired``) is added to the step-time label. Modes that did not run are
    left out.

    Args:
        results: :class:`~gds_offload.bench.train.spec.RunResult` objects or their dicts.
        out: the PNG to write (parent directories are created).
        title: the figure title.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'gds_offload[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"plotting needs matplotlib ({exc}); pip install 'gds_offload[plot]' or drop --plot") from exc
    rows = [r for r in results if _get(r, "status") == "ok" and _get(r, "median_step_s")]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    keep = next((r for r in rows if _get(r, "mode") == "keep"), None)
    modes = [_get(r, "mode") for r in rows]
    step = [_get(r, "median_step_s") for r in rows]
    peaks = [_get(r, "peak_activation_bytes") or 0 for r in rows]
    unit, scale = ("GiB", 2**30) if max(peaks, default=0) >= 2**30 else ("MiB", 2**20)
    mem = [p / scale for p in peaks]
    keep_mem = (_get(keep, "peak_activation_bytes") or 0) / scale if keep else None
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.6 * max(len(rows), 3) + 1.6))
    keep_step = _get(keep, "median_step_s") if keep else None
    step_ratios = [_get(r, "step_ratio") or (v / keep_step if keep_step else None) for r, v in zip(rows, step)]
    mem_ratios = [_get(r, "memory_ratio") or (v / keep_mem if keep_mem else None) for r, v in zip(rows, mem)]
    panels = [
        (axes[0], step, "median step time (s)", step_ratios, "{:.3g}"),
        (axes[1], mem, f"peak activation memory ({unit})", mem_ratios, "{:.3g}"),
    ]
    colors = ["#777777" if m == "keep" else "#2b7bba" if m.startswith("offload") or m == "adaptive" else "#d08c2a" for m in modes]
    for ax, values, label, ratios, fmt in panels:
        y = range(len(values))
        ax.barh(list(y), values, color=colors)
        ax.set_yticks(list(y), modes)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
        top = max(values, default=0) or 1
        for i, v in enumerate(values):
            text = fmt.format(v) + (f"  ({ratios[i]:.2f}x)" if ratios[i] is not None else "")
            paired = _get(rows[i], "paired_ratio") if ax is axes[0] else None
            if paired is not None:
                text += f"  (paired {paired:.2f}x)"
            ax.text(v + top * 0.01, i, text, va="center", fontsize=9)
        ax.set_xlim(0, top * (1.75 if ax is axes[0] and any(_get(r, "paired_ratio") for r in rows) else 1.35))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
