"""The one place engines are made, for both halves: :func:`make_engine`.

The offloader (spill files, read and written), the weight store (its files read only, read
buffers not pooled), ``convert`` and the benchmarks all get their engines here, by name
(``gds``, ``compat``, ``posix``, ``host``). Which name ``mode="auto"`` resolves to on this
node is :func:`gds_offload.node.choice.choose_engine`'s to say: it needs the node's probes,
which sit above this package.
"""
from __future__ import annotations

import difflib
from typing import Any, Literal, get_args

from gds_offload.errors import ConfigError
from gds_offload.io.base import Engine
from gds_offload.io.host import HostEngine
from gds_offload.io.kvikio.engine import KvikIOEngine
from gds_offload.io.limits import TokenBucket
from gds_offload.io.posix import PosixEngine

__all__ = ["EngineName", "MODES", "Mode", "make_engine", "validate_mode"]

Mode = Literal["auto", "gds", "compat", "posix", "host"]
MODES: tuple[str, ...] = get_args(Mode)
#: An engine's name: a :data:`Mode` once ``auto`` is resolved.
EngineName = Literal["gds", "compat", "posix", "host"]


def validate_mode(mode: object) -> Mode:
    """``mode`` if it names an engine or ``auto``; else :class:`ConfigError` with the nearest name."""
    if mode not in MODES:
        hint = difflib.get_close_matches(str(mode).lower(), MODES, n=1)
        raise ConfigError(
            f"mode={mode!r} is not an engine; expected one of {', '.join(MODES)}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    return mode  # type: ignore[return-value]  # checked against MODES just above


def make_engine(
    engine: EngineName,
    *,
    read_only: bool = False,
    num_threads: int | None = None,
    chunk_bytes: int | None = None,
    read_pool_bytes: int | None = None,
    max_bandwidth: float | None = None,
    strict: bool = True,
) -> Engine:
    """Create the named engine (as resolved by :func:`~gds_offload.node.choice.choose_engine`).

    Args:
        engine: ``gds``, ``compat`` (KvikIO), ``posix`` or ``host``.
        read_only: KvikIO opens files for reading only (a weight store); POSIX engines are
            handed descriptors and open nothing.
        num_threads: the engine's I/O threads (``None``: its default).
        chunk_bytes: the unit a transfer is split into (posix's chunks, KvikIO's tasks; ``None``: the default).
        read_pool_bytes: idle read buffers kept for reuse (``0``: none, as the weight store's
            reads land in buffers of their own; ``None``: the default).
        max_bandwidth: a cap in bytes per second shared by reads and writes.
        strict: for ``gds``, :attr:`~gds_offload.node.choice.Choice.strict` (``False`` when
            ``auto`` picked it); see :class:`~gds_offload.io.kvikio.engine.KvikIOEngine`.

    Raises:
        ConfigError: an unknown engine name, or KvikIO unusable for ``gds``/``compat``.
        GDSUnavailableError: a strict ``gds`` engine cannot turn cuFile's POSIX fallback off.
    """
    limiter = TokenBucket(max_bandwidth) if max_bandwidth else None
    kw: dict[str, Any] = {"limiter": limiter}
    if num_threads:
        kw["num_threads"] = num_threads
    if read_pool_bytes is not None:
        kw["read_pool_bytes"] = read_pool_bytes
    if engine in ("gds", "compat"):
        if chunk_bytes:
            kw["task_bytes"] = chunk_bytes
        return KvikIOEngine(engine, strict=strict, read_only=read_only, **kw)
    if engine == "posix":
        if chunk_bytes:
            kw["chunk_bytes"] = chunk_bytes
        return PosixEngine(**kw)
    if engine == "host":
        return HostEngine(limiter=limiter)
    raise ConfigError(f"engine {engine!r} unknown; expected gds, compat, posix or host")
