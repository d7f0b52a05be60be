"""The spill directory: which one, whether it is safe to spill to, and creating it.

One truth for ``attach()``, ``gds-check`` and the commands: :func:`spill_dir_origin` names
the default, :func:`check_dir` judges a directory without changing anything, and
:func:`prepare_dir` creates a missing one (0700, parents included) and judges it again.
The spill files inside it are :mod:`gds_offload.io.spill`'s. The weight benchmarks' working
directory (``--workdir``, and its private default) is judged by the same rules.
"""
from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gds_offload.errors import ConfigError

__all__ = [
    "DirCheck",
    "Origin",
    "PSEUDO_FSTYPES",
    "check_dir",
    "default_spill_dir",
    "missing_parent",
    "mount_of",
    "prepare_dir",
    "spill_dir_origin",
]

#: How a spill directory (or a benchmark's working directory: ``--workdir``) was chosen. It
#: names the directory in messages, and decides the ownership rule: a default directory must
#: belong to the user (its name claims it does).
Origin = Literal["path", "--path", "GDS_OFFLOAD_DIR", "default", "--workdir", "default --workdir"]
#: The origins whose directory must be the user's own.
_DEFAULTS = ("default", "default --workdir")
#: The origins created with their missing parents: the defaults, and ``$GDS_OFFLOAD_DIR`` (the
#: default a user sets once). A path given to one call or command must have its parent already.
_MAKE_PARENTS = ("default", "default --workdir", "GDS_OFFLOAD_DIR")

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
        exists: it exists; when not, ``attach()`` creates it (mode 0700; parents as needed for the
            default and ``$GDS_OFFLOAD_DIR``, else only when its parent exists).
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
        "--workdir": f"--workdir {path}",
        "default --workdir": f"the default working directory {path}",
    }[origin]


def _elsewhere(origin: Origin) -> str:
    """How to pick another directory, in the words of where this one came from."""
    return {
        "path": "pass another directory as path=",
        "--path": "pass another directory with --path",
        "GDS_OFFLOAD_DIR": "set GDS_OFFLOAD_DIR to another directory, or pass path= (--path for the commands)",
        "default": "choose another directory: set GDS_OFFLOAD_DIR, or pass path= (--path for the commands)",
        "--workdir": "pass another directory with --workdir",
        "default --workdir": "choose another directory: pass --workdir",
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


def missing_parent(path: Path | str) -> str | None:
    """Why ``path`` should not be created: its parent directory does not exist. The words name the
    nearest existing parent and the filesystem it is on, where a mistyped drive (``/mnt/nvme9/store``)
    would have been made. ``None`` when the parent exists (or ``path`` itself does).
    """
    p = Path(os.path.abspath(os.path.expanduser(path)))
    if os.path.lexists(p) or os.path.lexists(p.parent):  # a parent that is a file: the callers say "cannot be created"
        return None
    ancestor = p.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    device, mnt, fstype = mount_of(ancestor)
    root = ": the root filesystem" if mnt == "/" else ""
    where = f"on {device} ({fstype}, mounted at {mnt}{root})" if mnt else "on an unknown filesystem"
    return (f"its parent {p.parent} does not exist; the nearest existing parent is {ancestor}, {where}, where a "
            f"mistyped drive would land. Create {p.parent} first if that is meant, or correct the path")


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
    this process cannot write; a missing directory given by the caller (``path=``, ``--path``,
    ``--workdir``) whose parent is missing too (:func:`missing_parent`: a mistyped drive). A
    missing directory is fine when its nearest existing ancestor passes the same checks
    (``attach()`` creates it, 0700; the default and ``$GDS_OFFLOAD_DIR`` with their parents).
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
    if origin in _DEFAULTS and (st.st_uid != uid or lst.st_uid != uid):
        owner = st.st_uid if st.st_uid != uid else lst.st_uid
        what = "is spilled" if origin == "default" else "is read and written"
        why = (f"belongs to uid {owner}, not to you (uid {uid}; mode {mode:o}): another user made it, and could "
               f"read or replace what {what} there. Do not use it")
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
    no_parent = None if origin in _MAKE_PARENTS else missing_parent(path)
    if no_parent is not None:
        return DirCheck(path, False, problem=f"{label}: {no_parent}", fix=other)
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
