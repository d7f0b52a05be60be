"""Exception types of the weight store. Every message says what is wrong, where, and how to fix it."""
from __future__ import annotations

from gds_offload.errors import ConfigError, OffloadError, SpillSpaceError

__all__ = ["StoreFormatError", "StoreSpaceError", "StoreCorruptError", "WeightsMismatchError", "ConfigMismatchError"]


class StoreFormatError(ConfigError):
    """A store directory holds no manifest, an unreadable one, or one of another format version."""


class StoreSpaceError(SpillSpaceError):
    """The output drive cannot hold the store: raised before any byte of it is written."""


class StoreCorruptError(OffloadError):
    """A group's bytes do not match the checksum recorded at conversion (names the layer)."""


class WeightsMismatchError(ConfigError):
    """The model's parameters and the store's tensors differ: missing, extra, mis-shaped or mis-typed keys."""


class ConfigMismatchError(ConfigError):
    """The model's config is not the one the store was converted from (its hash differs)."""
