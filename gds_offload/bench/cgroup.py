"""A memory cap for one benchmark child: a cgroup v1 memory group of its own.

:class:`MemoryCap` creates ``gds_offload-bench-<parent pid>-t<its start time>-<n>`` inside the
memory group the caller itself runs in (:func:`own_memory_cgroup`), sets
``memory.limit_in_bytes``, and moves one process (the child, by its pid; never the caller)
into it with :meth:`MemoryCap.add`. Being below the caller's group, the child's memory also
counts against every limit above it: a cap larger than the caller's own limit cannot lift
the child out of it. In cgroup v1 the page cache a process fills is charged to its group, so
under the cap a mode that reads through the page cache (Accelerate's disk offload) really
reads the drive once the cap is reached. After the child exited, :meth:`MemoryCap.close`
reads the peak and removes the group.

A parent killed with ``SIGKILL`` cannot remove its group; :func:`remove_stale_groups`, run at
the start of every capped benchmark, removes the groups of parents that are gone (the name
says whose a group is; its start time tells a reused pid apart).

Needs root (or a delegated memory hierarchy) and cgroup v1; :func:`check_limit` says why a
limit cannot be had, before any child starts.
"""
from __future__ import annotations

import errno
import itertools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from gds_offload.errors import ConfigError

__all__ = ["MemoryCap", "CapReport", "MIN_LIMIT_BYTES", "cap_available", "check_limit", "own_memory_cgroup",
           "remove_stale_groups", "CGROUP_V1_MEMORY"]  # fmt: skip

CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
#: The smallest cap: a Python child cannot start under less.
MIN_LIMIT_BYTES = 64 << 20
_counter = itertools.count()
#: A group's name: the pid of the process that made it, that process's start time (clock ticks
#: after boot; absent in groups of older versions), and a counter.
_NAME = re.compile(r"gds_offload-bench-(\d+)(?:-t(\d+))?-(\d+)")


def cap_available(root: Path = CGROUP_V1_MEMORY) -> tuple[bool, str]:
    """``(usable, reason)``: whether a memory group can be made under ``root``."""
    if not (root / "cgroup.procs").is_file():
        return False, f"no cgroup v1 memory hierarchy at {root}"
    if not os.access(root, os.W_OK):
        return False, f"{root} is not writable (needs root)"
    return True, f"cgroup v1 at {root}"


def check_limit(limit_bytes: int, *, root: Path = CGROUP_V1_MEMORY, name: str = "limit_bytes") -> None:
    """Refuse a memory cap that cannot be had, before any child starts. ``name`` names the value
    in the message (``--memory-limit 1MiB`` for the commands).

    Raises:
        ConfigError: ``limit_bytes`` is not a positive int (0 is not "no cap"), is under
            :data:`MIN_LIMIT_BYTES`, or no memory group can be made here (no cgroup v1, not
            root, or the caller's own group is not found under ``root``).
    """
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
        raise ConfigError(f"{name}: a memory cap must be a positive size such as 1.2GiB; "
                          f"0 is not 'no cap': leave the cap out to run uncapped")  # fmt: skip
    if limit_bytes < MIN_LIMIT_BYTES:
        raise ConfigError(f"{name}: {limit_bytes} bytes is below 64 MiB; a Python child cannot start under it. Pass at least 64MiB")
    ok, why = cap_available(root)
    if not ok:
        raise ConfigError(f"{name}: cannot cap memory: {why}; run without a memory cap, or as root on a cgroup v1 host")
    own_memory_cgroup(root)


def own_memory_cgroup(root: Path = CGROUP_V1_MEMORY) -> Path:
    """The directory under ``root`` of the memory group this process runs in.

    ``/proc/self/cgroup``'s ``memory`` line names the group from the hierarchy's top; when
    ``root`` is mounted from a subtree of it (a container's own group, ``/proc/self/mountinfo``),
    the path is taken relative to that subtree.

    Raises:
        ConfigError: no memory controller line, or the group is not under ``root``.
    """
    group = None
    for line in _read("/proc/self/cgroup").splitlines():
        parts = line.split(":", 2)  # hierarchy id : controllers : path
        if len(parts) == 3 and "memory" in parts[1].split(","):
            group = parts[2].strip()
    if group is None:
        raise ConfigError("cannot cap memory: /proc/self/cgroup has no memory controller line; run without a memory cap")
    top = _mount_root(root)
    rel = os.path.relpath(group, top) if top != "/" else group.lstrip("/")
    where = root / rel if rel not in ("", ".") else root
    if rel.startswith("..") or not where.is_dir():
        raise ConfigError(f"cannot cap memory: this process's memory group {group} is not visible under {root} "
                          f"(mounted from {top}); run without a memory cap")  # fmt: skip
    return where


