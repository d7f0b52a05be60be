"""``gds-offload demo``: train a GPT without, then with, ``attach(model)``; show it live; compare.

The model is the built-in GPT (or ``--model llama|gpt2``: Hugging Face classes built from
configs, random weights) on synthetic tokens, on the GPU if there is one, else the CPU,
sized by :data:`gds_offload.models.gpt.DEMO_PRESETS` so that a step saves about 1 GiB of
activations and the whole demo takes minutes on a CPU. Each run is a
child process of :mod:`gds_offload.bench.train.runner` (so each memory peak is measured on its
own); this process shows their progress live and the comparison at the end.

Figures in the summary:

* **step time**: median over the measured steps (warm-up excluded), and offload / keep.
  The offload run alternates offloaded steps with :meth:`~gds_offload.Offloader.paused`
  ones (``RunSpec(paired=True)``), so a second ratio compares steps seconds apart in one
  process: on a shared machine it is the steadier of the two. With an odd ``--steps`` the
  last step is offloaded and has no partner.
* **peak activation memory**: measured from outside the offloader (peak RSS, or CUDA
  peak allocation, above the post-warm-up baseline; see :mod:`gds_offload.bench.train.child`),
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
import shlex
import sys
from dataclasses import replace

from gds_offload.bench.procs import reap, spawn
from gds_offload.bench.train.torchrun import torchrun_command
from gds_offload.commands.run_args import add_model_arguments, base_spec, resolve_device
from gds_offload.errors import ConfigError

HELP = "train a GPT without and with the offloader, live; compare step time, memory and losses"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=8, warmup=2)
    p.add_argument("--mode", default="auto", help="engine: auto, gds, compat, posix or host (default: auto)")
    p.add_argument("--policy", default="all", choices=("all", "adaptive"), help="attach policy: all or adaptive (default: all)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without offloading (no comparison)")
    p.add_argument("--nproc", type=int, default=1, help="data-parallel ranks, launched through torchrun (gds_offload/bench/train/demo_ranks.py)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gds_offload.bench.train.checks import check_runs
    from gds_offload.bench.train.demo_view import make_view, render_summary
    from gds_offload.bench.train.runner import run_mode
    from gds_offload.bench.train.spec import compare_losses, parse_mode

    if args.nproc != 1:  # several ranks: gds_offload/bench/train/demo_ranks.py
        return _launch_ranks(args)
    try:
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
             + (f", tokens from {spec.data}" if spec.data else ", synthetic tokens"))
    view = make_view(console, title)
    results = []
    for i, mode in enumerate(runs, 1):
        with view.run(f"run {i}/{len(runs)}: {mode}"):  # on a terminal, each run's last frame stays on screen
            results.append(run_mode(replace(spec, mode=mode), on_event=view.on_event, timeout_s=args.timeout))
    by_mode = {r.mode: r for r in results}
    keep, off = by_mode.get("keep"), by_mode.get(offload_mode)
    agree = compare_losses(results).get(offload_mode) if keep is not None else None
    console.print(render_summary(keep, off, agree))
    console.print(
        "[dim]peak activation memory: peak RSS (or CUDA allocation) above the post-warm-up baseline, each run in its own "
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
    failed = any(r.status != "ok" for r in results)
    return 1 if failed or exact is False else 0


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
