"""The spill store: where offloaded bytes live on disk.

One unnamed spill file per directory and process (``O_TMPFILE``, or a named file
unlinked right after it is created where the filesystem has no ``O_TMPFILE``; the
descriptor is the one that created it, checked to be that file), so a crash
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
import secrets
import stat
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gds_offload.errors import ConfigError, SpillSpaceError

__all__ = [
    "ALIGN",
    "DirCheck",
    "Origin",
    "Slot",
    "SpillFile",
    "SpillStore",
    "check_dir",
    "check_free_space",
    "default_spill_dir",
    "free_bytes",
    "open_unnamed",
    "prepare_dir",
    "spill_dir_origin",
]

ALIGN = 4096
#: The file grows by at least this much at a time, so fallocate is not called per tensor.
GROW_BYTES = 64 << 20


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


#: How a spill directory was chosen. It names the directory in messages, and decides the
#: ownership rule: the default directory must belong to the user (its name claims it does).
Origin = Literal["path", "--path", "GDS_OFFLOAD_DIR", "default"]

#: Filesystems that hold no files a spill could use (refused, with the fix).
PSEUDO_FSTYPES = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "devpts",
    "bpf", "pstore", "efivarfs", "fusectl", "mqueue", "binfmt_misc", "autofs", "rpc_pipefs", "nsfs",
})
#: Longest file name (bytes) and path (bytes, with the terminating NUL) Linux accepts.
NAME_MAX = 255
PATH_MAX = 4096


def spill_dir_origin(env: Mapping[str, str] | None = None) -> tuple[Path, Origin]:
    """The spill directory used when none is passed, and where it came from:
    ``$GDS_OFFLOAD_DIR`` (``"GDS_OFFLOAD_DIR"``), else a private ``gds_offload-<uid>``
    directory under the system temp dir (``"default"``).

    The one definition: ``gds-check``, the commands and ``attach()`` all call it.
    """
    env = os.environ if env is None else env
    explicit = env.get("GDS_OFFLOAD_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser(), "GDS_OFFLOAD_DIR"
    tmp = env.get("TMPDIR", "").strip() or tempfile.gettempdir()
    return Path(tmp) / f"gds_offload-{os.getuid()}", "default"


def default_spill_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$GDS_OFFLOAD_DIR``, else ``<tmp>/gds_offload-<uid>`` (see :func:`spill_dir_origin`)."""
    return spill_dir_origin(env)[0]


@dataclass(frozen=True)
class DirCheck:
    """What ``attach()`` would do with a spill directory, found without changing anything.

    Attributes:
        path: the directory as given.
        exists: it exists; when not, ``attach()`` creates it (mode 0700, parents as needed).
        create_under: when missing, the nearest existing ancestor (where it would be created).
        problem: the :class:`ConfigError` message ``attach()`` would raise; empty when usable.
        fix: its last part, what to do instead.
    """

    path: Path
    exists: bool
    create_under: Path | None = None
    problem: str = ""
    fix: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem


def _label(path: Path, origin: Origin) -> str:
    return {
        "path": f"path={str(path)!r}",
        "--path": f"--path {path}",
        "GDS_OFFLOAD_DIR": f"GDS_OFFLOAD_DIR={path}",
        "default": f"the default spill directory {path}",
    }[origin]


def _elsewhere(origin: Origin) -> str:
    """How to pick another directory, in the words of where this one came from."""
    return {
        "path": "pass another directory as path=",
        "--path": "pass another directory with --path",
        "GDS_OFFLOAD_DIR": "set GDS_OFFLOAD_DIR to another directory, or pass path= (--path for the commands)",
        "default": "choose another directory: set GDS_OFFLOAD_DIR, or pass path= (--path for the commands)",
    }[origin]


def mount_of(path: Path) -> tuple[str, str, str]:
    """(device, mount point, filesystem type) of the longest ``/proc/mounts`` entry holding
    ``path`` (resolved); ``("unknown", "", "unknown")`` when none can be read."""
    target = str(Path(path).resolve())
    best = ("unknown", "", "unknown")
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[1]):
                    best = (parts[0], mnt, parts[2])
    except OSError:
        pass
    return best


