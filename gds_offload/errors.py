"""Exception types. Every message says what is wrong, where, and how to fix it."""
from __future__ import annotations

__all__ = ["OffloadError", "ConfigError", "GDSUnavailableError", "SpillSpaceError"]


class OffloadError(RuntimeError):
    """An offloaded tensor could not be written, read or verified.

    Raised at the point the data is needed (for reads: when backward unpacks the
    tensor), never swallowed: a failed read never returns garbage.
    """


class ConfigError(ValueError):
    """A public entry point got an argument it cannot use."""


class GDSUnavailableError(ConfigError):
    """``mode="gds"`` was asked for on a node where the direct path does not work."""


class SpillSpaceError(OffloadError):
    """No spill directory has room for a slot (ENOSPC, file-size limit)."""
