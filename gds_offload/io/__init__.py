"""Storage engines: one interface (:class:`Engine`) over KvikIO/cuFile, POSIX and host memory.

This package knows nothing about autograd or layers; it moves bytes between tensors and
aligned file ranges (:mod:`~gds_offload.io.layout`), and imports nothing of the package but
:mod:`gds_offload.errors` and :mod:`gds_offload.units`. Engines are made by
:func:`make_engine` (:mod:`~gds_offload.io.factory`). The names below are imported on first
use, so :mod:`gds_offload.io.directory` and :mod:`gds_offload.io.layout` load without torch
(``gds-check`` uses them).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gds_offload.io.base import Engine, EngineStats, IOFuture
    from gds_offload.io.factory import MODES, EngineName, Mode, make_engine, validate_mode

_EXPORTS = {
    "Engine": "gds_offload.io.base",
    "EngineStats": "gds_offload.io.base",
    "IOFuture": "gds_offload.io.base",
    "MODES": "gds_offload.io.factory",
    "Mode": "gds_offload.io.factory",
    "EngineName": "gds_offload.io.factory",
    "make_engine": "gds_offload.io.factory",
    "validate_mode": "gds_offload.io.factory",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """The names of :data:`__all__`, imported from their module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gds_offload.io' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
