"""The decision: what the offloader can do at a spill directory, and why.

:func:`node_verdict` (one path) or :func:`~gds_offload.node.collect.collect_node` plus
:func:`decide` (several paths, as the CLI does) give a :class:`Verdict`:

* ``gds``: the direct GPU<->NVMe path will be used;
* ``compat``: offloading works, through a bounce buffer or on CPU; the reason names
  the first missing piece;
* ``unusable``: the offloader cannot work at this path.

The offloader's ``mode="auto"`` and ``gds-check`` both decide here, so they never
disagree. The checks themselves are in :mod:`~gds_offload.node.findings`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Mapping, Sequence

from gds_offload.io.directory import Origin
from gds_offload.node.collect import DEFAULT_PROBES, NodeReport, Probes, collect_node
from gds_offload.node.findings import (
    CheckResult,
    Finding,
    affinity_findings,
    driver_finding,
    node_findings,
    path_findings,
    recommendation_findings,
)

__all__ = ["Mode", "Verdict", "decide", "report_checks", "worst_verdict", "node_verdict"]

Mode = Literal["gds", "compat", "unusable"]


@dataclass(frozen=True)
class Verdict:
    """What the offloader will do at a path, and why.

    Attributes:
        mode: ``gds`` (direct path), ``compat`` (bounce buffer or CPU) or ``unusable``.
        reason: one line; for ``compat``/``unusable`` it names the first missing piece.
        fix: one line saying what to change (or that nothing needs changing).
        checks: every check that led here, in report order.
    """

    mode: Mode
    reason: str
    fix: str
    checks: tuple[CheckResult, ...]


def _findings_for(report: NodeReport, index: int) -> list[Finding]:
    """Every finding for ``report.paths[index]``, in blocking order (node, path, driver, affinity)."""
    path = report.paths[index]
    found = node_findings(report) + path_findings(report, path)
    found.append(driver_finding(report))
    found.extend(affinity_findings(report, path))
    found.extend(recommendation_findings(report))
    return found


def decide(report: NodeReport, index: int = 0) -> Verdict:
    """The verdict for ``report.paths[index]``.

    ``unusable`` when the first path finding that blocks usability fires (missing and
    not creatable, not a directory, read-only mount, not writable, no free space);
    otherwise ``compat`` with the first GDS blocker in this order: GPU, libcufile,
    KvikIO, KVIKIO_COMPAT_MODE/CUFILE_FORCE_COMPAT_MODE, WSL, nvidia-fs, its device
    nodes, /run/udev, cufile.json force_compat_mode, filesystem type, O_DIRECT, NVMe
    device, cufile.json denylist, and (when the report was made with
    ``probe_driver``) the KvikIO driver probe; otherwise ``gds``.

    Args:
        report: from :func:`collect_node`.
        index: which spill directory.

    Returns:
        The verdict, with every check.

    Raises:
        IndexError: ``index`` is out of range for ``report.paths`` (a caller bug).
    """
    if not 0 <= index < len(report.paths):
        raise IndexError(f"index={index} out of range: the report has {len(report.paths)} path(s)")
    found = _findings_for(report, index)
    checks = tuple(f.check for f in found)
    fatal = next((f for f in found if f.blocks == "usable"), None)
    if fatal is not None:
        return Verdict("unusable", fatal.reason, fatal.fix, checks)
    blocker = next((f for f in found if f.blocks == "gds"), None)
    if blocker is not None:
        return Verdict("compat", blocker.reason, blocker.fix, checks)
    path = report.paths[index]
    reason = (f"GPU, libcufile, nvidia-fs and KvikIO present; {path.path} is {path.fstype}"
              f"{' on ' + path.device.disk if path.device and path.device.disk else ''} with O_DIRECT")
    if not report.probe_driver:
        reason += " (cuFile driver not probed)"
    return Verdict("gds", reason, "nothing to fix: mode='auto' will use GPUDirect Storage", checks)


def report_checks(report: NodeReport) -> tuple[CheckResult, ...]:
    """Every check of a multi-path report, node checks once, then each path's.

    With several paths, path checks are named ``name@path``. With one path this is
    ``decide(report).checks``.

    Args:
        report: from :func:`collect_node`.

    Returns:
        The checks in report order.
    """
    if len(report.paths) == 1:
        return tuple(f.check for f in _findings_for(report, 0))
    checks = [f.check for f in node_findings(report)]
    checks.append(driver_finding(report).check)
    for path in report.paths:
        for f in path_findings(report, path) + affinity_findings(report, path):
            checks.append(replace(f.check, name=f"{f.check.name}@{path.path}"))
    checks.extend(f.check for f in recommendation_findings(report))
    return tuple(checks)


_SEVERITY = {"gds": 0, "compat": 1, "unusable": 2}


def worst_verdict(verdicts: Sequence[Verdict]) -> Verdict:
    """The most severe of several verdicts (``unusable`` > ``compat`` > ``gds``); first wins ties.

    Args:
        verdicts: at least one.

    Returns:
        That verdict.

    Raises:
        ValueError: ``verdicts`` is empty.
    """
    if not verdicts:
        raise ValueError("worst_verdict needs at least one verdict, got none")
    return max(verdicts, key=lambda v: _SEVERITY[v.mode])


def node_verdict(
    path: Path,
    *,
    root: Path = Path("/"),
    env: Mapping[str, str] | None = None,
    probe_driver: bool = True,
    timeout_s: float = 10.0,
    probes: Probes = DEFAULT_PROBES,
    origin: Origin = "--path",
) -> Verdict:
    """Decide what the offloader can do at ``path`` on this node.

    The offloader's ``mode="auto"`` and ``gds-check`` both call this. It never raises
    for node problems: they become checks and a verdict.

    Args:
        path: the spill directory (never created; a missing one is judged as attach would create it).
        root: root of the ``/proc``, ``/sys``, ``/etc``, ``/dev``, ``/run`` trees.
        env: environment; ``os.environ`` when None.
        probe_driver: let a child process open the cuFile driver through KvikIO (it
            can hang without a working NVIDIA driver; the child is killed after
            ``timeout_s``).
        timeout_s: limit for that child.
        probes: boundary functions (replace them in tests to simulate a node).
        origin: where ``path`` came from, as the directory verdict names it.

    Returns:
        ``gds``, ``compat`` or ``unusable`` with a one-line reason and fix.

    Example:
        >>> v = node_verdict(Path("/mnt/nvme/spill"))  # doctest: +SKIP
        >>> v.mode, v.reason
        ('compat', 'no GPU (torch.cuda.is_available() is False ...)')
    """
    report = collect_node([path], root=root, env=env, probe_driver=probe_driver,
                          timeout_s=timeout_s, probes=probes, origin=origin)
    return decide(report, 0)
