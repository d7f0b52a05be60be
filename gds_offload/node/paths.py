"""Spill-directory probes: mounts, the block device behind a path, O_DIRECT, free space.

:func:`probe_path` judges the directory exactly as ``attach()`` does
(:func:`gds_offload.io.directory.check_dir`: one function, one truth), then tries a write and an
aligned ``O_DIRECT`` write in it, reads its mount from ``<root>/proc/mounts`` and resolves
its ``st_dev`` through ``<root>/sys/dev/block`` to a disk (or the member disks of an md/dm
device), its PCI path and NUMA node. It changes nothing: a missing directory is reported as
"would be created" and its nearest existing ancestor is probed instead, without writing a
named file there. Probes never raise.
"""
from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from gds_offload.io.directory import Origin, check_dir, default_spill_dir  # one definition each, shared with attach()
from gds_offload.io.layout import ALIGN
from gds_offload.node.reader import Reader, int_or_none, sysfs_pci_dir, sysfs_pci_path

__all__ = [
    "MountEntry",
    "BlockDevice",
    "PathProbe",
    "default_spill_dir",
    "read_mounts",
    "find_mount",
    "probe_block_device",
    "probe_o_direct",
    "probe_path",
    "statvfs_space",
]


@dataclass(frozen=True)
class MountEntry:
    """One line of ``/proc/mounts``."""

    source: str
    mountpoint: str
    fstype: str
    options: tuple[str, ...]


@dataclass(frozen=True)
class BlockDevice:
    """The block device behind a filesystem, resolved through sysfs.

    Attributes:
        dev: ``MAJ:MIN`` of ``st_dev``.
        disk: the whole-disk name (``nvme0n1`` for ``nvme0n1p2``; ``md0`` for RAID).
        members: for md/dm devices, the disks underneath.
        nvme: the disk, or every member, is an NVMe namespace.
        pci_address: the PCI function of the (first) controller, ``""`` if none.
        pci_path: host bridge then PCI functions from the root port down to the controller.
        numa_node: the controller's NUMA node, None when unknown or ``-1``.
        error: why it could not be resolved.
    """

    dev: str
    disk: str = ""
    members: tuple[str, ...] = ()
    nvme: bool = False
    pci_address: str = ""
    pci_path: tuple[str, ...] = ()
    numa_node: int | None = None
    error: str = ""


@dataclass(frozen=True)
class PathProbe:
    """Everything about one spill directory.

    Attributes:
        path: the directory as given (absolute).
        exists: it exists.
        would_create: it is missing and ``attach()`` would create it (0700) under ``probed``.
        problem: what ``attach()`` would refuse it with (:func:`gds_offload.io.directory.check_dir`), or "".
        fix: what to do about ``problem``.
        probed: the directory the facts below describe: ``path``, or the existing ancestor
            a missing one would be created under.
        is_dir: ``probed`` is a directory.
        writable: a file could be created and removed in it.
        read_only_mount: its mount has the ``ro`` option.
        free_bytes: bytes available to unprivileged users, None when unknown.
        total_bytes: filesystem size, None when unknown.
        fstype: from the longest matching ``/proc/mounts`` entry.
        mountpoint: that entry's mount point.
        mount_source: that entry's source (``/dev/nvme0n1p1``).
        mount_options: that entry's options.
        o_direct: whether an aligned O_DIRECT write worked; None when not tested.
        o_direct_detail: how it was tested, or the error.
        device: the block device behind it, None for virtual filesystems.
        error: the first error met (creation, stat...).
    """

    path: str
    exists: bool = False
    would_create: bool = False
    problem: str = ""
    fix: str = ""
    probed: str = ""
    is_dir: bool = False
    writable: bool = False
    read_only_mount: bool = False
    free_bytes: int | None = None
    total_bytes: int | None = None
    fstype: str = ""
    mountpoint: str = ""
    mount_source: str = ""
    mount_options: tuple[str, ...] = ()
    o_direct: bool | None = None
    o_direct_detail: str = ""
    device: BlockDevice | None = None
    error: str = ""


# --------------------------------------------------------------------------------------
# Mounts and block devices
# --------------------------------------------------------------------------------------
def read_mounts(root: Path = Path("/")) -> tuple[MountEntry, ...]:
    """Parse ``<root>/proc/mounts`` (octal escapes such as ``\\040`` decoded).

    Args:
        root: root of the ``/proc`` tree.

    Returns:
        The entries in file order; empty when unreadable.
    """
    text = Reader(root).text("/proc/mounts", limit=1 << 22) or ""
    entries = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        source, mountpoint, fstype, options = (_unescape(p) for p in parts[:4])
        entries.append(MountEntry(source, mountpoint, fstype, tuple(options.split(","))))
    return tuple(entries)


