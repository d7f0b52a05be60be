"""The directories ``convert`` writes a store into: judged before anything changes, created
owner-writable only, and left clean when a conversion fails.

An output directory may be new, empty, or hold a weight store (files of :data:`STORE_NAMES`
only; ``lost+found`` at a drive's root is ignored). One holding anything else (another
checkpoint, the checkpoint itself) is refused even with ``overwrite``: its ``config.json``
would be overwritten, and it would load as another model. A store there is replaced only
with ``overwrite``; then every store file in it goes first (the manifest first, so the old
store never looks complete), and so do ``config.json`` and ``generation_config.json``, so
the new store never keeps the old one's config. The directories must be this user's (or
root's) and writable by nobody else (:mod:`~gds_offload.weights.store.trust`): a store written
there would be refused at load.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from gds_offload.errors import ConfigError
from gds_offload.io.directory import missing_parent
from gds_offload.weights.store.config import CONFIG_NAME, GENERATION_CONFIG_NAME
from gds_offload.weights.store.manifest import MANIFEST_NAME
from gds_offload.weights.store.trust import create_file, make_dirs, open_dir

__all__ = ["DATA_NAME", "STORE_NAMES", "prepare_dirs", "remove_store", "write_small_file"]

DATA_NAME = "weights.bin"
_FINAL = (MANIFEST_NAME, DATA_NAME, CONFIG_NAME, GENERATION_CONFIG_NAME)
#: Every name a store (or a conversion in progress) has in its directories.
STORE_NAMES = frozenset(_FINAL + tuple(n + ".partial" for n in _FINAL))
#: Entries an output directory may hold besides a store's (a filesystem's root has one).
_IGNORED = frozenset({"lost+found"})
_SHOWN = 6


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def _store_files(d: Path) -> tuple[list[str], list[str]]:
    """``(store names present, other entries)`` of the existing directory ``d``."""
    ours: list[str] = []
    foreign: list[str] = []
    for name in sorted(os.listdir(d)):
        if name in _IGNORED:
            continue
        try:
            is_dir = stat.S_ISDIR(os.lstat(d / name).st_mode)
        except FileNotFoundError:
            continue
        (ours if name in STORE_NAMES and not is_dir else foreign).append(name)
    return ours, foreign


def prepare_dirs(dirs: list[Path], *, checkpoint: Path, overwrite: bool) -> list[int]:
    """Judge every output directory, then create the missing ones and (``overwrite``) empty the
    others of their store; returns a descriptor of each (the caller closes them).

    Nothing changes on disk unless every directory passes.

    Raises:
        ConfigError: a directory is the checkpoint's, a file, not writable, another user's or
            writable by others (:class:`~gds_offload.weights.errors.StoreTrustError`), holds files
            that are not a store's, or holds a store (or part of one) and not ``overwrite``.
    """
    present: list[list[str]] = []
    for d in dirs:
        if d.exists() and _same(d, checkpoint):
            raise ConfigError(
                f"out={d} is the checkpoint directory itself: the store would overwrite its config.json and put a second "
                f"copy of the weights beside them; pass another directory for the store"
            )
        if not os.path.lexists(d):
            no_parent = missing_parent(d)
            if no_parent is not None:
                raise ConfigError(f"the store {d}: {no_parent}")
            present.append([])
            continue
        if not d.is_dir():
            raise ConfigError(f"out={d} is a file, not a directory; pass a new or empty directory for the store")
        os.close(open_dir(d))  # yours or root's, writable by nobody else (else the store would be refused at load)
        if not os.access(d, os.W_OK | os.X_OK):
            raise ConfigError(f"out={d} is not writable by this process; fix its permissions or pass another directory")
        ours, foreign = _store_files(d)
        if foreign:
            more = f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else ""
            raise ConfigError(
                f"out={d} holds files that are not part of a weight store ({', '.join(foreign[:_SHOWN])}{more}): converting "
                f"there would overwrite or mix with them (another checkpoint's config.json would become the store's). "
                f"Pass a new or empty directory"
            )
        present.append(ours)
    if not overwrite:
        for d, ours in zip(dirs, present):
            if MANIFEST_NAME in ours:
                raise ConfigError(f"{d} holds a weight store already; pass overwrite=True (--force) to replace it, or another directory")
        for d, ours in zip(dirs, present):
            if ours:
                raise ConfigError(
                    f"{d} holds {', '.join(ours)} without a manifest (an unfinished conversion?); pass overwrite=True "
                    f"(--force) or remove them"
                )
    fds: list[int] = []
    try:
        for d in dirs:
            make_dirs(d)
            fds.append(open_dir(d))
        remove_store(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def remove_store(dir_fds: list[int]) -> None:
    """Unlink every store name (:data:`STORE_NAMES`) in these directories, the first one's manifest first."""
    order = [MANIFEST_NAME] + sorted(STORE_NAMES - {MANIFEST_NAME})
    for dfd in dir_fds:
        for name in order:
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass


def write_small_file(dfd: int, d: Path, name: str, data: bytes) -> None:
    """Write ``name`` in ``d`` (``dfd``) whole, as ``name.partial`` fsynced then renamed over ``name``.

    Raises:
        OSError: with the file's path as its ``filename`` (a full drive: ``ENOSPC``).
    """
    tmp = name + ".partial"
    try:
        fd, _ = create_file(dfd, tmp)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(d / name)) from exc
