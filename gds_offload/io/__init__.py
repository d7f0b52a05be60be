"""Storage engines: one interface (:class:`Engine`) over KvikIO/cuFile, POSIX and host memory.

This package knows nothing about autograd; it moves bytes between tensors and spill slots.
"""
from gds_offload.io.base import Engine, EngineStats, IOFuture
from gds_offload.io.select import MODES, Choice, Mode, choose_engine, make_engine, validate_mode

__all__ = ["Engine", "EngineStats", "IOFuture", "MODES", "Mode", "Choice", "choose_engine", "make_engine", "validate_mode"]
