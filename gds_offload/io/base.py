"""The storage-engine interface: asynchronous writes and reads of byte tensors to spill slots.

Every engine takes a *contiguous ``torch.uint8`` tensor* (the bytes of one storage)
and a :class:`~gds_offload.io.spill.Slot`, and returns an :class:`IOFuture`.

.. note:: Buffer ownership (applies to every engine)
   The caller keeps ``src`` (for writes) and ``dst`` (for reads) alive and unmodified
   until the returned future is done. For CUDA sources, ``ready`` is an event recorded
   on the producing stream; the engine waits on it (on its own thread) before reading
   the bytes, so the pack hook never blocks. For CUDA destinations, ``ready`` orders the
   engine's first write into ``dst`` (an engine may wait on its own side stream rather
   than its thread, and read from the drive meanwhile). A read future being done means
   the bytes are in ``dst`` and visible to every stream: the engine's copies and DMA into
   it have finished on the device.

.. note:: Streams
   Engines never move device memory on the legacy default stream or on a stream that
   synchronizes with it (see :mod:`gds_offload.io.staging`): a transfer waits for its
   ``ready`` event only, never for the rest of the compute queued on the caller's stream.
"""
from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal

import torch

from gds_offload.errors import OffloadError

if TYPE_CHECKING:
    from gds_offload.io.layout import Slot
    from gds_offload.io.limits import TokenBucket

__all__ = ["Engine", "EngineStats", "IOFuture", "Direction"]

Direction = Literal["write", "read"]


@dataclass
class EngineStats:
    """Counters of one engine. ``*_busy_s`` is wall time with at least one transfer being
    served (queueing excluded), so ``bytes / busy_s`` is the bandwidth the engine sustained
    while working."""

    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0
    write_busy_s: float = 0.0
    read_busy_s: float = 0.0
    retries: int = 0
    #: Host memory the engine's read buffers hold now: those of read-back tensors still alive
    #: (from the read until the last view of the bytes dies) and the idle ones kept for reuse.
    read_buffer_bytes: int = 0
    #: The most ``read_buffer_bytes`` held at once since the engine was made or :meth:`Engine.reset_peaks`.
    peak_read_buffer_bytes: int = 0
    #: Of ``read_buffer_bytes``, the idle buffers (now): between their tensor's death and the
    #: next read (see :meth:`Engine.trim`).
    idle_buffer_bytes: int = 0
    #: Host memory of the engine's staging buffers (pinned, for device memory) and bounce
    #: buffers (pageable, for host tensors not moved in place), held from each thread's first
    #: use of them until the engine closes.
    staging_bytes: int = 0
    #: Bytes copied through the engine's own pageable bounce buffers (posix, a host tensor that
    #: could not be moved as page spans in place); 0 where every transfer went zero-copy.
    bounced_bytes: int = 0

    def write_gbps(self) -> float:
        return self.bytes_written / self.write_busy_s / 1e9 if self.write_busy_s else 0.0

    def read_gbps(self) -> float:
        return self.bytes_read / self.read_busy_s / 1e9 if self.read_busy_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"write_gbps": self.write_gbps(), "read_gbps": self.read_gbps()}


class IOFuture:
    """Handle of one asynchronous transfer. Thread-safe.

    ``wait()`` returns the number of bytes moved, or raises :class:`OffloadError`
    (with the OS error as ``__cause__``) if the transfer failed.
    """

    __slots__ = ("_future", "nbytes")

    def __init__(self, future: Future[int], nbytes: int) -> None:
        self._future = future
        self.nbytes = nbytes

    @classmethod
    def completed(cls, nbytes: int) -> IOFuture:
        f: Future[int] = Future()
        f.set_result(nbytes)
        return cls(f, nbytes)

    @property
    def token(self) -> object:
        """Identifies the transfer: equal for every wrapper of it (callbacks get new wrappers)."""
        return self._future

    def done(self) -> bool:
        """True once the transfer finished, successfully or not. Never blocks."""
        return self._future.done()

    def failed(self) -> bool:
        return self._future.done() and self._future.exception() is not None

    def wait(self, timeout_s: float | None = None) -> int:
        """Block until done; return the bytes moved. Raises :class:`OffloadError` on failure,
        ``TimeoutError`` if ``timeout_s`` passes first.

        Raising hands out the stored exception, whose traceback then holds the caller's
        frames: code that keeps the future should use :meth:`error` instead."""
        return self._future.result(timeout_s)

    def error(self, timeout_s: float | None = None) -> BaseException | None:
        """Block until done; return the failure, or None. Never raises the transfer's error,
        so no caller frame is attached to the exception the future keeps."""
        return self._future.exception(timeout_s)

    def moved(self) -> int:
        """The bytes moved by a transfer that finished without error."""
        assert self._future.done() and self._future.exception() is None, "moved() of a failed or pending transfer"
        return self._future.result()

    def add_done_callback(self, fn: Callable[[IOFuture], None]) -> None:
        """Call ``fn(self)`` when done, on the engine thread that finished it (or now, if done)."""
        # Hand fn a new wrapper rather than capturing self: a callback stored on self._future
        # that referenced self would be a reference cycle, and whatever fn holds (read
        # buffers, sources) would then live until the cyclic GC runs.
        nbytes = self.nbytes
        self._future.add_done_callback(lambda f: fn(IOFuture(f, nbytes)))


