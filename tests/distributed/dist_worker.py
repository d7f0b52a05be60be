"""Worker for ``test_distributed.py``: run under ``torchrun --nproc-per-node 2`` (gloo, CPU).

Usage: ``torchrun ... dist_worker.py OUT_DIR SPILL_BASE CONFIGS_JSON``, where CONFIGS_JSON is a
list of ``[wrapper, engine]`` pairs; wrapper is ``ddp``, ``fsdp`` (FSDP2 ``fully_shard`` on each
block, then the root) or ``fsdp-keep`` (the same with ``reshard_after_forward=False``).

For each wrapper the rank trains the model 3 steps without the offloader, then, for each of
its engines, the same model (same seed, same inputs) with ``gds_offload.attach`` and compares
every loss and every gradient after reduction (DDP: the all-reduced ``p.grad``; FSDP2: the
local shard of the reduce-scattered ``p.grad``) with ``torch.equal``. The results go to
``OUT_DIR/rank{rank}.json``, rewritten after each configuration, so that a crash (a native
fault in an engine) still leaves the configurations that finished.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import gds_offload

WIDTH, BATCH, DEPTH, STEPS = 128, 32, 4, 3


class Block(nn.Module):
    """Pre-norm residual MLP block: LayerNorm saves its weight and bias, Linear a view (``weight.t()``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(wrapper: str) -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank and in every run
    model = Net()
    if wrapper == "ddp":
        return DistributedDataParallel(model)
    reshard = wrapper == "fsdp"
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def train(wrapper: str, engine: str | None, spill: Path) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], dict]:
    model = build(wrapper)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    off = None
    if engine is not None:
        spill.mkdir(parents=True, exist_ok=True)
        off = gds_offload.attach(model, path=spill, mode=engine, min_bytes=0, keep_last=1)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own batch
    losses, grads = [], []
    try:
        for _ in range(STEPS):
            x = torch.randn(BATCH, WIDTH, generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            if off is not None:
                off.synchronize()  # every write done: backward reads the offloaded tensors back
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([local(p.grad) for p in model.parameters()])
            opt.step()
        stats = {}
        if off is not None:
            s = off.stats()
            stats = {"bytes_offloaded": s.bytes_offloaded, "bytes_packed": s.bytes_packed, "bytes_read": s.bytes_read}
    finally:
        if off is not None:
            off.detach()
    return losses, grads, stats


def compare(base: tuple, got: tuple) -> dict:
    (bl, bg, _), (gl, gg, stats) = base, got
    bad = [f"step {k}: {len(b)} grads, the reference has {len(a)}" for k, (a, b) in enumerate(zip(bg, gg)) if len(a) != len(b)]
    bad += [
        f"step {k} grad {i}"
        for k, (a, b) in enumerate(zip(bg, gg))
        for i, (x, y) in enumerate(zip(a, b))
        if not torch.equal(x, y)
    ]
    return {
        "losses_equal": len(bl) == len(gl) > 0 and all(torch.equal(a, b) for a, b in zip(bl, gl)),
        "grads_equal": len(bg) == len(gg) and not bad,
        "mismatches": bad[:8],
        "nan_grads": sum(bool(torch.isnan(g).any()) for step in gg for g in step),
        **stats,
    }


def main() -> None:
    out, spill_base, configs = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spill = spill_base / f"rank{rank}"
    results: list[dict] = []
    baselines: dict[str, tuple] = {}
    for wrapper, engine in configs:
        rec: dict = {"wrapper": wrapper, "engine": engine}
        try:
            if wrapper not in baselines:
                baselines[wrapper] = train(wrapper, None, spill)
            rec.update(compare(baselines[wrapper], train(wrapper, engine, spill)))
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            rec["error"] = traceback.format_exc()
        results.append(rec)
        (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
