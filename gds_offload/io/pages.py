"""Zero-copy ``O_DIRECT`` for host memory: move the whole pages that hold a tensor.

``O_DIRECT`` wants the memory address, the file offset and the length aligned to the
drive's block size. torch's CPU allocator aligns to 64 bytes, so a storage usually
begins part-way into a page. Rather than copy every byte through an aligned bounce
buffer (a CPU memcpy per byte each way, on the cores that run the model), an engine
moves the *pages that contain the bytes*, straight from and into the tensor's memory:

- write: from the page boundary at or below the first byte to the one at or above the
  last, out of the source's own memory. The bytes of that span outside the tensor (the
  allocator's header, a neighbour) travel with it and are never used as data. The
  *head* (how far into its first page the tensor starts) is remembered per slot.
- read: into a buffer made by :func:`empty_like_head`, whose data starts ``head``
  bytes into a page and whose first and last pages belong to it alone, so the span can
  be read in place. The buffers come from a :class:`HostBufferPool`: reading into fresh
  anonymous memory makes the kernel fault in and zero every page first (one fault per
  4 KiB read back, every step), on the cores that run the model.

The pool's buffers are backed by transparent huge pages where the kernel allows it
(:func:`map_anonymous`): on virtual disks an ``O_DIRECT`` transfer costs the cores per
4 KiB segment more than per byte, so huge pages leave more of the cores to the model.

A slot must hold the span: up to one page more than the tensor (:func:`span_bytes`).
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
import weakref
from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np
import torch

from gds_offload.io.base import Engine, EngineStats
from gds_offload.io.layout import ALIGN, align_up, aligned_view

if TYPE_CHECKING:
    from gds_offload.io.layout import Slot
    from gds_offload.io.limits import TokenBucket

__all__ = ["DEFAULT_POOL_IDLE_BYTES", "HUGE_PAGE", "HostBufferPool", "PageSpanEngine", "SlotHeads", "empty_like_head", "head_of", "map_anonymous", "own_pages", "pages_around", "span_bytes", "writable_head"]

#: A transparent huge page (x86-64 and most arm64 kernels).
HUGE_PAGE = 2 << 20
#: Idle read buffers a pool keeps by default: about two layers of the demo model.
DEFAULT_POOL_IDLE_BYTES = 256 << 20
#: torch's CPU allocator alignment: a head that is a multiple of it keeps every dtype's
#: elements aligned in a buffer from :func:`empty_like_head`.
_TORCH_ALIGN = 64


def head_of(buf: torch.Tensor) -> int:
    """Bytes between the page boundary below ``buf``'s first byte and that byte."""
    return buf.data_ptr() % ALIGN


def writable_head(src: torch.Tensor, slot: Slot) -> int | None:
    """``src``'s head if it can be written from its own pages into ``slot``, else ``None``.

    It can when ``src`` is in host memory, the slot's file is ``O_DIRECT``, the head is a
    multiple of 64 (reads can then restore it, see :func:`empty_like_head`) and the span
    fits the slot (callers sized it with :func:`span_bytes`).
    """
    if src.device.type != "cpu" or not slot.file.direct or not src.numel():
        return None
    head = head_of(src)
    if head % _TORCH_ALIGN or align_up(head + src.numel(), ALIGN) > slot.nbytes:
        return None
    return head


def span_bytes(nbytes: int) -> int:
    """Slot bytes that hold the page span of ``nbytes`` bytes wherever they start in a page."""
    return align_up(nbytes) + ALIGN


def pages_around(buf: torch.Tensor) -> memoryview:
    """The whole pages that contain ``buf`` (contiguous, CPU, uint8), as bytes, without a copy.

    For writes only: the span reaches outside ``buf`` into memory it does not own (mapped,
    since a page is mapped whole). The caller keeps ``buf`` alive while the view is used.
    """
    head = head_of(buf)
    length = align_up(head + buf.numel(), ALIGN)
    return memoryview((ctypes.c_ubyte * length).from_address(buf.data_ptr() - head)).cast("B")


def own_pages(buf: torch.Tensor) -> memoryview | None:
    """The page span of ``buf`` when every byte of it lies inside ``buf``'s storage (so it
    can be read into without touching anything else), else ``None``."""
    storage = buf.untyped_storage()
    span = pages_around(buf)
    lo = buf.data_ptr() - head_of(buf)
    if lo < storage.data_ptr() or lo + len(span) > storage.data_ptr() + storage.nbytes():
        return None
    return span


