"""Storage-engine bandwidth, next to the drive's raw O_DIRECT bandwidth measured in the same run.

:func:`~gds_offload.bench.raw_io.raw_direct_bandwidth` asks ``fio`` (or ``dd``) what the drive does with O_DIRECT;
:func:`measure_engine` pushes tensors through an engine into a :class:`~gds_offload.io.spill.SpillStore`
the way the scheduler does (byte views, every write submitted before any is waited on,
then every read), and checks the bytes that come back. :func:`run_bench` runs both over
engines, tensor sizes and thread counts; ``gds-offload bench-io``
render its :class:`IOBenchReport`.

Which memory: on a node with a CUDA device every engine moves *device* buffers, as the
offloader does for a model on the GPU; only then does ``gds`` mean GPUDirect. Without one
the buffers are host memory, which KvikIO sends through POSIX whatever its compat mode:
each row says which (``memory``, ``label``: :func:`buffer_label`).

Page cache: a bandwidth read from memory is not a drive's. :func:`measure_engine` asks
the kernel (``mincore``) how many bytes of the spill file sit in the page cache after the
write phase and after the read phase, and reports them; before the read phase it flushes
and drops the file's cached pages so reads come from the drive.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gds_offload.bench.machine import describe_machine
from gds_offload.bench.raw_io import page_cache_bytes, raw_direct_bandwidth
from gds_offload.errors import ConfigError, OffloadError
from gds_offload.io.factory import make_engine, validate_mode
from gds_offload.io.spill import SpillStore

__all__ = [
    "buffer_label",
    "IOBenchReport",
    "measure_engine",
    "run_bench",
]

#: Distinct source tensors are cycled through up to this many bytes (keeps memory bounded).
SOURCE_POOL_BYTES = 256 << 20
#: Tensors compared with ``torch.equal`` after each read phase.
VERIFY_SAMPLES = 8

def _cached(files: list[Any]) -> int:
    return sum(page_cache_bytes(f.fd, f.size) for f in files if f.fd >= 0)


def _drop_cache(files: list[Any]) -> None:
    for f in files:
        if f.fd >= 0:
            os.fsync(f.fd)
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)


# ---------------------------------------------------------------------------------------
# one engine
# ---------------------------------------------------------------------------------------
def _make(mode: str, num_threads: int | None, chunk_bytes: int | None) -> Any:
    return make_engine(mode, num_threads=num_threads, chunk_bytes=chunk_bytes)  # type: ignore[arg-type]


def _memory(memory: str) -> str:
    """``auto``: the first CUDA device when there is one (what the offloader moves on a GPU), else ``host``."""
    import torch

    if memory == "auto":
        return "cuda:0" if torch.cuda.is_available() else "host"
    if memory == "host":
        return memory
    try:
        device = torch.device(memory)
    except RuntimeError:
        device = torch.device("cpu")  # not a device name: refused below
    if device.type != "cuda":
        raise ConfigError(f"memory={memory!r}: expected auto, host or a CUDA device (cuda, cuda:1)")
    if not torch.cuda.is_available():
        raise ConfigError(f"memory={memory!r} needs a CUDA device, and torch sees none")
    return f"cuda:{device.index or 0}"


def buffer_label(engine: str, memory: str, uses_gds: bool) -> str:
    """What a figure of ``engine`` measured with ``memory`` buffers is a figure of."""
    if memory == "host":
        return {
            "gds": "host memory through KvikIO (POSIX, not GPUDirect: no CUDA device)",
            "compat": "host memory through KvikIO (POSIX)",
            "posix": "host memory, pwrite/pread",
            "host": "host memory copies, no drive",
        }.get(engine, "host memory")
    return {
        "gds": f"{memory} memory, cuFile direct (GPUDirect)" if uses_gds else f"{memory} memory through cuFile (its POSIX fallback not ruled out)",
        "compat": f"{memory} memory staged through pinned host buffers, KvikIO POSIX",
        "posix": f"{memory} memory staged through pinned host buffers, pwrite/pread",
        "host": f"{memory} memory copied to pinned host buffers, no drive",
    }.get(engine, f"{memory} memory")


def _engine_threads(engine: Any) -> int | None:
    if engine.name == "posix":
        return engine.num_threads
    if engine.name in ("compat", "gds"):
        import kvikio.defaults

        return int(kvikio.defaults.get("num_threads"))
    return None


def measure_engine(
    mode: str,
    path: Path,
    total_bytes: int,
    tensor_bytes: int,
    repeats: int = 1,
    *,
    num_threads: int | None = None,
    chunk_bytes: int | None = None,
    memory: str = "auto",
) -> dict[str, Any]:
    """Write ``total_bytes`` of ``tensor_bytes`` tensors through engine ``mode``, then read them back.

    Each repeat uses a fresh :class:`~gds_offload.io.spill.SpillStore` in ``path`` with every slot
    allocated before the clock starts (as after a training run's first step). The write phase
    submits every write and then waits for all; the read phase likewise, into the buffers the
    offloader reads into (:meth:`~gds_offload.io.base.Engine.empty`), faulted in before the clock. GB/s is bytes / wall time of the phase (1e9 bytes per second); with
    several repeats the median is reported. Sources are cycled from a pool of distinct random
    tensors of at most :data:`SOURCE_POOL_BYTES`.

    Args:
        mode: ``posix``, ``compat``, ``gds`` or ``host``.
        path: spill directory.
        total_bytes: bytes per phase (rounded down to whole tensors; at least one tensor).
        tensor_bytes: bytes per tensor.
        repeats: write+read rounds.
        num_threads: engine threads (``None``: the engine's default).
        chunk_bytes: posix chunk / KvikIO task size (``None``: the engine's default).
        memory: the buffers' memory: ``auto`` (the first CUDA device if any, else host),
            ``host``, or a CUDA device. Device phases start and end with the device idle
            (synchronized), and each transfer gets a ``ready`` event, as from the offloader.

    Returns:
        ``{"engine", "description", "memory", "label", "threads", "tensor_bytes",
        "total_bytes", "write_gbps", "read_gbps", "write_gbps_all", "read_gbps_all",
        "page_cache_after_write_bytes", "page_cache_after_read_bytes", "verified"}``.
        ``memory`` is ``host`` or ``cuda:N``; ``label`` says what the figure is of
        (:func:`buffer_label`). The page-cache figures are the spill files' bytes resident
        in the page cache after each phase (0 means true direct I/O).

    Raises:
        ConfigError: bad sizes, or the engine cannot run here.
        OffloadError: a transfer failed or the bytes read back differ.
    """
    import torch

    if tensor_bytes <= 0 or repeats < 1:
        raise ConfigError(f"need tensor_bytes > 0 and repeats >= 1, got tensor_bytes={tensor_bytes}, repeats={repeats}")
    count = max(1, total_bytes // tensor_bytes)
    total = count * tensor_bytes
    where = _memory(memory)
    device = torch.device("cpu" if where == "host" else where)
    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    pool = min(count, max(1, SOURCE_POOL_BYTES // tensor_bytes))
    sources = [torch.randint(0, 256, (tensor_bytes,), dtype=torch.uint8, generator=gen).to(device) for _ in range(pool)]
    engine = _make(mode, num_threads, chunk_bytes)
    writes: list[float] = []
    reads: list[float] = []
    cached_w = cached_r = 0

    def idle_ready() -> Any:
        # The device idle, and one event (recorded there) every transfer waits on, as the
        # scheduler hands each transfer an event of the producing or consuming stream.
        if not cuda:
            return None
        torch.cuda.synchronize(device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        return ready

    try:
        for _ in range(repeats):
            store = SpillStore([Path(path)] if engine.needs_files else [])
            try:
                slots = [store.allocate(engine.slot_bytes(tensor_bytes, device)) for _ in range(count)]
                _drop_cache(store.files)
                ready = idle_ready()
                t0 = time.perf_counter()
                futures = [engine.write(sources[i % pool], slots[i], ready=ready) for i in range(count)]
                for f in futures:
                    f.wait()
                writes.append(total / (time.perf_counter() - t0) / 1e9)
                cached_w = max(cached_w, _cached(store.files))
                _drop_cache(store.files)
                # The buffers the offloader reads into (Engine.empty), faulted in before the clock.
                dsts = [engine.empty(tensor_bytes, slot, device).zero_() for slot in slots]
                ready = idle_ready()
                t0 = time.perf_counter()
                futures = [engine.read(dsts[i], slots[i], ready=ready) for i in range(count)]
                for f in futures:
                    f.wait()
                reads.append(total / (time.perf_counter() - t0) / 1e9)
                cached_r = max(cached_r, _cached(store.files))
                for i in range(0, count, max(1, count // VERIFY_SAMPLES)):
                    if not torch.equal(dsts[i], sources[i % pool]):
                        raise OffloadError(f"{mode}: tensor {i} of {count} read back differs from what was written")
            finally:
                store.close()
        return {
            "engine": engine.name,
            "description": engine.description,
            "memory": where,
            "label": buffer_label(engine.name, where, engine.uses_gds),
            "threads": _engine_threads(engine),
            "chunk_bytes": getattr(engine, "chunk_bytes", None) or getattr(engine, "task_bytes", None),
            "tensor_bytes": tensor_bytes,
            "total_bytes": total,
            "write_gbps": statistics.median(writes),
            "read_gbps": statistics.median(reads),
            "write_gbps_all": writes,
            "read_gbps_all": reads,
            "page_cache_after_write_bytes": cached_w,
            "page_cache_after_read_bytes": cached_r,
            "verified": True,
        }
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------
# the whole benchmark
# ---------------------------------------------------------------------------------------
@dataclass
class IOBenchReport:
    """What ``gds-offload bench-io`` measured: the machine, the raw drive, and one row per run."""

    machine: dict[str, Any]
    raw: dict[str, Any] | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    #: Engines that could not run here, with the reason.
    skipped: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_bench(
    path: Path,
    *,
    total_bytes: int,
    tensor_sizes: list[int],
    engines: list[str],
    threads: list[int] | None = None,
    chunk_sizes: list[int] | None = None,
    repeats: int = 1,
    raw: bool = True,
    progress: Any = None,
    memory: str = "auto",
) -> IOBenchReport:
    """Measure the raw drive, every engine x thread count x chunk size x tensor size, then the raw drive again.

    ``threads``/``chunk_sizes`` (``None``: engine defaults) apply to ``posix`` and ``compat``/``gds``;
    ``host`` runs once per tensor size. ``memory``: the buffers' memory (see
    :func:`measure_engine`; ``auto``: the GPU when there is one). Each row gets ``write_ratio``/``read_ratio`` to the raw
    figure (the mean of the raw runs before and after, both kept in ``raw["samples"]``). ``progress(str)`` is called before each measurement (for a CLI status line).
    Engines that cannot run here (no KvikIO) land in ``skipped`` with the reason.
    """

    for e in engines:
        if validate_mode(e) == "auto":
            raise ConfigError("bench-io measures named engines; pass posix, compat, gds or host, not auto")
    _memory(memory)  # a bad value is the caller's error, not an engine that cannot run here
    path = Path(path)
    report = IOBenchReport(machine=describe_machine(path).as_dict(), raw=None)
    if raw:
        if progress:
            progress(f"raw O_DIRECT bandwidth of {path} (before)")
        before = raw_direct_bandwidth(path, total_bytes)
    # None: the engine's default thread count or chunk size.
    threads_tried: list[int | None] = list(threads) if threads else [None]
    chunks_tried: list[int | None] = list(chunk_sizes) if chunk_sizes else [None]
    for mode in engines:
        per_engine: list[tuple[int | None, int | None]] = (
            [(None, None)] if mode == "host" else [(t, c) for t in threads_tried for c in chunks_tried])
        for t, c in per_engine:
            for size in tensor_sizes:
                if progress:
                    progress(f"{mode} threads={t or 'default'} chunk={c or 'default'} tensors of {size} bytes")
                try:
                    row = measure_engine(mode, path, total_bytes, size, repeats, num_threads=t, chunk_bytes=c, memory=memory)
                except ConfigError as exc:
                    report.skipped[mode] = str(exc)
                    break
                report.rows.append(row)
            if mode in report.skipped:
                break
    if raw:
        if progress:
            progress(f"raw O_DIRECT bandwidth of {path} (after)")
        after = raw_direct_bandwidth(path, total_bytes)
        report.raw = _mean_raw(before, after)
        for row in report.rows:
            row["write_ratio"] = row["write_gbps"] / report.raw["write_gbps"]
            row["read_ratio"] = row["read_gbps"] / report.raw["read_gbps"]
    return report


def _mean_raw(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The raw figure the ratios use: the mean of the runs before and after the engines
    (a shared or virtual disk drifts over a minute; one sample would skew every ratio)."""
    return before | {
        "write_gbps": (before["write_gbps"] + after["write_gbps"]) / 2,
        "read_gbps": (before["read_gbps"] + after["read_gbps"]) / 2,
        "samples": [{k: r[k] for k in ("write_gbps", "read_gbps")} for r in (before, after)],
    }
