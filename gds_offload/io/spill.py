"""The spill store: where offloaded bytes live on disk.

One unnamed spill file per directory and process (``O_TMPFILE``, or a named file
unlinked right after it is created where the filesystem has no ``O_TMPFILE``; the
descriptor is the one that created it, checked to be that file), so a crash
or ``kill -9`` leaves nothing behind. A first-fit slot allocator (:class:`~gds_offload.io.layout.File`'s) with 4 KiB
alignment hands out byte ranges; freed ranges are coalesced and reused by the next
step, so the file stops growing once the working set is known. Space is reserved
with ``fallocate`` when the file grows: a full drive is found at allocation time,
while the tensor is still in memory, not half-way through a write.

Several directories are striped at tensor granularity: each allocation goes to the
directory with the fewest bytes allocated that still has room.

Metadata (offsets, sizes, checksums) lives in memory only; nothing on disk is
ever parsed, unpickled or executed. Which directory, and whether it is safe to spill
to, is :mod:`gds_offload.io.directory`'s to decide.
"""
from __future__ import annotations

import errno
import os
import secrets
import threading
from pathlib import Path

from gds_offload.errors import ConfigError, SpillSpaceError
from gds_offload.io.directory import Origin, mount_of, prepare_dir
from gds_offload.io.fds import close_fd
from gds_offload.io.layout import File, Slot, align_up

__all__ = [
    "GROW_BYTES",
    "SpillStore",
    "check_free_space",
    "free_bytes",
    "open_unnamed",
]

#: The file grows by at least this much at a time, so fallocate is not called per tensor.
GROW_BYTES = 64 << 20


class SpillStore:
    """Slots in spill files, striped over ``dirs``. Thread-safe.

    Args:
        dirs: spill directories (one per drive). Empty for a virtual store (``host`` engine).
        direct: open files with ``O_DIRECT`` where the filesystem accepts it.
        reserve_bytes: bytes that must be free in total at start (0: no check).
        create: create a missing directory (0700, parents as needed; see :func:`prepare_dir`).
        origin: where ``dirs`` came from (named in messages; see :func:`check_dir`).
    """

    def __init__(
        self,
        dirs: list[Path],
        *,
        direct: bool = True,
        reserve_bytes: int = 0,
        create: bool = False,
        origin: Origin = "path",
    ) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self.files: list[File] = []
        if not dirs:
            self.files.append(File(id=0, path=None, note="virtual (no storage)"))
            return
        dirs = [prepare_dir(Path(d), create=create, origin=origin) for d in dirs]
        if reserve_bytes:
            check_free_space(dirs, reserve_bytes)
        try:
            for i, d in enumerate(dirs):
                fd, is_direct, note = open_unnamed(d, direct=direct)
                self.files.append(File(id=i, path=d, fd=fd, direct=is_direct, note=note))
        except BaseException:
            self.close()
            raise

    @property
    def virtual(self) -> bool:
        return self.files[0].fd < 0

    def allocate(self, nbytes: int) -> Slot:
        """A slot of at least ``nbytes`` (rounded up to 4 KiB).

        Raises:
            SpillSpaceError: no directory has room (ENOSPC or the file-size limit);
                the message names each directory and what it could not reserve.
        """
        need = align_up(max(nbytes, 1))
        with self._lock:
            if self._closed:
                raise SpillSpaceError("the spill store is closed (the offloader was detached)")
            problems = []
            # Least-loaded directory first (striping): its freed space, else grow it; a
            # directory that cannot grow passes the request on to the next one.
            for f in sorted(self.files, key=lambda f: f.allocated):
                off = f.take(need)
                if off is None:
                    try:
                        self._grow(f, need)
                    except OSError as exc:
                        f.full = True
                        problems.append(f"{f.path}: {os.strerror(exc.errno or errno.EIO)}")
                        continue
                    f.full = False
                    off = f.take(need)
                    assert off is not None, "a freshly grown file must fit the request"
                return Slot(f, off, need)
        raise SpillSpaceError(f"no room for {need} bytes in any spill directory ({'; '.join(problems)})")

    def free(self, slot: Slot) -> None:
        """Return a slot's range for reuse. Idempotence is the caller's job (free once)."""
        with self._lock:
            slot.file.give_back(slot.offset, slot.nbytes)
            slot.file.allocated -= slot.nbytes

    def allocated_bytes(self) -> int:
        with self._lock:
            return sum(f.allocated for f in self.files)

    def file_bytes(self) -> int:
        """Total size of the spill files (their high-water mark)."""
        with self._lock:
            return sum(f.size for f in self.files)

    def close(self) -> None:
        """Close (and so delete) the spill files. Outstanding slots become invalid."""
        with self._lock:
            self._closed = True
            for f in self.files:
                close_fd(f)

    def forget(self) -> None:
        """In a forked child: close this process's copies of the files, leaving the parent's intact.

        Takes no lock: another thread of the parent may have held it when the process forked."""
        self._closed = True
        for f in self.files:
            close_fd(f)

    def _grow(self, f: File, need: int) -> None:
        # Extend the file; if its tail is free, the new space merges with it.
        grow = max(GROW_BYTES, need)
        if f.fd >= 0:
            try:
                os.posix_fallocate(f.fd, f.size, grow)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG) and grow > need:
                    grow = need  # a nearly full drive may still hold this slot
                    os.posix_fallocate(f.fd, f.size, grow)
                elif exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                else:
                    os.ftruncate(f.fd, f.size + grow)  # no fallocate here: ENOSPC shows at write time
        f.give_back(f.size, grow)
        f.size += grow


