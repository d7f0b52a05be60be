"""The ``host`` engine: no storage, a pool of (pinned) host buffers.

RAM offload for nodes with plenty of DRAM, and a baseline for the drive engines.
Device tensors are copied on a side CUDA stream into pinned buffers; CPU tensors
into plain host buffers (which moves bytes but saves no memory on a CPU-only run).
Buffers are pooled by size and reused by the next step.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from gds_offload.io.base import Engine, io_error

if TYPE_CHECKING:
    from gds_offload.io.layout import Slot
    from gds_offload.io.limits import TokenBucket

__all__ = ["HostEngine"]


class HostEngine(Engine):
    """Copies to and from a pool of host buffers, keyed by slot."""

    name = "host"
    needs_files = False

    def __init__(self, *, limiter: TokenBucket | None = None) -> None:
        super().__init__(limiter=limiter)
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._pool: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._buf_lock = threading.Lock()
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="gds_offload-host")
        self._stream: Any = None
        self._pin = torch.cuda.is_available()
        self.description = "host memory" + (" (pinned, side CUDA stream)" if self._pin else " (CPU tensors: no memory saved)")

    def close(self) -> None:
        super().close()
        self._threads.shutdown(wait=True)
        with self._buf_lock:
            self._buffers.clear()
            self._pool.clear()

    def release(self, slot: Slot) -> None:
        with self._buf_lock:
            buf = self._buffers.pop((slot.file.id, slot.offset), None)
            if buf is not None:
                self._pool[buf.numel()].append(buf)

    def _buffer(self, slot: Slot) -> torch.Tensor:
        with self._buf_lock:
            free = self._pool[slot.nbytes]
            buf = free.pop() if free else torch.empty(slot.nbytes, dtype=torch.uint8, pin_memory=self._pin)
            self._buffers[(slot.file.id, slot.offset)] = buf
            return buf

    def warm_up(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._threads.submit(self._side_stream, device).result(timeout=120)

    def _side_stream(self, device: torch.device) -> Any:
        """This engine thread's side stream on ``device`` (made on first use). It must live on the
        tensor's device: a copy runs on the current stream of *its* device, and this thread
        starts on device 0 (wrong for a model on cuda:1)."""
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, ready: Any) -> None:
        if dst.device.type == "cpu" and src.device.type == "cpu":
            dst.copy_(src)
            return
        self._side_stream(dst.device if dst.device.type == "cuda" else src.device)
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
        self._stream.synchronize()

    def _submit_write(self, src: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        def run() -> int:
            try:
                with self._serving("write"):
                    self._throttle(src.numel())
                    self._copy(self._buffer(slot)[: src.numel()], src, ready)
                return src.numel()
            except BaseException as exc:  # noqa: BLE001
                raise io_error("write", src.numel(), slot, exc) from exc

        return self._threads.submit(run)

    def _submit_read(self, dst: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        def run() -> int:
            try:
                with self._buf_lock:
                    buf = self._buffers.get((slot.file.id, slot.offset))
                if buf is None:
                    raise KeyError(f"no buffer at offset {slot.offset}: never written, or already released")
                with self._serving("read"):
                    self._throttle(dst.numel())
                    self._copy(dst, buf[: dst.numel()], ready)
                return dst.numel()
            except BaseException as exc:  # noqa: BLE001
                raise io_error("read", dst.numel(), slot, exc) from exc

        return self._threads.submit(run)
