"""The ``posix`` engine: the project's own thread pool doing ``pwrite``/``pread``.

For machines where KvikIO cannot load (no CUDA driver), and for CPU-only CI. With
``O_DIRECT`` files (bypassing the page cache like cuFile does), host tensors move
without a copy: the engine transfers the whole pages that hold them
(:mod:`gds_offload.io.pages`). Read buffers not made by :meth:`PosixEngine.empty` go
through per-thread 4 KiB-aligned bounce buffers. Large transfers are split into chunks
spread over the pool, so one big tensor keeps several requests in flight.

Device tensors go through per-thread pinned staging buffers, copied on the thread's own
side stream (:mod:`gds_offload.io.staging`): a ``copy_`` on a pool thread would run on the
legacy default stream and wait for (and hold up) the compute queued there. A chunk of a
write waits on its thread for ``ready``, copies device to pinned, then writes it; a
chunk of a read is read into pinned memory at once, and only its copy into ``dst`` waits
(on the side stream) for ``ready``. Each chunk's copy has finished before the chunk
counts as done, so a done read's bytes are visible to every stream.
"""
from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import torch

from gds_offload.io.base import Direction, io_error, warm_each_thread
from gds_offload.io.layout import ALIGN, align_up
from gds_offload.io.pages import DEFAULT_POOL_IDLE_BYTES, PageSpanEngine, map_anonymous
from gds_offload.io.staging import CudaBackend, StagingPool, copy_out_chunks, on_device, padded

if TYPE_CHECKING:
    from gds_offload.io.layout import Slot
    from gds_offload.io.limits import TokenBucket

__all__ = ["PosixEngine"]

#: Worker threads (requests in flight): enough to keep a drive's queue busy with small tensors,
#: few enough that Python's per-chunk work does not crowd the model's CPU threads. Choose for a
#: node with ``gds-offload bench-io --engines posix --threads 4,8,16 --tensor-sizes 1MiB,64MiB``.
DEFAULT_THREADS = 8
#: Chunk size: large enough that each request is one efficient ``O_DIRECT`` transfer (compare
#: with ``bench-io --chunk-sizes 1MiB,8MiB``).
DEFAULT_CHUNK_BYTES = 8 << 20