def _unescape(field_text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


def find_mount(path: Path, mounts: Sequence[MountEntry]) -> MountEntry | None:
    """The mount that holds ``path``: longest mount point that is a path prefix.

    Later entries win on ties (a mount stacked over another).

    Args:
        path: an absolute path (resolved by the caller).
        mounts: from :func:`read_mounts`.

    Returns:
        The entry, or None when nothing matches.
    """
    target = Path(os.path.normpath(str(path)))
    best: MountEntry | None = None
    best_len = -1
    for entry in mounts:
        mp = Path(os.path.normpath(entry.mountpoint))
        if target == mp or mp in target.parents:
            depth = len(mp.parts)
            if depth >= best_len:
                best, best_len = entry, depth
    return best


def probe_block_device(st_dev: int, root: Path = Path("/")) -> BlockDevice | None:
    """Resolve ``st_dev`` to a disk through ``<root>/sys/dev/block/MAJ:MIN``.

    Partitions resolve to their disk; md/dm devices to their member disks (through
    ``slaves/``). The PCI path is read from the resolved sysfs path, the NUMA node from
    the controller's ``numa_node``.

    Args:
        st_dev: ``os.stat(path).st_dev``.
        root: root of the ``/sys`` tree.

    Returns:
        The device, or None for a virtual filesystem (major 0: tmpfs, overlay, NFS...).
    """
    major, minor = os.major(st_dev), os.minor(st_dev)
    dev = f"{major}:{minor}"
    if major == 0:
        return None
    link = root / "sys/dev/block" / dev
    if not link.exists():
        return BlockDevice(dev, error=f"/sys/dev/block/{dev} not found")
    disk_dir = _disk_dir(Path(os.path.realpath(link)))
    members = _members(disk_dir, root)
    controllers = members or [disk_dir]
    nvme = all(c.name.startswith("nvme") for c in controllers)
    pci_path = sysfs_pci_path(controllers[0])
    pci_address = pci_path[-1] if len(pci_path) > 1 else ""
    numa = None
    if pci_address:
        numa = int_or_none(Reader(root).text(sysfs_pci_dir(controllers[0]) / "numa_node"))
    return BlockDevice(dev, disk_dir.name, tuple(m.name for m in members), nvme,
                       pci_address, pci_path, numa)


def _disk_dir(resolved: Path) -> Path:
    return resolved.parent if (resolved / "partition").exists() else resolved


def _members(disk_dir: Path, root: Path, depth: int = 0) -> list[Path]:
    slaves = disk_dir / "slaves"
    if depth > 4 or not slaves.is_dir():
        return []
    found: list[Path] = []
    for slave in sorted(slaves.iterdir()):
        member = _disk_dir(Path(os.path.realpath(slave)))
        found.extend(_members(member, root, depth + 1) or [member])
    return found


# --------------------------------------------------------------------------------------
# Writes: O_DIRECT, writability, free space
# --------------------------------------------------------------------------------------
def probe_o_direct(directory: Path, *, named_fallback: bool = True) -> tuple[bool | None, str]:
    """Whether the filesystem under ``directory`` accepts an aligned O_DIRECT write.

    Tries ``open(dir, O_TMPFILE|O_RDWR|O_DIRECT)`` (leaves nothing behind), then a
    named temporary file reopened with ``O_DIRECT``; writes one 4 KiB page-aligned block.
    ``EINVAL`` from the open or the write means no.

    Args:
        directory: an existing, writable directory.
        named_fallback: without ``O_TMPFILE``, test with a named file (removed after);
            False: leave a directory entirely untouched and report ``None``.

    Returns:
        ``(True|False, how)``, or ``(None, why)`` when the test itself could not run.
    """
    if not hasattr(os, "O_DIRECT"):
        return None, "this platform has no O_DIRECT"
    flags = os.O_RDWR | os.O_DIRECT
    block = mmap.mmap(-1, ALIGN)  # page-aligned, as O_DIRECT needs
    try:
        try:
            fd = os.open(directory, os.O_TMPFILE | flags, 0o600)
            how = "O_TMPFILE"
        except OSError:
            if not named_fallback:
                return None, "not tested: no O_TMPFILE here, and the directory does not exist yet"
            return _o_direct_named(directory, flags, block)
        return _o_direct_write(fd, how, block)
    finally:
        block.close()


def _o_direct_named(directory: Path, flags: int, block: mmap.mmap) -> tuple[bool | None, str]:
    try:
        name = _make_test_file(directory)
    except OSError as exc:
        return None, f"could not create a test file: {exc.strerror}"
    try:
        try:
            fd = os.open(name, flags)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False, "open(O_DIRECT) failed with EINVAL"
            return None, f"open(O_DIRECT) failed: {exc.strerror}"
        return _o_direct_write(fd, "named temporary file", block)
    finally:
        _remove_quietly(name)


def _o_direct_write(fd: int, how: str, block: mmap.mmap) -> tuple[bool | None, str]:
    try:
        os.write(fd, block)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False, f"open(O_DIRECT) worked but a 4 KiB aligned write failed with EINVAL ({how})"
        return None, f"4 KiB O_DIRECT write failed: {exc.strerror} ({how})"
    finally:
        os.close(fd)
    return True, f"4 KiB aligned write accepted ({how})"


def statvfs_space(path: Path) -> tuple[int, int]:
    """``(free_bytes, total_bytes)`` of the filesystem under ``path`` (bytes available to unprivileged users)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def probe_path(
    path: Path,
    *,
    root: Path = Path("/"),
    disk_space: Callable[[Path], tuple[int, int]] = statvfs_space,
    origin: Origin = "--path",
) -> PathProbe:
    """Probe a spill directory without changing it: ``attach()``'s verdict, writability, space,
    mount, O_DIRECT, device.

    Args:
        path: the directory (a real path; only ``/proc`` and ``/sys`` are read under ``root``).
        root: root of the ``/proc`` and ``/sys`` trees.
        disk_space: ``path -> (free_bytes, total_bytes)``; ``statvfs`` by default.
        origin: where the path came from (``--path``, ``GDS_OFFLOAD_DIR``, ``default``), as
            :func:`gds_offload.io.directory.check_dir` names it in its verdict.

    Returns:
        The facts; ``problem`` is what ``attach()`` would refuse, ``error`` the first problem met.
    """
    path = Path(os.path.abspath(os.path.expanduser(str(path))))
    found = check_dir(path, origin=origin)
    target = path if found.exists else found.create_under
    probe = PathProbe(str(path), exists=found.exists, would_create=not found.exists and not found.problem,
                      problem=found.problem, fix=found.fix, probed=str(target or ""))
    if target is None:
        return replace(probe, error=found.problem or f"{path} does not exist")
    real = Path(os.path.realpath(target))
    mount = find_mount(real, read_mounts(root))
    if mount is not None:
        probe = replace(probe, fstype=mount.fstype, mountpoint=mount.mountpoint,
                        mount_source=mount.source, mount_options=mount.options,
                        read_only_mount="ro" in mount.options)
    probe = replace(probe, is_dir=real.is_dir())
    if not probe.is_dir:
        return replace(probe, error=found.problem or f"{target} exists but is not a directory")
    try:
        free, total = disk_space(real)
        probe = replace(probe, free_bytes=int(free), total_bytes=int(total))
    except Exception as exc:  # noqa: BLE001 - a probe never raises
        probe = replace(probe, error=f"free space unknown: {exc}")
    if found.exists:
        writable, why = _try_write(real)
    else:  # the ancestor is not ours to write in: ask the kernel only
        writable = os.access(real, os.W_OK | os.X_OK)
        why = "" if writable else f"{real} is not writable by uid {os.geteuid()}"
    probe = replace(probe, writable=writable and not probe.read_only_mount)
    if not writable:
        probe = replace(probe, error=probe.error or why)
    if writable:
        o_direct, detail = probe_o_direct(real, named_fallback=found.exists)
        probe = replace(probe, o_direct=o_direct, o_direct_detail=detail)
    try:
        probe = replace(probe, device=probe_block_device(os.stat(real).st_dev, root))
    except OSError as exc:
        probe = replace(probe, device=BlockDevice("?", error=str(exc)))
    return probe


def _try_write(directory: Path) -> tuple[bool, str]:
    if not os.access(directory, os.W_OK | os.X_OK):
        return False, f"{directory} is not writable by uid {os.geteuid()}"
    try:
        name = _make_test_file(directory)
    except OSError as exc:
        return False, f"cannot create a file in {directory}: {exc.strerror or exc}"
    _remove_quietly(name)
    return True, ""


def _make_test_file(directory: Path) -> str:
    """Create an empty temporary file in ``directory`` and close it; raises OSError."""
    handle, name = tempfile.mkstemp(prefix=".gds-check-", dir=directory)
    os.close(handle)
    return name


def _remove_quietly(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name)
