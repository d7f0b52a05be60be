"""``gds-offload bench-io``: engine bandwidth next to the drive's raw O_DIRECT bandwidth.

Probes with :func:`gds_offload.bench.io.run_bench`, then renders its report as a
rich table (or JSON). Example::

    gds-offload bench-io --path /mnt/nvme/spill --size 2GiB --tensor-sizes 1MiB,64MiB
    gds-offload bench-io --engines posix,compat --threads 1,2,4,8 --json results/io.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gds_offload.commands.run_args import check_outputs, positive_int
from gds_offload.errors import ConfigError
from gds_offload.io.directory import prepare_dir, spill_dir_origin
from gds_offload.io.spill import GROW_BYTES, free_bytes
from gds_offload.units import format_bytes, parse_bytes

HELP = "measure storage-engine write/read bandwidth against the drive's raw O_DIRECT bandwidth"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", default=None, help="spill directory on the drive (default: $GDS_OFFLOAD_DIR or <tmp>/gds_offload-<uid>)")
    p.add_argument("--size", default="2GiB", help="bytes written then read per measurement (default: 2GiB)")
    p.add_argument("--tensor-sizes", default="1MiB,64MiB", help="comma-separated tensor sizes (default: 1MiB,64MiB)")
    p.add_argument("--engines", default="posix,compat,host", help="comma-separated engines: posix, compat, gds, host (default: posix,compat,host)")
    p.add_argument("--threads", default="", help="comma-separated engine thread counts to sweep, e.g. 1,2,4,8 (default: each engine's default)")
    p.add_argument("--chunk-sizes", default="", help="comma-separated posix chunk / KvikIO task sizes to sweep, e.g. 4MiB,8MiB (default: engine defaults)")
    p.add_argument("--memory", default="auto", help="buffers the engines move: auto (the GPU when there is one, as the offloader does), host, or a CUDA device (default: auto)")
    p.add_argument("--repeats", type=positive_int, default=1, help="write+read rounds per measurement; the median is shown (default: 1)")
    p.add_argument("--no-raw", action="store_true", help="skip the fio/dd raw measurement (no ratios)")
    p.add_argument("--json", metavar="OUT", default=None, help="also write the report as JSON to OUT ('-': print JSON instead of the table)")


def _list(text: str, parse: Any, name: str) -> list[Any]:
    values = [parse(part.strip(), name=name) for part in text.split(",") if part.strip()]
    if any(v <= 0 for v in values):
        raise ConfigError(f"{name} {text!r}: every value must be positive (0 is not 'the default': leave the flag out)")
    return values


def _int(text: str, *, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer; pass e.g. --threads 1,2,4,8") from None
    if value < 1:
        raise ConfigError(f"{name}={value} must be >= 1")
    return value


def check_room(path: Path, total: int, sizes: list[int], engines: list[str], *, raw: bool) -> None:
    """Refuse a ``--size`` the drive cannot hold: the raw pass and each engine's spill file exist
    one at a time, each about ``--size`` (the spill file grows 64 MiB at a time).

    Raises:
        ConfigError: too little free space, with both figures.
    """

    needs = [max(total, 1 << 20)] if raw else []
    if any(e != "host" for e in engines):
        needs += [max(1, total // s) * s + GROW_BYTES for s in sizes]
    if not needs:
        return
    need, free = max(needs), free_bytes(path)
    if need > free:
        raise ConfigError(
            f"--size {format_bytes(total)} needs about {format_bytes(need)} free in {path} (the raw pass and each "
            f"engine's spill file, one at a time) but it has {format_bytes(free)} free; pass a smaller --size"
        )


def render(report: Any) -> None:
    """Print ``report`` (an :class:`~gds_offload.bench.io.IOBenchReport`) as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = report.machine
    console.print(
        f"[bold]machine[/]: {m['cpu_model']} ({m['cpu_usable'] or m['cpu_cores']} CPUs, {format_bytes(m['ram_bytes'] or 0)}), {m['os']}\n"
        f"[bold]path[/]: {m['path']} on {m['filesystem']} ({m['drive'] or m['mount_source']}"
        f"{', O_DIRECT' if m['o_direct'] else ''})"
    )
    raw = report.raw
    if raw:
        samples = ", ".join(f"{r['write_gbps']:.2f}/{r['read_gbps']:.2f}" for r in raw.get("samples", []))
        console.print(
            f"[bold]raw O_DIRECT[/] ({raw['tool']}): write {raw['write_gbps']:.2f} GB/s, read {raw['read_gbps']:.2f} GB/s"
            + (f" (mean of runs before/after the engines, write/read: {samples})" if samples else "")
        )
        console.print(f"[dim]{raw['command']}[/]")
    table = Table(title="bench-io: GB/s (1e9 B/s), ratio to raw O_DIRECT, bytes left in page cache")
    for col in ("engine", "memory", "thr", "chunk", "tensor", "write", "read", "w/raw", "r/raw", "cached w/r"):
        table.add_column(col, justify="left" if col in ("engine", "memory") else "right")
    for r in report.rows:
        ratio = (f"{r['write_ratio']:.2f}", f"{r['read_ratio']:.2f}") if "write_ratio" in r else ("-", "-")
        cw, cr = r["page_cache_after_write_bytes"], r["page_cache_after_read_bytes"]
        table.add_row(
            r["engine"],
            r["memory"],
            str(r["threads"] or "-"),
            format_bytes(r["chunk_bytes"]) if r["chunk_bytes"] else "-",
            format_bytes(r["tensor_bytes"]),
            f"{r['write_gbps']:.2f}",
            f"{r['read_gbps']:.2f}",
            *ratio,
            "none" if not (cw or cr) else f"{format_bytes(cw)}/{format_bytes(cr)}",
        )
    console.print(table)
    # What each figure is of (host memory through KvikIO is not GPUDirect), unabridged.
    for engine, label in dict.fromkeys((r["engine"], r["label"]) for r in report.rows):
        console.print(f"[bold]{engine}[/]: {label}")
    for name, why in report.skipped.items():
        console.print(f"[yellow]skipped {name}[/]: {why}")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gds_offload.bench.io import run_bench
    from gds_offload.io.factory import validate_mode

    err = Console(stderr=True)
    try:
        check_outputs(("--json", args.json, None))
        total = parse_bytes(args.size, name="--size")
        sizes = _list(args.tensor_sizes, parse_bytes, "--tensor-sizes")
        engines = [e.strip() for e in args.engines.split(",") if e.strip()]
        threads = _list(args.threads, _int, "--threads") or None
        chunks = _list(args.chunk_sizes, parse_bytes, "--chunk-sizes") or None
        if total <= 0:
            raise ConfigError(f"--size {args.size!r} must be positive, e.g. 2GiB")
        if not sizes or not engines:
            raise ConfigError("--tensor-sizes and --engines must name at least one value")
        for e in engines:
            if validate_mode(e) == "auto":
                raise ConfigError("--engines: bench-io measures named engines; pass posix, compat, gds or host, not auto")
        if args.path is not None and not args.path.strip():
            raise ConfigError(f"--path {args.path!r} is empty; pass a directory, or leave the flag out for $GDS_OFFLOAD_DIR or <tmp>/gds_offload-<uid>")
        path, origin = (Path(args.path), "--path") if args.path is not None else spill_dir_origin()
        path = prepare_dir(path, create=True, origin=origin)  # type: ignore[arg-type]
        check_room(path, total, sizes, engines, raw=not args.no_raw)
        report = run_bench(
            path,
            total_bytes=total,
            tensor_sizes=sizes,
            engines=engines,
            threads=threads,
            chunk_sizes=chunks,
            repeats=args.repeats,
            raw=not args.no_raw,
            progress=lambda msg: err.print(f"[dim]measuring {msg}[/]"),
            memory=args.memory,
        )
    except ConfigError as exc:
        print(f"gds-offload bench-io: {exc}", file=sys.stderr)
        return 2
    if args.json and args.json != "-":
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2))
    if args.json == "-":
        json.dump(report.as_dict(), sys.stdout, indent=2)
        print()
    else:
        render(report)
    return 0
