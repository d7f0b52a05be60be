"""What a run's skips lost, grouped by why: missing hardware, missing privileges, or anything
else (a package, a build step, a version), which a complete set-up should not skip. The suite's
``conftest.py`` prints the groups at the end of every run; with ``GDS_OFFLOAD_STRICT_SKIPS=1``
a skip of the third kind fails the run."""
from __future__ import annotations

import re
from collections import Counter

__all__ = ["GROUPS", "group_of", "summary"]

GROUPS = ("hardware", "privileges", "set-up")
_HARDWARE = re.compile(r"GPU|CUDA|NVIDIA|nvidia-fs|huge pages|GDS_TEST_DIR", re.IGNORECASE)
_PRIVILEGES = re.compile(r"needs root|as root|root privileges|cgroup|privilege", re.IGNORECASE)


def group_of(reason: str) -> str:
    """``hardware``, ``privileges`` or ``set-up`` for a skip's reason."""
    if _HARDWARE.search(reason):
        return "hardware"
    if _PRIVILEGES.search(reason):
        return "privileges"
    return "set-up"


def summary(reasons: list[str]) -> tuple[list[str], int]:
    """The lines to print for ``reasons`` (one per skipped test), and how many were of the set-up kind."""
    by_group: dict[str, Counter[str]] = {g: Counter() for g in GROUPS}
    for r in reasons:
        by_group[group_of(r)][r] += 1
    lines = []
    for g in GROUPS:
        n = sum(by_group[g].values())
        if n:
            lines.append(f"skipped for {g}: {n}")
            lines.extend(f"  {count} x {reason}" for reason, count in by_group[g].most_common())
    return lines, sum(by_group["set-up"].values())
