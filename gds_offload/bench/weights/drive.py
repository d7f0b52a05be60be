"""Facts about the drive and the page cache that a fair weights benchmark needs.

* :func:`evict`: drop given files' clean pages from the page cache (``fsync``, then
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each), so no mode starts with the weights cached
  by another. Only those files are touched (``/proc/sys/vm/drop_caches`` is often refused
  in containers, and would drop every process's cache).
* :func:`cached_bytes`: how much of each file is in the page cache now (``mincore`` on a
  mapping of it, :func:`gds_offload.bench.raw_io.page_cache_bytes`): evidence that
  :func:`evict` worked, recorded with every mode.
* :func:`raw_read_bandwidth`: the drive's sequential ``O_DIRECT`` read rate with several
  requests in flight (one thread per request, each ``preadv`` into the next chunk of a window
  of huge pages larger than a CPU cache, no copy, no checksum): the ceiling any streamer can
  reach on this drive.
* :func:`read_interference`: how much such reads slow compute running beside them (a matmul
  timed alone and with reads in flight, alternately). Where the reads cost CPU (a VM's
  virtualised drive, a kernel's I/O path), a streamer cannot hide them completely, however
  well it overlaps; the weights benchmark turns this into a bound on its own targets.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from gds_offload.bench.raw_io import page_cache_bytes
from gds_offload.io.layout import ALIGN
from gds_offload.io.pages import map_anonymous

__all__ = ["RAW_WINDOW_BYTES", "RawRead", "ReadInterference", "evict", "cached_bytes", "raw_read_bandwidth", "read_interference"]


def evict(paths: list[Path]) -> None:
    """``fsync`` then ``POSIX_FADV_DONTNEED`` each file (missing ones are skipped).

    Pages mapped by a live process stay; call it when no child runs.
    """
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(paths: list[Path]) -> dict[str, tuple[int, int]]:
    """``{path: (bytes in the page cache, file size)}`` for each existing file."""
    out = {}
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            size = os.fstat(fd).st_size
            out[str(p)] = (page_cache_bytes(fd, size), size)
        finally:
            os.close(fd)
    return out


@dataclass(frozen=True)
class RawRead:
    """One pass over a file: ``depth`` requests of ``chunk_bytes`` in flight, into ``window_bytes`` of memory."""

    depth: int
    chunk_bytes: int
    nbytes: int
    seconds: float
    window_bytes: int = 0

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"bytes_per_s": self.bytes_per_s}


#: Destination memory a raw pass cycles its requests through: larger than a CPU cache, as a
#: layer is. One small buffer reused by every request stays in cache, and where the drive is
#: virtualised (the host copies each request into guest memory) that inflates the rate over
#: what reads into memory that can hold the data get. Each :class:`RawRead` records its window.
RAW_WINDOW_BYTES = 64 << 20


def raw_read_bandwidth(path: Path, *, depths: tuple[int, ...] = (1, 4, 8), chunk_bytes: int = 8 << 20, max_bytes: int | None = None,
                       window_bytes: int = RAW_WINDOW_BYTES) -> list[RawRead]:  # fmt: skip
    """Read ``path`` (its first ``max_bytes``) sequentially with ``O_DIRECT``, once per depth.

    Chunks are handed to ``depth`` threads in file order, so ``depth`` requests are in flight,
    each into the next ``chunk_bytes`` of one ``window_bytes`` buffer of huge pages (wrapping
    around; at least ``depth`` chunks). The file's cache is dropped first (``O_DIRECT``
    bypasses it anyway).

    Raises:
        OSError: the file cannot be opened with ``O_DIRECT`` (tmpfs, overlayfs): measure on the store's drive.
    """
    if chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be a multiple of {ALIGN} for O_DIRECT")
    out = []
    for depth in depths:
        evict([path])
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size // ALIGN * ALIGN
            size = min(size, max_bytes // ALIGN * ALIGN) if max_bytes else size
            window = _window(window_bytes, depth, chunk_bytes)
            start = time.perf_counter()
            moved = _read_pass(fd, size, depth, chunk_bytes, window)
            out.append(RawRead(depth, chunk_bytes, moved, time.perf_counter() - start, len(window)))
        finally:
            os.close(fd)
    return out


def _window(window_bytes: int, depth: int, chunk_bytes: int) -> memoryview:
    # Huge pages, as the streamer's ring has: a request into 4 KiB pages needs a segment per
    # page, and a queue's segment limit (virtio: ~254) then caps the request's size.
    return memoryview(map_anonymous(max(window_bytes // chunk_bytes, depth) * chunk_bytes))


def _read_pass(fd: int, size: int, depth: int, chunk_bytes: int, window: memoryview, stop: threading.Event | None = None,
               on_read: Callable[[int], None] | None = None) -> int:  # fmt: skip
    """Read ``fd``'s first ``size`` bytes in ``chunk_bytes`` requests, ``depth`` in flight, into
    successive chunks of ``window``; bytes read. With ``stop``, requests after it is set read nothing;
    ``on_read(nbytes)`` runs on the reading thread after each request."""

    def read(off: int) -> int:
        if stop is not None and stop.is_set():
            return 0
        at = off % len(window)
        n = os.preadv(fd, [window[at : at + min(chunk_bytes, size - off)]], off)
        if on_read is not None:
            on_read(n)
        return n

    with ThreadPoolExecutor(depth, thread_name_prefix="gds_offload-raw") as pool:
        return sum(pool.map(read, range(0, size, chunk_bytes)))


class _Reads:
    """Passes over ``fd`` on a thread until :meth:`stop`; counts bytes as each request lands."""

    def __init__(self, fd: int, size: int, depth: int, chunk_bytes: int) -> None:
        self._stop, self.flowing = threading.Event(), threading.Event()
        self._lock, self.moved = threading.Lock(), 0
        window = _window(RAW_WINDOW_BYTES, depth, chunk_bytes)
        self._thread = threading.Thread(target=self._run, args=(fd, size, depth, chunk_bytes, window), name="gds_offload-interference")

    def _landed(self, nbytes: int) -> None:
        with self._lock:
            self.moved += nbytes
        self.flowing.set()

    def _run(self, fd: int, size: int, depth: int, chunk_bytes: int, window: memoryview) -> None:
        while not self._stop.is_set():
            _read_pass(fd, size, depth, chunk_bytes, window, self._stop, self._landed)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start reading; return once the first request has landed, so what is timed next runs beside reads."""
        self._thread.start()
        self.flowing.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class ReadInterference:
    """A compute workload timed alone and with ``O_DIRECT`` reads in flight (medians over rounds)."""

    alone_s: float
    with_reads_s: float
    read_bytes_per_s: float
    depth: int
    torch_threads: int

    @property
    def slowdown(self) -> float:
        """``with_reads_s / alone_s``: how much slower compute runs while the drive reads at full rate."""
        return self.with_reads_s / self.alone_s if self.alone_s else 1.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"slowdown": self.slowdown}


