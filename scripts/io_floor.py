#!/usr/bin/env python
"""What the offloader's I/O costs a training step by itself, with no offloader at all.

Runs, each in its own child process (as ``gds-offload bench`` does), on the demo model:

1. ``offload:<engine>``: attach() offloading everything; records the bytes it wrote and
   read per step and its median step time, so the rate it moved them;
2. ``keep``: no offloader;
3. ``keep + fio``: no offloader, while ``fio`` moves the same bytes per second, each way,
   through ``O_DIRECT`` on the same drive (sequential 8 MiB requests, libaio).

If ``keep + fio`` is as slow as the offloader, the step-time cost is the price of that much
I/O on this machine's CPUs (system calls, interrupts, page pinning), not the offloader's
design: no engine can move those bytes for less. Prints a table, writes ``--out`` (JSON).

    python scripts/io_floor.py                 # the demo model, posix engine
    python scripts/io_floor.py --engine compat --steps 5
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from gds_offload.bench.gpt import demo_preset  # noqa: E402
from gds_offload.bench.machine import describe_machine  # noqa: E402
from gds_offload.bench.runner import RunResult, RunSpec, run_mode  # noqa: E402
from gds_offload.store import default_spill_dir, prepare_dir  # noqa: E402

#: fio's request size and queue depth for the background I/O.
FIO_BLOCK = "8m"
FIO_IODEPTH = 4


def spec_for(mode: str, steps: int, path: str) -> RunSpec:
    config, batch = demo_preset("cpu")
    return RunSpec(
        mode=mode, layers=config.layers, hidden=config.hidden, heads=config.heads, seq=config.seq,
        vocab=config.vocab, dropout=config.dropout, batch=batch, steps=steps, warmup=2, path=path,
    )


def per_step(result: RunResult, key: str) -> float:
    """Bytes of ``key`` (an OffloadStats field) per measured step."""
    stats = result.offload or {}
    return float(stats.get(key, 0)) / max(1, len(result.step_seconds))


def with_fio(spec: RunSpec, write_bps: float, read_bps: float, directory: Path, console: Console) -> tuple[RunResult, str]:
    """Run ``spec`` while fio writes and reads at the given rates; return the result and fio's summary."""
    fio = shutil.which("fio")
    if fio is None:
        raise SystemExit("io_floor: needs fio (apt-get install fio); it makes the background I/O")
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".io_floor-", delete=False) as f:
        target = Path(f.name)
    cmd = [
        fio, "--name=floor", f"--filename={target}", "--size=1G", "--rw=rw", "--rwmixread=50",
        f"--bs={FIO_BLOCK}", "--direct=1", "--ioengine=libaio", f"--iodepth={FIO_IODEPTH}",
        f"--rate={int(read_bps)},{int(write_bps)}", "--time_based", "--runtime=3600", "--output-format=terse",
    ]
    console.print(f"[dim]{' '.join(cmd)}[/]")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)  # fio lays out its file first
        result = run_mode(spec)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        target.unlink(missing_ok=True)
    fields = out.strip().splitlines()[-1].split(";") if out.strip() else []
    # terse v3: field 6 is read bandwidth (KiB/s), field 47 write bandwidth (KiB/s)
    summary = f"fio read {int(fields[6]) * 1024 / 1e6:.0f} MB/s, write {int(fields[47]) * 1024 / 1e6:.0f} MB/s" if len(fields) > 47 else err.strip()[-200:]
    return result, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="posix", choices=("posix", "compat", "gds"), help="drive engine to compare with (default: posix)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per run (default: 5)")
    p.add_argument("--path", default=None, help="spill directory, also where fio writes (default: the offloader's)")
    p.add_argument("--out", default="results/io_floor.json", help="JSON results file; '' for none")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: measured steps per run must be 1 or more")
    console = Console()
    directory = prepare_dir(Path(args.path) if args.path else default_spill_dir(), create=args.path is None)

    console.print(f"offload:{args.engine} ...")
    off = run_mode(spec_for(f"offload:{args.engine}", args.steps, str(directory)))
    if off.status != "ok" or not off.median_step_s:
        console.print(f"[red]offload:{args.engine} failed: {off.error}[/]")
        return 1
    write_bps = per_step(off, "bytes_offloaded") / off.median_step_s
    read_bps = per_step(off, "bytes_read") / off.median_step_s
    console.print("keep ...")
    keep = run_mode(spec_for("keep", args.steps, str(directory)))
    console.print(f"keep + fio at {write_bps / 1e6:.0f} MB/s write, {read_bps / 1e6:.0f} MB/s read ...")
    floor, fio_summary = with_fio(spec_for("keep", args.steps, str(directory)), write_bps, read_bps, directory, console)
    if keep.status != "ok" or floor.status != "ok" or not keep.median_step_s or not floor.median_step_s:
        console.print(f"[red]a keep run failed: {keep.error or floor.error}[/]")
        return 1

    machine = describe_machine(directory)
    table = Table(title=f"I/O floor: demo model, {machine.cpu_model} ({machine.cpu_usable} CPUs), {machine.filesystem} on {machine.mount_source}")
    for col in ("run", "step (median)", "x keep", "I/O per step (write / read)"):
        table.add_column(col, justify="left" if col == "run" else "right")
    io = f"{per_step(off, 'bytes_offloaded') / 2**30:.2f} / {per_step(off, 'bytes_read') / 2**30:.2f} GiB"
    table.add_row("keep", f"{keep.median_step_s:.3f} s", "1.00", "-")
    table.add_row("keep + fio, same bytes/s", f"{floor.median_step_s:.3f} s", f"{floor.median_step_s / keep.median_step_s:.2f}", f"({fio_summary})")
    table.add_row(f"offload:{args.engine}", f"{off.median_step_s:.3f} s", f"{off.median_step_s / keep.median_step_s:.2f}", io)
    console.print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "machine": machine.as_dict(),
            "write_bps": write_bps, "read_bps": read_bps, "fio": fio_summary,
            "keep": asdict(keep), "keep_with_fio": asdict(floor), "offload": asdict(off),
            "floor_ratio": floor.median_step_s / keep.median_step_s,
            "offload_ratio": off.median_step_s / keep.median_step_s,
        }
        out.write_text(json.dumps(doc, indent=2))
        console.print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
