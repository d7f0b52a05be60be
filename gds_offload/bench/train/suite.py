"""``gds-offload bench``'s runs: every mode in its own process, rounds, summaries, the results file and table.

The command (:mod:`gds_offload.commands.bench`) checks its flags and calls these: the modes
expanded (:func:`select_modes`), run one after the other in child processes
(:func:`run_modes`, each through :func:`~gds_offload.bench.train.runner.run_mode`), summarised
against ``keep`` round by round (:func:`summarize`), a cross-process loss difference checked
again in one process (:func:`check_in_process`), the results file (:func:`results_doc`) and
the table (:func:`render_table`). With ``--nproc``: :mod:`gds_offload.bench.train.ranks_suite`.
"""
from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

from gds_offload.bench.docs.plot import plot_results
from gds_offload.bench.docs.report import current_commit
from gds_offload.bench.docs.stale import exercised_paths
from gds_offload.bench.machine import describe_machine
from gds_offload.bench.train.child import LOSSES_DIFFER_NOTE, exact_in_process, in_process_verdict
from gds_offload.bench.train.runner import run_mode
from gds_offload.bench.train.spec import compare_losses, expand_modes, paired_ratios, parse_mode
from gds_offload.units import format_bytes

__all__ = [
    "check_in_process",
    "combine_rounds",
    "render_table",
    "results_doc",
    "round_order",
    "run_modes",
    "select_modes",
    "summarize",
    "unexplained_differences",
    "plot_modes",
]

T = TypeVar("T")


def select_modes(text: str, device: str, path: str | None) -> list[str]:
    """``--modes`` expanded (``auto``, ``offload:*``) and validated."""

    if text.strip() == "auto":
        text = "keep,offload:*,adaptive,recompute" + (",save_on_cpu" if device.startswith("cuda") else "")
    return expand_modes(text.split(","), device, path)


def summarize(results: list[Any]) -> dict[str, Any]:
    """Per mode: its ratios to ``keep`` and whether its losses agree with ``keep``'s.

    Each ratio is taken within one round (against that round's ``keep``), and the
    summary's ``step_ratio`` / ``memory_ratio`` is the median over rounds; the
    per-round ratios are in ``step_ratios`` / ``memory_ratios``. Paired runs add
    ``paired_ratio``: the median, over every pair of every round, of an offloaded
    step's time over its paused partner's (``paired_ratios``). Losses agree when they
    agree in every round.
    """

    rounds = sorted({r.round for r in results})
    per_round = {k: [r for r in results if r.round == k] for k in rounds}
    rows: dict[str, dict[str, Any]] = {}
    for k in rounds:
        agree = compare_losses(per_round[k])
        keep = next((r for r in per_round[k] if r.mode == "keep" and r.status == "ok"), None)
        for r in per_round[k]:
            row = rows.setdefault(r.mode, {"status": r.status, "losses_agree": None, "step_ratios": [], "memory_ratios": []})
            if row["status"] == "ok":  # a mode that failed in any round shows that failure
                row["status"] = r.status
            if agree.get(r.mode) is not None:
                row["losses_agree"] = agree[r.mode] and row["losses_agree"] is not False
            if keep is not None and r.status == "ok" and keep.median_step_s:
                row["step_ratios"].append(r.median_step_s / keep.median_step_s)
                if r.peak_activation_bytes is not None and keep.peak_activation_bytes:
                    row["memory_ratios"].append(r.peak_activation_bytes / keep.peak_activation_bytes)
    for mode, row in rows.items():
        pairs = [x for r in results if r.mode == mode and r.status == "ok" for x in paired_ratios(r)]
        if pairs:
            row["paired_ratios"] = pairs
            row["paired_ratio"] = statistics.median(pairs)
        row["step_ratio"] = statistics.median(row["step_ratios"]) if row["step_ratios"] else None
        row["memory_ratio"] = statistics.median(row["memory_ratios"]) if row["memory_ratios"] else None
    checked = [v["losses_agree"] for v in rows.values() if v["losses_agree"] is not None]
    return {
        "rounds": len(rounds),
        "modes": rows,
        "all_losses_agree": all(checked) if checked else None,
        "failed": sorted({r.mode for r in results if r.status == "error"}),
        "unavailable": sorted({r.mode for r in results if r.status == "unavailable"}),
    }