def _mount_fstype(real: Path) -> tuple[str, str]:
    """(filesystem type, mount point) holding ``real``; empty strings when unknown."""
    _, mnt, fstype = mount_of(real)
    return ("", "") if not mnt else (fstype, mnt)


def _filesystem_problem(real: Path) -> str:
    """Why the filesystem under the existing directory ``real`` cannot hold spill files, or ""."""
    fstype, mnt = _mount_fstype(real)
    top = real.parts[1] if len(real.parts) > 1 else ""
    if fstype in PSEUDO_FSTYPES or (not fstype and top in ("proc", "sys")):
        return f"is on {fstype or top} (mounted at {mnt or '/' + top}), a kernel interface that holds no files"
    try:
        if os.statvfs(real).f_flag & os.ST_RDONLY:
            return f"is on a read-only filesystem ({fstype or 'unknown'} at {mnt or '?'}), so it is not writable"
    except OSError:
        pass
    return ""


def check_dir(path: Path | str, *, origin: Origin = "path") -> DirCheck:
    """Decide whether ``attach()`` can spill to ``path``, without creating or changing anything.

    ``gds-check``, the commands and :func:`prepare_dir` (so ``attach()``) all call it: one
    truth. Refused, each with a message naming where the path came from and the fix: a name
    longer than the kernel accepts; a path that cannot be examined; a symlink owned by
    another user (root's are followed); anything under ``/proc``, ``/sys`` or another kernel
    interface; a non-directory; the default directory when another user owns it; a
    world-writable directory without the sticky bit; a read-only filesystem; a directory
    this process cannot write. A missing directory is fine when its nearest existing
    ancestor passes the same checks (``attach()`` creates it, 0700).
    """
    path = Path(path)
    label, other = _label(path, origin), _elsewhere(origin)
    for name in path.parts:
        if len(os.fsencode(name)) > NAME_MAX:
            why = (f"has a name of {len(os.fsencode(name))} bytes ({name[:24]}...); the kernel accepts at most "
                   f"{NAME_MAX} bytes per name")
            return DirCheck(path, False, problem=f"{label} {why}; {other}", fix=other)
    size = len(os.fsencode(os.path.abspath(path)))
    if size >= PATH_MAX:
        why = f"is {size} bytes long; the kernel accepts paths under {PATH_MAX} bytes"
        return DirCheck(path, False, problem=f"{label} {why}; {other}", fix=other)
    try:
        path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return _check_missing(path, origin)
    except OSError as exc:
        return DirCheck(path, False, problem=f"{label} cannot be examined ({exc.strerror or exc}); {other}", fix=other)
    refusal = _refusal(path, origin)
    if refusal is None:
        return DirCheck(path, True)
    return DirCheck(path, True, problem=f"{label} {refusal[0]}; {refusal[1]}", fix=refusal[1])


def _refusal(path: Path, origin: Origin) -> tuple[str, str] | None:
    """Why the existing ``path`` cannot be a spill directory, and the fix; None when it can."""
    uid, other = os.geteuid(), _elsewhere(origin)
    try:
        lst = path.lstat()
        st = path.stat()
    except OSError as exc:
        return f"cannot be followed ({exc.strerror or exc})", other
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (uid, 0):
        return (f"is a symlink owned by uid {lst.st_uid}, not by you (uid {uid}); refusing to follow it",
                f"pass the real directory instead, or {_short(other)}")
    real = Path(os.path.realpath(path))
    fs = _filesystem_problem(real)
    if fs and "read-only" not in fs:
        return fs, other
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory", f"pass a directory on an NVMe drive ({_short(other)})"
    mode = stat.S_IMODE(st.st_mode)
    if origin == "default" and (st.st_uid != uid or lst.st_uid != uid):
        owner = st.st_uid if st.st_uid != uid else lst.st_uid
        why = (f"belongs to uid {owner}, not to you (uid {uid}; mode {mode:o}): another user made it, and could "
               f"read or replace what is spilled there. Do not use it")
        return why, other
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        why = f"is world-writable (mode {mode:o}) without the sticky bit; other users could tamper with it"
        if st.st_uid == uid:
            return why, f"use a private directory (chmod 700 {path}), or {_short(other)}"
        return why, f"it belongs to uid {st.st_uid}: ask its owner for the sticky bit (chmod +t), or {_short(other)}"
    if fs:
        return fs, other
    if not os.access(path, os.W_OK | os.X_OK):
        why = f"is not writable by this process (uid {uid}, mode {mode:o}, owner uid {st.st_uid})"
        return why, (f"fix its permissions, or {_short(other)}" if st.st_uid == uid else other)
    return None


