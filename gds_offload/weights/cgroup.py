"""A memory cap for one benchmark child: a cgroup v1 memory group of its own.

:class:`MemoryCap` creates ``/sys/fs/cgroup/memory/gds_offload-bench-<parent pid>-<n>``,
sets ``memory.limit_in_bytes``, and moves one process (the child, by its pid; never the
caller) into it with :meth:`MemoryCap.add`. In cgroup v1 the page cache a process fills
is charged to its group, so under the cap a mode that reads through the page cache
(Accelerate's disk offload) really reads the drive once the cap is reached. After the
child exited, :meth:`MemoryCap.close` reads the peak and removes the group.

Needs root (or a delegated memory hierarchy) and cgroup v1; :func:`cap_available` says
why not otherwise.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gds_offload.errors import ConfigError

__all__ = ["MemoryCap", "CapReport", "ChildRun", "cap_available", "run_capped", "serve_child", "CGROUP_V1_MEMORY"]

CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
_counter = itertools.count()


def cap_available(root: Path = CGROUP_V1_MEMORY) -> tuple[bool, str]:
    """``(usable, reason)``: whether a memory group can be made under ``root``."""
    if not (root / "cgroup.procs").is_file():
        return False, f"no cgroup v1 memory hierarchy at {root}"
    if not os.access(root, os.W_OK):
        return False, f"{root} is not writable (needs root)"
    return True, f"cgroup v1 at {root}"


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
        ok, why = cap_available(root)
        if not ok:
            raise ConfigError(f"cannot cap memory: {why}; run without --memory-limit, or as root on a cgroup v1 host")
        if limit_bytes < 64 << 20:
            raise ConfigError(f"memory limit {limit_bytes} bytes is below 64 MiB; a Python child cannot start under it")
        self.limit_bytes = limit_bytes
        self.path = root / f"gds_offload-bench-{os.getpid()}-{next(_counter)}"
        self.path.mkdir()
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


@dataclass(frozen=True)
class ChildRun:
    """A benchmark child that has exited: its status, what it printed, and its group's report."""

    returncode: int
    out: str
    err: str
    cap: CapReport | None


def run_capped(cmd: list[str], *, env: dict[str, str], memory_limit: int | None, timeout_s: float) -> ChildRun:
    """Run ``cmd`` in a child (under a :class:`MemoryCap` of ``memory_limit`` bytes when given) and
    wait for it. The child must wait for one line on its stdin before it starts work: it gets it
    once it is in its group, so nothing it does runs uncapped. A child past ``timeout_s`` is killed."""
    from gds_offload.bench.children import reap, spawn

    cap = MemoryCap(memory_limit) if memory_limit else None
    try:
        proc = spawn(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    except BaseException:
        if cap is not None:
            cap.close()
        raise
    try:
        if cap is not None:
            cap.add(proc.pid)
        out, err = proc.communicate("go\n", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err = f"timed out after {timeout_s} s\n" + err
    finally:
        reap(proc)  # a no-op once it has exited; on a stop signal it stops the child first
        rep = cap.close() if cap is not None else None
    return ChildRun(proc.returncode, out, err, rep)


def serve_child(argv: list[str], spec_type: Callable[..., Any], run: Callable[[Any], Iterable[Any]], prefix: str) -> int:
    """The child's side of :func:`run_capped`: ``argv[0]`` is its spec as JSON (``batch_sizes`` a
    list); it waits for the parent's line on stdin (it is in its group then), then prints each
    dataclass ``run(spec)`` yields as one ``prefix``-ed JSON line."""
    import json
    from dataclasses import asdict

    from gds_offload.bench.children import die_with_parent

    die_with_parent()  # a parent killed without a chance to reap leaves no child running on
    spec_d = json.loads(argv[0])
    spec = spec_type(**(spec_d | {"batch_sizes": tuple(spec_d["batch_sizes"])}))
    sys.stdin.readline()
    for r in run(spec):
        print(prefix + json.dumps(asdict(r)), flush=True)
    return 0


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
