"""Engine selection: what ``mode="auto"`` picks on this node, and why.

Shares its node detection with ``gds-check`` (:func:`gds_offload.node.verdict.node_verdict`),
so the checker and the offloader never disagree. The engine itself is made by
:func:`gds_offload.io.factory.make_engine`.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from gds_offload.errors import ConfigError, GDSUnavailableError
from gds_offload.io.factory import EngineName, Mode, validate_mode
from gds_offload.io.kvikio.engine import kvikio_status
from gds_offload.node.verdict import node_verdict

__all__ = ["Choice", "choose_engine"]


@dataclass(frozen=True)
class Choice:
    """The engine ``mode`` resolves to on this node, and the one-line reason.

    ``strict``: ``mode="gds"`` was asked for by name, so the engine must turn cuFile's own
    POSIX fallback off or fail (:class:`~gds_offload.io.kvikio.engine.KvikIOEngine`);
    ``auto`` resolved to ``gds`` is not strict."""

    engine: EngineName
    reason: str
    strict: bool = False


def _gds_verdict(path: Path) -> tuple[bool, str]:
    """(direct path usable, reason), from the same probes gds-check uses."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible to torch"
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
    where = path or Path(".").resolve()
    gds_ok, gds_why = _gds_verdict(where)
    if mode == "gds":
        if not gds_ok:
            raise GDSUnavailableError(
                f"mode='gds' but GPUDirect Storage is not usable at {where}: {gds_why}. "
                f"Run `gds-check --path {shlex.quote(str(where))}` for details, or use mode='compat' (bounce buffers) or 'auto'"
            )
        return Choice("gds", f"GPUDirect Storage usable at {path}", strict=True)
    if gds_ok:
        return Choice("gds", f"GPUDirect Storage usable at {path}")
    if kvik_ok:
        return Choice("compat", f"no GDS ({gds_why}); {kvik_why} in compat mode")
    return Choice("posix", f"no GDS ({gds_why}); no KvikIO ({kvik_why})")