def empty_like_head(nbytes: int, head: int, pool: HostBufferPool | None = None) -> torch.Tensor:
    """A CPU uint8 tensor of ``nbytes`` starting ``head`` bytes into a page, whose page
    span (:func:`own_pages`) lies inside its own storage; from ``pool`` when given.

    The tensor is a view at a storage offset, a multiple of 64 like ``head`` (so a view of
    any dtype made from it is as aligned as one made by torch's allocator).
    """
    assert head % _TORCH_ALIGN == 0 and 0 <= head < ALIGN, f"head {head} is not a multiple of {_TORCH_ALIGN} below {ALIGN}"
    if pool is not None:
        # One length per nbytes whatever the head, so the same tensors find their buffers each step.
        return pool.take(span_bytes(nbytes))[head : head + nbytes]
    return aligned_view(torch.empty(span_bytes(nbytes) + ALIGN, dtype=torch.uint8), nbytes, head)


def map_anonymous(length: int) -> mmap.mmap:
    """Private anonymous memory of at least ``length`` bytes, at a page boundary, whose whole
    huge pages are advised ``MADV_HUGEPAGE`` and whose tail is advised ``MADV_NOHUGEPAGE``.

    The mapping is rounded up to :data:`HUGE_PAGE` so the kernel places it at a huge-page
    boundary; the bytes past ``length`` are never touched, so they cost no memory (the tail
    advice keeps a kernel with THP ``always`` from filling a whole huge page for them). Where
    the kernel has no THP the advice is ignored and the buffer is 4 KiB pages.
    """
    mapped = align_up(length, HUGE_PAGE)
    mm = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = length // HUGE_PAGE * HUGE_PAGE
    ranges = ((getattr(mmap, "MADV_HUGEPAGE", None), 0, whole), (getattr(mmap, "MADV_NOHUGEPAGE", None), whole, mapped - whole))
    for advice, start, size in ranges:
        if advice is not None and size:
            with contextlib.suppress(OSError):  # EINVAL: a kernel built without THP
                mm.madvise(advice, start, size)
    return mm


class HostBufferPool:
    """Page-aligned host buffers for reads, handed out again once the tensors viewing them die.

    Each buffer is a mapping of its own (:func:`map_anonymous`). It comes back to the pool
    when the last tensor that views it is freed (whatever thread frees it), and is kept for the next
    request of the same length while the idle total stays under ``max_idle_bytes`` and under
    the limit the last :meth:`trim` set; beyond that it is unmapped. Idle buffers are host
    memory that is resident but holds no activation: ``idle_bytes`` says how much, and
    ``in_use_bytes`` how much the buffers of live tensors hold. Thread-safe.
    """

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        #: The idle bytes wanted now (:meth:`trim`), at most ``max_idle_bytes``.
        self.keep_bytes = max_idle_bytes
        self._free: dict[int, list[mmap.mmap]] = defaultdict(list)
        self._lock = threading.Lock()
        self.idle_bytes = 0
        #: Bytes of the buffers handed out whose tensors are still alive, and the peak of
        #: everything mapped (in use + idle) since :meth:`reset_peaks`.
        self.in_use_bytes = 0
        self.peak_mapped_bytes = 0
        #: Buffers mapped (a miss) and handed out again (a hit), for tests and tuning.
        self.mapped = 0
        self.reused = 0

    def take(self, length: int) -> torch.Tensor:
        """A uint8 tensor of ``length`` bytes (a multiple of :data:`~gds_offload.io.layout.ALIGN`) at a page boundary."""
        with self._lock:
            free = self._free.get(length)
            mm = free.pop() if free else None
            if mm is not None:
                self.idle_bytes -= length
                self.reused += 1
            else:
                self.mapped += 1
            self.in_use_bytes += length
            self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.in_use_bytes + self.idle_bytes)
        if mm is None:
            mm = map_anonymous(length)
        arr = np.frombuffer(mm, dtype=np.uint8, count=length)
        # torch.from_numpy keeps arr alive as long as any view of the storage lives.
        weakref.finalize(arr, self._give_back, mm, length).atexit = False
        return torch.from_numpy(arr)

    def trim(self, keep_bytes: int = 0) -> None:
        """Keep at most ``keep_bytes`` (and ``max_idle_bytes``) idle from now on: unmap the idle
        buffers beyond it now, and buffers that die later once the idle ones reach it. The
        limit holds until the next call."""
        with self._lock:
            self.keep_bytes = min(max(keep_bytes, 0), self.max_idle_bytes)
            for length in sorted(self._free, reverse=True):
                free = self._free[length]
                while free and self.idle_bytes > self.keep_bytes:
                    free.pop()
                    self.idle_bytes -= length
            self._free = defaultdict(list, {n: f for n, f in self._free.items() if f})

    def clear(self) -> None:
        """Unmap the idle buffers, and from now on every buffer as it dies (the engine closes)."""
        with self._lock:
            self.max_idle_bytes = 0
        self.trim()

    def reset_peaks(self) -> None:
        """Count the peak of the mapped bytes from now."""
        with self._lock:
            self.peak_mapped_bytes = self.in_use_bytes + self.idle_bytes

    def _give_back(self, mm: mmap.mmap, length: int) -> None:
        with self._lock:
            self.in_use_bytes -= length
            if self.idle_bytes + length <= self.keep_bytes:
                self._free[length].append(mm)
                self.idle_bytes += length
        # Otherwise dropped: arr, being freed, still exports mm's buffer (so no mm.close());
        # the mapping goes once arr lets go of it.


