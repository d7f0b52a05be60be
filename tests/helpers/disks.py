"""Where spill tests write, and drives made small or full on purpose.

Spill tests need a real filesystem (``O_DIRECT``): on tmpfs or overlayfs they would test RAM.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gds_offload.io.directory import mount_of

__all__ = ["NOT_A_DISK", "fill", "fstype", "is_root", "real_disk_base", "tmpfs"]

#: Filesystems that are not a drive: spill tests there would test RAM, not O_DIRECT.
NOT_A_DISK = {"tmpfs", "ramfs", "overlay", "squashfs", "devtmpfs", "nfs", "nfs4", "9p", "fuse", "virtiofs"}
_TESTS = Path(__file__).resolve().parent.parent


def fstype(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    return mount_of(path)[2]


def real_disk_base() -> Path:
    """Where spill test directories go: ``$GDS_OFFLOAD_TEST_DIR``, else the system temp dir
    if it is on a real filesystem, else ``<repo>/.pytest_cache/spill`` (git-ignored)."""
    env = os.environ.get("GDS_OFFLOAD_TEST_DIR")
    if env:
        return Path(env)
    tmp = Path(tempfile.gettempdir())
    if fstype(tmp) not in NOT_A_DISK:
        return tmp
    base = _TESTS.parent / ".pytest_cache" / "spill"
    base.mkdir(parents=True, exist_ok=True)
    return base


def is_root() -> bool:
    return os.geteuid() == 0


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "8m", *, readonly: bool = False) -> Iterator[Path]:
    """Mount a small tmpfs at ``path`` (root only) for the duration of the block."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size},mode=0700" + (",ro" if readonly else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def fill(path: Path, *, leave_bytes: int = 0) -> Path:
    """Fill the filesystem of ``path`` with one file, leaving about ``leave_bytes`` free."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize - leave_bytes
    f = path / "filler"
    with open(f, "wb") as fh:
        chunk = b"\0" * (1 << 20)
        while free > 0:
            try:
                free -= fh.write(chunk[: min(len(chunk), free)])
                fh.flush()
            except OSError:
                break
    return f
