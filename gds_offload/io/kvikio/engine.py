"""The ``gds`` and ``compat`` engines: NVIDIA KvikIO (cuFile) file handles.

``gds``: cuFile's direct path (compat mode off). Device memory goes to the drive by
DMA with no host bounce buffer. What ``mode="gds"`` promises (a strict engine):

- KvikIO raises instead of falling back when compat mode is off, and the engine turns
  cuFile's *own* POSIX fallback off as well (``allow_compat_mode=false``, staged before the
  driver opens: :mod:`gds_offload.io.kvikio.cufile_params`), so a file cuFile cannot drive
  directly fails (``GDSUnavailableError`` when its handle opens, ``OffloadError`` for a
  transfer) instead of being served through host bounce buffers unannounced. When that
  cannot be arranged (the driver was opened earlier in the process with the fallback
  allowed, or a cuFile without the parameter API whose ``cufile.json`` allows it),
  creating the engine raises ``GDSUnavailableError`` naming the fix.
- Device memory moves through KvikIO's stream API (``CuFile.raw_write_async`` /
  ``raw_read_async``: ``cuFileWriteAsync``/``cuFileReadAsync``) queued on a side stream of
  the engine thread, never on the legacy default stream: KvikIO's ``pread``/``pwrite``
  synchronize the legacy default stream before every transfer of ``gds_threshold`` bytes
  or more (``file_handle.cpp``; the Python binding cannot turn that off), which would make
  every transfer wait for the compute queued there. KvikIO refuses its stream API when no
  ``cufile.json`` exists (``CUFILE_ENV_PATH_JSON``, else ``/etc/cufile.json``:
  ``compat_mode_manager.cpp``); then the engine uses ``pread``/``pwrite`` and its
  description says they synchronize the default stream.
- Host (CPU) tensors go through KvikIO's POSIX path whatever the mode: ``uses_gds`` is
  about device memory.

``mode="auto"`` resolved to ``gds`` builds a non-strict engine: cuFile's settings are left
as they are, and ``uses_gds`` is true only when ``cufile.json`` turns the fallback off.

``compat``: KvikIO's compatibility mode: POSIX I/O on KvikIO's thread pool. Host tensors
are handed over as whole pages (:mod:`gds_offload.io.pages`): aligned buffers, offsets and
sizes, so KvikIO's automatic direct I/O uses O_DIRECT. Device tensors are *not* handed to
KvikIO (its bounce-buffer copies run on blocking streams): the engine copies them to and
from pinned host buffers on its own side streams (:mod:`gds_offload.io.staging`) and gives
KvikIO the host pages, one task-sized chunk at a time per transfer (the copy of the next
chunk overlaps the drive I/O of this one; transfers in flight on the issue threads run in
parallel). Pinned memory: two task-sized buffers per issue thread that moved device memory.

KvikIO's thread pool and task size are process-wide settings; this engine sets
them once when created (see :data:`DEFAULT_THREADS`, :data:`DEFAULT_TASK_BYTES`).

Threads and streams: every transfer runs on one of the engine's issue threads. A write of
device memory waits on that thread for its ``ready`` event, then reads the source on the
thread's side stream; a read of device memory makes the side stream wait for ``ready``
before the first byte lands in ``dst``. A future completes after the side stream finished,
so a done read's bytes are visible to every stream (the contract of :mod:`gds_offload.io.base`).
"""
from __future__ import annotations

import functools
import os
import shlex
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Literal

import numpy as np
import torch

from gds_offload.errors import ConfigError, GDSUnavailableError
from gds_offload.io.base import Direction, io_error, warm_each_thread
from gds_offload.io.kvikio.cufile_params import compat_fallback
from gds_offload.io.layout import ALIGN, align_up
from gds_offload.io.pages import DEFAULT_POOL_IDLE_BYTES, PageSpanEngine, empty_like_head, own_pages
from gds_offload.io.staging import CudaBackend, SideStreams, StagingPool, copy_in_chunks, copy_out_chunks, on_device, padded