class SlotHeads:
    """Each written slot's head (0 where the bytes start at the slot's start).

    Engine threads record, the training thread reads: single dict operations, atomic
    under the GIL, so no lock. A slot's entry is replaced by its next write, and dropped
    by :meth:`drop` when the slot is released.
    """

    def __init__(self) -> None:
        self._heads: dict[tuple[object, int], int] = {}

    def record(self, slot: Slot, head: int) -> None:
        if head:
            self._heads[(slot.file, slot.offset)] = head
        else:
            self._heads.pop((slot.file, slot.offset), None)

    def get(self, slot: Slot) -> int:
        return self._heads.get((slot.file, slot.offset), 0)

    def drop(self, slot: Slot) -> None:
        self._heads.pop((slot.file, slot.offset), None)


class PageSpanEngine(Engine):
    """An engine that moves host tensors of ``O_DIRECT`` files as page spans (``posix``, ``compat``).

    Provides the slot sizing, read buffers and head bookkeeping; subclasses ask
    :meth:`_write_span` what to write and :meth:`_read_span` where to read, and move bytes.

    Raises:
        ValueError: ``read_pool_bytes`` is negative.
    """

    def __init__(self, *, limiter: TokenBucket | None = None, read_pool_bytes: int = DEFAULT_POOL_IDLE_BYTES) -> None:
        if read_pool_bytes < 0:
            raise ValueError(f"read_pool_bytes={read_pool_bytes}: idle read buffers to keep, in bytes; use 0 (none) or more")
        super().__init__(limiter=limiter)
        self._heads = SlotHeads()
        self._buffers = HostBufferPool(read_pool_bytes)

    def close(self) -> None:
        super().close()
        self._buffers.clear()

    def trim(self, keep_bytes: int = 0) -> None:
        self._buffers.trim(keep_bytes)

    def reset_peaks(self) -> None:
        self._buffers.reset_peaks()

    def stats(self) -> EngineStats:
        out = super().stats()
        pool = self._buffers
        out.read_buffer_bytes = pool.in_use_bytes + pool.idle_bytes
        out.peak_read_buffer_bytes = pool.peak_mapped_bytes
        out.idle_buffer_bytes = pool.idle_bytes
        out.staging_bytes = self._staging_bytes()
        return out

    def _staging_bytes(self) -> int:
        """Host memory of the subclass's staging and bounce buffers (:attr:`EngineStats.staging_bytes`)."""
        return 0

    def slot_bytes(self, nbytes: int, device: torch.device) -> int:
        return span_bytes(nbytes) if device.type == "cpu" else nbytes

    def empty(self, nbytes: int, slot: Slot, device: torch.device) -> torch.Tensor:
        if device.type != "cpu" or not slot.file.direct:
            return super().empty(nbytes, slot, device)
        return empty_like_head(nbytes, self._heads.get(slot), self._buffers)

    def data_offset(self, slot: Slot) -> int:
        return slot.offset + self._heads.get(slot)

    def release(self, slot: Slot) -> None:
        self._heads.drop(slot)

    def _write_span(self, src: torch.Tensor, slot: Slot) -> memoryview | None:
        """Record where ``src``'s bytes will start in ``slot``; return its page span, or ``None``
        when it must be written as it is (from the slot's start)."""
        head = writable_head(src, slot)
        self._heads.record(slot, head or 0)
        return None if head is None else pages_around(src)

    def _read_span(self, dst: torch.Tensor, slot: Slot) -> tuple[memoryview | None, int]:
        """``(span, head)``: ``dst``'s own page span when the slot's bytes can be read into it in
        place (else ``None``), and how far into the slot the bytes start."""
        head = self._heads.get(slot)
        if dst.device.type != "cpu" or not slot.file.direct or not dst.numel() or head_of(dst) != head:
            return None, head
        return own_pages(dst), head
