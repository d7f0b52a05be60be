"""The offloader under data-parallel wrappers: DDP and FSDP2 (``fully_shard``), 2 CPU ranks.

One ``torchrun --nproc-per-node 2`` launch (gloo) runs every configuration in sequence
(see ``dist_worker.py``): each rank trains 3 steps without the offloader and then with it,
same initial weights and inputs, each rank spilling to its own directory, and compares
losses and reduced gradients bit for bit. FSDP2 frees the unsharded parameters after
forward and gathers them again in backward: the offloader must leave them alone (write
only activations: as many bytes as under DDP) or backward sees freed memory.
DeepSpeed (ZeRO 1-3) is in ``test_deepspeed.py``.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.disks import real_disk_base

from gds_offload.io.kvikio.engine import kvikio_status

WORKER = Path(__file__).with_name("dist_worker.py")
ENGINES = ["posix"] + (["compat"] if kvikio_status()[0] else []) + ["host"]  # host last: see WRAPPERS
#: Without the fix, FSDP2 with the host engine can crash the process (it copies from freed
#: memory): run it last so that the other configurations still report.
WRAPPERS = ["ddp", "fsdp-keep", "fsdp"]
CONFIGS = [(w, e) for w in WRAPPERS for e in ENGINES]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], list[dict]]:
    """``(wrapper, engine) -> [rank 0 record, rank 1 record]`` from one torchrun launch."""
    base = Path(tempfile.mkdtemp(prefix="gds_offload-dist-", dir=real_disk_base()))
    os.chmod(base, 0o700)
    out, spill = base / "out", base / "spill"
    out.mkdir()
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        str(WORKER), str(out), str(spill), json.dumps(CONFIGS),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        ranks = [json.loads(p.read_text()) if p.exists() else [] for p in (out / "rank0.json", out / "rank1.json")]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    found: dict[tuple[str, str], list[dict]] = {}
    for recs in ranks:
        for r in recs:
            found.setdefault((r["wrapper"], r["engine"]), []).append(r)
    found[("torchrun", "")] = [{"rc": proc.returncode, "log": (proc.stdout + proc.stderr)[-3000:]}]
    return found


def test_torchrun_exit(results: dict) -> None:
    run = results[("torchrun", "")][0]
    assert run["rc"] == 0, f"torchrun exited {run['rc']}:\n{run['log']}"


@pytest.mark.parametrize(("wrapper", "engine"), CONFIGS, ids=[f"{w}-{e}" for w, e in CONFIGS])
def test_exact(results: dict, wrapper: str, engine: str) -> None:
    recs = results.get((wrapper, engine), [])
    assert len(recs) == 2, f"{len(recs)} of 2 ranks reported; torchrun said:\n{results[('torchrun', '')][0]['log']}"
    for rank, r in enumerate(recs):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["losses_equal"] and r["grads_equal"], f"rank {rank}: {r}"
        assert r["bytes_offloaded"] > 0, f"rank {rank}: nothing offloaded: {r}"
        # Only activations are written: a sharding wrapper's unsharded parameters stay put.
        ddp = results[("ddp", engine)][rank]
        assert r["bytes_offloaded"] == ddp["bytes_offloaded"], f"rank {rank}: {r} against DDP {ddp}"
