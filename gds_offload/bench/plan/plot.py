"""The planner's curve as a PNG: predicted tokens/s against sequences per weight load, one line per
KV placement, the plans that do not fit the memory dashed, the choice marked (``gds-offload plan --plot``)."""
from __future__ import annotations

from pathlib import Path

from gds_offload.units import format_bytes
from gds_offload.weights.planning.planner import Finetune, Plan

__all__ = ["plot_plan"]


def plot_plan(plan: Plan, out: Path, *, measured: tuple[tuple[str, int, float], ...] = ()) -> Path:
    """Write the curve of ``plan`` to ``out`` (PNG); returns ``out``. ``measured``: points run for
    real (``(label, sequences per load, tokens/s)``: ``bench-plan``'s modes and sweep), drawn over it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for placement in sorted({kv for kv, *_ in plan.curve}):
        pts = [(seqs, tps, fits) for kv, seqs, tps, fits in plan.curve if kv == placement]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ":", color="grey", linewidth=0.8)
        fit = [(s, t) for s, t, f in pts if f]
        ax.plot([p[0] for p in fit], [p[1] for p in fit], "o-", markersize=3, label=placement)
    c, e = plan.choice, plan.predicted
    ax.plot([c.in_flight], [e.tokens_per_s], "r*", markersize=14, label=f"plan: {c.per_load} x {c.micro_batch}, {e.bound}-bound")
    for label, seqs, tps in measured:
        ax.plot([seqs], [tps], "kx" if label == "sweep" else "s", markersize=6, label=None if label == "sweep" else f"{label} (measured)")
    if any(label == "sweep" for label, _, _ in measured):
        ax.plot([], [], "kx", label="sweep (measured)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences per weight load (micro-batches x micro-batch size)")
    w = plan.workload
    if isinstance(w, Finetune):
        ax.set_ylabel("tokens trained/s (lines: predicted; marks: measured)")
        what = f"LoRA r={w.lora_r}: {w.sequences} sequences x {w.seq} tokens, {w.global_batch} per step"
    else:
        ax.set_ylabel("generated tokens/s (lines: predicted; marks: measured)")
        what = f"{w.prompts} prompts x {w.prompt_len} + {w.new_tokens} tokens"
    ax.set_title(f"{what}, {format_bytes(plan.memory_nbytes)} (dotted: over memory)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