if TYPE_CHECKING:
    from gds_offload.io.layout import File, Slot
    from gds_offload.io.limits import TokenBucket

__all__ = ["KvikIOEngine", "cufile_config_path", "kvikio_status"]

#: KvikIO threads (and this engine's issue threads). Its default (1) leaves a drive at queue
#: depth 1; small tensors need many requests in flight to reach the drive's rate. Choose for a
#: node with ``gds-offload bench-io --engines compat --threads 4,8,16 --tensor-sizes 1MiB,64MiB``.
DEFAULT_THREADS = 16
#: KvikIO splits each transfer into tasks of this size over its threads (compare sizes with
#: ``bench-io --chunk-sizes 1MiB,8MiB``).
DEFAULT_TASK_BYTES = 8 << 20
#: Largest piece of one transfer queued as one cuFile stream operation: cuFile's I/O size
#: limit is under 2 GiB; cuFile itself splits a piece over its threads (``parallel_io``).
STREAM_PIECE_BYTES = 1 << 30


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
    return version_status(str(kvikio.__version__))


#: Modules known to open the cuFile driver in-process with compat mode allowed (DALI's GPU readers).
_DRIVER_OPENERS = ("nvidia.dali",)


def driver_openers(modules: Mapping[str, object] | None = None) -> str:
    """``" (opened by ...)"``: the modules loaded in this process that are known to open the
    cuFile driver on their own (``""``: none), for the message of a strict ``gds`` engine that
    found the driver already open."""
    loaded = sys.modules if modules is None else modules
    found = [m for m in _DRIVER_OPENERS if m in loaded]
    return f" (loaded here and known to open it with compat allowed: {', '.join(found)}; run it in its own process)" if found else ""


#: The oldest KvikIO with the settings the engines set (``auto_direct_io_read``/``_write`` came in 25.12).
KVIKIO_FLOOR = (25, 12)


def version_status(version: str) -> tuple[bool, str]:
    """``(usable, reason)`` of a KvikIO ``version``: older than :data:`KVIKIO_FLOOR` lacks settings the
    engines set (its ``kvikio.defaults.set`` raises ``KeyError`` on them)."""
    try:
        have = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return True, f"KvikIO {version}"  # a development build: its settings cannot be told from the name
    if have < KVIKIO_FLOOR:
        floor = ".".join(map(str, KVIKIO_FLOOR))
        return False, f"KvikIO {version} is older than {floor} (no auto_direct_io settings); pip install 'kvikio-cu12>={floor}' (or -cu13)"
    return True, f"KvikIO {version}"


def cufile_config_path(env: Any = None) -> str:
    """The ``cufile.json`` KvikIO finds (``""``: none), found the way KvikIO 26.10 finds it
    (``cpp/src/cufile/config.cpp``): ``CUFILE_ENV_PATH_JSON`` when that file exists, else
    ``/etc/cufile.json`` when it exists. KvikIO's stream API needs one."""
    env = os.environ if env is None else env
    configured = env.get("CUFILE_ENV_PATH_JSON")
    if configured and os.path.exists(configured):
        return configured
    return "/etc/cufile.json" if os.path.exists("/etc/cufile.json") else ""


#: ``kvikio.defaults.set`` changes a process-wide setting: every engine's handle opening goes
#: through this one lock, or a gds and a compat engine opening at once can leave the
#: process's compat mode at the other's value when both restore what they saw.
_COMPAT_LOCK = threading.Lock()


