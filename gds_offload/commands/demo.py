"""``gds-offload demo``: train a GPT without, then with, ``attach(model)``; show it live; compare.

The model is the built-in GPT (or ``--model llama|gpt2``: Hugging Face classes built from
configs, random weights) on synthetic tokens, on the GPU if there is one, else the CPU,
sized by :data:`gds_offload.models.gpt.DEMO_QUICK_PRESETS` so that the whole demo takes about a
minute on a 2-core CPU (``--full``: :data:`~gds_offload.models.gpt.DEMO_PRESETS`, a step saving
about 1 GiB, more steps: 4-5 minutes there). Each run is a child process of
:mod:`gds_offload.bench.train.runner` (so each memory peak is measured on its own); this process
shows their progress live and the comparison at the end, then writes the results and a plot of
them (``results/demo.json`` and ``.png`` in the current directory; the line it prints last says where).

Figures in the summary:

* **step time**: median over the measured steps (warm-up excluded), and offload / keep.
  The offload run alternates offloaded steps with :meth:`~gds_offload.Offloader.paused`
  ones (``RunSpec(paired=True)``), so a second ratio compares steps seconds apart in one
  process: on a shared machine it is the steadier of the two. With an odd ``--steps`` the
  last step is offloaded and has no partner. When nothing was offloaded (every saved tensor
  under ``min_bytes``, as in a tiny ``--hidden``), a line says so and what to change.
* **peak activation memory**: measured from outside the offloader (peak RSS, or CUDA
  peak allocation, above a baseline taken before the first step, model and optimizer state
  built; see :mod:`gds_offload.bench.train.memory`),
  and the offloader's own ``peak_resident_bytes`` (saved-activation bytes it held at once).
* **I/O hidden behind compute**: ``1 - io_wait_s / (write_s + read_s)``:
  of the time the engine was moving bytes, the share during which the training thread
  was *not* blocked waiting for a read. 100 % means no step ever waited on the drive; it
  does not count CPU time the I/O threads took from compute (on a small CPU, compare the
  step times for that).
* **losses agree**: every loss (and the final parameters) bit-identical to the run
  without the offloader. The exit code is 1 when they are not, or a run failed.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from gds_offload.bench.procs import reap, spawn
from gds_offload.bench.train.torchrun import torchrun_command
from gds_offload.commands.run_args import add_model_arguments, base_spec, check_outputs, resolve_device, wrote_line
from gds_offload.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from gds_offload.bench.train.spec import RunResult, RunSpec

HELP = "train a GPT without and with the offloader, live; compare step time, memory and losses"

#: The default run (about a minute on a 2-core CPU) and ``--full`` (4-5 minutes there): measured steps and warm-up.
QUICK_STEPS, QUICK_WARMUP = 4, 1
FULL_STEPS, FULL_WARMUP = 8, 2
_OUT = "results/demo.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=QUICK_STEPS, warmup=QUICK_WARMUP)
    p.set_defaults(steps=None, warmup=None)  # from --full unless given
    p.add_argument("--full", action="store_true",
                   help=f"the full run: on a CPU sequences of 512 tokens, {FULL_WARMUP} warm-up + {FULL_STEPS} steps per run (4-5 minutes "
                        f"on 2 cores; the default, 256 tokens and {QUICK_WARMUP} + {QUICK_STEPS} steps, about one)")  # fmt: skip
    p.add_argument("--mode", default="auto", help="engine: auto, gds, compat, posix or host (default: auto)")
    p.add_argument("--policy", default="all", choices=("all", "adaptive"), help="attach policy: all or adaptive (default: all)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without offloading (no comparison)")
    p.add_argument("--nproc", type=int, default=1, help="data-parallel ranks, launched through torchrun (gds_offload/bench/train/demo_ranks.py)")
    p.add_argument("--out", default=_OUT, help=f"the results (JSON); '' for none (default: {_OUT}, in the current directory)")
    p.add_argument("--plot", default=None, help="PNG of step time and memory per run (default: OUT with .png; '' for none)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gds_offload.activations.config import DEFAULT_MIN_BYTES
    from gds_offload.bench.train.checks import check_runs
    from gds_offload.bench.train.demo_view import make_view, render_summary, summary_notes
    from gds_offload.bench.train.runner import run_mode
    from gds_offload.bench.train.spec import compare_losses, parse_mode

    run_lengths(args)
    if args.nproc != 1:  # several ranks: gds_offload/bench/train/demo_ranks.py
        return _launch_ranks(args)
    try:
        check_outputs(("--out", args.out, _OUT), ("--plot", args.plot, None))
        device = resolve_device(args.device)
        spec = base_spec(args, device)
        offload_mode = f"adaptive:{args.mode}" if args.policy == "adaptive" else f"offload:{args.mode}"
        parse_mode(offload_mode)
        spec = replace(spec, progress=True, paired=True, policy="all" if args.policy == "adaptive" else args.policy)
        runs = ([] if args.no_baseline else ["keep"]) + [offload_mode]
        check_runs(spec, runs)  # every argument, before the first child starts
    except (ConfigError, ValueError) as exc:
        print(f"gds-offload demo: {exc}", file=sys.stderr)
        return 2
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)  # a file or a pipe: no 80-column wrapping
    title = (f"gds-offload demo: {spec.model} layers={spec.layers} hidden={spec.hidden} heads={spec.heads} "
             f"seq={spec.seq} batch={spec.batch} on {device}, {spec.warmup} warm-up + {spec.steps} steps per run"
             + (f", tokens from {spec.data}" if spec.data else ", synthetic tokens") + ("" if args.full else " (--full: the longer run)"))
    view = make_view(console, title)
    started, load_before = time.time(), os.getloadavg()
    results = []
    for i, mode in enumerate(runs, 1):
        with view.run(f"run {i}/{len(runs)}: {mode}"):  # on a terminal, each run's last frame stays on screen
            results.append(run_mode(replace(spec, mode=mode), on_event=view.on_event, timeout_s=args.timeout))
    by_mode = {r.mode: r for r in results}
    keep, off = by_mode.get("keep"), by_mode.get(offload_mode)
    agree = compare_losses(results).get(offload_mode) if keep is not None else None
    console.print(render_summary(keep, off, agree))
    for note in summary_notes(off, DEFAULT_MIN_BYTES if spec.min_bytes is None else spec.min_bytes):
        console.print(note, markup=False, highlight=False)
    console.print(
        "[dim]peak activation memory: peak RSS (or CUDA allocation) above a baseline taken before the first step (model and "
        "optimizer state built), each run in its own "
        "process. I/O hidden behind compute = 1 - io_wait / (write + read busy time): the share of the drive's busy time "
        "the training thread did not wait for; CPU time taken by I/O threads shows in the step-time ratio instead.[/]"
    )
    for r in results:
        if r.status != "ok":
            console.print(f"[bold]{r.mode}[/]: [red]{r.status}[/] {r.error}")
    exact = agree
    if agree is False:
        from gds_offload.bench.train.child import LOSSES_DIFFER_NOTE, exact_in_process, in_process_verdict

        console.print(f"[yellow]Note: {LOSSES_DIFFER_NOTE}[/]")
        console.print("checking in one process: 2 steps without, then with the offloader, every loss and gradient ...")
        exact = exact_in_process(replace(spec, mode=offload_mode, progress=False))
        console.print(in_process_verdict(exact))
    written = _write_results(args, spec, runs, results, started, load_before, console)
    if written:
        console.print(written, markup=False, highlight=False, soft_wrap=True)
    failed = any(r.status != "ok" for r in results)
    return 1 if failed or exact is False else 0


def run_lengths(args: argparse.Namespace) -> None:
    """Fill in the measured steps and warm-up the user left out: the default run's, or ``--full``'s."""
    args.steps = args.steps or (FULL_STEPS if args.full else QUICK_STEPS)
    args.warmup = args.warmup or (FULL_WARMUP if args.full else QUICK_WARMUP)


def _write_results(args: argparse.Namespace, spec: RunSpec, runs: list[str], results: list[RunResult], started: float,
                   load_before: tuple[float, float, float], console: Console) -> str:  # fmt: skip
    """Write the results file and its plot beside it (``--out``, ``--plot``); the line that says where."""
    from gds_offload.bench.train.suite import combine_rounds, plot_modes, results_doc, summarize

    out = args.out
    plot = args.plot if args.plot is not None else (str(Path(out).with_suffix(".png")) if out else "")
    if not out and not plot:
        return ""
    summary = summarize(results)
    doc = results_doc("demo", started, load_before, out=out, title="", about="", command=getattr(args, "command_line", None), spec=spec,
                      path=spec.path, modes=runs, summary=summary, results=results, plot=plot or None)  # fmt: skip
    if plot:
        no_plot = plot_modes(combine_rounds(results), summary, doc["machine"], spec, plot)
        if no_plot is not None:
            console.print(f"[yellow]no plot: {no_plot}[/]")
            plot = ""
    return wrote_line(out, plot)


def _launch_ranks(args: argparse.Namespace) -> int:
    """Check the options, then start ``args.nproc`` ranks of the demo under torchrun
    (:mod:`gds_offload.bench.train.demo_ranks`, given the run's spec); their exit code (2: bad options)."""
    from gds_offload.bench.train.spec import parse_mode

    try:
        if args.nproc < 2:
            raise ConfigError(f"--nproc {args.nproc}: pass 2 or more ranks (1, the default, runs the one-process demo)")
        if args.steps < 1 or args.warmup < 0:
            raise ConfigError(f"--steps {args.steps} --warmup {args.warmup}: need at least 1 measured step and no negative warm-up")
        if args.no_baseline:
            raise ConfigError("--no-baseline: the demo on several ranks always trains without the offloader first, to compare")
        mode = f"offload:{args.mode}"
        parse_mode(mode)
        spec = replace(base_spec(args, resolve_device(args.device)), mode=mode)
    except (ConfigError, ValueError) as exc:
        print(f"gds-offload demo: {exc}", file=sys.stderr)
        return 2
    # torchrun tied to this process (its ranks die with it), started and reaped as every benchmark child is.
    cmd = torchrun_command(args.nproc, "gds_offload.bench.train.demo_ranks", ["--spec", spec.to_json()], owned=True)
    print(f"gds-offload demo: {shlex.join(cmd)}", flush=True)
    proc = spawn(cmd)  # the ranks print to this process's stdout and stderr
    try:
        return proc.wait()
    finally:
        reap(proc)  # a no-op once it has exited; on a stop signal it stops torchrun and its ranks first
