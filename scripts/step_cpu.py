#!/usr/bin/env python
"""Where an offloaded step's extra time goes: CPU accounting, offloaded against paused steps.

Trains the demo model (``gds-offload bench``'s model options) in this process with the
offloader attached, alternating offloaded steps with steps under ``off.paused()`` in ABBA
order (as ``bench --paired`` does), and reports the median per kind of step of:

* wall time;
* the process's user and system CPU time (``getrusage``);
* the training thread's CPU time and its involuntary context switches (how often another
  thread or the kernel took its core), from ``/proc/self/task``;
* the CPU time of the offloader's threads (those started by ``attach``) and of torch's
  other threads (started before it);
* how often the kernel's block-queue workers ran, system-wide: kworker threads whose name
  says they last ran ``kblockd`` work (blk-mq runs a stopped queue from them, e.g. when a
  virtio disk's ring was full). A kworker's name follows its latest work item, so this
  count is approximate.

Runs with ``MALLOC_MMAP_THRESHOLD_=65536`` like ``bench``'s children (re-executes itself
with it; ``--no-memory`` keeps glibc's defaults). ``OMP_NUM_THREADS`` sets torch's threads.

    python scripts/step_cpu.py                      # the demo model, 8 measured steps
    OMP_NUM_THREADS=1 python scripts/step_cpu.py    # leave a core to the I/O
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import gds_offload  # noqa: E402
from gds_offload.bench.runner import abba_first_half, attach_kwargs, build_workload  # noqa: E402
from gds_offload.commands.bench import add_model_arguments, base_spec  # noqa: E402
from gds_offload.errors import ConfigError  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
ROWS = {
    "wall_s": "step wall time (s)",
    "user_s": "process user CPU (s)",
    "sys_s": "process system CPU (s)",
    "main_cpu_s": "training thread CPU (s)",
    "main_preempted": "training thread involuntary switches",
    "offloader_cpu_s": "offloader threads' CPU (s)",
    "torch_cpu_s": "torch's other threads' CPU (s)",
    "kblockd_runs": "kblockd worker runs (system-wide)",
}


def thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def kblockd_runs() -> int:
    """Times the kworkers now named ``*kblockd*`` went to sleep (so ran), summed."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue  # the process ended
        name = text.split("\n", 1)[0].partition("\t")[2]
        if name.startswith("kworker") and "kblockd" in name:
            total += int(text.split("\nvoluntary_ctxt_switches:\t", 1)[1].split("\n", 1)[0])
    return total


def preemptions(tid: int) -> int:
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise RuntimeError("no nonvoluntary_ctxt_switches in /proc/self/task/*/status")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, steps=8, warmup=2)
    parser.add_argument("--mode", default="auto", help="attach mode (default: auto)")
    parser.add_argument("--out", type=Path, default=None, help="write the per-step figures and medians as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.steps % 2:
        parser.error(f"--steps {args.steps}: pairs of an offloaded and a paused step; need an even number >= 2")
    if args.device not in ("auto", "cpu"):
        parser.error(f"--device {args.device}: this script accounts CPU time of a model on the CPU; use --device cpu")
    if args.warmup < 1:
        parser.error(f"--warmup {args.warmup}: need at least 1 (the first steps pay one-time costs)")
    if not args.no_memory and os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536"})
    try:
        spec = base_spec(args, "cpu")
    except ConfigError as exc:
        parser.error(str(exc))
    console = Console()
    torch.use_deterministic_algorithms(True, warn_only=True)
    wl = build_workload(spec)
    model = wl.model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)

    def step(i: int) -> None:
        torch.manual_seed(spec.seed * 1_000_003 + i)
        wl.loss_fn(model, wl.batch_fn(i)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)  # starts torch's threads: every thread after attach() is the offloader's
    main_tid, torch_tids = threading.get_native_id(), set(thread_cpu())
    off = gds_offload.attach(model, **attach_kwargs(spec, args.mode, spec.policy))
    rows: list[dict[str, float | bool]] = []
    try:
        for i in range(1, 1 + args.warmup + args.steps):
            offloaded = i <= args.warmup or abba_first_half(i - 1 - args.warmup)
            packed0, kb0 = off.stats().bytes_packed, kblockd_runs()
            cpu0, ru0, pre0, t0 = thread_cpu(), resource.getrusage(resource.RUSAGE_SELF), preemptions(main_tid), time.perf_counter()
            with contextlib.nullcontext() if offloaded else off.paused():
                step(i)
            wall = time.perf_counter() - t0
            cpu1, ru1, pre1, kb1 = thread_cpu(), resource.getrusage(resource.RUSAGE_SELF), preemptions(main_tid), kblockd_runs()
            used = {tid: c - cpu0.get(tid, 0.0) for tid, c in cpu1.items()}
            row = {
                "offloaded": offloaded,
                "wall_s": wall,
                "user_s": ru1.ru_utime - ru0.ru_utime,
                "sys_s": ru1.ru_stime - ru0.ru_stime,
                "main_cpu_s": used.get(main_tid, 0.0),
                "main_preempted": pre1 - pre0,
                "offloader_cpu_s": sum(c for tid, c in used.items() if tid not in torch_tids),
                "torch_cpu_s": sum(c for tid, c in used.items() if tid in torch_tids and tid != main_tid),
                "kblockd_runs": kb1 - kb0,
                "packed_bytes": off.stats().bytes_packed - packed0,  # saved through the hooks: 0 when paused
            }
            if i > args.warmup:
                rows.append(row)
            console.print(f"[dim]step {i}{'' if i > args.warmup else ' (warm-up)'}: "
                          f"{'offloaded' if offloaded else 'paused'}, {wall:.2f} s[/]")
        stats = off.stats()
    finally:
        off.detach()
    medians = {kind: {k: statistics.median(float(r[k]) for r in rows if r["offloaded"] == (kind == "offloaded")) for k in ROWS}
               for kind in ("offloaded", "paused")}
    ratios = [a["wall_s"] / b["wall_s"] for a, b in zip([r for r in rows if r["offloaded"]], [r for r in rows if not r["offloaded"]])]
    table = Table(title=f"{spec.model} layers={spec.layers} hidden={spec.hidden} seq={spec.seq} batch={spec.batch}, "
                        f"engine {stats.engine}, torch threads: {torch.get_num_threads()}, medians over {args.steps // 2} steps of each kind")
    for col in ("", "offloaded", "paused", "difference"):
        table.add_column(col, justify="left" if not col else "right")
    for key, label in ROWS.items():
        a, b = medians["offloaded"][key], medians["paused"][key]
        fmt = "{:.0f}" if key in ("main_preempted", "kblockd_runs") else "{:.3f}"
        table.add_row(label, fmt.format(a), fmt.format(b), ("+" if a >= b else "") + fmt.format(a - b))
    console.print(table)
    console.print(f"offloaded / paused step time, pair by pair: {', '.join(f'{r:.3f}' for r in ratios)} "
                  f"(median {statistics.median(ratios):.3f}); {stats.bytes_offloaded / max(1, stats.steps) / 2**30:.2f} GiB "
                  f"written per offloaded step")
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv, "torch_threads": torch.get_num_threads(), "engine": stats.engine,
                                        "steps": rows, "medians": medians, "paired_ratios": ratios,
                                        "bytes_offloaded": stats.bytes_offloaded, "offloaded_steps": stats.steps}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