def check_in_process(summary: dict[str, Any], base: Any, console: Any = None) -> None:
    """For each offload mode whose losses differed from keep's across processes, decide in one
    process (:func:`~gds_offload.bench.train.child.exact_in_process`) and record the verdict as the
    mode's ``exact_in_process`` in ``summary``. Other modes (recompute, ...) are not checked."""

    for mode, row in summary["modes"].items():
        if row["losses_agree"] is False and parse_mode(mode)[0] in ("offload", "adaptive"):
            if console is not None:
                console.print(f"{mode}: losses differ from keep's process; checking in one process (2 steps without, then with) ...")
            row["exact_in_process"] = exact_in_process(replace(base, mode=mode, progress=False))


def unexplained_differences(summary: dict[str, Any]) -> list[str]:
    """Modes whose losses differed from keep's and were not shown bit-identical in one process."""
    return [m for m, row in summary["modes"].items() if row["losses_agree"] is False and row.get("exact_in_process") is not True]


def combine_rounds(results: list[Any]) -> list[Any]:
    """One row per mode (in first-seen order) pooling its rounds.

    ``step_s`` holds every round's steps and ``median_step_s`` is their median;
    ``peak_activation_bytes`` is the median of the rounds' peaks; ``offload`` and the
    rest come from the mode's first round. A mode that failed in any round is that
    failed row.
    """
    out: list[Any] = []
    for mode in dict.fromkeys(r.mode for r in results):
        runs = [r for r in results if r.mode == mode]
        bad = next((r for r in runs if r.status != "ok"), None)
        if bad is not None or len(runs) == 1:
            out.append(bad or runs[0])
            continue
        steps = [s for r in runs for s in r.step_s]
        paused = [s for r in runs for s in r.paired_keep_s]
        peaks = [r.peak_activation_bytes for r in runs if r.peak_activation_bytes is not None]
        median = statistics.median(steps)
        out.append(replace(
            runs[0],
            step_s=steps,
            paired_keep_s=paused,
            median_step_s=median,
            tokens_per_s=runs[0].tokens_per_step / median if median else None,
            peak_activation_bytes=int(statistics.median(peaks)) if peaks else None,
            wall_s=sum(r.wall_s for r in runs),
        ))
    return out



