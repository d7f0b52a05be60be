"""Device memory to and from the drive without waiting for the training's streams.

Why this module exists: a copy between device memory and the host that an engine thread
runs on the *legacy default stream*, or on a stream created *blocking*
(``CU_STREAM_DEFAULT``), is ordered against every kernel queued on the legacy default
stream, which is where most training runs: the copy waits for the compute queued before
it, and compute queued after it waits for the copy. Three paths did that:

- KvikIO's compat mode copies its bounce buffers on per-thread streams it creates with
  ``CU_STREAM_DEFAULT`` (KvikIO 26.10 ``cpp/src/detail/stream.cpp``, ``StreamCreate(&stream,
  CU_STREAM_DEFAULT)``; used by ``posix_device_io`` in ``detail/posix_io.hpp`` and by
  ``posix_device_read_aligned`` in ``cpp/src/detail/posix_io.cpp``).
- KvikIO's ``FileHandle::pread``/``pwrite`` with compat mode off call
  ``StreamSynchronize(nullptr)`` before every transfer of at least ``gds_threshold`` bytes
  (``cpp/src/file_handle.cpp``, ``sync_default_stream`` defaults to true and the Python
  binding ``_lib/file_handle.pyx`` never passes it).
- ``tensor.copy_`` on an engine thread runs on that thread's current stream: the legacy
  default stream.

Streams made by ``torch.cuda.Stream()`` come from torch's pool, created
``cudaStreamNonBlocking`` (``c10/cuda/CUDAStream.cpp``, ``kDefaultFlags``): work on them
is ordered only by the events it is made to wait on. So the engines copy on such streams:

- :class:`Staging` (``compat``, ``posix``): device memory and page-aligned pinned host
  buffers, copied on a side stream the staging owns; KvikIO or ``os.pwrite``/``preadv``
  then move *host* pages, which needs no CUDA stream at all.
- :class:`SideStreams` (``gds``): a side stream per thread and device, on which KvikIO's
  stream API (``CuFile.raw_read_async``/``raw_write_async``, cuFile's
  ``cuFileReadAsync``/``cuFileWriteAsync``) is queued.

Contract of everything here:

- **Thread**: a :class:`Staging` and a stream from :class:`SideStreams` belong to the one
  engine thread that asked for it (:class:`StagingPool` and :class:`SideStreams` key them by
  thread and device); nothing here is shared between threads.
- **Ordering**: a write's source is read after its ``ready`` event (the engine thread
  synchronizes on it before :func:`copy_out_chunks`); a read's destination is written, on
  the side stream, only after the side stream waited for the read's ``ready`` event
  (:func:`copy_in_chunks`), while the drive read into the pinned buffer starts at once.
- **Completion**: every function returns only when its copies have finished on the
  device (it synchronizes its events, and its stream on the way out even after an
  error), so a future completed after it means "the bytes are in ``dst``, visible to
  every stream", and no copy of the staging outlives the call.
- **Buffers**: the caller keeps ``src``/``dst`` alive during the call; the staging owns its
  pinned buffers for its life and reuses them only after the copy that used them is done.
  No ``record_stream`` is needed for ``src``/``dst``: the side stream uses them only during
  the call, and that use has finished on the device when the call returns, so the caching
  allocator may hand their blocks to any stream afterwards.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Callable, Generic, TypeVar

import torch

from gds_offload.io.layout import ALIGN, align_up, aligned_view

T = TypeVar("T")

__all__ = [
    "CudaBackend",
    "SideStreams",
    "Staging",
    "StagingPool",
    "copy_in_chunks",
    "copy_out_chunks",
    "on_device",
    "padded",
]


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is in device (not host) memory: the engines stage or stream it."""
    return t.device.type != "cpu"


