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
import sys
import time
from dataclasses import replace
from typing import Any

from gds_offload.commands.run_args import add_model_arguments, base_spec, check_outputs, positive_int, resolve_device, wrote_line
from gds_offload.errors import ConfigError

HELP = "benchmark keep / offload / recompute / ... on one model: step time, activation memory, exactness"

DEFAULT_MODES = "auto"
_OUT, _PLOT = "results/bench.json", "results/bench.png"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=5, warmup=2)
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated modes: keep, offload, offload:<engine>, offload:*, adaptive, recompute, save_on_cpu; auto: all that run here (default: auto)")
    p.add_argument("--rounds", type=positive_int, default=1, help="run every mode this many times, interleaved (each round starts one mode later); ratios are taken within a round and the median is reported: slow spells of a shared machine then hit every mode alike (default: 1)")
    p.add_argument("--paired", action="store_true", help="offload modes also time steps with the offloader paused, alternating with offloaded ones in the same process (ABBA); the 'x keep, paired' column is the median ratio of each pair (an odd --steps leaves the last offloaded step unpaired)")
    p.add_argument("--policy", default="all", choices=("all", "adaptive"), help="attach policy of the offload modes (default: all)")
    p.add_argument("--out", default=_OUT, help=f"JSON results file; '' for none (default: {_OUT}, in the current directory)")
    p.add_argument("--plot", default=_PLOT, help=f"PNG of step time and memory per mode; '' for none (default: {_PLOT}, in the current directory)")
    p.add_argument("--title", default="", help="a title for the result file (shown on the performance page)")
    p.add_argument("--about", default="", help="a sentence on what the run shows (shown on the performance page)")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    p.add_argument("--nproc", type=positive_int, default=1, help="also run every mode on this many DDP ranks through torchrun, interleaved with its one-process run (gds_offload/bench/train/ranks_suite.py); no plot (default: 1)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gds_offload.bench.train.checks import check_runs
    from gds_offload.bench.train.suite import (
        check_in_process,
        combine_rounds,
        plot_modes,
        render_table,
        results_doc,
        run_modes,
        select_modes,
        summarize,
        unexplained_differences,
    )

    if args.nproc > 1:
        return _run_ranks(args)
    try:
        check_outputs(("--out", args.out, _OUT), ("--plot", args.plot, _PLOT))
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
    doc = results_doc("bench", started, load_before, **_about(args), spec=base, path=base.path, modes=modes, summary=summary,
                      results=results, plot=args.plot or None)
    # On a CPU the thread count decides how much of the cores the I/O has to take from the model.
    counts = sorted({r.torch_threads for r in rows if r.torch_threads})
    threads = f"torch threads: {'/'.join(map(str, counts))}" if counts and device == "cpu" else ""
    if args.plot:
        no_plot = plot_modes(rows, summary, doc["machine"], base, args.plot, threads=threads)
        if no_plot is not None:
            console.print(f"[yellow]no plot: {no_plot}[/]")
            args.plot = ""
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
        written = wrote_line(args.out, args.plot)
        if written:
            Console().print(written, markup=False, highlight=False, soft_wrap=True)
    bad = summary["failed"] or unexplained_differences(summary)
    return 1 if bad else 0


def _about(args: argparse.Namespace) -> dict[str, Any]:
    """What the results file says about the command: where it goes, its title and text, the command line."""
    return {"out": args.out, "title": args.title, "about": args.about, "command": getattr(args, "command_line", None)}


def _run_ranks(args: argparse.Namespace) -> int:
    """``gds-offload bench`` with ``--nproc`` above 1 (:mod:`gds_offload.bench.train.ranks_suite`)."""
    from rich.console import Console

    from gds_offload.bench.train.ranks_suite import check_ranked, one_process_path, per_process_threads, render, run_all, summarize_settings
    from gds_offload.bench.train.suite import check_in_process, results_doc, select_modes, unexplained_differences

    nproc = args.nproc
    try:
        device = resolve_device(args.device)
        threads = per_process_threads(nproc)
        ranked = replace(base_spec(args, device), torch_threads=threads)
        modes = select_modes(args.modes, device, ranked.path)
        check_ranked(ranked, modes, nproc)
        single = replace(ranked, path=one_process_path(ranked.path, nproc))
    except (ConfigError, ValueError) as exc:
        print(f"gds-offload bench: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    started, load_before = time.time(), os.getloadavg()
    if args.json:
        results = run_all(single, ranked, modes, nproc, timeout_s=args.timeout, rounds=args.rounds, status=None)
    else:
        with console.status("starting") as status:
            results = run_all(single, ranked, modes, nproc, timeout_s=args.timeout, rounds=args.rounds, status=status)
    summary = summarize_settings(results, nproc)
    for setting in summary["settings"].values():
        if setting["all_losses_agree"] is False:
            check_in_process(setting, single, console)  # the offloader alone, in one process
    doc = results_doc("bench-ranks", started, load_before, **_about(args), spec=ranked, path=single.path, modes=modes,
                      summary=summary, results=results, nproc=nproc, torch_threads=threads, one_process_path=single.path)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        title = (f"gds-offload bench: {ranked.model} layers={ranked.layers} hidden={ranked.hidden} seq={ranked.seq} "
                 f"batch={ranked.batch} per process on {device}, 1 process and {nproc} DDP ranks, {threads} torch thread(s) each")
        if args.rounds > 1:
            title += f"; {args.rounds} interleaved rounds, x keep = median of per-round ratios"
        render(doc, title)
        if args.out:
            Console().print(f"results: {args.out}")
    bad = summary["failed"] or [m for s in summary["settings"].values() for m in unexplained_differences(s)]
    return 1 if bad else 0
