"""Facts about the drive and the page cache that a fair weights benchmark needs.

* :func:`evict`: drop given files' clean pages from the page cache (``fsync``, then
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each), so no mode starts with the weights cached
  by another. Only those files are touched (``/proc/sys/vm/drop_caches`` is often refused
  in containers, and would drop every process's cache).
* :func:`cached_bytes`: how much of each file is in the page cache now (``mincore`` on a
  mapping of it, :func:`gds_offload.bench.io_bench.page_cache_bytes`): evidence that
  :func:`evict` worked, recorded with every mode.
* :func:`raw_read_bandwidth`: the drive's sequential ``O_DIRECT`` read rate with several
  requests in flight (one thread per request, each ``preadv`` into its own aligned buffer,
  no copy, no checksum): the ceiling any streamer can reach on this drive.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gds_offload.bench.io_bench import page_cache_bytes

__all__ = ["RawRead", "evict", "cached_bytes", "raw_read_bandwidth"]


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
    """One pass over a file: ``depth`` requests of ``chunk_bytes`` in flight."""

    depth: int
    chunk_bytes: int
    nbytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"bytes_per_s": self.bytes_per_s}


def raw_read_bandwidth(path: Path, *, depths: tuple[int, ...] = (1, 4, 8), chunk_bytes: int = 8 << 20, max_bytes: int | None = None) -> list[RawRead]:
    """Read ``path`` (its first ``max_bytes``) sequentially with ``O_DIRECT``, once per depth.

    Chunks are handed to ``depth`` threads in file order, so ``depth`` requests are in flight.
    The file's cache is dropped first (``O_DIRECT`` bypasses it anyway).

    Raises:
        OSError: the file cannot be opened with ``O_DIRECT`` (tmpfs, overlayfs): measure on the store's drive.
    """
    if chunk_bytes % 4096:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be a multiple of 4096 for O_DIRECT")
    out = []
    for depth in depths:
        evict([path])
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size // 4096 * 4096
            size = min(size, max_bytes) if max_bytes else size
            local = threading.local()

            def read(off: int, fd: int = fd, size: int = size, local: threading.local = local) -> int:
                if not hasattr(local, "buf"):
                    local.buf = memoryview(mmap.mmap(-1, chunk_bytes))
                n = min(chunk_bytes, size - off)
                return os.preadv(fd, [local.buf[:n]], off)

            start = time.perf_counter()
            with ThreadPoolExecutor(depth, thread_name_prefix="gds_offload-raw") as pool:
                moved = sum(pool.map(read, range(0, size, chunk_bytes)))
            out.append(RawRead(depth, chunk_bytes, moved, time.perf_counter() - start))
        finally:
            os.close(fd)
    return out
