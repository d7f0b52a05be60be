"""``gds-offload bench-weights``: inference tokens/s with weights resident, streamed from the
drive or host memory by :mod:`gds_offload.weights`, and under Accelerate's disk offload,
each mode in its own process (:mod:`gds_offload.weights.bench`). Examples::

    gds-offload bench-weights --tiny                                  # seconds: the end-to-end check
    gds-offload bench-weights --batch-sizes 1,4 --json results/weights.json
    gds-offload bench-weights --memory-limit 1GiB                     # each child in a cgroup v1 memory cap
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

HELP = "benchmark inference with weights resident, streamed from drive/host, and Accelerate disk offload"


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,4") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes must be positive integers")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gds_offload.commands.bench import positive_int

    p.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 model, short prompt: runs in seconds")
    p.add_argument("--modes", default="resident,drive,host,accelerate-disk", help="comma-separated (default: all four)")
    p.add_argument("--hidden", type=positive_int, default=None, help="hidden size (default 1024)")
    p.add_argument("--intermediate", type=positive_int, default=None, help="MLP size (default 2816)")
    p.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default 16)")
    p.add_argument("--dtype", default=None, help="float32 (default) or bfloat16")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=None, help="comma-separated (default 1,4)")
    p.add_argument("--prompt-len", type=positive_int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=positive_int, default=None, help="tokens generated per sequence (default 16)")
    p.add_argument("--rounds", type=positive_int, default=1, help="run every mode this many times, interleaved; medians are shown (default 1)")
    p.add_argument("--repeats", type=positive_int, default=2, help="measurements per batch size inside each child (default 2)")
    p.add_argument("--slots", type=positive_int, default=2, help="ring buffers of the drive mode (default 2)")
    p.add_argument("--threads", type=positive_int, default=4, help="engine threads of the streamed modes (default 4)")
    p.add_argument("--checkpoint", type=Path, default=None, help="use this safetensors checkpoint (Llama-like) instead of random weights")
    p.add_argument("--workdir", type=Path, default=None, help="where the checkpoint and store go (default <tmp>/gds_offload-bench-weights)")
    p.add_argument("--memory-limit", default=None, help="cap each child's memory (page cache included), e.g. 1GiB, except resident's (the reference outputs); needs root and cgroup v1")
    p.add_argument("--json", metavar="OUT", default=None, help="write the report as JSON to OUT ('-': print it instead of the table)")


def run(args: argparse.Namespace) -> int:
    from gds_offload.errors import ConfigError
    from gds_offload.units import parse_bytes
    from gds_offload.weights.bench import DEFAULT_MODEL, MODES, TINY, BenchSpec, run_bench

    try:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise ConfigError(f"--modes {args.modes!r}: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(MODES)}")
        model = TINY if args.tiny else DEFAULT_MODEL
        model = replace(model, **{k: v for k, v in (("hidden", args.hidden), ("intermediate", args.intermediate), ("layers", args.layers), ("dtype", args.dtype)) if v is not None})
        defaults = ((1, 2), 16, 4) if args.tiny else ((1, 4), 128, 16)
        batches = args.batch_sizes or defaults[0]
        workdir = args.workdir or Path(tempfile.gettempdir()) / ("gds_offload-bench-weights" + ("-tiny" if args.tiny else ""))
        spec = BenchSpec("", "", "", str(workdir), batch_sizes=batches, prompt_len=defaults[1] if args.prompt_len is None else args.prompt_len,
                         new_tokens=defaults[2] if args.new_tokens is None else args.new_tokens, slots=args.slots, num_threads=args.threads, repeats=args.repeats)  # fmt: skip
        limit = parse_bytes(args.memory_limit, name="--memory-limit") if args.memory_limit else None
        if args.rounds < 1 or args.repeats < 1:
            raise ConfigError(f"--rounds {args.rounds} --repeats {args.repeats}: both must be at least 1")
        report = run_bench(spec, modes, model=model, rounds=args.rounds, memory_limit=limit, checkpoint=args.checkpoint)
    except ConfigError as exc:
        print(f"gds-offload bench-weights: {exc}", file=sys.stderr)
        return 2
    report["command"] = getattr(args, "command_line", "gds-offload bench-weights")
    from gds_offload.bench.machine import describe

    report["machine"] = describe(workdir)
    if args.json and args.json != "-":
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    if args.json == "-":
        print(json.dumps(report, indent=2, default=str))
    else:
        render(report)
    failed = [r for r in report["summary"] if r["rounds_ok"] < r["rounds"] or r["matches_resident"] is False]
    return 1 if failed else 0


def render(report: dict) -> None:
    """Print the per-mode medians as a rich table (peak mem: the cgroup's peak, page cache included,
    under --memory-limit; else the child's peak RSS)."""
    from rich.console import Console
    from rich.table import Table

    from gds_offload.units import format_bytes

    m = report["model"]
    t = Table(title=f"bench-weights: {m['layers']} layers, hidden {m['hidden']}, {m['dtype']}, "
                    f"{format_bytes(m['layers_nbytes'])} of layers + {format_bytes(m['resident_nbytes'])} resident")  # fmt: skip
    for col in ("mode", "B", "prefill tok/s", "decode tok/s", "drive B/tok", "store B/tok", "peak mem", "=res"):
        t.add_column(col, justify="left" if col == "mode" else "right", no_wrap=col == "mode")

    def num(v: float | None, fmt: str = "{:.1f}") -> str:
        return "-" if v is None else fmt.format(v)

    for r in report["summary"]:
        if not r["rounds_ok"]:
            t.add_row(r["mode"], str(r["batch"]), f"[red]{(r['errors'] or ['?'])[0][:60]}[/]", "", "", "", "", "")
            continue
        t.add_row(r["mode"], str(r["batch"]), num(r["prefill_tokens_per_s"]), num(r["decode_tokens_per_s"]),
                  format_bytes(r["drive_bytes_per_token"]), "-" if r["store_bytes_per_token"] is None else format_bytes(r["store_bytes_per_token"]),
                  format_bytes(r["cgroup_peak_bytes"] or r["peak_rss_bytes"]), {True: "yes", False: "[red]no[/]", None: "-"}[r["matches_resident"]])  # fmt: skip
    Console().print(t)
