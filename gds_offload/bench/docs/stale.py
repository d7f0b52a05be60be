"""Whether a result file still measures the code: the paths each benchmark exercises, and the
commits that changed them since a result's commit.

Every result file names the commit it was measured at (``commit``) and the source paths its
figures depend on (``exercises``, from :data:`EXERCISES` by the command that wrote it). A
result is *stale* when ``git log <commit>..HEAD -- <exercises>`` lists a commit: the code it
measures changed after it was measured, so its figures may no longer be what that code
does. ``gds-offload report --check`` fails on a stale result (:func:`freshness`).

Older result files record no ``exercises``; their paths are taken from :data:`EXERCISES` by
the subcommand of their ``command``. A result that cannot be checked (no git checkout, its
commit not in this clone, an unknown command) is reported as such, not as stale.
"""
from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gds_offload.bench.docs.report import Section

__all__ = ["EXERCISES", "Freshness", "exercised_paths", "freshness"]

_IO = ("gds_offload/io",)
_WEIGHTS = ("gds_offload/weights", "gds_offload/activations", *_IO, "gds_offload/runtime", "gds_offload/bench/weights",
            "gds_offload/bench/procs.py", "gds_offload/bench/cgroup.py", "gds_offload/bench/raw_io.py")  # fmt: skip

#: The source paths (files or folders, from the repository root) whose code each result-writing
#: subcommand of ``gds-offload`` measures: the library it runs and the benchmark code that
#: runs and measures it, not the code that renders the page. ``tests/test_report.py`` checks
#: that every path exists.
EXERCISES: dict[str, tuple[str, ...]] = {
    "bench": ("gds_offload/activations", *_IO, "gds_offload/models", "gds_offload/bench/train", "gds_offload/bench/procs.py"),
    "bench-weights": _WEIGHTS,
    "bench-finetune": _WEIGHTS,
    "bench-plan": (*_WEIGHTS, "gds_offload/bench/plan"),
    "shards": ("gds_offload/data", *_IO, "gds_offload/models", "gds_offload/bench/data", "gds_offload/bench/train"),
}


def exercised_paths(subcommand: str) -> list[str]:
    """The paths a result of ``gds-offload <subcommand>`` measures (:data:`EXERCISES`), for its ``exercises`` key.

    Raises:
        KeyError: ``subcommand`` writes no result file; add it to :data:`EXERCISES`.
    """
    if subcommand not in EXERCISES:
        raise KeyError(f"gds-offload {subcommand} has no entry in EXERCISES ({', '.join(EXERCISES)}); add the paths it measures")
    return list(EXERCISES[subcommand])


def _subcommand(command: str) -> str | None:
    """The ``gds-offload`` subcommand of a recorded command line (its first word after the program), if known."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    return next((w for w in words[1:2] if w in EXERCISES), None)


@dataclass(frozen=True)
class Freshness:
    """One result file against the code it measures."""

    #: The result file.
    path: Path
    #: The commit it was measured at, as recorded (``None``: not recorded).
    commit: str | None
    #: The paths its figures depend on (recorded, or from :data:`EXERCISES` by its command).
    exercises: tuple[str, ...]
    #: ``<hash> <subject>`` of each commit since ``commit`` that changed one of ``exercises``, newest first.
    changes: tuple[str, ...] = ()
    #: Why it could not be checked ("" when it was).
    unchecked: str = ""

    @property
    def stale(self) -> bool:
        return bool(self.changes)

    def line(self) -> str:
        """One line for the terminal: why it is stale, or why it was not checked, or that it is current."""
        if self.unchecked:
            return f"{self.path.name}: not checked: {self.unchecked}"
        if not self.stale:
            return f"{self.path.name}: current (measured at {self.commit})"
        newest = self.changes[0].split(" ", 1)[0]
        more = f" and {len(self.changes) - 1} more" if len(self.changes) > 1 else ""
        return (f"{self.path.name}: stale: measured at {self.commit}, and {newest}{more} changed {', '.join(self.exercises)} since; "
                f"rerun its command")  # fmt: skip


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None


def _check(section: Section, repo: Path) -> Freshness:
    doc: dict[str, Any] = section.doc
    commit, recorded = doc.get("commit"), doc.get("exercises")
    sub = _subcommand(str(doc.get("command") or ""))
    paths = tuple(recorded) if recorded else tuple(EXERCISES[sub]) if sub else ()

    def unchecked(why: str) -> Freshness:
        return Freshness(section.path, commit, paths, unchecked=why)

    if not paths:
        return unchecked(f"no 'exercises' recorded, and {doc.get('command')!r} names no known subcommand")
    if not commit:
        return unchecked("no commit recorded")
    rev = str(commit).removesuffix("+dirty")
    known = _git(repo, "cat-file", "-e", f"{rev}^{{commit}}")
    if known is None or known.returncode:
        return unchecked(f"commit {rev} is not in this clone (a shallow clone?)")
    log = _git(repo, "log", "--format=%h %s", f"{rev}..HEAD", "--", *paths)
    if log is None or log.returncode:
        return unchecked(f"git log failed: {log.stderr.strip() if log else 'git did not run'}")
    return Freshness(section.path, commit, paths, changes=tuple(log.stdout.splitlines()))


def freshness(sections: list[Section], results_dir: Path) -> list[Freshness]:
    """Each section's result against the commits of the git checkout that holds ``results_dir``.

    Never raises: outside a checkout (or without git) every result is unchecked, with why.
    """
    top = _git(results_dir, "rev-parse", "--show-toplevel")
    if top is None or top.returncode:
        return [Freshness(s.path, s.doc.get("commit"), (), unchecked=f"{results_dir} is not in a git checkout") for s in sections]
    repo = Path(top.stdout.strip())
    return [_check(s, repo) for s in sections]