class Engine(ABC):
    """A storage engine. Subclasses implement :meth:`_submit_write` and :meth:`_submit_read`."""

    #: Name used in ``mode=`` and in stats.
    name: ClassVar[str]
    #: False for engines that keep bytes in memory (``host``): the store then has no files.
    needs_files: ClassVar[bool] = True

    def __init__(self, *, limiter: TokenBucket | None = None) -> None:
        self._limiter = limiter
        self._lock = threading.Lock()
        self._stats = EngineStats()
        self._active = {"write": 0, "read": 0}
        self._busy_since = {"write": 0.0, "read": 0.0}
        self._closed = False
        self._aborted = False
        #: Whether bytes really move GPU memory -> storage without a host bounce buffer.
        self.uses_gds = False
        #: One line saying how this engine moves bytes (shown in stats and ``gds-offload info``).
        self.description = self.name
        #: Transfers this engine keeps in flight at most (its threads): the depth a raw reference
        #: read of the drive should use to compare with it.
        self.depth = 1

    # -- public API ---------------------------------------------------------------------
    def write(self, src: torch.Tensor, slot: Slot, *, ready: Any = None) -> IOFuture:
        """Start writing ``src`` (contiguous uint8, ``src.numel() <= slot.nbytes``) to ``slot``.

        Returns at once. ``ready``: a CUDA event the engine waits on before touching ``src``.
        """
        self._check_args(src, slot)
        return self._track("write", src.numel(), lambda: self._submit_write(src, slot, ready))

    def read(self, dst: torch.Tensor, slot: Slot, *, ready: Any = None) -> IOFuture:
        """Start reading ``dst.numel()`` bytes of ``slot`` into ``dst`` (contiguous uint8). Returns at once.

        ``ready``: a CUDA event the engine waits on before writing into ``dst`` (the caching
        allocator may hand out memory that a queued kernel still reads).
        """
        self._check_args(dst, slot)
        return self._track("read", dst.numel(), lambda: self._submit_read(dst, slot, ready))

    def slot_bytes(self, nbytes: int, device: torch.device) -> int:
        """Bytes of spill store to allocate for a write of ``nbytes`` from ``device``
        (engines that move whole pages need up to a page more)."""
        return nbytes

    def empty(self, nbytes: int, slot: Slot, device: torch.device) -> torch.Tensor:
        """A new uint8 buffer for reading ``slot`` back: the one :meth:`read` fills fastest.

        Any contiguous uint8 tensor of ``nbytes`` works with :meth:`read`; this one may be a
        view part-way into a larger allocation (see :mod:`gds_offload.io.pages`).
        """
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def data_offset(self, slot: Slot) -> int:
        """File offset of the first byte written to ``slot`` (engines that move whole pages
        may place it part-way into the slot)."""
        return slot.offset

    def release(self, slot: Slot) -> None:
        """The slot's bytes are no longer needed (engines that hold memory per slot free it)."""

    def trim(self, keep_bytes: int = 0) -> None:
        """Keep at most ``keep_bytes`` of memory for reuse that holds no bytes (idle read
        buffers): give back the rest now, and buffers that die later beyond it, until the next call.

        The offloader calls it with the bytes backward has still to read, each time that
        falls (a read issued) and when a backward pass ends: an idle buffer beyond the reads to
        come would never be used again, and would sit in memory at backward's end, where the
        gradients peak, or through the next forward, on top of its kept and written
        activations. Engines that keep nothing: no-op.
        """

    def reset_peaks(self) -> None:
        """Count :attr:`EngineStats.peak_read_buffer_bytes` from now (``stats(reset=True)``). Engines without read buffers: no-op."""

    def close(self) -> None:
        """Wait for in-flight transfers and stop the engine's threads. Idempotent."""
        self._closed = True

    def abort(self) -> None:
        """Interpreter exit: transfers not started yet fail at once (:class:`OffloadError`)
        instead of running, the running ones finish; returns without waiting. Unusable after."""
        self._closed = True
        self._aborted = True

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(**asdict(self._stats))

    def warm_up(self, device: torch.device) -> None:
        """Give every I/O thread what its first transfer of ``device`` memory would set up (side
        streams, pinned staging buffers), and return once all have. Pinning host memory is an
        implicit synchronization point of the device, so a measurement that starts after this sees
        the steady state. Engines with nothing to set up: no-op."""

    # -- for subclasses -----------------------------------------------------------------
    def _count_bounced(self, nbytes: int) -> None:
        with self._lock:
            self._stats.bounced_bytes += nbytes

    @abstractmethod
    def _submit_write(self, src: torch.Tensor, slot: Slot, ready: Any) -> Future[int]: ...

    @abstractmethod
    def _submit_read(self, dst: torch.Tensor, slot: Slot, ready: Any) -> Future[int]: ...

    @contextlib.contextmanager
    def _serving(self, kind: Direction) -> Iterator[None]:
        """Wrap the part of a transfer that uses the drive (not its wait in a queue)."""
        with self._lock:
            if self._active[kind] == 0:
                self._busy_since[kind] = time.perf_counter()
            self._active[kind] += 1
        try:
            yield
        finally:
            with self._lock:
                self._active[kind] -= 1
                if self._active[kind] == 0:
                    busy = time.perf_counter() - self._busy_since[kind]
                    if kind == "write":
                        self._stats.write_busy_s += busy
                    else:
                        self._stats.read_busy_s += busy

    def _throttle(self, nbytes: int) -> None:
        # Called by every engine before each transfer (or chunk) starts.
        if self._aborted:
            raise OffloadError(f"{self.name} engine stopped at interpreter exit")
        if self._limiter is not None:
            self._limiter.acquire(nbytes)

    def _count_retry(self) -> None:
        with self._lock:
            self._stats.retries += 1

    # -- internals ----------------------------------------------------------------------
    def _check_args(self, buf: torch.Tensor, slot: Slot) -> None:
        if self._closed:
            raise OffloadError(f"{self.name} engine is closed; attach the offloader again")
        assert buf.dtype.itemsize == 1 and buf.is_contiguous(), "engines move contiguous byte tensors"
        assert buf.numel() <= slot.nbytes, f"{buf.numel()} bytes do not fit slot of {slot.nbytes}"

    def _track(self, kind: Direction, nbytes: int, submit: Callable[[], Future[int]]) -> IOFuture:
        future = submit()
        future.add_done_callback(lambda f: self._finish(kind, nbytes, ok=f.exception() is None))
        return IOFuture(future, nbytes)

    def _finish(self, kind: Direction, nbytes: int, *, ok: bool) -> None:
        with self._lock:
            if not ok:
                return
            if kind == "write":
                self._stats.bytes_written += nbytes
                self._stats.writes += 1
            else:
                self._stats.bytes_read += nbytes
                self._stats.reads += 1


def io_error(op: Direction, nbytes: int, slot: Slot, exc: BaseException) -> OffloadError:
    """An :class:`OffloadError` naming the transfer, the file and offset, and the OS error."""
    err = OffloadError(f"{op} of {nbytes} bytes at {slot.file.describe()} offset {slot.offset} failed: {exc}")
    err.__cause__ = exc
    return err


def warm_each_thread(pool: ThreadPoolExecutor, threads: int, setup: Callable[[], Any]) -> None:
    """Run ``setup`` once on each of ``pool``'s ``threads`` threads (a barrier holds every task
    until all have started, so no thread takes two) and wait for them."""
    barrier = threading.Barrier(threads)

    def task() -> None:
        barrier.wait(timeout=60)
        setup()

    for future in [pool.submit(task) for _ in range(threads)]:
        future.result(timeout=120)
