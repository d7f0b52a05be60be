"""Child processes of the commands, and the environments launchers give their ranks."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["EXAMPLES", "LAUNCH_VARS", "REPO", "alive", "assert_exact", "children", "clean_env", "cmdline", "cpu_seconds", "free_port", "per_rank_dirs"]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NODELIST")


def children(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    """``pid`` runs (and is not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cpu_seconds(pid: int) -> float:
    """CPU time ``pid`` has used, with that of the children it reaped; 0 once it is gone. A
    busy machine stretches the wall time a process takes, not the CPU time its work needs:
    wait on this, not on a clock, for a child to get somewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime, stime, cutime, cstime


def cmdline(pid: int) -> str:
    """The command line of ``pid``, space-separated ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables, the repository importable, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env | extra


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def per_rank_dirs(tmp_path: Path) -> str:
    """Two private directories ``nvme0``, ``nvme1`` under ``tmp_path``, and the ``{local_rank}`` template naming them."""
    for r in (0, 1):
        (tmp_path / f"nvme{r}").mkdir(mode=0o700)
    return str(tmp_path / "nvme{local_rank}")


def assert_exact(proc: subprocess.CompletedProcess[str]) -> str:
    """A distributed example exited 0 and said every rank was bit-identical; its output."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "bit-identical to the run without the offloader on every rank: yes" in out, out[-4000:]
    return out