class PosixEngine(PageSpanEngine):
    """``os.pwrite``/``os.pread`` on a thread pool; O_DIRECT through aligned buffers.

    Args:
        num_threads: worker threads (requests in flight).
        chunk_bytes: transfers are split into chunks of this size (a multiple of 4 KiB).
        limiter: a bandwidth cap shared by reads and writes.
        read_pool_bytes: idle read buffers kept for reuse (:class:`~gds_offload.io.pages.HostBufferPool`).
        cuda: the CUDA calls of the device route (:class:`~gds_offload.io.staging.CudaBackend`; ``None``: torch's).
    """

    name = "posix"

    def __init__(
        self,
        *,
        num_threads: int = DEFAULT_THREADS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        limiter: TokenBucket | None = None,
        read_pool_bytes: int = DEFAULT_POOL_IDLE_BYTES,
        cuda: CudaBackend | None = None,
    ) -> None:
        super().__init__(limiter=limiter, read_pool_bytes=read_pool_bytes)
        if num_threads < 1 or chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"need num_threads >= 1 and chunk_bytes a multiple of {ALIGN}, got {num_threads}, {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.num_threads = self.depth = num_threads
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="gds_offload-posix")
        self._local = threading.local()
        # Device memory: one pinned staging buffer of one chunk per pool thread and device (a
        # pool task moves one chunk; the pool's threads keep several in flight).
        self._staging = StagingPool(chunk_bytes, cuda, count=1)
        self._bounce_bytes = 0  # the threads' bounce buffers (_bounce), made on first use
        self.description = f"posix pwrite/pread, {num_threads} threads, {chunk_bytes >> 20} MiB chunks"

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=True)
        self._staging.close()

    def _submit_write(self, src: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        fd, base = slot.file.fd, slot.offset
        if on_device(src):
            self._heads.record(slot, 0)  # device bytes start at the slot's start
            return self._split("write", src.numel(), src.numel(), ready, slot, lambda lo, n: self._write_device_chunk(src, lo, n, slot))
        span = self._write_span(src, slot)  # zero-copy: see gds_offload.io.pages
        if span is None:
            return self._split("write", src.numel(), src.numel(), ready, slot, lambda lo, n: self._write_chunk(src, lo, n, slot))

        def write_span(lo: int, n: int, _src: torch.Tensor = src) -> None:  # _src: a span does not keep its memory alive
            self._pwrite_all(fd, span[lo : lo + n], base + lo)

        return self._split("write", len(span), src.numel(), ready, slot, write_span)

    def _submit_read(self, dst: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        fd, base, total = slot.file.fd, slot.offset, dst.numel()
        if on_device(dst):
            # No host-side wait for ready: each chunk's drive read starts at once; its copy into
            # dst waits for ready on the side stream (_read_device_chunk).
            head = self._heads.get(slot)
            return self._split(
                "read", align_up(head + total), total, None, slot, lambda lo, n: self._read_device_chunk(dst, lo, n, slot, head, ready)
            )
        span, head = self._read_span(dst, slot)
        if span is None:
            # Through the bounce buffers; the bytes start ``head`` into the slot.
            return self._split("read", align_up(head + total), total, ready, slot, lambda lo, n: self._read_chunk(dst, lo, n, slot, head))
        end = head + total  # bytes of the span past this are not data, and may lie past a truncated file's end

        def read_span(lo: int, n: int, _dst: torch.Tensor = dst) -> None:  # _dst: a span does not keep its memory alive
            self._pread_all(fd, span[lo : lo + n], base + lo, need=min(n, end - lo))

        return self._split("read", len(span), total, ready, slot, read_span)

    def _split(
        self, kind: Direction, length: int, total: int, ready: Any, slot: Slot, move: Callable[[int, int], None]
    ) -> Future[int]:
        """Run ``move(lo, n)`` over ``[0, length)`` in chunks on the pool; the future gives ``total``.

        The future completes only when every chunk has finished or failed: a failed chunk
        must not let the caller free (and reuse) a slot that other chunks still write.
        """
        result: Future[int] = Future()
        if total == 0:
            result.set_result(0)
            return result
        starts = range(0, length, self.chunk_bytes)
        remaining = [len(starts)]
        failure: list[BaseException] = []
        lock = threading.Lock()

        def run(lo: int) -> None:
            n = min(self.chunk_bytes, length - lo)
            try:
                if ready is not None:
                    ready.synchronize()
                with self._serving(kind):
                    self._throttle(n)
                    move(lo, n)
            except BaseException as exc:  # noqa: BLE001 - handed to the future
                with lock:
                    failure.append(exc.with_traceback(None))  # no frames: they would hold the buffers
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            if failure:
                result.set_exception(io_error(kind, total, slot, failure[0]))
            else:
                result.set_result(total)

        for lo in starts:
            self._pool.submit(run, lo)
        return result

    def warm_up(self, device: torch.device) -> None:
        if device.type == "cuda":
            warm_each_thread(self._pool, self.num_threads, lambda: self._staging.get(device))

    def _staging_bytes(self) -> int:
        with self._lock:
            bounce = self._bounce_bytes
        return bounce + self._staging.pinned_bytes

    def _bounce(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        # One aligned buffer per worker thread, reused for every chunk (map_anonymous is page-aligned).
        self._count_bounced(nbytes)
        local = self._local
        if not hasattr(local, "mm"):
            local.mm = map_anonymous(self.chunk_bytes)
            with self._lock:
                self._bounce_bytes += self.chunk_bytes
            local.view = memoryview(local.mm)
            local.tensor = torch.frombuffer(local.mm, dtype=torch.uint8)
        return local.tensor, local.view

    def _write_device_chunk(self, src: torch.Tensor, lo: int, n: int, slot: Slot) -> None:
        # n <= chunk_bytes: one staging buffer holds the chunk; copy_out_chunks drains the side
        # stream before returning, also after a failed pwrite.
        f = slot.file

        def to_drive(host: torch.Tensor, _lo: int, m: int) -> None:
            self._pwrite_all(f.fd, host.numpy().data[: padded(m, f.direct)], slot.offset + lo)

        copy_out_chunks(self._staging.get(src.device), src[lo : lo + n], to_drive)

    def _read_device_chunk(self, dst: torch.Tensor, lo: int, n: int, slot: Slot, head: int, ready: Any) -> None:
        # [lo, lo + n) of the slot, through one staging buffer; its data bytes are those in
        # [head, head + dst.numel()), as for _read_chunk.
        f = slot.file
        first, last = max(lo, head), min(lo + n, head + dst.numel())
        if last <= first:
            return
        stage = self._staging.get(dst.device)
        try:
            self._pread_all(f.fd, stage.buffers[0].numpy().data[: padded(n, f.direct)], slot.offset + lo, need=last - lo)
            stage.copy_in(0, dst[first - head : last - head], first - lo, ready=ready)
            stage.wait(0)
        finally:
            stage.drain()  # after a failure too: no copy may still write dst once this returns

    def _write_chunk(self, src: torch.Tensor, lo: int, n: int, slot: Slot) -> None:
        f = slot.file
        if f.direct:
            tensor, view = self._bounce(n)
            tensor[:n].copy_(src[lo : lo + n])
            data = view[: align_up(n)] if f.direct else view[:n]
        else:
            data = src[lo : lo + n].numpy().data
        self._pwrite_all(f.fd, data, slot.offset + lo)

    def _read_chunk(self, dst: torch.Tensor, lo: int, n: int, slot: Slot, head: int) -> None:
        # [lo, lo + n) of the slot; its data bytes are the ones in [head, head + dst.numel()).
        f = slot.file
        first, last = max(lo, head), min(lo + n, head + dst.numel())
        if last <= first:
            return
        if f.direct:
            tensor, view = self._bounce(last - first)
            self._pread_all(f.fd, view[: align_up(n) if f.direct else n], slot.offset + lo, need=last - lo)
            dst[first - head : last - head].copy_(tensor[first - lo : last - lo])
        else:
            self._pread_all(f.fd, dst[first - head : last - head].numpy().data, slot.offset + first, need=last - first)

    def _pwrite_all(self, fd: int, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):
            n = os.pwrite(fd, data[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite wrote {n} bytes at offset {offset + done}")
            done += n
            if done < len(data):
                self._count_retry()  # a short write: continue from where it stopped

    def _pread_all(self, fd: int, data: memoryview, offset: int, *, need: int) -> None:
        done = 0
        while done < need:
            n = os.preadv(fd, [data[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"spill file ends after {offset + done} bytes; {need - done} bytes missing (truncated?)")
            done += n
            if done < need:
                self._count_retry()
