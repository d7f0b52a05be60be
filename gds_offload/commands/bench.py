"""``gds-offload bench``: train one model in several modes, each in its own process, and compare.

Modes (``--modes``, comma-separated): ``keep`` (no offloader), ``offload`` (engine
``auto``), ``offload:<engine>`` (``posix``, ``compat``, ``host``, ``gds``),
``offload:*`` (every engine that runs here), ``adaptive`` (``policy="adaptive"``),
``recompute`` (per-layer activation checkpointing) and ``save_on_cpu`` (CUDA only).
``auto`` (the default) is ``keep,offload:*,adaptive,recompute`` plus ``save_on_cpu`` on
a GPU. See :mod:`gds_offload.bench.train.child` for how each mode is run and measured.

Models (``--model``): ``gpt`` (the built-in GPT), ``llama`` / ``gpt2`` (Hugging Face
``LlamaForCausalLM`` / ``GPT2LMHeadModel`` built from a config of the requested size,
random weights), or ``pkg.module:factory``: a function called with a
:class:`~gds_offload.bench.train.workload.ModelSpec` (the sizes below, ``seed`` and ``device``)
that returns ``(model, batch_fn)`` or ``(model, batch_fn, loss_fn)``, where
``batch_fn(step: int)`` returns that step's batch (a function of the step only) and the
loss is ``loss_fn(model, batch)``, else the model's output for the batch (``**dict``,
``*tuple`` or the object), itself a scalar tensor or with ``.loss``. The module must be
importable by the child processes (from the current directory or ``PYTHONPATH``). Example::

    gds-offload bench --modes keep,offload:posix,offload:compat,recompute --steps 5
    gds-offload bench --model llama --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4
    gds-offload bench --model mypkg.models:make --modes keep,offload

Exit code: 0 when every mode that could run here ran and all losses agree bit for bit
with ``keep``; 1 when losses disagree or a mode failed (``unavailable`` modes do not count).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

from gds_offload.commands.run_args import add_model_arguments, base_spec, check_runs, positive_int, resolve_device

HELP = "benchmark keep / offload / recompute / ... on one model: step time, activation memory, exactness"

DEFAULT_MODES = "auto"

T = TypeVar("T")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=5, warmup=2)
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated modes: keep, offload, offload:<engine>, offload:*, adaptive, recompute, save_on_cpu; auto: all that run here (default: auto)")
    p.add_argument("--rounds", type=positive_int, default=1, help="run every mode this many times, interleaved (each round starts one mode later); ratios are taken within a round and the median is reported: slow spells of a shared machine then hit every mode alike (default: 1)")
    p.add_argument("--paired", action="store_true", help="offload modes also time steps with the offloader paused, alternating with offloaded ones in the same process (ABBA); the 'x keep, paired' column is the median ratio of each pair (an odd --steps leaves the last offloaded step unpaired)")
    p.add_argument("--policy", default="all", choices=("all", "adaptive"), help="attach policy of the offload modes (default: all)")
    p.add_argument("--out", default="results/bench.json", help="JSON results file; '' for none (default: results/bench.json)")
    p.add_argument("--plot", default="results/bench.png", help="PNG of step time and memory per mode; '' for none (default: results/bench.png)")
    p.add_argument("--title", default="", help="a title for the result file (shown on the performance page)")
    p.add_argument("--about", default="", help="a sentence on what the run shows (shown on the performance page)")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    p.add_argument("--nproc", type=positive_int, default=1, help="also run every mode on this many DDP ranks through torchrun, interleaved with its one-process run (gds_offload/commands/bench_ranks.py); no plot (default: 1)")


def select_modes(text: str, device: str, path: str | None) -> list[str]:
    """``--modes`` expanded (``auto``, ``offload:*``) and validated."""
    from gds_offload.bench.train.spec import expand_modes

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
    from gds_offload.bench.train.spec import compare_losses, paired_ratios

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
    from gds_offload.bench.train.child import exact_in_process
    from gds_offload.bench.train.spec import parse_mode

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

    ``step_seconds`` holds every round's steps and ``median_step_s`` is their median;
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
        steps = [s for r in runs for s in r.step_seconds]
        paused = [s for r in runs for s in r.paired_keep_seconds]
        peaks = [r.peak_activation_bytes for r in runs if r.peak_activation_bytes is not None]
        median = statistics.median(steps)
        out.append(replace(
            runs[0],
            step_seconds=steps,
            paired_keep_seconds=paused,
            median_step_s=median,
            tokens_per_s=runs[0].tokens_per_step / median if median else None,
            peak_activation_bytes=int(statistics.median(peaks)) if peaks else None,
            wall_s=sum(r.wall_s for r in runs),
        ))
    return out


def _fmt_bytes(n: float | None) -> str:
    from gds_offload.units import format_bytes

    return "-" if n is None else format_bytes(n)


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
        steps = max(1, off.get("steps", 0) or len(r.step_seconds))
        agree = s["losses_agree"]
        table.add_row(
            r.mode,
            f"{r.median_step_s:.3f} s",
            f"{s['step_ratio']:.2f}" if s.get("step_ratio") is not None else "-",
            *([f"{s['paired_ratio']:.2f}" if "paired_ratio" in s else "-"] if paired else []),
            _fmt_bytes(r.peak_activation_bytes),
            f"{s['memory_ratio']:.2f}" if s.get("memory_ratio") is not None else "-",
            f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-",
            _fmt_bytes(off["bytes_offloaded"] / steps) if off else "-",
            _fmt_bytes(off["bytes_deduplicated"] / steps) if off else "-",
            f"{off['io_wait_seconds'] / steps:.3f} s" if off else "-",
            "-" if agree is None else "[green]yes[/]" if agree else "[red]NO[/]",
        )
    console.print(table)
    for r in results:
        if r.status != "ok":
            console.print(f"[bold]{r.mode}[/]: {r.error}")
    if summary["all_losses_agree"] is False:
        from gds_offload.bench.train.child import LOSSES_DIFFER_NOTE, in_process_verdict

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
    from gds_offload.bench.train.runner import run_mode

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
    args: argparse.Namespace, kind: str, started: float, load_before: tuple[float, float, float], *,
    spec: Any, path: str | None, modes: list[str], summary: dict[str, Any], results: list[Any], **fields: Any,
) -> dict[str, Any]:
    """The results file of a ``bench`` run (written to ``--out`` unless it is ''): what ran, at
    which commit, when, under what load, on which machine (``path``: its spill drive), the
    ``fields`` of its kind, and the figures."""
    from gds_offload.bench.docs.report import current_commit
    from gds_offload.bench.machine import describe_machine

    doc = {
        "kind": kind,
        "title": args.title or None,
        "about": args.about or None,
        "command": getattr(args, "command_line", shlex.join(sys.argv)),
        "commit": current_commit(),
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
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gds_offload.errors import ConfigError

    if args.nproc > 1:
        from gds_offload.commands.bench_ranks import run as run_ranks

        return run_ranks(args)
    try:
        device = resolve_device(args.device)
        base = base_spec(args, device)
        modes = select_modes(args.modes, device, base.path)
        check_runs(base, modes)
    except (ConfigError, ValueError) as exc:
        print(f"gds-offload bench: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    started = time.time()
    load_before = os.getloadavg()
    if args.json:
        results = run_modes(base, modes, timeout_s=args.timeout, rounds=args.rounds)
    else:
        with console.status("starting") as status:
            results = run_modes(base, modes, timeout_s=args.timeout, status=status, rounds=args.rounds)
    summary = summarize(results)
    if summary["all_losses_agree"] is False:
        check_in_process(summary, base, console)
    rows = combine_rounds(results)
    doc = results_doc(args, "bench", started, load_before, spec=base, path=base.path, modes=modes, summary=summary,
                      results=results, plot=args.plot or None)
    # On a CPU the thread count decides how much of the cores the I/O has to take from the model.
    counts = sorted({r.torch_threads for r in rows if r.torch_threads})
    threads = f"torch threads: {'/'.join(map(str, counts))}" if counts and device == "cpu" else ""
    if args.plot:
        try:
            from gds_offload.bench.docs.plot import plot_results

            m = doc["machine"]
            title = (f"{base.model} L{base.layers} h{base.hidden} seq{base.seq} batch{base.batch} on {device} "
                     f"({m['cpu_usable']} CPUs{', ' + threads if threads else ''}{', ' + m['gpus'][0] if m['gpus'] else ''}; {m['filesystem']})")
            ratios = {m: {k: v for k, v in row.items() if k in ("step_ratio", "memory_ratio", "paired_ratio")} for m, row in summary["modes"].items()}
            plot_results([r.as_dict() | ratios[r.mode] for r in rows], args.plot, title=title)
        except ImportError as exc:
            console.print(f"[yellow]no plot: {exc}[/]")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        title = f"gds-offload bench: {base.model} layers={base.layers} hidden={base.hidden} seq={base.seq} batch={base.batch} on {device}"
        if threads:
            title += f" ({threads})"
        if args.rounds > 1:
            title += f"; {args.rounds} interleaved rounds, x keep = median of per-round ratios"
        if args.paired:
            title += "; x keep, paired = offloaded step / paused step in one process"
        render_table(rows, summary, title=title)
        if args.out:
            Console().print(f"results: {args.out}" + (f", plot: {args.plot}" if args.plot else ""))
    bad = summary["failed"] or unexplained_differences(summary)
    return 1 if bad else 0
