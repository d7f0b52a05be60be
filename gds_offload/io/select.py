"""Engine selection: what ``mode="auto"`` picks on this node, and why.

Shares its node detection with ``gds-check`` (:func:`gds_offload.node.probes.node_verdict`),
so the checker and the offloader never disagree.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from gds_offload.errors import ConfigError, GDSUnavailableError
from gds_offload.io.base import Engine
from gds_offload.io.host import HostEngine
from gds_offload.io.kvikio_engine import KvikIOEngine, kvikio_status
from gds_offload.io.limits import TokenBucket
from gds_offload.io.posix import PosixEngine

__all__ = ["Mode", "MODES", "Choice", "choose_engine", "make_engine", "validate_mode"]

Mode = Literal["auto", "gds", "compat", "posix", "host"]
MODES: tuple[str, ...] = get_args(Mode)


@dataclass(frozen=True)
class Choice:
    """The engine ``mode`` resolves to on this node, and the one-line reason.

    ``strict``: ``mode="gds"`` was asked for by name, so the engine must turn cuFile's own
    POSIX fallback off or fail (:class:`~gds_offload.io.kvikio_engine.KvikIOEngine`);
    ``auto`` resolved to ``gds`` is not strict."""

    engine: Literal["gds", "compat", "posix", "host"]
    reason: str
    strict: bool = False


def validate_mode(mode: object) -> Mode:
    if mode not in MODES:
        hint = difflib.get_close_matches(str(mode).lower(), MODES, n=1)
        raise ConfigError(
            f"mode={mode!r} is not an engine; expected one of {', '.join(MODES)}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    return mode  # type: ignore[return-value]


def _gds_verdict(path: Path) -> tuple[bool, str]:
    """(direct path usable, reason), from the same probes gds-check uses."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA GPU visible to torch"
    except ImportError:  # pragma: no cover - torch is a dependency
        return False, "torch not importable"
    try:
        from gds_offload.node.probes import node_verdict
    except ImportError as exc:
        return False, f"gds-check probes unavailable ({exc})"
    verdict = node_verdict(path)
    return verdict.mode == "gds", verdict.reason + (f"; fix: {verdict.fix}" if verdict.fix else "")


def choose_engine(mode: Mode, path: Path | None, device: str | None = None) -> Choice:
    """Resolve ``mode`` to an engine name without creating it.

    ``device``: the device type of the tensors to move (``"cpu"``, ``"cuda"``; ``None``:
    not known, as for ``gds-offload info``). ``auto`` picks ``posix`` for CPU tensors:
    cuFile has nothing to do for host memory, and posix moves the same pages with fewer
    threads (8 against KvikIO's 16 plus 16 issuing), and on a CPU every thread's work is
    taken from the model's (compare with ``gds-offload bench --modes keep,offload:posix,offload:compat``).

    Raises:
        GDSUnavailableError: ``mode="gds"`` where the direct path does not work (names what is missing).
        ConfigError: ``mode="compat"`` without a usable KvikIO.
    """
    mode = validate_mode(mode)
    if mode == "host":
        return Choice("host", "host memory requested (mode='host')")
    if mode == "posix":
        return Choice("posix", "POSIX engine requested (mode='posix')")
    if mode == "auto" and device == "cpu":
        return Choice("posix", "the model is on the CPU: host tensors need no cuFile, and posix moves their pages with fewer threads")
    kvik_ok, kvik_why = kvikio_status()
    if mode == "compat":
        if not kvik_ok:
            raise ConfigError(f"mode='compat' needs KvikIO: {kvik_why}; or use mode='posix'")
        return Choice("compat", f"KvikIO compat mode requested ({kvik_why})")
    gds_ok, gds_why = _gds_verdict(path or Path("."))
    if mode == "gds":
        if not gds_ok:
            raise GDSUnavailableError(
                f"mode='gds' but GPUDirect Storage is not usable at {path}: {gds_why}. "
                f"Run `gds-check --path {path}` for details, or use mode='compat' (bounce buffers) or 'auto'"
            )
        return Choice("gds", f"GPUDirect Storage usable at {path}", strict=True)
    if gds_ok:
        return Choice("gds", f"GPUDirect Storage usable at {path}")
    if kvik_ok:
        return Choice("compat", f"no GDS ({gds_why}); {kvik_why} in compat mode")
    return Choice("posix", f"no GDS ({gds_why}); no KvikIO ({kvik_why})")


def make_engine(
    engine: Literal["gds", "compat", "posix", "host"],
    *,
    max_bandwidth: float | None = None,
    num_threads: int | None = None,
    strict: bool = True,
) -> Engine:
    """Create the named engine (as resolved by :func:`choose_engine`).

    ``strict``: for ``gds``, :attr:`Choice.strict` (``False`` when ``auto`` picked it); see
    :class:`~gds_offload.io.kvikio_engine.KvikIOEngine`.

    Raises:
        GDSUnavailableError: a strict ``gds`` engine cannot turn cuFile's POSIX fallback off.
    """
    limiter = TokenBucket(max_bandwidth) if max_bandwidth else None
    if engine in ("gds", "compat"):
        if num_threads:
            return KvikIOEngine(engine, strict=strict, limiter=limiter, num_threads=num_threads)
        return KvikIOEngine(engine, strict=strict, limiter=limiter)
    if engine == "posix":
        return PosixEngine(limiter=limiter, **({"num_threads": num_threads} if num_threads else {}))
    if engine == "host":
        return HostEngine(limiter=limiter)
    raise ConfigError(f"engine {engine!r} unknown; expected gds, compat, posix or host")
