"""The drive itself, without an engine: its sequential ``O_DIRECT`` bandwidth (:func:`raw_direct_bandwidth`,
through ``fio`` or ``dd``), and how much of a file sits in the page cache (:func:`page_cache_bytes`,
``mincore``), so that a bandwidth read from memory is never taken for a drive's.
"""
from __future__ import annotations

import ctypes
import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from gds_offload.errors import ConfigError
from gds_offload.io.spill import open_unnamed

__all__ = ["FIO_BLOCK_BYTES", "FIO_IODEPTH", "DD_BLOCK_BYTES", "page_cache_bytes", "raw_direct_bandwidth"]

#: fio's request size and queue depth for the raw figure: sequential 1 MiB requests, 16 in
#: flight, one job, libaio. That saturates NVMe drives, and 16 requests is about what the
#: engines keep in flight (posix: 8 threads; KvikIO: 16 threads).
FIO_BLOCK_BYTES = 1 << 20
FIO_IODEPTH = 16
#: ``dd``'s block size when fio is missing (dd has one request in flight; big blocks help).
DD_BLOCK_BYTES = 64 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------
# the drive's raw O_DIRECT bandwidth
# ---------------------------------------------------------------------------------------
def _fio_pass(fio: str, file: str, rw: str, total_bytes: int, fd: int) -> tuple[float, list[str]]:
    cmd = [
        fio, f"--name=raw-{rw}", f"--filename={file}", f"--rw={rw}", f"--bs={FIO_BLOCK_BYTES}",
        "--direct=1", "--ioengine=libaio", f"--iodepth={FIO_IODEPTH}", "--numjobs=1",
        f"--size={total_bytes}", "--output-format=json",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600, pass_fds=(fd,)).stdout
    report = json.loads(out[out.index("{") :])  # fio may print notes before the JSON
    job = report["jobs"][0]["write" if rw == "write" else "read"]
    return job["io_bytes"] / (job["runtime"] / 1000) / 1e9, cmd


def _dd_pass(dd: str, file: str, rw: str, total_bytes: int, fd: int) -> tuple[float, list[str]]:
    count = max(1, total_bytes // DD_BLOCK_BYTES)
    bs = f"bs={DD_BLOCK_BYTES}"
    if rw == "write":
        cmd = [dd, "if=/dev/zero", f"of={file}", bs, f"count={count}", "oflag=direct", "conv=notrunc", "status=none"]
    else:
        cmd = [dd, f"if={file}", "of=/dev/null", bs, f"count={count}", "iflag=direct", "status=none"]
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True, timeout=600, pass_fds=(fd,))
    return count * DD_BLOCK_BYTES / (time.perf_counter() - t0) / 1e9, cmd


def raw_direct_bandwidth(path: Path, total_bytes: int) -> dict[str, Any]:
    """The drive's sequential O_DIRECT write, then read, bandwidth under ``path``.

    fio when installed (libaio, :data:`FIO_IODEPTH` requests of :data:`FIO_BLOCK_BYTES`
    in flight, one job, a fresh file it lays out like a new spill file), else ``dd``
    with ``oflag=direct``/``iflag=direct`` and 64 MiB blocks. The file is unnamed, as a
    spill file is: the tool writes it through ``/proc/self/fd/N``, and its space is freed
    when this function returns, or when the process dies however it dies.

    Args:
        path: a directory on the drive.
        total_bytes: bytes written and then read (rounded up to 1 MiB).

    Returns:
        ``{"tool", "write_gbps", "read_gbps", "command"}`` (GB/s = 1e9 bytes per second).

    Raises:
        ConfigError: neither fio nor dd is installed.
        subprocess.CalledProcessError: the tool failed (its stderr says why).
    """
    total_bytes = -(-max(total_bytes, FIO_BLOCK_BYTES) // FIO_BLOCK_BYTES) * FIO_BLOCK_BYTES
    fio, dd = shutil.which("fio"), shutil.which("dd")
    if fio:
        tool, run_pass = "fio", lambda f, rw, fd: _fio_pass(fio, f, rw, total_bytes, fd)
    elif dd:
        tool, run_pass = "dd", lambda f, rw, fd: _dd_pass(dd, f, rw, total_bytes, fd)
    else:
        raise ConfigError("raw bandwidth needs fio or dd on PATH; install fio (apt-get install fio)")
    # An unnamed file (O_TMPFILE, or a named one unlinked at once): the tool reaches it through
    # /proc/self/fd/N (the descriptor is passed to it), so even a kill -9 leaves nothing behind.

    fd, _direct, _note = open_unnamed(Path(path), direct=False)
    file = f"/proc/self/fd/{fd}"
    try:
        write_gbps, wcmd = run_pass(file, "write", fd)
        read_gbps, rcmd = run_pass(file, "read", fd)
    finally:
        os.close(fd)
    command = " && ".join(shlex.join(c) for c in (wcmd, rcmd))
    return {"tool": tool, "write_gbps": write_gbps, "read_gbps": read_gbps, "command": command}


# ---------------------------------------------------------------------------------------
# page cache residency
# ---------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def page_cache_bytes(fd: int, size: int) -> int:
    """Bytes of the file behind ``fd`` (its first ``size`` bytes) resident in the page cache.

    Maps the file (nothing is touched) and asks ``mincore``; works on O_DIRECT descriptors
    and unnamed files, and counts pages cached through any descriptor of the same file.
    """
    if size <= 0:
        return 0
    import numpy as np

    addr = _libc.mmap(None, size, 0x1, 0x01, fd, 0)  # PROT_READ, MAP_SHARED
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of fd {fd} for mincore failed: {os.strerror(err)}")
    try:
        pages = (size + _PAGE - 1) // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(addr, size, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore failed: {os.strerror(err)}")
        return int((np.frombuffer(memoryview(vec), dtype=np.uint8) & 1).sum()) * _PAGE
    finally:
        _libc.munmap(addr, size)
