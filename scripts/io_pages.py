#!/usr/bin/env python
"""What ``O_DIRECT`` I/O through 4 KiB pages costs the cores, next to 2 MiB (huge) pages.

A matrix-multiply loop runs on torch's threads (the stand-in for a training step) while a
background thread writes and reads a spill file at a fixed rate, each way, in 8 MiB
requests, out of and into a buffer that is one of:

* ``4k``: 4 KiB pages (``MADV_NOHUGEPAGE``), as torch's allocator hands out activations;
* ``huge``: transparent huge pages (:func:`gds_offload.io.pages.map_anonymous`), as the
  engines' read buffers are;
* ``4k->huge``: writes out of 4 KiB pages, reads into huge pages (what the offloader does).

Cases run interleaved, ``--rounds`` times, round k in reverse order when k is odd; each
is reported as the median loop time over the rounds divided by the median without I/O.
The bytes moved are the same in every case, so any difference is the price of the page
size. Prints a table; writes ``--out`` (JSON) when given.

    python scripts/io_pages.py                      # 200 MB/s each way, 12 rounds
    python scripts/io_pages.py --rate 400MB/s --rounds 6
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from gds_offload.bench.machine import describe  # noqa: E402
from gds_offload.errors import ConfigError  # noqa: E402
from gds_offload.io.pages import HUGE_PAGE, map_anonymous  # noqa: E402
from gds_offload.store import default_spill_dir, prepare_dir  # noqa: E402
from gds_offload.units import parse_bandwidth  # noqa: E402

FILE_BYTES = 64 << 20
REQUEST = 8 << 20
CASES = ("none", "4k", "4k->huge", "huge")


def four_k_buffer(length: int) -> mmap.mmap:
    mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_NOHUGEPAGE)
    return mm


def huge_pages(mm: mmap.mmap) -> int:
    """Bytes of ``mm`` backed by huge pages, from ``/proc/self/smaps``."""
    import ctypes

    start = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        lo = line.split("-", 1)[0]
        if all(c in "0123456789abcdef" for c in lo) and int(lo, 16) <= start < int(line.split()[0].split("-")[1], 16):
            for row in lines[i + 1 : i + 30]:
                if row.startswith("AnonHugePages:"):
                    return int(row.split()[1]) << 10
    return 0


class Mover:
    """Writes then reads back ``REQUEST``-byte pieces of a file at ``rate`` bytes/s each way."""

    def __init__(self, fd: int, src: memoryview, dst: memoryview, rate: float) -> None:
        self.fd, self.src, self.dst, self.rate = fd, src, dst, rate
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0, moved = time.perf_counter(), 0
        while not self.stop.is_set():
            for off in range(0, FILE_BYTES, REQUEST):
                os.pwrite(self.fd, self.src[off : off + REQUEST], off)
                os.preadv(self.fd, [self.dst[off : off + REQUEST]], off)
                moved += REQUEST
                ahead = moved / self.rate - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)
                if self.stop.is_set():
                    return

    def __enter__(self) -> Mover:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="200MB/s", help="bytes per second each way (default: 200MB/s)")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of every case (default: 12)")
    parser.add_argument("--path", default=None, help="directory for the spill file (default: the offloader's)")
    parser.add_argument("--size", type=int, default=1536, help="matrix size of the compute loop (default: 1536)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: need at least 1")
    if args.size < 1:
        parser.error(f"--size {args.size}: the matrices' side, need at least 1")
    try:
        rate = parse_bandwidth(args.rate, name="--rate")
    except ConfigError as exc:
        parser.error(str(exc))
    console = Console()
    directory = prepare_dir(Path(args.path) if args.path else default_spill_dir(), create=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".io_pages-") as f:
        fd = os.open(f.name, os.O_RDWR | os.O_DIRECT)
        try:
            os.ftruncate(fd, FILE_BYTES)
            buffers = {"4k": four_k_buffer(FILE_BYTES), "huge": map_anonymous(FILE_BYTES)}
            for mm in buffers.values():
                mm[:] = b"\x01" * FILE_BYTES  # fault every page in before timing
            views = {k: memoryview(mm)[:FILE_BYTES] for k, mm in buffers.items()}
            backing = {k: huge_pages(mm) for k, mm in buffers.items()}
            a, b = torch.randn(args.size, args.size), torch.randn(args.size, args.size)

            def loop() -> float:
                t0 = time.perf_counter()
                for _ in range(120):
                    a @ b
                return time.perf_counter() - t0

            loop()
            times: dict[str, list[float]] = {c: [] for c in CASES}
            for k in range(args.rounds):
                for case in CASES if k % 2 == 0 else CASES[::-1]:
                    if case == "none":
                        times[case].append(loop())
                        continue
                    src = views["huge" if case == "huge" else "4k"]
                    dst = views["4k" if case == "4k" else "huge"]
                    with Mover(fd, src, dst, rate):
                        time.sleep(0.05)
                        times[case].append(loop())
                console.print(f"[dim]round {k + 1}/{args.rounds}: " + ", ".join(f"{c} {times[c][-1]:.2f} s" for c in CASES) + "[/]")
        finally:
            os.close(fd)
    base = statistics.median(times["none"])
    table = Table(title=f"compute loop with {args.rate} each way of O_DIRECT I/O, {args.rounds} rounds")
    for col in ("case", "median s", "x none"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for case in CASES:
        table.add_row(case, f"{statistics.median(times[case]):.3f}", f"{statistics.median(times[case]) / base:.3f}")
    table.caption = (
        f"huge-page bytes: 4k buffer {backing['4k'] >> 20} MiB, huge buffer {backing['huge'] >> 20} MiB of {FILE_BYTES >> 20} MiB"
        f" (huge page {HUGE_PAGE >> 20} MiB); torch threads {torch.get_num_threads()}"
    )
    console.print(table)
    if args.out:
        args.out.write_text(json.dumps({
            "command": " ".join(sys.argv), "rate_bps": rate, "rounds": args.rounds, "seconds": times,
            "ratio": {c: statistics.median(times[c]) / base for c in CASES}, "huge_page_bytes": backing,
            "machine": describe(str(directory)),
        }, indent=2, default=str))
        console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