class KvikIOEngine(PageSpanEngine):
    """KvikIO ``CuFile`` reads and writes, in GDS (direct) or compat mode.

    Args:
        mode: ``"gds"`` (compat mode off: fail rather than fall back) or ``"compat"``.
        strict: ``gds`` only: turn cuFile's own POSIX fallback off for the process and raise
            when that cannot be done (what ``mode="gds"`` promises; see the module doc).
            ``False`` (``mode="auto"``): leave cuFile's settings alone.
        num_threads: KvikIO's thread pool size (process-wide): at least this many threads; a pool
            already that large is left as it is.
        task_bytes: KvikIO's task size (process-wide).
        issue_threads: this engine's own threads, which wait for the producing CUDA
            event and for KvikIO's futures, so the caller never blocks (``None``: ``num_threads``).
        limiter: a bandwidth cap shared by reads and writes.
        read_pool_bytes: idle host read buffers kept for reuse (:class:`~gds_offload.io.pages.HostBufferPool`).
        cuda: the CUDA calls of the device routes (:class:`~gds_offload.io.staging.CudaBackend`; ``None``: torch's).
        read_only: open files for reading only (a weight store may be shared, or on a read-only
            mount); spill files are opened ``r+``.

    Attributes:
        uses_gds: device memory goes to and from the drive by DMA, or fails: a ``gds`` engine
            on a GPU whose cuFile compat fallback is known to be off.
        stream_io: device memory moves through KvikIO's stream API (``gds`` with a
            ``cufile.json``); else through ``pread``/``pwrite`` (``gds``) or staging (``compat``).

    Raises:
        ConfigError: KvikIO is not usable here.
        GDSUnavailableError: a strict ``gds`` engine whose cuFile fallback cannot be turned off.
    """

    def __init__(
        self,
        mode: Literal["gds", "compat"],
        *,
        strict: bool = True,
        num_threads: int = DEFAULT_THREADS,
        task_bytes: int = DEFAULT_TASK_BYTES,
        issue_threads: int | None = None,
        limiter: TokenBucket | None = None,
        read_pool_bytes: int = DEFAULT_POOL_IDLE_BYTES,
        read_only: bool = False,
        cuda: CudaBackend | None = None,
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
        settings: dict[str, Any] = {"task_size": task_bytes, "auto_direct_io_read": True, "auto_direct_io_write": True}
        # Setting num_threads rebuilds KvikIO's one process-wide pool, also to the size it has: an
        # engine made while another's reads are in flight (a trainer's beside its streamed model's
        # fills) could leave a read that never completes. The pool only grows, and only when needed.
        if kvikio.defaults.get("num_threads") < num_threads:
            settings["num_threads"] = num_threads
        kvikio.defaults.set(settings)
        self.task_bytes = task_bytes
        #: How handles open their files (opening goes through :meth:`_handle`, under the process-wide compat-mode lock).
        self.open_flags = "r" if read_only else "r+"
        # Keyed by the File itself (identity), not its id: ids restart at 0 in every store.
        self._handles: dict[File, Any] = {}
        self._handles_lock = threading.Lock()
        # One issue thread per KvikIO thread: tensors smaller than a task are one KvikIO call
        # each, so fewer issue threads would cap the requests in flight.
        self.issue_threads = issue_threads or num_threads
        self.depth = self.issue_threads
        self._pool = ThreadPoolExecutor(self.issue_threads, thread_name_prefix=f"gds_offload-{mode}")
        # Device memory: staging buffers (compat) and side streams (gds), per issue thread.
        self._staging = StagingPool(align_up(task_bytes, ALIGN), cuda)
        self._streams = SideStreams(cuda)
        self.stream_io = False
        how = "host memory only (no CUDA device)"
        if mode == "gds" and torch.cuda.is_available():
            fallback = compat_fallback(disable=strict)
            if strict and not fallback.off:
                self._pool.shutdown(wait=False)
                raise GDSUnavailableError(
                    f"mode='gds' must not let cuFile fall back to POSIX unannounced, but {fallback.detail}{driver_openers()}. Set "
                    f"\"allow_compat_mode\": false in cufile.json (or point CUFILE_ENV_PATH_JSON at a copy that does), "
                    "create the offloader before anything else opens the cuFile driver, or use mode='auto' (which reports "
                    "what it knows) or mode='compat'"
                )
            self.uses_gds = fallback.off
            self.stream_io = bool(cufile_config_path())
            how = (
                ("device memory through cuFile's stream API on side streams" if self.stream_io else
                 "device memory through pread/pwrite, which synchronize the default CUDA stream (no cufile.json: KvikIO's stream API needs one)")
                + f"; cuFile compat fallback {'off' if fallback.off else 'possible'} ({fallback.detail})"
            )
        elif mode == "compat":
            how = "POSIX; device memory staged through pinned buffers on side streams"
        self.description = (
            f"KvikIO {kvikio.__version__} {'cuFile direct (GDS)' if mode == 'gds' else 'compat mode'}: {how}; "
            f"{num_threads} threads, {task_bytes >> 20} MiB tasks"
        )

    def warm_up(self, device: torch.device) -> None:
        if device.type == "cuda":
            warm_each_thread(self._pool, self.issue_threads, lambda: (self._staging.get(device), self._streams.get(device)))

    def _staging_bytes(self) -> int:
        return self._staging.pinned_bytes

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=True)
        self._staging.close()
        self._streams.close()
        with self._handles_lock:
            for h in self._handles.values():
                h.close()
            self._handles.clear()

    def _handle(self, f: File) -> Any:
        with self._handles_lock:
            h = self._handles.get(f)
            if h is None:
                try:
                    with _COMPAT_LOCK, self._kvikio.defaults.set("compat_mode", self._compat):
                        h = self._kvikio.CuFile(f.proc_path, self.open_flags)
                except Exception as exc:
                    if self.name == "gds":
                        raise GDSUnavailableError(
                            f"cuFile could not open {f.describe()} in GDS mode ({exc}); "
                            f"run `gds-check --path {shlex.quote(str(f.directory))}` for the reason, or use mode='compat'"
                        ) from exc
                    raise
                self._handles[f] = h
            return h

    def _submit_write(self, src: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        if on_device(src):
            self._heads.record(slot, 0)  # device bytes start at the slot's start
            return self._pool.submit(self._device_transfer, "write", src, slot, ready)
        span = self._write_span(src, slot)
        if span is None:
            return self._pool.submit(self._transfer, "write", src, src.numel(), slot, ready)
        return self._pool.submit(self._transfer, "write", span, src.numel(), slot, ready, src)

    def _submit_read(self, dst: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        if on_device(dst):
            return self._pool.submit(self._device_transfer, "read", dst, slot, ready)
        total = dst.numel()
        span, head = self._read_span(dst, slot)
        if span is not None:
            return self._pool.submit(self._transfer, "read", span, total, slot, ready, dst)
        if not slot.file.direct or not total:
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
        """Move host memory ``buf`` (a byte tensor, or a page span) at the slot's start; report ``total`` bytes.

        ``owner``: the tensor a page span views, held here until the transfer ends (a
        span does not keep its memory alive)."""
        try:
            if ready is not None:
                ready.synchronize()
            handle = self._handle(slot.file)
            with self._serving(kind):
                self._move(kind, handle, buf, slot.offset)
            return total
        except GDSUnavailableError:
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised with the file and offset
            raise io_error(kind, total, slot, exc) from exc

    def _device_transfer(self, kind: Direction, buf: torch.Tensor, slot: Slot, ready: Any) -> int:
        """Move device memory ``buf`` (contiguous uint8) to or from the slot, on this thread's
        side stream (see the module doc for which route and why).

        ``ready``: for a write, synchronized here before the source is read (outside the busy
        time, as for host memory); for a read, waited for on the side stream before the first
        byte lands in ``buf`` (the drive read itself starts at once where the route allows).
        Returns after every queued operation of this transfer finished on the device."""
        total = buf.numel()
        try:
            if ready is not None and (kind == "write" or (self.name == "gds" and not self.stream_io)):
                ready.synchronize()
                ready = None
            handle = self._handle(slot.file)
            with self._serving(kind):
                if self.name == "compat":
                    self._staged(kind, handle, buf, slot, ready)
                elif self.stream_io:
                    self._streamed(kind, handle, buf, slot, ready)
                else:
                    self._move(kind, handle, buf, self.data_offset(slot))
            return total
        except GDSUnavailableError:
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised with the file and offset
            raise io_error(kind, total, slot, exc) from exc

    def _staged(self, kind: Direction, handle: Any, buf: torch.Tensor, slot: Slot, ready: Any) -> None:
        """compat: device memory through this thread's pinned staging buffers; KvikIO moves host pages."""
        stage = self._staging.get(buf.device)
        base = self.data_offset(slot)
        # Whole pages on an O_DIRECT file when the bytes start on a page (a slot is 4 KiB-sized).
        direct = slot.file.direct and base % ALIGN == 0

        def to_drive(host: torch.Tensor, lo: int, n: int) -> None:
            self._move("write", handle, host[: padded(n, direct)], base + lo)

        def from_drive(host: torch.Tensor, lo: int, n: int) -> None:
            self._move("read", handle, host[: padded(n, direct)], base + lo)

        if kind == "write":
            copy_out_chunks(stage, buf, to_drive)
        else:
            copy_in_chunks(stage, buf, from_drive, ready=ready)

    def _streamed(self, kind: Direction, handle: Any, buf: torch.Tensor, slot: Slot, ready: Any) -> None:
        """gds: cuFile stream operations on this thread's side stream, waited for one by one.

        KvikIO's ``StreamFuture.check_bytes_done()`` synchronizes that stream (only it) and
        raises on a cuFile error; the future is held until then, as KvikIO requires (it
        owns the size/offset arguments cuFile reads when the operation runs)."""
        base = self.data_offset(slot)
        op = handle.raw_write_async if kind == "write" else handle.raw_read_async
        with self._streams.use(buf.device) as stream:
            if ready is not None:
                stream.wait_event(ready)  # what may still read dst's memory, before cuFile writes it

            def piece(done: int, n: int) -> int:
                return int(op(buf[done : done + n], stream.cuda_stream, n, base + done, 0).check_bytes_done())

            self._until_done(f"cuFile {kind}", buf.numel(), base, piece, STREAM_PIECE_BYTES)

    def _move(self, kind: Direction, handle: Any, buf: torch.Tensor | memoryview, offset: int) -> None:
        """``pwrite``/``pread`` of all of ``buf`` at file ``offset``, retrying short transfers."""
        # KvikIO takes host memory as a numpy array and device memory through
        # __cuda_array_interface__; uint8 views sidestep dtypes it cannot map (bf16, fp8).
        if isinstance(buf, memoryview):
            arr: Any = np.frombuffer(buf, dtype=np.uint8)
        else:
            arr = buf.numpy() if buf.device.type == "cpu" else buf
        call = handle.pwrite if kind == "write" else handle.pread

        def rest(done: int, n: int) -> int:
            return int(call(arr[done:], n, offset + done, self.task_bytes).get())

        self._until_done(f"KvikIO {kind}", len(arr), offset, rest)

    def _until_done(self, what: str, total: int, offset: int, step: Callable[[int, int], int], piece: int | None = None) -> None:
        """Call ``step(done, n)`` (moves up to ``n`` bytes from ``done`` on, returns how many)
        until ``total`` bytes moved, ``n`` being what is left (at most ``piece``); a short
        step is retried from where it stopped, a step that moved nothing raises ``OSError``."""
        done = 0
        while done < total:
            n = total - done if piece is None else min(piece, total - done)
            self._throttle(n)
            moved = step(done, n)
            if moved <= 0:
                raise OSError(f"{what} moved {moved} bytes at offset {offset + done}")
            done += moved
            if done < total:
                self._count_retry()
