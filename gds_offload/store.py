"""The spill store: where offloaded bytes live on disk.

One unnamed spill file per directory and process (``O_TMPFILE``, or a named file
unlinked right after opening where the filesystem has no ``O_TMPFILE``), so a crash
or ``kill -9`` leaves nothing behind. A first-fit slot allocator with 4 KiB
alignment hands out byte ranges; freed ranges are coalesced and reused by the next
step, so the file stops growing once the working set is known. Space is reserved
with ``fallocate`` when the file grows: a full drive is found at allocation time,
while the tensor is still in memory, not half-way through a write.

Several directories are striped at tensor granularity: each allocation goes to the
directory with the fewest bytes allocated that still has room.

Metadata (offsets, sizes, checksums) lives in memory only; nothing on disk is
ever parsed, unpickled or executed.
"""
from __future__ import annotations

import bisect
import errno
import os
import stat
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gds_offload.errors import ConfigError, SpillSpaceError

__all__ = ["ALIGN", "Slot", "SpillFile", "SpillStore", "default_spill_dir", "prepare_dir"]

ALIGN = 4096
#: The file grows by at least this much at a time, so fallocate is not called per tensor.
GROW_BYTES = 64 << 20


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def default_spill_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$GDS_OFFLOAD_DIR``, else a private ``gds_offload-<uid>`` directory under the system temp dir.

    The one definition: ``gds-check`` and ``attach()`` both call it.
    """
    env = os.environ if env is None else env
    explicit = env.get("GDS_OFFLOAD_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    tmp = env.get("TMPDIR", "").strip() or tempfile.gettempdir()
    return Path(tmp) / f"gds_offload-{os.getuid()}"


def prepare_dir(path: Path, *, create: bool) -> Path:
    """Validate a spill directory (creating it 0700 if ``create``) and return it.

    Refuses, with a message naming the path and the fix: a missing directory (unless
    ``create``), a non-directory, a symlink owned by another user, a world-writable
    directory without the sticky bit, and a directory this process cannot write.
    """
    path = Path(path)
    try:
        lst = path.lstat()
    except FileNotFoundError:
        if not create:
            raise ConfigError(f"spill path {path} does not exist; create it or pass an existing directory") from None
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        lst = path.lstat()
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (os.getuid(), 0):
        raise ConfigError(
            f"spill path {path} is a symlink owned by uid {lst.st_uid}, not by you (uid {os.getuid()}); "
            f"refusing to follow it. Pass the real directory instead"
        )
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"spill path {path} is not a directory; pass a directory on an NVMe drive")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(
            f"spill path {path} is world-writable (mode {stat.S_IMODE(st.st_mode):o}) without the sticky bit; "
            f"other users could tamper with it. Use a private directory (chmod 700 {path})"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"spill path {path} is not writable by this process; fix its permissions or pass another path")
    return path


@dataclass(frozen=True, slots=True)
class Slot:
    """A byte range of a spill file. ``nbytes`` is a multiple of :data:`ALIGN`."""

    file: SpillFile
    offset: int
    nbytes: int


@dataclass(eq=False)
class SpillFile:
    """One unnamed spill file (or, for engines that need no files, a virtual one: ``fd == -1``)."""

    id: int
    dir: Path | None
    fd: int = -1
    #: Opened with O_DIRECT.
    direct: bool = False
    #: Why not O_DIRECT, or how the file was made unnamed.
    note: str = ""
    size: int = 0
    allocated: int = 0
    full: bool = False
    _free: list[tuple[int, int]] = field(default_factory=list)  # sorted (offset, length)

    @property
    def proc_path(self) -> str:
        """A path that reopens this unnamed file (for libraries that take paths, such as KvikIO)."""
        return f"/proc/self/fd/{self.fd}"

    def describe(self) -> str:
        return f"spill file #{self.id} in {self.dir}" if self.dir else f"host buffer pool #{self.id}"

    # The allocator. Caller holds the store's lock.
    def take(self, nbytes: int) -> int | None:
        for i, (off, length) in enumerate(self._free):
            if length >= nbytes:
                if length == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (off + nbytes, length - nbytes)
                self.allocated += nbytes
                return off
        return None

    def give_back(self, off: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._free, (off, 0))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # merge with left
            i -= 1
            off, nbytes = self._free[i][0], self._free[i][1] + nbytes
            del self._free[i]
        if i < len(self._free) and off + nbytes == self._free[i][0]:  # merge with right
            nbytes += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (off, nbytes))

    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)


class SpillStore:
    """Slots in spill files, striped over ``dirs``. Thread-safe.

    Args:
        dirs: spill directories (one per drive). Empty for a virtual store (``host`` engine).
        direct: open files with ``O_DIRECT`` where the filesystem accepts it.
        reserve_bytes: bytes that must be free in total at start (0: no check).
        create_default: create a missing directory (only for the default path).
    """

    def __init__(
        self,
        dirs: list[Path],
        *,
        direct: bool = True,
        reserve_bytes: int = 0,
        create_default: bool = False,
    ) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self.files: list[SpillFile] = []
        if not dirs:
            self.files.append(SpillFile(id=0, dir=None, note="virtual (no storage)"))
            return
        dirs = [prepare_dir(Path(d), create=create_default) for d in dirs]
        if reserve_bytes:
            check_free_space(dirs, reserve_bytes)
        try:
            for i, d in enumerate(dirs):
                fd, is_direct, note = _open_unnamed(d, direct=direct)
                self.files.append(SpillFile(id=i, dir=d, fd=fd, direct=is_direct, note=note))
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
                        problems.append(f"{f.dir}: {os.strerror(exc.errno or errno.EIO)}")
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
                if f.fd >= 0:
                    os.close(f.fd)
                    f.fd = -1

    def forget(self) -> None:
        """In a forked child: close this process's copies of the files, leaving the parent's intact.

        Takes no lock: another thread of the parent may have held it when the process forked."""
        self._closed = True
        for f in self.files:
            if f.fd >= 0:
                os.close(f.fd)
                f.fd = -1

    def _grow(self, f: SpillFile, need: int) -> None:
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
    free = {d: _free_bytes(d) for d in dirs}
    if sum(free.values()) < reserve_bytes:
        where = ", ".join(f"{d}: {n} bytes free" for d, n in free.items())
        raise SpillSpaceError(
            f"spill directories need {reserve_bytes} bytes but have {sum(free.values())} free ({where}); "
            f"free space, add a directory, or lower the amount offloaded"
        )


def _free_bytes(d: Path) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


def _open_unnamed(d: Path, *, direct: bool) -> tuple[int, bool, str]:
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
        # No O_TMPFILE on this filesystem: a named file unlinked at once.
        fd_, name = tempfile.mkstemp(prefix=".gds_offload-", dir=d)
        os.close(fd_)
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno == errno.EINVAL and is_direct:
                note = f"{d} refused O_DIRECT ({_fstype(d)}); using buffered I/O"
                continue
            raise
        finally:
            os.unlink(name)
        return fd, is_direct, (note + "; " if note else "") + "no O_TMPFILE: named file unlinked at open"
    raise AssertionError("unreachable: the buffered attempt either returns or raises")


def _fstype(d: Path) -> str:
    best, fstype = "", "unknown filesystem"
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and str(d.resolve()).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return fstype
