"""Per-rank stores, ``stats(all_ranks=True)``, one rank's drive filling, and a rank killed mid-step,
on 2 gloo ranks under ``torchrun`` (see ``ranks_worker.py``). Two launches: one for the
scenarios that finish, one that ends with SIGKILL.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.disks import is_root, real_disk_base, tmpfs

WORKER = Path(__file__).with_name("ranks_worker.py")
REPO = Path(__file__).resolve().parents[2]
#: Rank 1's spill directory: room for a few of the model's activations, not for a step's.
FULL_TMPFS = "96k"

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")


def torchrun(out: Path, base: Path, scenarios: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GDS_OFFLOAD_DIR": str(base / "default"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--monitor-interval", "0.2",
           "--standalone", str(WORKER), str(out), str(base), scenarios]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def base():
    d = Path(tempfile.mkdtemp(prefix="gds_offload-ranks-", dir=real_disk_base()))
    os.chmod(d, 0o700)
    (d / "out").mkdir()
    (d / "spill0").mkdir(mode=0o700)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def results(base):
    """``{scenario: [rank0 record, rank1 record]}`` from one launch; rank 1's drive a tiny tmpfs when root."""
    (base / "spill1").mkdir(mode=0o700)
    with tmpfs(base / "spill1", FULL_TMPFS) if is_root() else contextlib.nullcontext():
        proc = torchrun(base / "out", base, "default,fallback,raise")
    ranks = [json.loads(p.read_text()) if p.exists() else {} for p in (base / "out/rank0.json", base / "out/rank1.json")]
    found = {name: [r.get(name, {"error": "no record"}) for r in ranks] for name in ("default", "fallback", "raise")}
    found["torchrun"] = [{"rc": proc.returncode, "log": (proc.stdout + proc.stderr)[-3000:]}]
    return found


def _ok(results: dict, name: str) -> list[dict]:
    recs = results[name]
    for rank, r in enumerate(recs):
        assert "error" not in r, f"rank {rank}: {r['error']}\ntorchrun: {results['torchrun'][0]['log']}"
    return recs


def test_torchrun_exit(results):
    assert results["torchrun"][0]["rc"] == 0, results["torchrun"][0]["log"]


def test_default_path_is_per_rank(results, base):
    recs = _ok(results, "default")
    assert [r["paths"] for r in recs] == [[str(base / "default" / "rank0")], [str(base / "default" / "rank1")]]


def test_template_and_all_ranks_stats(results, base):
    recs = _ok(results, "fallback")
    for rank, r in enumerate(recs):
        assert r["paths"] == [str(base / f"spill{rank}")]
        assert r["all_ranks"] == r["by_hand"], f"rank {rank}"
        assert r["layers_summed"]
    assert recs[0]["all_ranks"] == recs[1]["all_ranks"]
    assert recs[0]["all_ranks"]["bytes_offloaded"] == recs[0]["stats"]["bytes_offloaded"] + recs[1]["stats"]["bytes_offloaded"]


@pytest.mark.root
@pytest.mark.skipif(not is_root(), reason="needs root to mount a tmpfs for rank 1's spill directory")
def test_one_full_drive_falls_back_and_every_rank_stays_exact(results):
    r0, r1 = _ok(results, "fallback")
    for rank, r in enumerate((r0, r1)):
        assert r["losses_equal"] and r["grads_equal"], f"rank {rank}: {r}"
        assert r["stats"]["bytes_offloaded"] > 0, f"rank {rank}: nothing offloaded"
    assert r0["stats"]["bytes_fallback"] == 0 and not r0["warnings"]
    assert r1["stats"]["bytes_fallback"] > 0, r1
    assert any("spill1" in w and "stay in memory" in w for w in r1["warnings"]), r1["warnings"]
    assert r1["all_ranks"]["bytes_fallback"] == r1["stats"]["bytes_fallback"]


@pytest.mark.root
@pytest.mark.skipif(not is_root(), reason="needs root to mount a tmpfs for rank 1's spill directory")
def test_one_full_drive_raises_on_that_rank_only(results):
    r0, r1 = _ok(results, "raise")
    for rank, r in enumerate((r0, r1)):
        assert r["losses_equal"] and r["grads_equal"], f"rank {rank}: {r}"
    assert r0["raised"] == [] and r0["stats"]["bytes_fallback"] == 0
    assert r1["raised"] and all("could not offload" in m for m in r1["raised"]), r1["raised"]


def test_rank_killed_mid_step_leaves_no_file(base):
    out = base / "out-kill"
    out.mkdir()
    proc = torchrun(out, base, "kill", timeout=90)
    assert proc.returncode != 0  # rank 1 died: torchrun stops the job
    for rank in (0, 1):
        rec = json.loads((out / f"kill{rank}.json").read_text())
        spill = base / "default" / f"rank{rank}"
        assert rec["paths"] == [str(spill)]
        assert rec["spill_file_bytes"] > 0 and rec["listing"] == [], rec  # bytes written, no name in the directory
        assert rec["open_in_spill"] and all(t.endswith("(deleted)") for t in rec["open_in_spill"]), rec
        assert list(spill.iterdir()) == [], f"rank {rank} left {list(spill.iterdir())}"