class CudaBackend:
    """The CUDA calls a :class:`Staging` makes, in one place (tests replace it on the CPU)."""

    def stream(self, device: torch.device) -> Any:
        # From torch's pool: cudaStreamNonBlocking, so never ordered against the legacy stream.
        return torch.cuda.Stream(device=device)

    def event(self) -> Any:
        # blocking=True: the engine thread sleeps in synchronize() instead of spinning a core.
        return torch.cuda.Event(blocking=True)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` (and its device) current on this thread for the block."""
        return torch.cuda.stream(stream)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def current_device(self) -> int:
        return torch.cuda.current_device()


class Staging:
    """A side stream on ``device``, ``count`` page-aligned pinned host buffers of
    ``chunk_bytes``, and an event per buffer. For one thread (see the module doc).

    Args:
        device: the CUDA device whose memory is copied.
        chunk_bytes: size of each host buffer, a multiple of 4 KiB (the drive moves whole
            pages of it with ``O_DIRECT``).
        backend: the CUDA calls (:class:`CudaBackend`).
        count: host buffers; two let a chunk's copy overlap the previous chunk's drive I/O.
    """

    def __init__(self, device: torch.device, chunk_bytes: int, backend: CudaBackend | None = None, *, count: int = 2) -> None:
        if chunk_bytes < ALIGN or chunk_bytes % ALIGN or count < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of {ALIGN}, count={count} at least 1")
        self.backend = backend or CudaBackend()
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.stream = self.backend.stream(device)
        self.events = [self.backend.event() for _ in range(count)]
        #: Pinned bytes the buffers hold, as torch's caching host allocator reserves them.
        self.pinned_nbytes = 0
        self.buffers = [self._aligned(chunk_bytes) for _ in range(count)]
        #: Whether buffer i has a copy queued that was not waited for yet.
        self._queued = [False] * count

    def _aligned(self, nbytes: int) -> torch.Tensor:
        # torch's pinned allocator promises no page alignment (O_DIRECT needs it), but its blocks
        # come from cudaHostAlloc, which gives whole pages: ask for exactly ``nbytes`` first. Asking
        # for ``nbytes + ALIGN`` up front would make its caching allocator, which rounds every
        # request up to a power of two, hold twice a power-of-two chunk.
        block = self.backend.pinned(nbytes)
        if block.data_ptr() % ALIGN:
            block = self.backend.pinned(nbytes + ALIGN)
        self.pinned_nbytes += held_nbytes(block.numel())
        return aligned_view(block, nbytes)

    def copy_out(self, i: int, src: torch.Tensor) -> None:
        """Queue ``buffers[i][:n] <- src`` (``n = src.numel()`` bytes of device memory) on the side stream."""
        assert src.numel() <= self.chunk_bytes, f"{src.numel()} bytes do not fit a {self.chunk_bytes}-byte staging buffer"
        with self.backend.use(self.stream):
            self.buffers[i][: src.numel()].copy_(src, non_blocking=True)
        self.events[i].record(self.stream)
        self._queued[i] = True

    def copy_in(self, i: int, dst: torch.Tensor, start: int = 0, *, ready: Any = None) -> None:
        """Queue ``dst <- buffers[i][start : start + dst.numel()]`` on the side stream, after
        ``ready`` (a CUDA event: what may still use ``dst``'s memory) when given."""
        with self.backend.use(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            dst.copy_(self.buffers[i][start : start + dst.numel()], non_blocking=True)
        self.events[i].record(self.stream)
        self._queued[i] = True

    def wait(self, i: int) -> None:
        """Block this thread until buffer ``i``'s queued copy finished (at once if none is)."""
        if self._queued[i]:
            self.events[i].synchronize()
            self._queued[i] = False

    def drain(self) -> None:
        """Block until every copy queued on the side stream finished."""
        self.stream.synchronize()
        self._queued = [False] * len(self.buffers)


def _chunks(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(chunk, total - lo)) for lo in range(0, total, chunk)]


def copy_out_chunks(stage: Staging, src: torch.Tensor, sink: Callable[[torch.Tensor, int, int], None]) -> None:
    """Hand ``src`` (device memory, contiguous uint8) to ``sink(host, lo, n)`` chunk by chunk.

    ``host`` is a pinned, page-aligned buffer of ``stage.chunk_bytes`` whose first ``n``
    bytes are ``src[lo : lo + n]`` (copied and finished); ``sink`` writes them to the drive
    before it returns (the buffer is refilled after). With two buffers the copy of chunk
    k + 1 runs on the side stream while ``sink`` writes chunk k. The caller has synchronized on the write's
    ``ready`` event before calling.
    """
    parts = _chunks(src.numel(), stage.chunk_bytes)
    m = len(stage.buffers)
    queued = 0
    try:
        for k, (lo, n) in enumerate(parts):
            # Chunk j goes into buffer j % m, whose previous chunk j - m sink() has written once j - m < k.
            while queued < len(parts) and queued <= k + m - 1:
                qlo, qn = parts[queued]
                stage.copy_out(queued % m, src[qlo : qlo + qn])
                queued += 1
            stage.wait(k % m)
            sink(stage.buffers[k % m], lo, n)
    finally:
        stage.drain()  # after a failure too: no copy may still read src once this returns


def copy_in_chunks(stage: Staging, dst: torch.Tensor, source: Callable[[torch.Tensor, int, int], None], *, ready: Any = None) -> None:
    """Fill ``dst`` (device memory, contiguous uint8) from ``source(host, lo, n)`` chunk by chunk.

    ``source`` fills the first ``n`` bytes of ``host`` (a pinned, page-aligned buffer of
    ``stage.chunk_bytes``; it may fill whole pages past ``n``) with ``dst``'s bytes
    ``[lo, lo + n)`` from the drive. The copy into ``dst`` waits on the side stream for
    ``ready`` (the caching allocator may have handed out memory a queued kernel still
    reads); with two buffers the drive read of chunk k + 1 runs while chunk k is copied.
    Returns when every byte is in ``dst``.
    """
    parts = _chunks(dst.numel(), stage.chunk_bytes)
    try:
        for k, (lo, n) in enumerate(parts):
            i = k % len(stage.buffers)
            stage.wait(i)  # the copy out of this buffer (an earlier chunk's) is done: it can be refilled
            source(stage.buffers[i], lo, n)
            stage.copy_in(i, dst[lo : lo + n], ready=ready if k == 0 else None)  # one wait orders them all
    finally:
        stage.drain()


def indexed_device(device: torch.device, current: Callable[[], int] = torch.cuda.current_device) -> torch.device:
    """``device`` with its index: ``cuda`` is the current CUDA device (``cuda:N``), as
    ``tensor.device`` always names it; other devices as given. Registries keyed by device need it:
    ``torch.device("cuda") != torch.device("cuda:0")``, so a warm-up given ``cuda`` would otherwise
    set up values the engine threads, which look up ``tensor.device``, never find."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", current())
    return device


def held_nbytes(nbytes: int) -> int:
    """What torch's caching host allocator reserves for a pinned request of ``nbytes``: the next
    power of two."""
    return 1 << max(nbytes - 1, 0).bit_length()


class _PerThreadDevice(Generic[T]):
    """One value per (thread, device), made by ``make(device)`` on its first use. Thread-safe.
    ``cuda`` and ``cuda:<current>`` are one device (:func:`indexed_device`)."""

    def __init__(self, make: Callable[[torch.device], T], backend: CudaBackend) -> None:
        self._make = make
        self._backend = backend
        self._lock = threading.Lock()
        self._values: dict[tuple[int, torch.device], T] = {}

    def get(self, device: torch.device) -> T:
        device = indexed_device(device, self._backend.current_device)
        key = (threading.get_ident(), device)
        with self._lock:
            value = self._values.get(key)
        if value is None:
            value = self._make(device)  # outside the lock: it may pin memory
            with self._lock:
                self._values[key] = value
        return value

    def values(self) -> list[T]:
        with self._lock:
            return list(self._values.values())

    def close(self) -> None:
        """Drop every value (call once the threads using them have stopped)."""
        with self._lock:
            self._values.clear()


class StagingPool(_PerThreadDevice[Staging]):
    """One :class:`Staging` per (thread, device), made on its first use. Thread-safe.

    Args:
        chunk_bytes: each staging buffer's size (a multiple of 4 KiB).
        backend: the CUDA calls (:class:`CudaBackend`).

    Pinned host memory: ``count * chunk_bytes`` (rounded up to a power of two each) per engine thread that
    moved device memory; :attr:`pinned_bytes` says how much. :meth:`close` hands it back to
    torch's pinned-memory cache. Pinning memory is an implicit synchronization point of the
    device (CUDA C++ Programming Guide, "Implicit Synchronization"), so a thread's first
    device transfer waits for the work queued before it; later ones reuse the buffers.
    """

    def __init__(self, chunk_bytes: int, backend: CudaBackend | None = None, *, count: int = 2) -> None:
        backend = backend or CudaBackend()
        super().__init__(lambda device: Staging(device, chunk_bytes, backend, count=count), backend)
        self.chunk_bytes = chunk_bytes

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory the buffers hold, as torch's caching host allocator reserves it."""
        return sum(s.pinned_nbytes for s in self.values())


class SideStreams(_PerThreadDevice[Any]):
    """One side stream per (thread, device), from torch's non-blocking pool. Thread-safe."""

    def __init__(self, backend: CudaBackend | None = None) -> None:
        self.backend = backend or CudaBackend()
        super().__init__(self.backend.stream, self.backend)

    @contextlib.contextmanager
    def use(self, device: torch.device) -> Iterator[Any]:
        """This thread's side stream on ``device``, current (with its device) for the block."""
        stream = self.get(device)
        with self.backend.use(stream):
            yield stream


def padded(n: int, direct: bool) -> int:
    """Bytes to move for ``n`` data bytes: whole pages on an ``O_DIRECT`` file (slots are
    4 KiB-aligned and sized, so the padding stays inside the slot), else ``n``."""
    return align_up(n) if direct else n