def read_interference(path: Path, *, rows: int, hidden: int, intermediate: int, depth: int = 4, seconds: float = 2.0,
                      rounds: int = 2, chunk_bytes: int = 8 << 20) -> ReadInterference:  # fmt: skip
    """Time ``rows x hidden @ hidden x intermediate`` float32 matmuls (repeated for about
    ``seconds``) alone and while ``depth`` threads read ``path`` with ``O_DIRECT`` over and
    over, alternating, ``rounds`` times each; medians. Compute uses torch's current thread count.

    Raises:
        OSError: the file cannot be opened with ``O_DIRECT``.
    """
    import torch

    a, b = torch.randn(rows, hidden), torch.randn(hidden, intermediate)
    a @ b  # warm the kernels and the allocator
    start = time.perf_counter()
    a @ b
    reps = max(1, round(seconds / max(time.perf_counter() - start, 1e-6)))

    def compute() -> float:
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        return time.perf_counter() - t

    alone, busy, rates = [], [], []
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size // ALIGN * ALIGN
        for _ in range(rounds):
            alone.append(compute())
            reads, t = _Reads(fd, size, depth, chunk_bytes), time.perf_counter()
            reads.start()  # compute starts once reads are flowing, however short it is
            busy.append(compute())
            reads.stop()
            rates.append(reads.moved / (time.perf_counter() - t))
    finally:
        os.close(fd)
    return ReadInterference(statistics.median(alone), statistics.median(busy), statistics.median(rates), depth, torch.get_num_threads())
