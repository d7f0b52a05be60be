"""Exception types of the weight store. Every message says what is wrong, where, and how to fix it."""
from __future__ import annotations

from gds_offload.errors import ConfigError, OffloadError, SpillSpaceError

__all__ = ["StoreFormatError", "StoreTrustError", "StoreSpaceError", "StoreCorruptError", "WeightsMismatchError", "ConfigMismatchError"]


class StoreFormatError(ConfigError):
    """A store directory holds no manifest, an unreadable one, or one of another format version."""


class StoreTrustError(StoreFormatError):
    """A store directory or file this process must not trust: another user's (not root's), writable
    by group or others, a symlink, or not a regular file. Its message names the path and the fix."""


class StoreSpaceError(SpillSpaceError):
    """The output drive cannot hold the store: found before any byte of it is written, or (a drive
    another writer filled meanwhile) while writing, after which nothing of the store is left."""


class StoreCorruptError(OffloadError):
    """A group's bytes do not match the checksum recorded at conversion (names the layer)."""


class WeightsMismatchError(ConfigError):
    """The model's parameters and the store's tensors differ: missing, extra, mis-shaped or mis-typed keys."""


class ConfigMismatchError(ConfigError):
    """The model's config is not the one the store was converted from (its hash differs)."""
