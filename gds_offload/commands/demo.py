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
* **I/O hidden behind compute**: ``1 - io_wait_seconds / (write_seconds + read_seconds)``:
  of the time the engine was moving bytes, the share during which the training thread
  was *not* blocked waiting for a read. 100 % means no step ever waited on the drive; it
  does not count CPU time the I/O threads took from compute (on a small CPU, compare the
  step times for that).
* **losses agree**: every loss (and the final parameters) bit-identical to the run
  without the offloader. The exit code is 1 when they are not, or a run failed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import deque
from dataclasses import replace
from typing import Any

from gds_offload.commands.run_args import add_model_arguments, base_spec, check_runs, resolve_device

HELP = "train a GPT without and with the offloader, live; compare step time, memory and losses"

_HISTORY = 12


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=8, warmup=2)
    p.add_argument("--mode", default="auto", help="engine: auto, gds, compat, posix or host (default: auto)")
    p.add_argument("--policy", default="all", choices=("all", "adaptive"), help="attach policy: all or adaptive (default: all)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without offloading (no comparison)")
    p.add_argument("--nproc", type=int, default=1, help="data-parallel ranks, launched through torchrun (gds_offload/commands/demo_ranks.py)")


def _gb(nbytes: float | None) -> str:
    from gds_offload.units import format_bytes

    return "-" if nbytes is None else format_bytes(nbytes)


class _LiveView:
    """The live display: which run, its engine, and its last steps."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.run = ""
        self.setup: dict[str, Any] = {}
        self.rows: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        self.live: Any = None

    def start_run(self, label: str) -> None:
        self.run, self.setup = label, {}
        self.rows.clear()
        self.refresh()

    def on_event(self, ev: dict[str, Any]) -> None:
        if ev.get("event") == "setup":
            self.setup = ev
        elif ev.get("event") == "step":
            self.rows.append(ev)
        self.refresh()

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self.render())

    def render(self) -> Any:
        from rich.table import Table

        s = self.setup
        if s.get("engine"):
            engine = f"engine {s['engine']} ({'GDS in use' if s.get('gds') else 'no GDS'}): {s.get('engine_reason', '')}"
        else:
            engine = "no offloader" if s else "starting..."
        table = Table(title=f"{self.title}\n[bold]{self.run}[/]: {engine}", title_justify="left")
        for col in ("step", "phase", "loss", "step time", "RSS", "resident", "peak resident", "write GB/s", "read GB/s"):
            table.add_column(col, justify="right")
        for ev in self.rows:
            o = ev.get("offload") or {}
            table.add_row(
                str(ev["step"] + 1),
                ev["phase"],
                f"{ev['loss']:.6f}",
                f"{ev['step_s']:.2f} s",
                _gb(ev.get("rss_bytes")),
                _gb(o.get("resident_bytes")) if o else "-",
                _gb(o.get("peak_resident_bytes")) if o else "-",
                f"{o['write_gbps']:.2f}" if o else "-",
                f"{o['read_gbps']:.2f}" if o else "-",
            )
        return table


def io_hidden_fraction(offload: dict[str, Any]) -> float | None:
    """``1 - io_wait_seconds / (write_seconds + read_seconds)``, clamped to [0, 1]; None without I/O."""
    busy = offload.get("write_seconds", 0.0) + offload.get("read_seconds", 0.0)
    if busy <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - offload.get("io_wait_seconds", 0.0) / busy))


def render_summary(keep: Any, off: Any, agree: bool | None) -> Any:
    """The keep-vs-offload comparison table."""
    from rich.table import Table

    from gds_offload.bench.train.spec import paired_ratios

    table = Table(title="demo summary", show_header=True)
    table.add_column("")
    table.add_column("keep (no offload)", justify="right")
    table.add_column(f"{off.mode}" if off else "offload", justify="right")
    table.add_column("offload / keep", justify="right")

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "-"

    k_ok = keep is not None and keep.status == "ok"
    o_ok = off is not None and off.status == "ok"
    k_step = keep.median_step_s if k_ok else None
    o_step = off.median_step_s if o_ok else None
    table.add_row("median step time", f"{k_step:.3f} s" if k_step else "-", f"{o_step:.3f} s" if o_step else "-", ratio(o_step, k_step))
    pairs = paired_ratios(off) if o_ok else []
    if pairs:
        table.add_row(f"step time, offloaded / paused, same process ({len(pairs)} pair{'' if len(pairs) == 1 else 's'})", "", "", f"{statistics.median(pairs):.2f}x")
    waits = [statistics.median(r.input_wait_seconds) if ok and r.input_wait_seconds else None for r, ok in ((keep, k_ok), (off, o_ok))]
    table.add_row("input wait per step (median)", *(f"{w:.4f} s" if w is not None else "-" for w in waits), "")
    k_mem = keep.peak_activation_bytes if k_ok else None
    o_mem = off.peak_activation_bytes if o_ok else None
    table.add_row("peak activation memory (measured)", _gb(k_mem), _gb(o_mem), ratio(o_mem, k_mem))
    stats = (off.offload or {}) if o_ok else {}
    steps = max(1, stats.get("steps", 0))
    if stats:
        table.add_row("offloader peak resident", "", _gb(stats["peak_resident_bytes"]), "")
        for name in ("bytes_packed", "bytes_offloaded", "bytes_deduplicated", "bytes_forwarded", "bytes_read", "bytes_kept"):
            table.add_row(f"{name.removeprefix('bytes_')} per step", "", _gb(stats[name] / steps), "")
        hidden = io_hidden_fraction(stats)
        table.add_row("I/O wait per step", "", f"{stats['io_wait_seconds'] / steps:.3f} s", "")
        table.add_row("I/O hidden behind compute", "", "-" if hidden is None else f"{hidden:.0%}", "")
        table.add_row("engine", "", f"{stats['engine']} ({'GDS' if stats['gds'] else 'no GDS'})", "")
    table.add_row("loss curves agree (bit-identical)", "", "-" if agree is None else "[green]yes[/]" if agree else "[red]NO[/]", "")
    return table


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from gds_offload.bench.train.runner import run_mode
    from gds_offload.bench.train.spec import compare_losses, parse_mode
    from gds_offload.errors import ConfigError

    if args.nproc != 1:  # several ranks: gds_offload/commands/demo_ranks.py
        from gds_offload.commands.demo_ranks import launch

        return launch(args)
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
    view = _LiveView(title)
    results = []
    for i, mode in enumerate(runs, 1):
        with Live(view.render(), console=console, refresh_per_second=4) as live:  # one per run: each stays on screen
            view.live = live
            view.start_run(f"run {i}/{len(runs)}: {mode}")
            results.append(run_mode(replace(spec, mode=mode), on_event=view.on_event, timeout_s=args.timeout))
        view.live = None
        if not console.is_terminal:
            console.line()  # off a terminal, Live leaves its last frame without a line end
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