def check_free_space(dirs: list[Path], reserve_bytes: int) -> None:
    """Raise :class:`SpillSpaceError` unless ``dirs`` have ``reserve_bytes`` free in total."""
    free = {d: free_bytes(d) for d in dirs}
    if sum(free.values()) < reserve_bytes:
        where = ", ".join(f"{d}: {n} bytes free" for d, n in free.items())
        raise SpillSpaceError(
            f"spill directories need {reserve_bytes} bytes but have {sum(free.values())} free ({where}); "
            f"free space, add a directory, or lower the amount offloaded"
        )


def free_bytes(d: Path) -> int:
    """Bytes of the filesystem under ``d`` available to this user (``statvfs``)."""
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


def open_unnamed(d: Path, *, direct: bool) -> tuple[int, bool, str]:
    """Open an unnamed 0600 file in ``d``: (fd, opened with O_DIRECT, note)."""
    base = os.O_RDWR | os.O_CLOEXEC
    attempts = [(base | os.O_DIRECT, True), (base, False)] if direct else [(base, False)]
    note = "" if direct else "O_DIRECT not requested"
    for flags, is_direct in attempts:
        try:
            return os.open(d, flags | os.O_TMPFILE | os.O_EXCL, 0o600), is_direct, note
        except OSError as exc:
            if exc.errno == errno.EINVAL and is_direct:
                note = f"{d} refused O_DIRECT ({_fstype(d)}); using buffered I/O"
                continue
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.ENOENT):
                raise
        # No O_TMPFILE on this filesystem: a named file unlinked at once (see _open_named).
        try:
            fd = _open_named(d, flags)
        except OSError as exc:
            if exc.errno == errno.EINVAL and is_direct:
                note = f"{d} refused O_DIRECT ({_fstype(d)}); using buffered I/O"
                continue
            raise
        return fd, is_direct, (note + "; " if note else "") + "no O_TMPFILE: named file unlinked at open"
    raise AssertionError("unreachable: the buffered attempt either returns or raises")


def _open_named(d: Path, flags: int) -> int:
    """Create a new 0600 file in ``d`` and unlink it, keeping the one descriptor it was created with.

    The file is created through a descriptor of ``d`` with ``O_CREAT | O_EXCL | O_NOFOLLOW``
    (so it is new, and ours); before the name is unlinked, ``fstat`` of our descriptor and
    ``lstat`` of the name must be the same file, and afterwards our file must have no name
    left. Another user who swapped the name for a file of theirs in between is caught.

    Raises:
        ConfigError: the name was replaced (someone else can rename files in ``d``).
        OSError: the file could not be created (``EINVAL``: no O_DIRECT here).
    """
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for _ in range(100):
            name = f".gds_offload-{secrets.token_hex(8)}"
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(errno.EEXIST, f"no free spill file name in {d} after 100 tries")
        try:
            ours = os.fstat(fd)
            there = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            same = (there.st_dev, there.st_ino) == (ours.st_dev, ours.st_ino)
            if same:
                os.unlink(name, dir_fd=dfd)
            if not same or os.fstat(fd).st_nlink != 0:
                raise ConfigError(
                    f"the spill file {d / name} was replaced by another file between its creation and its unlink: "
                    f"someone else can rename files in {d}. Use a private directory (0700) of your own"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd
    finally:
        os.close(dfd)


def _fstype(d: Path) -> str:
    """The filesystem type under ``d``, for the buffered-I/O note."""
    fstype = mount_of(d)[2]
    return "unknown filesystem" if fstype == "unknown" else fstype