def _mount_root(root: Path) -> str:
    """The subtree of the hierarchy mounted at ``root`` (field 4 of its ``/proc/self/mountinfo`` line); "/" if none found."""
    for ln in _read("/proc/self/mountinfo").splitlines():
        fields = ln.split()
        if len(fields) > 4 and fields[4] == str(root):
            return fields[3]
    return "/"


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/<pid>/stat`` field 22);
    ``None`` when there is no such process or it is a zombie (it will never remove a group)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def remove_stale_groups(root: Path = CGROUP_V1_MEMORY) -> list[str]:
    """Remove the memory groups of benchmark parents that are gone (a ``SIGKILL`` leaves them).

    Every ``gds_offload-bench-<pid>-t<start>-<n>`` group under ``root`` (wherever in the
    hierarchy) whose ``<pid>`` is no live process started at ``<start>`` is removed (groups of
    older versions, without ``t<start>``: whose pid is not alive). The group of a live parent is
    never touched, and the kernel refuses to remove one that still holds processes: such a
    group is left and named. Pids are this pid namespace's: benchmarks sharing one hierarchy
    should run in one pid namespace. Returns one line per group removed or left; nothing when
    ``root`` is no usable hierarchy.
    """
    if not cap_available(root)[0]:
        return []
    said = []
    for top, dirs, _files in os.walk(root):
        for d in list(dirs):
            m = _NAME.fullmatch(d)
            if m is None:
                continue
            dirs.remove(d)  # a benchmark group holds no groups of its own
            pid, start = int(m.group(1)), m.group(2)
            alive = _start_ticks(pid)
            if alive is not None and (start is None or int(start) == alive):
                continue
            path = Path(top) / d
            try:
                path.rmdir()
            except FileNotFoundError:
                continue  # its parent closed it meanwhile
            except OSError as exc:
                procs = " ".join(_read(path / "cgroup.procs").split()) or "none listed"
                why = "it still holds processes" if exc.errno == errno.EBUSY else exc.strerror
                said.append(f"memory group {path} of benchmark parent {pid} (gone) left in place: {why} (pids: {procs})")
                continue
            said.append(f"removed the memory group {path} left by benchmark parent {pid}, which is gone (killed without cleaning up)")
    return said


@dataclass(frozen=True)
class CapReport:
    """What the group saw: its limit, peak usage (process memory plus page cache) and limit hits."""

    limit_bytes: int
    peak_bytes: int | None
    failcnt: int | None


class MemoryCap:
    """One memory group with a limit. Use: ``cap = MemoryCap(n)``, start the child, ``cap.add(child.pid)``,
    let it run, wait for it, ``cap.close()``.

    Raises:
        ConfigError: no cgroup v1 memory hierarchy here, or it is not writable.
    """

    def __init__(self, limit_bytes: int, *, root: Path = CGROUP_V1_MEMORY) -> None:
        check_limit(limit_bytes, root=root)
        self.limit_bytes = limit_bytes
        #: The group this process runs in: the new one is made inside it, under its limits.
        self.parent = own_memory_cgroup(root)
        me = os.getpid()
        self.path = self.parent / f"gds_offload-bench-{me}-t{_start_ticks(me)}-{next(_counter)}"
        try:
            self.path.mkdir()
        except OSError as exc:
            raise ConfigError(f"cannot cap memory: cannot create {self.path} ({exc.strerror}); run without a memory cap") from None
        try:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():  # no swapping out to get under the cap
                swap.write_text(str(limit_bytes))
        except OSError:
            self.path.rmdir()
            raise

    def add(self, pid: int) -> None:
        """Move process ``pid`` (the child's: never the caller's own) into the group."""
        if pid == os.getpid():
            raise ConfigError("MemoryCap.add: refusing to cap the calling process itself; pass the child's pid")
        (self.path / "cgroup.procs").write_text(str(pid))

    def report(self) -> CapReport:
        return CapReport(self.limit_bytes, _read_int(self.path / "memory.max_usage_in_bytes"), _read_int(self.path / "memory.failcnt"))

    def close(self) -> CapReport:
        """The group's report; then remove it (its processes must have exited). Idempotent enough:
        a group already gone reports ``None`` figures."""
        rep = self.report()
        for _ in range(50):  # the kernel may take a moment to drop an exited task from the group
            try:
                self.path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
        return rep


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
