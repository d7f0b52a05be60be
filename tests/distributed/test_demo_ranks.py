"""``gds-offload demo --nproc 2`` on the CPU (gloo): the demo launched through torchrun, exact on both ranks."""
from __future__ import annotations

import subprocess
import sys

from helpers.procs import clean_env


def test_demo_on_two_ranks(tmp_path):
    """``gds-offload demo --nproc 2`` launches itself through torchrun; rank 0 prints the all-ranks summary."""
    tiny = ["--layers", "2", "--hidden", "64", "--seq", "64", "--batch", "2", "--vocab", "256", "--steps", "2", "--warmup", "1",
            "--mode", "posix", "--min-bytes", "0"]
    env = clean_env(GDS_OFFLOAD_DIR=str(tmp_path / "default"), COLUMNS="160")
    proc = subprocess.run([sys.executable, "-m", "gds_offload.cli", "demo", "--nproc", "2", *tiny], env=env,
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "gds_offload.bench.train.torchrun --nproc-per-node 2" in out and "demo summary, all 2 ranks" in out
    row = next(line for line in out.splitlines() if "bit-identical on every rank" in line)
    assert "yes" in row, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == ["rank0", "rank1"]
    bad = subprocess.run([sys.executable, "-m", "gds_offload.cli", "demo", "--nproc", "2", "--steps", "0"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--steps: '0' is not a positive integer" in bad.stderr, bad.stderr  # before any rank starts