def _short(other: str) -> str:
    return other.removeprefix("choose another directory: ")


def _check_missing(path: Path, origin: Origin) -> DirCheck:
    """A missing directory: can it be created (0700) under its nearest existing ancestor?"""
    label, other = _label(path, origin), _elsewhere(origin)
    ancestor = Path(os.path.abspath(path)).parent
    while True:
        try:
            ancestor.lstat()
            break
        except (FileNotFoundError, NotADirectoryError):
            ancestor = ancestor.parent
        except OSError as exc:
            return DirCheck(path, False, problem=f"{label} does not exist, and {ancestor} cannot be examined "
                                                 f"({exc.strerror or exc}); {other}", fix=other)
    refusal = _refusal(ancestor, "path")
    if refusal is None:
        return DirCheck(path, False, ancestor)
    fix = other if "chmod" not in refusal[1] and "sticky" not in refusal[1] else f"{refusal[1].split(', or ')[0]}, or {_short(other)}"
    return DirCheck(path, False, ancestor, problem=f"{label} does not exist and cannot be created: {ancestor} {refusal[0]}; {fix}", fix=fix)


def prepare_dir(path: Path | str, *, create: bool, origin: Origin = "path") -> Path:
    """Validate a spill directory with :func:`check_dir` (creating it 0700 if missing and
    ``create``) and return it.

    Every directory it creates, parents included, is made 0700 whatever the umask; the new
    directory is then checked again, so one another user slipped in meanwhile is refused.

    Raises:
        ConfigError: what :func:`check_dir` found, or a missing directory without ``create``.
    """
    path = Path(path)
    found = check_dir(path, origin=origin)
    if found.problem:
        raise ConfigError(found.problem)
    if found.exists:
        return path
    label = _label(path, origin)
    if not create:
        raise ConfigError(f"{label} does not exist; create it, or pass an existing directory")
    assert found.create_under is not None, "a missing directory has an existing ancestor"
    todo = []
    p = Path(os.path.abspath(path))
    while p != found.create_under and p != p.parent:
        todo.append(p)
        p = p.parent
    for d in reversed(todo):
        _make_private_dir(d, label)
    again = check_dir(path, origin=origin)
    if again.problem or not again.exists:
        raise ConfigError(again.problem or f"{label} vanished right after it was created; pass another directory")
    return path


def _make_private_dir(d: Path, label: str) -> None:
    """``mkdir d`` with mode exactly 0700 (fchmod through a descriptor opened without following
    symlinks, so the umask cannot widen it and a swapped-in symlink is not chmod-ed)."""
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        return  # made by someone else meanwhile: check_dir judges it afterwards
    except OSError as exc:
        raise ConfigError(f"{label}: cannot create {d} ({exc.strerror or exc}); pass another directory") from None
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


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
        self.files: list[SpillFile] = []
        if not dirs:
            self.files.append(SpillFile(id=0, dir=None, note="virtual (no storage)"))
            return
        dirs = [prepare_dir(Path(d), create=create, origin=origin) for d in dirs]
        if reserve_bytes:
            check_free_space(dirs, reserve_bytes)
        try:
            for i, d in enumerate(dirs):
                fd, is_direct, note = open_unnamed(d, direct=direct)
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
