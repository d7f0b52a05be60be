"""The ``gds`` and ``compat`` engines: NVIDIA KvikIO (cuFile) file handles.

``gds``: cuFile's direct path (compat mode off). Device memory goes to the drive by
DMA with no host bounce buffer. KvikIO raises instead of falling back when compat
mode is off, so a ``gds`` engine that works is really direct.

``compat``: KvikIO's compatibility mode: POSIX I/O on KvikIO's thread pool through
pinned bounce buffers (device tensors), or straight from host memory (CPU tensors).
Host tensors are handed over as whole pages (:mod:`gds_offload.io.pages`): aligned
buffers, offsets and sizes, so KvikIO's automatic direct I/O uses O_DIRECT.

KvikIO's thread pool and task size are process-wide settings; this engine sets
them once when created (see :data:`DEFAULT_THREADS`, :data:`DEFAULT_TASK_BYTES`).
"""
from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from gds_offload.errors import ConfigError, GDSUnavailableError
from gds_offload.io.base import Direction, io_error
from gds_offload.io.pages import DEFAULT_POOL_IDLE_BYTES, PageSpanEngine, empty_like_head, own_pages

if TYPE_CHECKING:
    from gds_offload.io.limits import TokenBucket
    from gds_offload.store import Slot, SpillFile

__all__ = ["KvikIOEngine", "kvikio_status"]

#: KvikIO threads (and this engine's issue threads). Its default (1) leaves a drive at queue
#: depth 1. 16 moved 1 MiB tensors at 3.0-3.2 GB/s vs 2.1-2.5 with 4 (64 MiB tensors: equal)
#: on the 2-CPU virtio/ext4 test machine; measured with ``gds-offload bench-io --engines compat
#: --threads 4,8,16 --tensor-sizes 1MiB,64MiB --repeats 2``.
DEFAULT_THREADS = 16
#: KvikIO splits each transfer into tasks of this size over its threads (1 MiB and 8 MiB tasks
#: were within noise with ``bench-io --chunk-sizes 1MiB,8MiB``).
DEFAULT_TASK_BYTES = 8 << 20


@functools.cache
def kvikio_status() -> tuple[bool, str]:
    """(usable, reason): whether KvikIO imports and can do host I/O on this machine.

    KvikIO needs ``libcuda.so.1`` even for host buffers; without it the import or the
    first call fails. Cached per process.
    """
    try:
        import kvikio  # noqa: F401
        import kvikio.defaults
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return False, f"KvikIO does not import ({type(exc).__name__}: {exc}); pip install 'gds_offload[cu12]'"
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return False, f"KvikIO needs libcuda.so.1 (the NVIDIA driver's library): {exc}"
    return True, f"KvikIO {kvikio.__version__}"


#: ``kvikio.defaults.set`` changes a process-wide setting: every engine's handle opening goes
#: through this one lock, or a gds and a compat engine opening at once can leave the
#: process's compat mode at the other's value when both restore what they saw.
_COMPAT_LOCK = threading.Lock()


