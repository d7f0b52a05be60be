"""Worker for ``test_ranks_dist.py``: per-rank stores, all-ranks statistics and a full drive, under
``torchrun --nproc-per-node 2`` (gloo, CPU).

Usage: ``torchrun ... ranks_worker.py OUT_DIR BASE SCENARIOS``, SCENARIOS a comma-separated list of:

* ``default``: ``attach(model)`` with ``GDS_OFFLOAD_DIR=BASE/default``: where each rank spills.
* ``fallback``: DDP, ``attach(path=BASE/spill{rank}, on_error="fallback")``; the test makes
  ``BASE/spill1`` a tiny tmpfs, so rank 1's drive fills mid-step. Losses and reduced gradients
  against the same run without the offloader (``torch.equal``), every rank's counters, and
  ``stats(all_ranks=True)`` against those counters combined by hand.
* ``raise``: the same with ``on_error="raise"``: a rank whose write fails gets ``OffloadError``
  in forward, and redoes that step with the offloader paused; every rank stays exact.
* ``kill``: attach with the default path, forward, wait for the writes; rank 1 then records
  what it holds and kills itself with SIGKILL mid-step (the test checks that no file is left).

Each rank writes ``OUT_DIR/rank{rank}.json`` (``{scenario: record}``) after each scenario.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from dist_worker import BATCH, STEPS, WIDTH, Net
from torch.nn.parallel import DistributedDataParallel

import gds_offload

COUNTERS = ("bytes_packed", "bytes_offloaded", "bytes_fallback", "bytes_read", "bytes_kept", "steps", "peak_resident_bytes",
            "peak_writing_bytes", "stalls", "spill_file_bytes")


def train(attach_kw: dict | None) -> dict:
    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    off = gds_offload.attach(model, mode="posix", min_bytes=0, keep_last=1, **attach_kw) if attach_kw is not None else None
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    losses, grads, raised = [], [], []
    rec: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            x = torch.randn(BATCH, WIDTH, generator=gen)
            opt.zero_grad(set_to_none=True)
            try:
                loss = model(x).square().mean()
            except gds_offload.OffloadError as exc:  # on_error="raise": this rank's write failed; redo the step in memory
                raised.append(str(exc))
                with off.paused():
                    loss = model(x).square().mean()
            if off is not None:
                off.synchronize()  # every write landed: backward reads the offloaded tensors back
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([p.grad.detach().clone() for p in model.parameters()])
            opt.step()
    rec["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    rec["raised"] = raised
    if off is not None:
        mine = off.stats()
        rec["stats"] = {k: getattr(mine, k) for k in COUNTERS}
        rec["paths"] = [str(p) for p in off.config.paths]
        combined = off.stats(all_ranks=True)  # a collective: every rank calls it here
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rec["stats"])
        rec["all_ranks"] = {k: getattr(combined, k) for k in (*COUNTERS, "ranks", "engine")}
        rec["by_hand"] = {
            k: (max if k.startswith("peak_") or k == "steps" else sum)(s[k] for s in everyone) for k in COUNTERS
        } | {"ranks": len(everyone), "engine": "posix"}
        rec["layers_summed"] = sum(row.bytes_offloaded for row in combined.layers) == combined.bytes_offloaded
        off.detach()
    rec["losses"], rec["grads"] = losses, grads
    return rec


def _all_equal(want: list, got: list) -> bool:
    """As many tensors on each side, each ``torch.equal`` to its twin (an empty side is not equal)."""
    return len(want) == len(got) > 0 and all(torch.equal(a, b) for a, b in zip(want, got))


def compare(base: dict, got: dict) -> dict:
    out = {k: v for k, v in got.items() if k not in ("losses", "grads")}
    out["losses_equal"] = _all_equal(base["losses"], got["losses"])
    out["grads_equal"] = len(base["grads"]) == len(got["grads"]) and all(_all_equal(a, b) for a, b in zip(base["grads"], got["grads"]))
    return out


def kill(out: Path, rank: int) -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    off = gds_offload.attach(model, mode="posix", min_bytes=0, keep_last=0)
    loss = model(torch.randn(BATCH, WIDTH)).square().mean()
    off.synchronize()
    spill = off.config.paths[0]
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    rec = {
        "paths": [str(p) for p in off.config.paths],
        "spill_file_bytes": off.stats().spill_file_bytes,
        "listing": sorted(os.listdir(spill)),
        "open_in_spill": [t for t in fds if t.startswith(str(spill))],
    }
    (out / f"kill{rank}.json").write_text(json.dumps(rec))
    dist.barrier()  # both ranks hold offloaded tensors now
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()  # rank 0: blocks in DDP's all-reduce until torchrun stops it


def main() -> None:
    out, base, scenarios = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict = {}
    baseline = None
    for name in scenarios:
        try:
            if name == "kill":
                kill(out, rank)
                continue
            if name == "default":
                with gds_offload.attach(Net(), mode="posix") as off:
                    results[name] = {"paths": [str(p) for p in off.config.paths]}
            else:
                baseline = baseline or train(None)
                template = str(base / "spill{rank}")
                results[name] = compare(baseline, train({"path": template, "on_error": name}))
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            results[name] = {"error": traceback.format_exc()}
        (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
