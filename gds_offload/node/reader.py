"""How the probes see a node: small files under a root, the environment, sysfs PCI paths.

Shared by :mod:`~gds_offload.node.system`, :mod:`~gds_offload.io.kvikio.cufile_config`,
:mod:`~gds_offload.node.paths`, :mod:`~gds_offload.node.topology` and
:mod:`~gds_offload.node.collect`. Nothing here raises for a missing or unreadable file.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

__all__ = ["Reader", "env_map", "int_or_none", "sysfs_pci_path", "sysfs_pci_dir"]

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")


class Reader:
    """Reads small files under a root and remembers which ones were unreadable."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.unreadable: list[str] = []

    def at(self, absolute: str) -> Path:
        """The path of ``absolute`` (``/proc/...``) under the root."""
        return self.root / absolute.lstrip("/")

    def text(self, absolute: str | Path, limit: int = 65536) -> str | None:
        """File content (first ``limit`` bytes), or None when missing or unreadable."""
        path = absolute if isinstance(absolute, Path) else self.at(absolute)
        try:
            with open(path, "rb") as fh:
                return fh.read(limit).decode("utf-8", "replace")
        except PermissionError:
            self.unreadable.append(str(path))
            return None
        except OSError:
            return None


def env_map(env: Mapping[str, str] | None) -> Mapping[str, str]:
    """``env``, or ``os.environ`` when None."""
    return os.environ if env is None else env


def int_or_none(text: str | None) -> int | None:
    """A non-negative integer from a sysfs file's text; None when absent, not a number or ``-1``."""
    try:
        value = int((text or "").strip())
    except ValueError:
        return None
    return value if value >= 0 else None


def sysfs_pci_path(sysfs_path: Path) -> tuple[str, ...]:
    """Host bridge then PCI functions (``dddd:bb:dd.f``) from a resolved sysfs device path.

    Args:
        sysfs_path: e.g. ``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/nvme/nvme0``.

    Returns:
        ``("pci0000:00", "0000:00:01.0", "0000:01:00.0")``; empty when no host bridge is on the path.
    """
    parts = sysfs_path.parts
    start = next((i for i, p in enumerate(parts) if _HOST_BRIDGE.match(p)), None)
    if start is None:
        return ()
    chain = [parts[start]]
    for part in parts[start + 1:]:
        if _BDF.match(part):
            chain.append(part)
        elif len(chain) > 1:
            break
    return tuple(chain)


def sysfs_pci_dir(sysfs_path: Path) -> Path:
    """The deepest PCI function directory on ``sysfs_path`` (``sysfs_path`` itself when none)."""
    parts = sysfs_path.parts
    last = max((i for i, p in enumerate(parts) if _BDF.match(p)), default=None)
    return Path(*parts[:last + 1]) if last is not None else sysfs_path
