"""``accelerate launch`` with the Trainer callback, and Lightning Fabric: the examples on 2 CPU
processes with ``--check`` (see ``test_launchers.py``)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.procs import EXAMPLES, assert_exact, clean_env, free_port, per_rank_dirs


def test_accelerate_launch_trainer(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'gds_offload[hf]')")
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", free_port(),
           str(EXAMPLES / "hf_trainer.py"), "--steps", "2", "--check", "--mode", "posix", "--path", per_rank_dirs(tmp_path)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for r in (0, 1):
        assert f"process {r}: logged losses and parameters bit-identical to the run without the offloader: yes" in out, out[-4000:]
    assert "all 2 ranks: offloaded" in out


def test_lightning_fabric(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed (pip install lightning)")
    cmd = [sys.executable, str(EXAMPLES / "fabric_ddp.py"), "--devices", "2", "--steps", "2", "--check", "--mode", "posix"]
    out = assert_exact(subprocess.run(cmd, env=clean_env(GDS_OFFLOAD_DIR=str(tmp_path / "default")), cwd=tmp_path,
                                      capture_output=True, text=True, timeout=240))
    assert "all 2 ranks, 2 steps: offloaded" in out
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == ["rank0", "rank1"]  # each rank its own directory