def render_table(results: list[Any], summary: dict[str, Any], *, title: str) -> None:
    """The results as a rich table, then one line per mode that did not run."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=150)  # a file or a pipe: no 80-column wrapping
    table = Table(title=title)
    paired = any("paired_ratio" in s for s in summary["modes"].values())
    cols = ["mode", "step (median)", "x keep", *(["x keep, paired"] if paired else []), "peak act. mem", "x keep",
            "tokens/s", "offloaded/step", "dedup/step", "I/O wait/step", "losses = keep"]
    for col in cols:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in results:
        s = summary["modes"][r.mode]
        if r.status != "ok":
            table.add_row(r.mode, f"[red]{r.status}[/]" if r.status == "error" else f"[yellow]{r.status}[/]", *["-"] * (len(cols) - 2))
            continue
        off = r.offload or {}
        steps = max(1, off.get("steps", 0) or len(r.step_s))
        agree = s["losses_agree"]
        table.add_row(
            r.mode,
            f"{r.median_step_s:.3f} s",
            f"{s['step_ratio']:.2f}" if s.get("step_ratio") is not None else "-",
            *([f"{s['paired_ratio']:.2f}" if "paired_ratio" in s else "-"] if paired else []),
            format_bytes(r.peak_activation_bytes),
            f"{s['memory_ratio']:.2f}" if s.get("memory_ratio") is not None else "-",
            f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-",
            format_bytes(off["bytes_offloaded"] / steps) if off else "-",
            format_bytes(off["bytes_deduplicated"] / steps) if off else "-",
            f"{off['io_wait_s'] / steps:.3f} s" if off else "-",
            "-" if agree is None else "[green]yes[/]" if agree else "[red]NO[/]",
        )
    console.print(table)
    for r in results:
        if r.status != "ok":
            console.print(f"[bold]{r.mode}[/]: {r.error}")
    if summary["all_losses_agree"] is False:

        console.print("[red]losses differ between modes (bit-identical expected)[/]")
        console.print(f"[yellow]{LOSSES_DIFFER_NOTE}[/]")
        for mode, row in summary["modes"].items():
            if "exact_in_process" in row:
                console.print(f"{mode}: {in_process_verdict(row['exact_in_process'])}")


def round_order(modes: list[T], k: int) -> list[T]:
    """The order of round ``k``: ``modes`` (or any runs) rotated left by ``k``, so that none always runs first or last."""
    k %= max(1, len(modes))
    return modes[k:] + modes[:k]


def run_modes(base: Any, modes: list[str], *, timeout_s: float, status: Any = None, rounds: int = 1) -> list[Any]:
    """Run each mode in its own child process, one after the other, ``rounds`` times.

    Round ``k`` runs the modes in :func:`round_order` ``(modes, k)``; every result
    carries its ``round``.
    """

    results = []
    total = len(modes) * rounds
    for k in range(rounds):
        for i, mode in enumerate(round_order(modes, k), 1):
            label = f"[{k * len(modes) + i}/{total}] {mode}" + (f" (round {k + 1}/{rounds})" if rounds > 1 else "")

            def on_event(ev: dict[str, Any], label: str = label) -> None:
                if status is not None and ev.get("event") == "step":
                    status.update(f"{label}: {ev['phase']} step {ev['step'] + 1}/{base.warmup + base.steps} ({ev['step_s']:.2f} s)")

            if status is not None:
                status.update(f"{label}: starting")
            r = run_mode(replace(base, mode=mode, progress=status is not None), on_event=on_event, timeout_s=timeout_s)
            r.round = k
            results.append(r)
    return results


def results_doc(
    kind: str, started: float, load_before: tuple[float, float, float], *, out: str, title: str, about: str,
    command: str | None, spec: Any, path: str | None, modes: list[str], summary: dict[str, Any], results: list[Any], **fields: Any,
) -> dict[str, Any]:
    """The results file of a ``bench`` run (written to ``out`` unless it is ''): what ran
    (``command``: the command line as given, default ``sys.argv``), at which commit, when,
    under what load, on which machine (``path``: its spill drive), the ``fields`` of its kind,
    and the figures; ``title`` and ``about`` are shown on the performance page."""
    doc = {
        "kind": kind,
        "title": title or None,
        "about": about or None,
        "command": command or shlex.join(sys.argv),
        "commit": current_commit(),
        "exercises": exercised_paths("bench"),
        **fields,
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": time.time() - started,
        # Other work on the machine moves step times (not memory or exactness): recorded with them.
        "load_average": {"start": list(load_before), "end": list(os.getloadavg())},
        "spec": asdict(spec) | {"mode": None, "progress": None},
        "modes": modes,
        "machine": describe_machine(path).as_dict(),
        "summary": summary,
        "results": [r.as_dict() for r in results],
    }
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def plot_modes(rows: list[Any], summary: dict[str, Any], machine: dict[str, Any], base: Any, out: str, *, threads: str = "") -> str | None:
    """Draw ``rows`` (:func:`combine_rounds`) with their ratios to keep (``summary``) into the PNG
    ``out``, titled by the model and ``machine`` (a results document's); ``None``, or why there is
    no plot (matplotlib missing)."""
    gpu = f", {machine['gpus'][0]}" if machine["gpus"] else ""
    title = (f"{base.model} L{base.layers} h{base.hidden} seq{base.seq} batch{base.batch} on {base.device} "
             f"({machine['cpu_usable']} CPUs{', ' + threads if threads else ''}{gpu}; {machine['filesystem']})")
    ratios = {m: {k: v for k, v in row.items() if k in ("step_ratio", "memory_ratio", "paired_ratio")} for m, row in summary["modes"].items()}
    try:  # matplotlib is optional: plot_results imports it
        plot_results([r.as_dict() | ratios[r.mode] for r in rows], out, title=title)
    except ImportError as exc:
        return str(exc)
    return None
