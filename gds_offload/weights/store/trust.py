"""Trusting a weight store's directories and files before anything reads them.

A store is read only if nobody but its owner can change it, and its owner is this process's
user or root: every directory and file belongs to one of them, none is writable by group or
others, and every file is a regular file with a plain name inside its directory. Files are
opened relative to a descriptor of their directory, without following a symlink
(``O_NOFOLLOW``) and without blocking on a FIFO (``O_NONBLOCK``), and judged by ``fstat`` of
the descriptor, so what is checked is what is read. Anyone who could write a store could swap
two layers, checksums included, and even a verified load would compute wrong outputs without
an error; such stores are refused, with the fix, as ``attach()`` refuses such spill
directories (:mod:`gds_offload.io.directory`).

:func:`make_dirs` and :func:`create_file` make stores that pass: directories 0755 and files
0644, less what the umask takes away, and never writable by group or others whatever the
umask (world-readable, writable by the owner only; a store several users load is converted
by root, since another user's store is refused).
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from gds_offload.weights.errors import StoreFormatError, StoreTrustError
from gds_offload.weights.store.advice import no_store_advice

__all__ = ["SHARED_WRITE", "check_name", "create_file", "make_dirs", "open_dir", "open_file", "read_file", "refusal"]

#: Mode bits that let someone other than the owner change a file or a directory's entries.
SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH
_DIR_MODE, _FILE_MODE = 0o755, 0o644
_NAME_MAX = 255


def check_name(name: object, *, where: str) -> str:
    """``name`` if it is a plain file name (no ``/``, not ``.`` or ``..``, no NUL, at most 255 bytes).

    Raises:
        StoreFormatError: anything else (it would open a file outside the store directory).
    """
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name
            or len(os.fsencode(name)) > _NAME_MAX):  # fmt: skip
        raise StoreFormatError(
            f"{where}: data file name {name!r} is not a plain file name inside the store directory (a path, '..' "
            f"or empty): the manifest is damaged or was edited; convert the checkpoint again"
        )
    return name


def refusal(st: os.stat_result, path: Path) -> str | None:
    """Why ``path`` (``st``: its status) cannot be trusted, with the fix; ``None`` when it can."""
    uid = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (uid, 0):
        return (f"{path} belongs to uid {st.st_uid}, not to you (uid {uid}) nor root (mode {mode:o}): its owner could "
                f"change the weights under you. Convert the checkpoint into a directory of your own, have root convert "
                f"it, or, once you have checked it, take it over (chown -R {uid} {path})")
    if st.st_mode & SHARED_WRITE:
        who = "group and others" if st.st_mode & SHARED_WRITE == SHARED_WRITE else "others" if st.st_mode & stat.S_IWOTH else "its group"
        fix = f"chmod go-w {path}" if st.st_uid == uid else f"ask root to run chmod go-w {path}"
        return (f"{path} is writable by {who} (mode {mode:o}): they could change the weights under you. Run {fix} "
                f"(convert makes stores 0755, files 0644)")
    return None


def open_dir(d: Path) -> int:
    """A descriptor of the store directory ``d`` once it is found trustworthy (the caller closes it).

    Another user's symlink to it is not followed; yours or root's are.

    Raises:
        StoreFormatError: ``d`` is missing or not a directory. StoreTrustError: see :func:`refusal`.
    """
    uid = os.geteuid()
    try:
        lst = os.lstat(d)
        if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (uid, 0):
            raise StoreTrustError(f"{d} is a symlink owned by uid {lst.st_uid}, not by you (uid {uid}) nor root; "
                                  f"refusing to follow it. Pass the real directory")  # fmt: skip
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError) as exc:
        what = "does not exist" if isinstance(exc, FileNotFoundError) else "is not a directory"
        raise StoreFormatError(f"{d} {what}: no weight store there; {no_store_advice(Path(d))}") from None
    except OSError as exc:
        raise StoreFormatError(f"{d} cannot be opened ({exc.strerror or exc}); fix its permissions or pass another store") from None
    why = refusal(os.fstat(fd), d)
    if why:
        os.close(fd)
        raise StoreTrustError(why)
    return fd


def open_file(dfd: int, d: Path, name: str, *, direct: bool = False) -> tuple[int, bool] | None:
    """Open ``d/name`` read-only through ``dfd`` (a descriptor of ``d``): ``(fd, O_DIRECT?)``, or
    ``None`` if there is no such name. With ``direct``, ``O_DIRECT`` where the filesystem allows it.

    Raises:
        StoreTrustError: a symlink, not a regular file (a FIFO, a device, a directory), or see :func:`refusal`.
        StoreFormatError: it cannot be opened (permissions).
    """
    path = d / name
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreTrustError(f"{path} is a symlink; a store's files are regular files inside its directory and links "
                                  f"are not followed. Convert the checkpoint again, or put the file itself there") from None  # fmt: skip
        raise StoreFormatError(f"{path} cannot be opened ({exc.strerror or exc}); fix its permissions or convert again") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a device or socket"
            raise StoreTrustError(f"{path} is {kind}, not a regular file; a weight store holds only regular files. Convert the checkpoint again")
        why = refusal(st, path)
        if why:
            raise StoreTrustError(why)
        return fd, direct and _set_direct(fd)
    except BaseException:
        os.close(fd)
        raise


def read_file(dfd: int, d: Path, name: str, *, limit: int) -> bytes | None:
    """The bytes of ``d/name`` opened as :func:`open_file` does; ``None`` if there is none.

    Raises:
        StoreFormatError: larger than ``limit`` bytes (not a file a store writes), or what :func:`open_file` raises.
    """
    opened = open_file(dfd, d, name)
    if opened is None:
        return None
    fd = opened[0]
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise StoreFormatError(f"{d / name} has {size} bytes, more than the {limit} a weight store writes there; convert the checkpoint again")
        chunks, left = [], size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _set_direct(fd: int) -> bool:
    """Turn on ``O_DIRECT`` for ``fd``; ``False`` where the filesystem refuses it."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True


def _owner_only(fd: int) -> None:
    """Take group and others' write bits off what ``fd`` opens, if the umask left them."""
    st = os.fstat(fd)
    if st.st_mode & SHARED_WRITE and st.st_uid == os.geteuid():
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~SHARED_WRITE)


def make_dirs(d: Path) -> None:
    """Create ``d`` and its missing parents, each 0755 less the umask and never writable by group or others."""
    missing = []
    p = Path(os.path.abspath(d))
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for m in reversed(missing):
        try:
            os.mkdir(m, _DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by someone else: the caller judges d with open_dir
        fd = os.open(m, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _owner_only(fd)
        finally:
            os.close(fd)


def create_file(dfd: int, name: str, *, direct: bool = False) -> tuple[int, bool]:
    """Create ``name`` (it must not exist, and no link is followed) in the directory ``dfd`` for
    writing: 0644 less the umask, never writable by group or others. ``(fd, O_DIRECT?)``."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE, dir_fd=dfd)
    try:
        _owner_only(fd)
        return fd, direct and _set_direct(fd)
    except BaseException:
        os.close(fd)
        raise
