"""A fault-injecting engine wrapper, for tests and chaos runs.

:class:`FaultyEngine` wraps any :class:`~gds_offload.io.base.Engine` and makes
chosen transfers fail the way drives and filesystems fail: ``ENOSPC`` or ``EIO``
(the future raises :class:`~gds_offload.errors.OffloadError` with the OS error as
its cause), a *short* transfer (only the first half of the bytes move and the future
reports that count), or *corruption* (the bytes move, but wrong: a write stores
flipped bytes, a read flips bytes after they arrive, and both report success).

A *late* transfer is a drive slower than any compute, without a timer: the bytes move, but
the transfer is reported done only once someone waits for its future (``IOFuture.wait`` or
``error``, as :meth:`~gds_offload.Offloader.synchronize` does); until then it is not done and
no completion callback runs. It combines with one other fault on the same transfer (a late
corrupt write). A test that needs a write settled before backward must force it, and a run
with every write late shows whether it does. The write window waits for writes to finish by
themselves, which late ones never do: keep late writes to models whose forward fits the window.

Two more kinds force timing and submission failures: ``hold`` (the transfer starts only
when :meth:`FaultyEngine.resume` is called, so a test can keep a read in flight for as long
as it needs, without timers) and ``raise`` (submitting the transfer raises
:class:`~gds_offload.errors.OffloadError` at once and moves nothing, as an engine that cannot
start one does).

Faults are deterministic: a :class:`Fault` hits the ``nth`` transfer of its
direction (1-based, counted from when the wrapper was installed) and the
``count - 1`` after it (``count=0``: every one from ``nth`` on). Failed futures
complete on the wrapper's own thread, like real I/O completions do.

The wrapper also checks the buffer-ownership contract of reads (:mod:`gds_offload.io.base`):
a read submitted into memory that an unfinished read still writes is recorded in
:attr:`FaultyEngine.overlaps`.

Install into a freshly attached offloader (before its first step)::

    off = gds_offload.attach(model, path=tmp, min_bytes=0)
    faulty = inject(off, "write:enospc:3")     # or Fault("write", "enospc", nth=3)

Spec strings (``--faults`` of ``scripts/soak.py``): ``OP:KIND[:NTH[:COUNT]]`` joined
by commas, e.g. ``"write:eio:5,read:corrupt:2:0"``.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from gds_offload.errors import ConfigError, OffloadError
from gds_offload.io.base import Direction, Engine, EngineStats, IOFuture, io_error

if TYPE_CHECKING:
    from gds_offload.io.layout import Slot

__all__ = ["Fault", "FaultyEngine", "UsesEngine", "inject", "parse_faults"]

Kind = Literal["enospc", "eio", "short", "corrupt", "late", "hold", "raise"]
_KINDS: tuple[str, ...] = ("enospc", "eio", "short", "corrupt", "late", "hold", "raise")
_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO}


@dataclass(frozen=True)
class Fault:
    """Make transfers ``nth`` .. ``nth + count - 1`` of direction ``op`` fail with ``kind``
    (``late``: complete only when waited for; see the module doc).

    ``delay_s``: an ``enospc``/``eio`` failure completes this long after submission (so a
    waiter finds the transfer still in flight, then failed).
    """

    op: Direction
    kind: Kind
    nth: int = 1
    count: int = 1
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.op not in ("write", "read"):
            raise ConfigError(f"Fault op={self.op!r}; expected 'write' or 'read'")
        if self.kind not in _KINDS:
            raise ConfigError(f"Fault kind={self.kind!r}; expected one of {', '.join(_KINDS)}")
        if self.nth < 1 or self.count < 0:
            raise ConfigError(f"Fault nth={self.nth}, count={self.count}: need nth >= 1 and count >= 0")

    def hits(self, op: Direction, n: int) -> bool:
        return op == self.op and n >= self.nth and (self.count == 0 or n < self.nth + self.count)


def parse_faults(spec: str) -> list[Fault]:
    """``"write:eio:5,read:corrupt:2:0"`` -> faults. Empty string -> no faults.

    Raises:
        ConfigError: a part is not ``OP:KIND[:NTH[:COUNT]]``.
    """
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        bits = part.split(":")
        try:
            if not 2 <= len(bits) <= 4:
                raise ValueError(part)
            nums = [int(b) for b in bits[2:]]
        except ValueError:
            raise ConfigError(f"fault {part!r} is not OP:KIND[:NTH[:COUNT]], e.g. 'write:eio:5'") from None
        out.append(Fault(bits[0], bits[1], *nums))  # type: ignore[arg-type]
    return out


@dataclass
class _Injected:
    op: Direction
    kind: Kind
    n: int
    offset: int


class FaultyEngine(Engine):
    """``inner`` with faults injected. Forwards everything else (release, close, stats) to ``inner``.

    Args:
        inner: the engine that does the real I/O.
        faults: what to inject (see :class:`Fault`); more can be added with :meth:`add`.

    Attributes:
        injected: one record per fault injected (direction, kind, transfer number, slot offset);
            ``late`` transfers are not recorded.
        overlaps: one line per read submitted into memory an unfinished read still wrote.
    """

    def __init__(self, inner: Engine, faults: Sequence[Fault] = ()) -> None:
        self.name = inner.name  # type: ignore[misc]  # report as the wrapped engine
        super().__init__()
        self.inner = inner
        self.needs_files = inner.needs_files  # type: ignore[misc]
        self.uses_gds = inner.uses_gds
        self.depth = inner.depth
        self.description = f"{inner.description} (fault injection)"
        self.faults: list[Fault] = list(faults)
        self.injected: list[_Injected] = []
        self._counts = {"write": 0, "read": 0}
        self._fault_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gds_offload-faults")
        self.overlaps: list[str] = []
        self._reading: dict[int, tuple[int, int]] = {}  # unfinished reads' destination ranges
        self._held: list[Any] = []  # starts of the transfers a "hold" fault keeps back

    def add(self, *faults: Fault) -> None:
        """Inject more faults (counted from the transfers already done)."""
        with self._fault_lock:
            self.faults.extend(faults)

    def counts(self) -> dict[str, int]:
        """Transfers seen so far, by direction."""
        with self._fault_lock:
            return dict(self._counts)

    def holding(self) -> int:
        """Transfers a ``hold`` fault keeps back (submitted, not started)."""
        with self._fault_lock:
            return len(self._held)

    def resume(self) -> None:
        """Start every transfer a ``hold`` fault keeps back."""
        with self._fault_lock:
            starts, self._held = self._held, []
        for start in starts:
            start()

    def release(self, slot: Slot) -> None:
        self.inner.release(slot)

    def slot_bytes(self, nbytes: int, device: torch.device) -> int:
        return self.inner.slot_bytes(nbytes, device)

    def data_offset(self, slot: Slot) -> int:
        return self.inner.data_offset(slot)

    def empty(self, nbytes: int, slot: Slot, device: torch.device) -> torch.Tensor:
        return self.inner.empty(nbytes, slot, device)

    def trim(self, keep_bytes: int = 0) -> None:
        self.inner.trim(keep_bytes)

    def reset_peaks(self) -> None:
        self.inner.reset_peaks()

    def close(self) -> None:
        super().close()
        self.resume()  # a held transfer must not outlive the engine
        self._pool.shutdown(wait=True)
        self.inner.close()

    def abort(self) -> None:
        super().abort()
        self.inner.abort()

    def stats(self) -> EngineStats:
        """The wrapped engine's counters: the bytes that really moved."""
        return self.inner.stats()

    # ------------------------------------------------------------------ internals
    def _pick(self, op: Direction, slot: Slot) -> tuple[Fault | None, bool]:
        """The fault that hits this transfer (the first that does, ``late`` aside) and whether it is late."""
        with self._fault_lock:
            self._counts[op] += 1
            n = self._counts[op]
            hit = [f for f in self.faults if f.hits(op, n)]
            fault = next((f for f in hit if f.kind != "late"), None)
            late = any(f.kind == "late" for f in hit)
            if fault is not None:  # late is the drive's pace, not a fault of the data: not recorded
                self.injected.append(_Injected(op, fault.kind, n, slot.offset))
        return fault, late

    def _submit_write(self, src: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        fault, late = self._pick("write", slot)
        if fault is not None and fault.kind == "raise":
            raise OffloadError(f"write of {src.numel()} bytes at {slot.file.describe()} offset {slot.offset} could not start (injected by FaultyEngine)")
        future = self._write(fault, src, slot, ready)
        return _Late(future) if late else future

    def _submit_read(self, dst: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        fault, late = self._pick("read", slot)
        if fault is not None and fault.kind == "raise":
            raise OffloadError(f"read of {dst.numel()} bytes at {slot.file.describe()} offset {slot.offset} could not start (injected by FaultyEngine)")
        future = self._read(fault, dst, slot, ready)
        self._track_read(dst, future)
        return _Late(future) if late else future

    def _write(self, fault: Fault | None, src: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        if fault is not None and fault.kind == "hold":
            return self._hold(lambda: self.inner.write(src, slot, ready=ready))
        if fault is None:
            return _chain(self.inner.write(src, slot, ready=ready))
        if fault.kind in _ERRNO:
            return self._fail("write", src.numel(), slot, fault)
        if fault.kind == "short":
            return _chain(self.inner.write(src[: src.numel() // 2], slot, ready=ready))
        bad = src.clone()  # corrupt: the drive stores other bytes, and says it worked
        bad[:64] ^= 0x5A
        return _chain(self.inner.write(bad, slot, ready=ready), keep=bad, report=src.numel())

    def _read(self, fault: Fault | None, dst: torch.Tensor, slot: Slot, ready: Any) -> Future[int]:
        if fault is None:
            return _chain(self.inner.read(dst, slot, ready=ready))
        if fault.kind in _ERRNO:
            return self._fail("read", dst.numel(), slot, fault)
        if fault.kind == "short":
            return _chain(self.inner.read(dst[: dst.numel() // 2], slot, ready=ready))
        if fault.kind == "hold":
            return self._hold(lambda: self.inner.read(dst, slot, ready=ready))

        def flip() -> None:
            dst[:64] ^= 0x5A

        return _chain(self.inner.read(dst, slot, ready=ready), after=flip)

    def _hold(self, start: Any) -> Future[int]:
        """A transfer that ``start()`` submits to the inner engine once :meth:`resume` is called."""
        out = _Mirror(None)
        with self._fault_lock:
            self._held.append(lambda: _chain(start(), into=out))
        return out

    def _track_read(self, dst: torch.Tensor, future: Future[int]) -> None:
        lo = dst.data_ptr()
        hi = lo + dst.numel()
        with self._fault_lock:
            for a, b in self._reading.values():
                if a < hi and lo < b:
                    self.overlaps.append(f"a read into [{lo:#x}, {hi:#x}) while a read into [{a:#x}, {b:#x}) is unfinished")
            key = id(future)
            self._reading[key] = (lo, hi)

        def done(_: Future[int]) -> None:
            with self._fault_lock:
                self._reading.pop(key, None)

        future.add_done_callback(done)

    def _fail(self, op: Direction, nbytes: int, slot: Slot, fault: Fault) -> Future[int]:
        code = _ERRNO[fault.kind]
        exc = io_error(op, nbytes, slot, OSError(code, f"{os.strerror(code)} (injected by FaultyEngine)"))

        def raise_it() -> int:
            time.sleep(fault.delay_s)
            raise exc

        return self._pool.submit(raise_it)


class _Late(Future[int]):
    """Mirrors ``inner``, but completes only when waited for (:meth:`result`, :meth:`exception`):
    until then :meth:`done` is false and no done-callback runs; the waiter then runs them."""

    def __init__(self, inner: Future[int]) -> None:
        super().__init__()
        self._inner = inner

    def _settle(self, timeout: float | None) -> None:
        if self.done():  # settled already (a done-callback asks again, from inside set_result)
            return
        failure = self._inner.exception(timeout)
        try:
            if failure is not None:
                self.set_exception(failure)
            else:
                self.set_result(self._inner.result())
        except InvalidStateError:
            pass  # another waiter settled it meanwhile

    def result(self, timeout: float | None = None) -> int:
        self._settle(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._settle(timeout)
        return super().exception(timeout)


class _Mirror(Future[int]):
    """The future :func:`_chain` returns: waiting for it waits for the transfer it mirrors first,
    so a wrapped engine's late transfer (:class:`_Late`) completes when the wrapper's is waited for."""

    def __init__(self, inner: IOFuture | None) -> None:
        super().__init__()
        self.inner: IOFuture | None = inner  # dropped once mirrored: it holds the callback that holds this
        # (None until a held transfer is started: waiting then waits for it to be started and done)

    def _pull(self, timeout: float | None) -> None:
        inner = self.inner
        if inner is not None:
            inner.error(timeout)

    def result(self, timeout: float | None = None) -> int:
        self._pull(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._pull(timeout)
        return super().exception(timeout)


def _chain(
    inner: IOFuture, *, keep: Any = None, report: int | None = None, after: Any = None, into: _Mirror | None = None
) -> Future[int]:
    """A concurrent Future (``into``, or a new one) that mirrors ``inner`` (optionally running
    ``after`` first, reporting ``report`` bytes)."""
    out = _Mirror(inner) if into is None else into
    out.inner = inner

    def done(f: IOFuture, _keep: Any = keep) -> None:  # _keep: the buffer lives until the transfer ends
        out.inner = None
        failure = f.error(0)
        if failure is not None:
            out.set_exception(failure)
            return
        try:
            if after is not None:
                after()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            out.set_exception(exc.with_traceback(None))
            return
        out.set_result(report if report is not None else f.moved())

    inner.add_done_callback(done)
    return out


class UsesEngine(Protocol):
    """What :func:`inject` needs of its target: the engine it uses, and a way to hand it
    another (an attached :class:`~gds_offload.Offloader`, a
    :class:`~gds_offload.weights.StreamedModel`)."""

    @property
    def engine(self) -> Engine | None: ...

    def use_engine(self, engine: Engine) -> Any: ...


def inject(target: UsesEngine, *faults: Fault | str) -> FaultyEngine:
    """Wrap ``target``'s engine in a :class:`FaultyEngine` (call before the first step, with no I/O in flight).

    Args:
        target: anything with ``.engine`` and ``.use_engine(engine)``: an attached offloader,
            a streamed model.
        faults: :class:`Fault` objects or spec strings (``"write:enospc:3"``).

    Raises:
        ConfigError: ``target`` uses no engine (a streamed model whose layers are all resident).

    Returns:
        The wrapper; the target closes it and the wrapped engine when it closes its own
        (``off.detach()``).
    """
    parsed: list[Fault] = []
    for f in faults:
        parsed.extend(parse_faults(f) if isinstance(f, str) else [f])
    inner = target.engine
    if inner is None:
        raise ConfigError(f"inject: {type(target).__name__} has no engine to wrap (it reads nothing from a drive)")
    engine = FaultyEngine(inner, parsed)
    target.use_engine(engine)
    return engine
