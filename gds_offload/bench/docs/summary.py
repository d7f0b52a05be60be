"""The performance page's first table: how fast, against what. One row per job and peer measured
beside it, read from the same result files as the sections below (nothing typed by hand): this
project's figure, the peer's, the ratio, and the machine.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["FULL_PEERS", "anchor", "full_comparison", "summary_rows", "render_summary"]


class Result(Protocol):
    """A result file as the page renders it (:class:`~gds_offload.bench.docs.report.Section`)."""

    @property
    def title(self) -> str: ...

    @property
    def doc(self) -> dict[str, Any]: ...


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")

#: What each weight benchmark's ``planned_over_<peer>`` compares against, in words.
_PEERS = {
    "resident": "the whole model in memory (resident), its best batch",
    "naive": "streaming one micro-batch per load (naive)",
    "accelerate-disk": "Accelerate's disk offload, its best batch",
    "airllm": "AirLLM, its best batch",
    "deepspeed-zero-inference": "DeepSpeed ZeRO-Inference, its best batch",
}


def _machine(doc: dict[str, Any]) -> str:
    m = doc.get("machine") or {}
    cpu = f"{m.get('cpu_usable') or m.get('cpu_cores') or '?'} CPUs"
    gpu = ", ".join(m["gpus"]) if m.get("gpus") else "no GPU"
    return f"{cpu}, {gpu}"


def _fig(s: dict[str, Any]) -> str:
    time = s.get("paired_ratio") or s.get("step_ratio")
    if time is None or s.get("memory_ratio") is None:
        return "failed"
    return f"{s['memory_ratio']:.2f}x memory, {time:.2f}x step time"


def _train(doc: dict[str, Any]) -> tuple[str, str] | None:
    modes = doc["summary"]["modes"]
    ours = next((m for m in modes if m.startswith("offload")), None)
    if ours is None:
        return None
    o = modes[ours]
    against = ["keep: 1.00x memory, 1.00x step time"]
    for peer in ("recompute", "save_on_cpu"):
        p = modes.get(peer)
        if p is None:
            against.append(f"{peer}: not in this run")
        elif p.get("memory_ratio"):
            against.append(f"{peer}: {_fig(p)} (offload: {o['memory_ratio'] / p['memory_ratio']:.2f}x its memory)")
    return f"{ours}: {_fig(o)}", "; ".join(against)


def _planned(doc: dict[str, Any], unit: str) -> tuple[str, str] | None:
    against = [f"{_PEERS.get(k.removeprefix('planned_over_'), k.removeprefix('planned_over_'))}: planned {r:.2f}x its {unit}"
               for k, r in doc["summary"].items() if k.startswith("planned_over_") and r is not None]  # fmt: skip
    return ("planned by the Balance Beam planner", "; ".join(against)) if against else None


#: The modes ``bench-finetune --full`` compares streaming with.
FULL_PEERS = ("resident", "deepspeed-infinity")


def full_comparison(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any] | None]] | None:
    """``bench-finetune --full``: the streamed row at the largest micro-batch that ran, and each
    peer of :data:`FULL_PEERS` in the run: its row at that micro-batch, or ``None`` if it failed there.
    ``None`` when no streamed row ran."""
    rows = doc["summary"]["full"]
    ok = {(r["mode"], r["batch"]): r for r in rows if r.get("tokens_per_s")}
    drive = [r for (mode, _), r in ok.items() if mode == "drive"]
    if not drive:
        return None
    r = max(drive, key=lambda r: r["batch"])
    return r, {mode: ok.get((mode, r["batch"])) for mode in FULL_PEERS if any(x["mode"] == mode for x in rows)}


def _full(doc: dict[str, Any]) -> tuple[str, str] | None:
    found = full_comparison(doc)
    if found is None:
        return None
    r, peers = found
    labels = {"resident": "every weight in memory", "deepspeed-infinity": "DeepSpeed ZeRO-Infinity"}
    against = [f"{labels[m]}: {o['tokens_per_s']:.3g} train tok/s (streamed: {r['tokens_per_s'] / o['tokens_per_s']:.2f}x)" if o is not None
               else f"{labels[m]}: failed (out of memory or error)" for m, o in peers.items()]  # fmt: skip
    return f"streamed from the drive: {r['tokens_per_s']:.3g} train tok/s", "; ".join(against)


#: The jobs in the order a user asks about them.
_JOBS = ("train a model, activations offloaded", "generate, weights streamed", "LoRA fine-tuning, weights streamed", "full fine-tuning, weights streamed")


def summary_rows(sections: Sequence[Result]) -> list[tuple[str, str, str, str]]:
    """``(job and result, this project, against what, machine)`` for each result that compares
    this project with something a user would run instead."""
    out: list[tuple[int, str, str, str, str]] = []
    for s in sections:
        doc, summary = s.doc, s.doc.get("summary")
        if not isinstance(summary, dict):
            continue
        if "modes" in summary and "rounds" in summary:
            job, row = 0, _train(doc)
        elif (doc.get("workload") or {}).get("kind") == "finetune":
            job, row = 2, _planned(doc, "train tok/s")
        elif any(k.startswith("planned_over_") for k in summary):
            job, row = 1, _planned(doc, "tok/s")
        elif "full" in summary:
            job, row = 3, _full(doc)
        else:
            continue
        if row is not None:
            out.append((job, f"{_JOBS[job]}: [{s.title}](#{anchor(s.title)})", *row, _machine(doc)))
    return [r[1:] for r in sorted(out, key=lambda r: r[0])]


def render_summary(sections: Sequence[Result]) -> list[str]:
    """The page's opening section: the table of :func:`summary_rows`."""
    rows = summary_rows(sections)
    if not rows:
        return []
    lines = ["## How fast, against what", "",
             "Each row compares this project with what a user would run instead, measured in the same run on the",
             "machine named (memory and step time are ratios to keeping everything; tok/s ratios are this project's",
             "over the other's). The sections below give each run's command, commit and every figure.", "",
             "| job, result | this project | against | machine |", "| --- | --- | --- | --- |"]  # fmt: skip
    lines += [f"| {' | '.join(cell.replace('|', chr(92) + '|') if i else cell for i, cell in enumerate(r))} |" for r in rows]
    return [*lines, ""]