class KvikIOEngine(PageSpanEngine):
    """KvikIO ``CuFile`` reads and writes, in GDS (direct) or compat mode.

    Args:
        mode: ``"gds"`` (compat mode off: fail rather than fall back) or ``"compat"``.
        num_threads: KvikIO's thread pool size (process-wide).
        task_bytes: KvikIO's task size (process-wide).
        issue_threads: this engine's own threads, which wait for the producing CUDA
            event and for KvikIO's futures, so the caller never blocks (``None``: ``num_threads``).
        limiter: a bandwidth cap shared by reads and writes.
        read_pool_bytes: idle host read buffers kept for reuse (:class:`~gds_offload.io.pages.HostBufferPool`).

    Raises:
        ConfigError: KvikIO is not usable here.
    """

    def __init__(
        self,
        mode: Literal["gds", "compat"],
        *,
        num_threads: int = DEFAULT_THREADS,
        task_bytes: int = DEFAULT_TASK_BYTES,
        issue_threads: int | None = None,
        limiter: TokenBucket | None = None,
        read_pool_bytes: int = DEFAULT_POOL_IDLE_BYTES,
    ) -> None:
        ok, why = kvikio_status()
        if not ok:
            raise ConfigError(f"mode={mode!r} needs KvikIO: {why}")
        self.name = mode  # type: ignore[misc]  # one class, two engine names
        super().__init__(limiter=limiter, read_pool_bytes=read_pool_bytes)
        import kvikio
        import kvikio.defaults

        self._kvikio = kvikio
        self._compat = kvikio.CompatMode.OFF if mode == "gds" else kvikio.CompatMode.ON
        kvikio.defaults.set(
            {
                "num_threads": num_threads,
                "task_size": task_bytes,
                "auto_direct_io_read": True,
                "auto_direct_io_write": True,
            }
        )
        self.task_bytes = task_bytes
        # Keyed by the SpillFile itself (identity), not its id: ids restart at 0 in every store.
        self._handles: dict[SpillFile, Any] = {}
        self._handles_lock = threading.Lock()
        # One issue thread per KvikIO thread: tensors smaller than a task are one KvikIO call
        # each, so fewer issue threads would cap the requests in flight.
        self._pool = ThreadPoolExecutor(issue_threads or num_threads, thread_name_prefix=f"gds_offload-{mode}")
        self.uses_gds = mode == "gds"
        self.description = (
            f"KvikIO {kvikio.__version__} {'cuFile direct (GDS)' if mode == 'gds' else 'compat mode (POSIX, bounce buffers for device memory)'}, "
            f"{num_threads} threads, {task_bytes >> 20} MiB tasks"
        )

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=True)
        with self._handles_lock:
            for h in self._handles.values():
                h.close()
            self._handles.clear()

    def _handle(self, f: SpillFile) -> Any:
        with self._handles_lock:
            h = self._handles.get(f)
            if h is None:
                try:
                    with _COMPAT_LOCK, self._kvikio.defaults.set("compat_mode", self._compat):
                        h = self._kvikio.CuFile(f.proc_path, "r+")
                except Exception as exc:
                    if self.name == "gds":
                        raise GDSUnavailableError(
                            f"cuFile could not open {f.describe()} in GDS mode ({exc}); "
                            f"run gds-check --path {f.dir} for the reason, or use mode='compat'"
                        ) from exc
                    raise
                self._handles[f] = h
            return h

    def _submit_write(self, src: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        span = self._write_span(src, slot)
        if span is None:
            return self._pool.submit(self._transfer, "write", src, src.numel(), slot, ready)
        return self._pool.submit(self._transfer, "write", span, src.numel(), slot, ready, src)

    def _submit_read(self, dst: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        total = dst.numel()
        span, head = self._read_span(dst, slot)
        if span is not None:
            return self._pool.submit(self._transfer, "read", span, total, slot, ready, dst)
        if dst.device.type != "cpu" or not slot.file.direct or not total:
            return self._pool.submit(self._transfer, "read", dst, total, slot, ready)
        # A buffer from elsewhere: read the pages into one of ours, then copy the bytes out.
        tmp = empty_like_head(total, head, self._buffers)

        pages = own_pages(tmp)
        assert pages is not None, "empty_like_head returns a buffer of whole pages"

        def via_tmp() -> int:
            self._transfer("read", pages, total, slot, ready)
            dst.copy_(tmp)
            return total

        return self._pool.submit(via_tmp)

    def _transfer(
        self, kind: Direction, buf: torch.Tensor | memoryview, total: int, slot: Slot, ready: Any, owner: Any = None
    ) -> int:
        """Move ``buf`` (a byte tensor, or a page span) at the slot's start; report ``total`` bytes.

        ``owner``: the tensor a page span views, held here until the transfer ends (a
        span does not keep its memory alive)."""
        try:
            if ready is not None:
                ready.synchronize()
            handle = self._handle(slot.file)
            with self._serving(kind):
                self._move(kind, handle, buf, slot)
            return total
        except GDSUnavailableError:
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised with the file and offset
            raise io_error(kind, total, slot, exc) from exc

    def _move(self, kind: Direction, handle: Any, buf: torch.Tensor | memoryview, slot: Slot) -> None:
        # KvikIO takes host memory as a numpy array and device memory through
        # __cuda_array_interface__; uint8 views sidestep dtypes it cannot map (bf16, fp8).
        if isinstance(buf, memoryview):
            arr: Any = np.frombuffer(buf, dtype=np.uint8)
        else:
            arr = buf.numpy() if buf.device.type == "cpu" else buf
        total = len(arr)
        done = 0
        while done < total:
            self._throttle(total - done)
            part = arr[done:]
            fut = (handle.pwrite if kind == "write" else handle.pread)(
                part, total - done, slot.offset + done, self.task_bytes
            )
            n = fut.get()
            if n <= 0:
                raise OSError(f"KvikIO {kind} moved {n} bytes at offset {slot.offset + done}")
            done += n
            if done < total:
                self._count_retry()
