"""Worker for ``test_deepspeed.py``: the offloader under a DeepSpeed engine, ZeRO stages 1-3, on
``torchrun --nproc-per-node 2`` with ``DS_ACCELERATOR=cpu`` (gloo).

Usage: ``torchrun ... deepspeed_worker.py OUT_DIR SPILL_BASE STAGES`` (STAGES: ``1,2,3``).

For each stage the rank trains 3 steps with ``deepspeed.initialize`` (a torch SGD optimizer
as the client optimizer, fp32) without the offloader, then the same engine set-up with
``gds_offload.attach(engine.module)``: no DeepSpeed code is patched. Every loss and the final
parameters (gathered with ``deepspeed.zero.GatheredParameters`` under ZeRO-3) are compared
with ``torch.equal``. Results: ``OUT_DIR/rank{rank}.json``, rewritten after each stage.
"""
from __future__ import annotations

import faulthandler
import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from dist_worker import BATCH, WIDTH, Net

import gds_offload

STEPS = 3
HANG_S = 200  # under test_deepspeed.py's 240 s
COLLECTIVE_TIMEOUT_S = 90


def train(stage: int, spill: Path | None) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    torch.manual_seed(0)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    off = None
    if spill is not None:
        spill.mkdir(parents=True, exist_ok=True)
        off = gds_offload.attach(engine.module, path=spill, mode="posix", min_bytes=0, keep_last=1)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    losses = []
    stats: dict = {}
    try:
        for _ in range(STEPS):
            loss = engine(torch.randn(BATCH, WIDTH, generator=gen)).square().mean()
            if off is not None:
                off.synchronize()  # every write landed: backward reads the offloaded tensors back
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().clone())
        if off is not None:
            s = off.stats()
            stats = {"bytes_offloaded": s.bytes_offloaded, "bytes_read": s.bytes_read, "bytes_packed": s.bytes_packed}
    finally:
        if off is not None:
            off.detach()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        final = [p.detach().clone() for p in params]
    engine.destroy()
    return losses, final, stats


def main() -> None:
    out, spill_base, stages = Path(sys.argv[1]), Path(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")]
    torch.set_num_threads(1)
    # A rank that fails in a stage leaves its peer in a collective: a short gloo timeout and a
    # stack dump before the test's own timeout turn a hang into a failure that says where.
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    results = []
    for stage in stages:
        rec: dict = {"stage": stage}
        try:
            base_losses, base_params, _ = train(stage, None)
            losses, params, stats = train(stage, spill_base / f"rank{rank}")
            rec.update(
                losses_equal=all(torch.equal(a, b) for a, b in zip(base_losses, losses)) and len(losses) == STEPS,
                params_equal=all(torch.equal(a, b) for a, b in zip(base_params, params)) and len(params) == len(base_params),
                params_changed=not all(torch.equal(a, b) for a, b in zip(base_params, [p for p in Net().parameters()])),
                **stats,
            )
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            rec["error"] = traceback.format_exc()
        results.append(rec)
        (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
        dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
