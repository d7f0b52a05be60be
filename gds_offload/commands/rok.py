"""``gds-offload rok``: sweep micro-batch sizes and placements; draw the ROK curve; recommend a point."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gds_offload.bench.machine import describe
from gds_offload.commands.run_args import check_outputs, positive_int, resolve_device
from gds_offload.errors import ConfigError
from gds_offload.units import format_bytes, parse_bandwidth, parse_bytes

_OUT, _PLOT = "results/rok.json", "results/rok.png"
HELP = "recompute-offload-keep sweep: the fastest micro-batch and placement within a memory limit"


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 2,4,8") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes must be positive integers")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt", help="gpt (built-in), llama, gpt2, or pkg.module:factory")
    p.add_argument("--layers", type=positive_int, default=6)
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--seq", type=positive_int, default=256)
    p.add_argument("--vocab", type=positive_int, default=4096)
    p.add_argument("--batches", type=_ints, default=[2, 4, 8], help="micro-batch sizes (default 2,4,8)")
    p.add_argument("--placements", default="keep,recompute,all,adaptive", help="subset of keep,recompute,all,adaptive")
    p.add_argument("--steps", type=positive_int, default=3, help="measured steps per point")
    p.add_argument("--warmup", type=positive_int, default=2, help="warm-up steps per point (adaptive profiles in these)")
    p.add_argument("--path", default=None, help="spill directory")
    p.add_argument("--max-bandwidth", default=None, help="cap the drive, e.g. 300MB/s (imitate a GPU:SSD ratio)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--memory", default=None, help="activation memory you have, e.g. 2GiB: recommend the fastest point that fits")
    p.add_argument("--out", type=Path, default=Path(_OUT))
    p.add_argument("--plot", type=Path, default=Path(_PLOT))


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rich.console import Console
    from rich.table import Table

    from gds_offload.bench.train import rok
    from gds_offload.bench.train.checks import check_runs
    from gds_offload.bench.train.spec import RunSpec
    from gds_offload.models.gpt import GPTConfig

    console = Console()
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    bad = [p for p in placements if p not in rok.PLACEMENTS]
    if bad or not placements:
        print(f"gds-offload rok: --placements: unknown {bad or '(none given)'}; expected some of {', '.join(rok.PLACEMENTS)}", file=sys.stderr)
        return 2
    try:
        check_outputs(("--out", args.out, _OUT), ("--plot", args.plot, _PLOT))
        memory = None if args.memory is None else parse_bytes(args.memory, name="--memory")
        if memory is not None and memory <= 0:
            raise ConfigError(f"--memory {args.memory!r} must be positive, e.g. 2GiB (0 is not 'the default': leave the flag out)")
        if args.max_bandwidth:
            parse_bandwidth(args.max_bandwidth, name="--max-bandwidth")
        device = resolve_device(args.device)
        if args.model == "gpt":
            GPTConfig(args.layers, args.hidden, args.heads, args.seq, args.vocab)  # heads must divide hidden
        base = RunSpec(
            mode="keep", model=args.model, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
            vocab=args.vocab, steps=args.steps, warmup=args.warmup, path=args.path, max_bandwidth=args.max_bandwidth,
            device=device,
        )
        modes = [rok.PLACEMENTS[p][0] for p in placements]
        for batch in args.batches:  # every point, before the first one runs
            check_runs(replace(base, batch=batch), modes)
    except ConfigError as exc:
        print(f"gds-offload rok: {exc}", file=sys.stderr)
        return 2
    total = len(args.batches) * len(placements)
    t0 = time.perf_counter()
    with console.status(f"ROK sweep: {total} points") as status:
        done = [0]

        def progress(pt: rok.RokPoint) -> None:
            done[0] += 1
            shown = f"{pt.measured.tokens_per_s:.0f} tok/s, {format_bytes(pt.measured.peak_activation_bytes)}" if pt.ok else pt.status
            console.log(f"batch {pt.batch:>3} {pt.placement:<9} {shown}")
            status.update(f"ROK sweep: {done[0]}/{total} points")

        points = rok.sweep(base, args.batches, placements, on_point=progress)
    wall = time.perf_counter() - t0

    table = Table(title=f"ROK sweep: {args.model} L{args.layers} H{args.hidden} seq {args.seq} on {args.device}")
    for col in ("batch", "placement", "tokens/s", "step s", "peak act. memory", "status"):
        table.add_column(col, justify="right" if col not in ("placement", "status") else "left")
    for pt in points:
        table.add_row(
            str(pt.batch), pt.placement, f"{pt.tokens_per_s:.0f}" if pt.ok else "-",
            f"{pt.median_step_s:.3f}" if pt.ok else "-",
            format_bytes(pt.measured.peak_activation_bytes) if pt.ok else "-", pt.status if pt.ok else f"{pt.status}: {pt.error[:60]}",
        )
    console.print(table)

    limits = [memory] if memory else sorted({p.measured.peak_activation_bytes for p in points if p.ok and p.placement == "keep"})
    answers = []
    for limit in limits:
        best = rok.recommend(points, limit)
        answers.append({"memory_bytes": limit, "best": best.__dict__ if best else None})
        if best is None:
            console.print(f"With {format_bytes(limit)}: no measured point fits.")
        else:
            console.print(
                f"With {format_bytes(limit)} of activation memory: [bold]batch {best.batch}, {best.placement}[/bold] "
                f"({best.measured.tokens_per_s:.0f} tokens/s, peak {format_bytes(best.measured.peak_activation_bytes)})"
            )
    facts = rok.findings(points)
    document = {
        "schema": "gds-offload-rok/1",
        "command": args.command_line,
        "base": base.__dict__,
        "wall_s": wall,
        "points": [p.__dict__ for p in points],
        "frontier": [p.__dict__ for p in rok.frontier(points)],
        "recommendations": answers,
        "findings": facts,
    }
    try:
        document["machine"] = describe(args.path)
    except TypeError:
        pass
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2, default=str))
    title = f"ROK: {args.model} L{args.layers} H{args.hidden} seq {args.seq}, {args.device}" + (
        f", drive capped at {args.max_bandwidth}" if args.max_bandwidth else ""
    )
    rok.plot(points, args.plot, title=title, memory_bytes=memory)
    console.print(f"wrote {args.out} and {args.plot} in {wall:.0f} s")
    return 0 if all(p.status in ("ok", "unavailable") for p in points) else 1
